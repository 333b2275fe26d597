"""Index cost: bytes per entry and 32-key prefix-lookup time at 10 thousand, 1 million and 10 million entries.

Native key table vs the pure-Python fallback vs a plain dict (the baseline: the cheapest Python map of the same
keys, with no LRU at all), measured in the same run. Targets: ≤ 150 bytes per entry at 10 million entries and the
lookup there ≤ 1.5× the lookup at 10 thousand.

    python bench/bench_index.py [--sizes 10000,1000000,10000000] [--reps 3]
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import tracemalloc

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Table, progress, write_json  # noqa: E402

from kvstore.keytable import PyKeyTable  # noqa: E402

try:
    from kvstore._kvindex import KeyTable as NativeKeyTable
except ImportError:
    NativeKeyTable = None

NS = (1).to_bytes(4, "big")
PY_LIMIT = 1_000_000     # the fallback and the dict are measured up to here (10M Python objects take minutes)


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def build(kind: str, hashes: np.ndarray) -> tuple[object, float]:
    """Fill a table with len(hashes) keys; returns it and the bytes it holds."""
    n = len(hashes)
    raw = hashes.tobytes()
    gc.collect()
    if kind == "native":
        before = rss()
        t = NativeKeyTable()
        for i in range(n):
            t.insert(NS + raw[16 * i:16 * i + 16], i, i & 3)
        return t, max(t.nbytes(), rss() - before)
    tracemalloc.start()
    if kind == "python":
        t = PyKeyTable()
        for i in range(n):
            t.insert(NS + raw[16 * i:16 * i + 16], i, i & 3)
    else:
        t = {}
        for i in range(n):
            t[NS + raw[16 * i:16 * i + 16]] = i
    used, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return t, used


def lookup_time(kind: str, table: object, hashes: np.ndarray, reps: int) -> float:
    """Median seconds for one 32-key prefix lookup of present keys at random places."""
    rng = np.random.default_rng(7)
    blobs = [hashes[rng.integers(0, len(hashes), 32)].tobytes() for _ in range(2000)]
    if kind == "dict":
        def one(blob: bytes) -> int:
            n = 0
            for i in range(0, 512, 16):
                if NS + blob[i:i + 16] not in table:  # type: ignore[operator]
                    break
                n += 1
            return n
    else:
        def one(blob: bytes) -> int:
            return table.prefix_len(NS, blob)  # type: ignore[attr-defined]
    runs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for b in blobs:
            assert one(b) == 32
        runs.append((time.perf_counter() - t0) / len(blobs))
    return statistics.median(runs)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="10000,1000000,10000000")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    kinds = (["native"] if NativeKeyTable else []) + ["python", "dict"]
    results = []
    for n in sizes:
        hashes = np.random.default_rng(n).integers(0, 256, (n, 16), dtype=np.uint8)
        for kind in kinds:
            if kind != "native" and n > PY_LIMIT:
                continue
            progress(f"{kind}: building {n:,} entries")
            table, nbytes = build(kind, hashes)
            t = lookup_time(kind, table, hashes, args.reps)
            results.append({"kind": kind, "entries": n, "bytes_per_entry": nbytes / n, "lookup32_us": t * 1e6})
            del table
            gc.collect()
    small = {r["kind"]: r for r in results if r["entries"] == min(sizes)}
    table = Table(["table", "entries", "bytes/entry", "lookup 32 keys", "× its smallest", "target"])
    for r in results:
        ratio = r["lookup32_us"] / small[r["kind"]]["lookup32_us"]
        target = ""
        if r["kind"] == "native" and r["entries"] >= 10_000_000:
            ok = r["bytes_per_entry"] <= 150 and ratio <= 1.5
            target = f"≤150 B, ≤1.5×: {'PASS' if ok else 'FAIL'}"
        table.add([r["kind"], f"{r['entries']:,}", f"{r['bytes_per_entry']:.0f}", f"{r['lookup32_us']:.2f} µs",
                   f"{ratio:.2f}", target])
    print(table)
    path = write_json("index", {"results": results})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
