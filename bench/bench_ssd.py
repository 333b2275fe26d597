"""The SSD record store against raw O_DIRECT on the same file system, in the same run.

Writes and reads N Full Blocks of 2 MiB through `SsdStore` (checksums on; sync policy batch: one fdatasync per
batch of 32 before and after the headers; reads 32 at a time, 4 in flight) and the same bytes with plain O_DIRECT
pwrite/pread of a preallocated file (one fdatasync per 32). Target: ≥ 0.85× raw for both. This measures the store
alone: the daemon's demotion and promotion paths are not wired to it yet.

    python bench/bench_ssd.py [--dir DIR] [--blocks 256]
"""
from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Table, progress, write_json  # noqa: E402

from kvstore.tiers.ssd import SsdStore  # noqa: E402

BLOCK = 2 << 20
BATCH = 32


def raw(path: str, blocks: list[bytes]) -> tuple[float, float]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    buf = mmap.mmap(-1, BLOCK)
    try:
        os.ftruncate(fd, len(blocks) * BLOCK)
        t0 = time.perf_counter()
        for i, b in enumerate(blocks):
            buf[:] = b
            os.pwritev(fd, [buf], i * BLOCK)
            if i % BATCH == BATCH - 1:
                os.fdatasync(fd)
        os.fdatasync(fd)
        t1 = time.perf_counter()
        for i in range(len(blocks)):
            os.preadv(fd, [buf], i * BLOCK)
        t2 = time.perf_counter()
    finally:
        os.close(fd)
        buf.close()
    n = len(blocks) * BLOCK
    return n / (t1 - t0) / 1e9, n / (t2 - t1) / 1e9


def store(directory: str, blocks: list[bytes]) -> tuple[float, float]:
    s = SsdStore(directory, capacity=len(blocks) * (BLOCK + 8192) * 2).open()
    ns = bytes(16)
    outs = [bytearray(BLOCK) for _ in range(BATCH)]
    try:
        t0 = time.perf_counter()
        for i in range(0, len(blocks), BATCH):
            s.put_many([(ns, j.to_bytes(16, "big"), blocks[j]) for j in range(i, min(i + BATCH, len(blocks)))])
        t1 = time.perf_counter()
        for i in range(0, len(blocks), BATCH):
            hs = [j.to_bytes(16, "big") for j in range(i, min(i + BATCH, len(blocks)))]
            assert s.get_many(ns, hs, outs[:len(hs)]) == len(hs)
        t2 = time.perf_counter()
    finally:
        s.close()
    n = len(blocks) * BLOCK
    return n / (t1 - t0) / 1e9, n / (t2 - t1) / 1e9


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", default=None, help="a directory on the file system to measure (default: a temp dir)")
    p.add_argument("--blocks", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    base = tempfile.mkdtemp(prefix="kvs-bench-", dir=args.dir)
    blocks = [os.urandom(BLOCK) for _ in range(args.blocks)]
    rw: dict[str, list[float]] = {"raw_w": [], "raw_r": [], "ssd_w": [], "ssd_r": []}
    try:
        for rep in range(args.reps):
            progress(f"repetition {rep + 1}/{args.reps}")
            w, r = raw(os.path.join(base, f"raw-{rep}"), blocks)
            rw["raw_w"].append(w)
            rw["raw_r"].append(r)
            w, r = store(os.path.join(base, f"ssd-{rep}"), blocks)
            rw["ssd_w"].append(w)
            rw["ssd_r"].append(r)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    m = {k: statistics.median(v) for k, v in rw.items()}
    t = Table(["figure", "kvstore", "raw O_DIRECT", "ratio", "target"])
    for what, a, b in (("write 2 MiB blocks", "ssd_w", "raw_w"), ("read 2 MiB blocks", "ssd_r", "raw_r")):
        ratio = m[a] / m[b]
        t.add([what, f"{m[a]:.2f} GB/s", f"{m[b]:.2f} GB/s", f"{ratio:.2f}",
               f"≥0.85×: {'PASS' if ratio >= 0.85 else 'FAIL'}"])
    print(t)
    print(f"\nwrote {write_json('ssd', {'gbps': rw, 'blocks': args.blocks, 'block_bytes': BLOCK})}")


if __name__ == "__main__":
    main()
