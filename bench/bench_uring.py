"""io_uring (kvstore.tiers.ssd.uring.run_many, one thread) against a thread pool of os.preadv/os.pwritev, same run.

O_DIRECT reads and writes of 2 MiB records over a ~1 GiB file (page cache bypassed, nothing dropped), in a
shuffled record order, at 1, 2, 4 and 8 requests in flight: io_uring keeps `depth` ops in flight from one thread
(run_many's sliding window); the baseline is a ThreadPoolExecutor of `depth` threads, each doing one blocking
os.preadv/os.pwritev at a time with a buffer of its own. Each write pass ends with one fdatasync (timed). The two
take turns at every depth, reads and writes alike, for `--reps` rounds after an untimed warm-up pass; the table
shows medians in GB/s (1e9 bytes/s), the ratio io_uring / threads, and the process CPU time per GB of each.

    .venv/bin/python bench/bench_uring.py [--dir DIR] [--size-mib 1024] [--reps 3] [--depths 1,2,4,8]
"""
from __future__ import annotations

import argparse
import mmap
import os
import queue
import random
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Table, busy_cpus, progress, summary, warn_if_busy, write_json  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kvstore.tiers.ssd import uring  # noqa: E402

REC = 2 << 20


def uring_pass(kind: str, fd: int, order: list[int], bufs: list[mmap.mmap], depth: int) -> None:
    res = uring.run_many([(kind, fd, [bufs[j % depth]], rec * REC) for j, rec in enumerate(order)], depth=depth)
    bad = [r for r in res if r != REC]
    if bad:
        raise OSError(f"io_uring {kind}: {len(bad)} ops moved {bad[0]} bytes")


def pool_pass(kind: str, fd: int, order: list[int], pool: ThreadPoolExecutor,
              free: queue.SimpleQueue[mmap.mmap]) -> None:
    def one(rec: int) -> int:
        b = free.get()
        try:
            return os.preadv(fd, [b], rec * REC) if kind == "r" else os.pwritev(fd, [b], rec * REC)
        finally:
            free.put(b)

    res = list(pool.map(one, order))
    if any(r != REC for r in res):
        raise OSError(f"threads {kind}: short transfer")


def timed(fn: Any, *args: Any) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one call."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0, time.process_time() - c0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", default=None, help="directory on the file system to measure (default: under /var/tmp)")
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--depths", default="1,2,4,8")
    args = p.parse_args()
    depths = [int(x) for x in args.depths.split(",")]
    if max(depths) > uring.DEPTH:
        p.error(f"depth at most {uring.DEPTH} (the ring's size)")
    if not uring.available():
        sys.exit(f"io_uring not available, nothing to compare: {uring.REASON}")
    progress(uring.REASON)
    load_before = warn_if_busy()

    n = args.size_mib * (1 << 20) // REC
    base = tempfile.mkdtemp(prefix="kvs-bench-uring-", dir=args.dir or ("/var/tmp" if os.path.isdir("/var/tmp")
                                                                          else None))
    path = os.path.join(base, "records")
    bufs = [mmap.mmap(-1, REC) for _ in range(max(depths))]
    for b in bufs:
        b[:] = os.urandom(REC)
    order = list(range(n))
    random.Random(1).shuffle(order)
    gbs = n * REC / 1e9
    data: dict[str, dict[str, dict[int, list[float]]]] = {
        f"{m}_{k}": {"gbps": {d: [] for d in depths}, "cpu_s_per_gb": {d: [] for d in depths}}
        for m in ("uring", "threads") for k in ("read", "write")}
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        os.posix_fallocate(fd, 0, n * REC)
        progress(f"writing {n} records of 2 MiB once ({gbs:.2f} GB) in {path} (untimed)")
        uring_pass("w", fd, list(range(n)), bufs, max(depths))
        os.fdatasync(fd)
        pools = {d: ThreadPoolExecutor(d) for d in depths}
        frees: dict[int, queue.SimpleQueue[mmap.mmap]] = {}
        for d in depths:
            frees[d] = queue.SimpleQueue()
            for b in bufs[:d]:
                frees[d].put(b)

        def write_u(d: int) -> None:
            uring_pass("w", fd, order, bufs, d)
            os.fdatasync(fd)

        def write_t(d: int) -> None:
            pool_pass("w", fd, order, pools[d], frees[d])
            os.fdatasync(fd)

        runs = {"uring_read": lambda d: uring_pass("r", fd, order, bufs, d),
                "threads_read": lambda d: pool_pass("r", fd, order, pools[d], frees[d]),
                "uring_write": write_u, "threads_write": write_t}
        progress("warm-up: one untimed read pass each")
        uring_pass("r", fd, order, bufs, 1)
        pool_pass("r", fd, order, pools[depths[0]], frees[depths[0]])
        for rep in range(args.reps):
            for d in depths:
                progress(f"repetition {rep + 1}/{args.reps}, depth {d}")
                names = ["uring_read", "threads_read", "uring_write", "threads_write"]
                if rep % 2:                                  # alternate who goes first
                    names = ["threads_read", "uring_read", "threads_write", "uring_write"]
                for name in names:
                    wall, cpu = timed(runs[name], d)
                    data[name]["gbps"][d].append(gbs / wall)
                    data[name]["cpu_s_per_gb"][d].append(cpu / gbs)
        # sanity: the two paths read the same bytes back
        a, b = mmap.mmap(-1, REC), mmap.mmap(-1, REC)
        assert uring.preadv(fd, [a], order[0] * REC) == REC and os.preadv(fd, [b], order[0] * REC) == REC
        assert a[:] == b[:]
        for pool in pools.values():
            pool.shutdown()
        os.close(fd)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    med = {name: {d: statistics.median(v["gbps"][d]) for d in depths} for name, v in data.items()}
    cpu = {name: {d: statistics.median(v["cpu_s_per_gb"][d]) for d in depths} for name, v in data.items()}
    t = Table(["depth", "read io_uring", "read threads", "ratio", "write io_uring", "write threads", "ratio",
               "CPU s/GB r u/t", "CPU s/GB w u/t"])
    for d in depths:
        t.add([d, f"{med['uring_read'][d]:.2f} GB/s", f"{med['threads_read'][d]:.2f} GB/s",
               f"{med['uring_read'][d] / med['threads_read'][d]:.2f}",
               f"{med['uring_write'][d]:.2f} GB/s", f"{med['threads_write'][d]:.2f} GB/s",
               f"{med['uring_write'][d] / med['threads_write'][d]:.2f}",
               f"{cpu['uring_read'][d]:.3f}/{cpu['threads_read'][d]:.3f}",
               f"{cpu['uring_write'][d]:.3f}/{cpu['threads_write'][d]:.3f}"])
    print(t)
    print(f"\n{n} records of 2 MiB, O_DIRECT, shuffled order, medians of {args.reps}; {uring.REASON}")
    res = {"record_bytes": REC, "records": n, "reps": args.reps, "depths": depths, "backend": uring.REASON,
           "load_before": load_before, "load_after": busy_cpus(),
           "results": {name: {"gbps": {str(d): summary(v["gbps"][d]) for d in depths},
                              "cpu_s_per_gb": {str(d): summary(v["cpu_s_per_gb"][d]) for d in depths},
                              "raw_gbps": {str(d): v["gbps"][d] for d in depths}}
                       for name, v in data.items()}}
    print(f"wrote {write_json('uring', res)}")


if __name__ == "__main__":
    main()
