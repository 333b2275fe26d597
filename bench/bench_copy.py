"""The client's checked copy without the daemon: the one-pass copy + CRC-32C (kvstore._kvcopy) against numpy's
memcpy and against memcpy then the `crc32c` package, over 2 MiB blocks, on 1 and 2 threads.

Three layouts, as the client and the connectors meet them: put (a private numpy buffer into a page-aligned slot), get
(a slot into a private buffer: numpy's buffers start 16 bytes into a page) and load (a slot into an engine's KV
tensor, which torch starts 64 bytes into a page: the vLLM and SGLang connectors' layer loads, streamed; where the CPU
has AVX2 the streamed one pass takes the vector loop that loads ahead of its stores, see native/kvcopy.c).
The kinds take turns within each repetition; every ratio is to the memcpy of the same repetition, and the table shows
medians with their IQR.

    python bench/bench_copy.py [--reps N] [--blocks N]
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from time import perf_counter

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Table, busy_cpus, summary, warn_if_busy, write_json  # noqa: E402

from kvstore.checksum import FUSED, copy_crc32c, crc32c  # noqa: E402

try:
    from kvstore._kvcopy import VECTOR
except ImportError:
    VECTOR = False

BLOCK = 2 << 20
Pairs = list[tuple[np.ndarray, np.ndarray]]


def page_aligned(n: int, into: int = 0) -> np.ndarray:
    """A buffer starting on a page, as a slot does (memfd segments are mapped at page boundaries), or `into` bytes
    after one (torch's tensors: 64)."""
    raw = np.ones(n + 8192, np.uint8)
    start = -raw.ctypes.data % 4096 + into
    return raw[start:start + n]


def kinds() -> dict[str, Callable[[np.ndarray, np.ndarray], object]]:
    out: dict[str, Callable[[np.ndarray, np.ndarray], object]] = {
        "memcpy": np.copyto,
        "memcpy+crc": lambda d, s: (np.copyto(d, s), crc32c(d)),
    }
    if FUSED:
        out["one pass"] = lambda d, s: copy_crc32c(d, s)
        out["one pass, stream"] = lambda d, s: copy_crc32c(d, s, stream=True)
    return out


def run(pool: ThreadPoolExecutor | None, fn: Callable[[np.ndarray, np.ndarray], object], pairs: Pairs) -> float:
    """GB/s of fn over all pairs, dealt round-robin to the threads."""
    def part(which: Pairs) -> None:
        for d, s in which:
            fn(d, s)
    t0 = perf_counter()
    if pool is None:
        part(pairs)
    else:
        job = pool.submit(part, pairs[1::2])
        part(pairs[::2])
        job.result()
    return len(pairs) * BLOCK / 1e9 / (perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--blocks", type=int, default=128)
    args = p.parse_args()
    load_before = warn_if_busy()
    private = [np.random.default_rng(i).integers(0, 256, BLOCK, dtype=np.uint8) for i in range(args.blocks)]
    slots = [page_aligned(BLOCK) for _ in range(args.blocks)]
    tensors = [page_aligned(BLOCK, 64) for _ in range(args.blocks)]
    layouts: dict[str, Pairs] = {"put": list(zip(slots, private)), "get": list(zip(private, slots)),
                                 "load": list(zip(tensors, slots))}
    t = Table(["layout", "threads", "kind", "GB/s: median (IQR)", "ratio to memcpy: median (IQR)"])
    res: dict[str, object] = {"fused_copy_crc": FUSED, "vector_loop": VECTOR, "block_bytes": BLOCK,
                              "blocks": args.blocks}
    pool = ThreadPoolExecutor(1)
    for name, pairs in layouts.items():
        for threads in (1, 2):
            speeds: dict[str, list[float]] = {k: [] for k in kinds()}
            for rep in range(args.reps + 1):                     # repetition 0 is the warm-up
                for k, fn in kinds().items():
                    gbps = run(pool if threads > 1 else None, fn, pairs)
                    if rep:
                        speeds[k].append(gbps)
            for k, xs in speeds.items():
                s = summary(xs)
                r = summary([a / b for a, b in zip(xs, speeds["memcpy"])])
                t.add([name, threads, k, f"{s['median']:.2f} ({s['p25']:.2f}-{s['p75']:.2f})",
                       f"{r['median']:.2f} ({r['p25']:.2f}-{r['p75']:.2f})"])
                res[f"{name}_{threads}t_{k}"] = {"gbps": s, "over_memcpy": r}
    pool.shutdown()
    print(t)
    res["load_average"] = {"before": load_before, "after": busy_cpus()}
    print(f"\nwrote {write_json('copy', res)}")


if __name__ == "__main__":
    main()
