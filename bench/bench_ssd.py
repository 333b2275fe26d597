"""The SSD record store against raw O_DIRECT on the same file system, in the same run.

Writes and reads Full Blocks of 2 MiB through `SsdStore` (checksums on; sync policy batch: one fdatasync per batch
of 32 before and after the headers; reads 32 at a time, 4 in flight) and the same bytes with plain O_DIRECT
pwrite/pread of a preallocated file (one fdatasync per 32), batch by batch in turns. Target: ≥ 0.85× raw for both.
This measures the store alone: the daemon's demotion and promotion paths are not wired to it yet.

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

from kvstore.tiers.ssd.store import SsdStore  # noqa: E402

BLOCK = 2 << 20
BATCH = 32


class Raw:
    """Plain O_DIRECT pwrite/pread of 2 MiB blocks in a preallocated file: the disk's own speed."""

    def __init__(self, path: str, nblocks: int) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        os.ftruncate(self.fd, nblocks * BLOCK)
        self.buf = mmap.mmap(-1, BLOCK)

    def write(self, first: int, blocks: list[bytes]) -> None:
        for i, b in enumerate(blocks):
            self.buf[:] = b
            os.pwritev(self.fd, [self.buf], (first + i) * BLOCK)
        os.fdatasync(self.fd)

    def read(self, first: int, n: int) -> None:
        for i in range(n):
            os.preadv(self.fd, [self.buf], (first + i) * BLOCK)

    def close(self) -> None:
        os.close(self.fd)
        self.buf.close()


def timed(fn: object, *args: object) -> float:
    t0 = time.perf_counter()
    fn(*args)  # type: ignore[operator]
    return time.perf_counter() - t0


def measure(base: str, blocks: list[bytes]) -> dict[str, list[float]]:
    """Batch by batch, raw and store take turns, so both see the same disk (a VM's disk speed drifts)."""
    raw = Raw(os.path.join(base, "raw"), len(blocks))
    s = SsdStore(os.path.join(base, "ssd"), capacity=len(blocks) * (BLOCK + 8192) * 2).open()
    ns = bytes(16)
    outs = [mmap.mmap(-1, BLOCK) for _ in range(BATCH)]       # page-aligned, as the daemon's host slots are
    key = lambda j: j.to_bytes(16, "big")  # noqa: E731
    gb = BATCH * BLOCK / 1e9
    out: dict[str, list[float]] = {"raw_w": [], "ssd_w": [], "raw_r": [], "ssd_r": []}
    try:
        for i in range(0, len(blocks) - BATCH + 1, BATCH):
            batch = blocks[i:i + BATCH]
            out["raw_w"].append(gb / timed(raw.write, i, batch))
            out["ssd_w"].append(gb / timed(s.put_many, [(ns, key(i + j), b) for j, b in enumerate(batch)]))
        for i in range(0, len(blocks) - BATCH + 1, BATCH):
            out["raw_r"].append(gb / timed(raw.read, i, BATCH))
            hs = [key(i + j) for j in range(BATCH)]
            t = timed(s.get_many, ns, hs, outs)
            assert bytes(outs[0]) == blocks[i]
            out["ssd_r"].append(gb / t)
    finally:
        s.close()
        raw.close()
    return out


def restart_seconds(base: str, records: int) -> float:
    """Seconds from opening a directory of `records` small records to having them all indexed (restart)."""
    d = os.path.join(base, "scan")
    s = SsdStore(d, capacity=1 << 40).open()
    payload, ns = os.urandom(4096), bytes(16)
    for i in range(0, records, 256):
        s.put_many([(ns, (i + j).to_bytes(16, "big"), payload) for j in range(min(256, records - i))])
    s.close()
    t0 = time.perf_counter()
    s = SsdStore(d, capacity=1 << 40).open()
    elapsed = time.perf_counter() - t0
    assert len(s.index) == records
    s.close()
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", default=None, help="a directory on the file system to measure (default: a temp dir)")
    p.add_argument("--blocks", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--records", type=int, default=100_000, help="records for the restart figure (0: skip)")
    args = p.parse_args()
    base = tempfile.mkdtemp(prefix="kvs-bench-", dir=args.dir)
    blocks = [os.urandom(BLOCK) for _ in range(args.blocks)]
    rw: dict[str, list[float]] = {"raw_w": [], "raw_r": [], "ssd_w": [], "ssd_r": []}
    try:
        for rep in range(args.reps):
            progress(f"repetition {rep + 1}/{args.reps}")
            d = os.path.join(base, str(rep))
            os.makedirs(d)
            for k, v in measure(d, blocks).items():
                rw[k].extend(v)
        if args.records:
            progress(f"writing {args.records} records, then a restart")
            scan = restart_seconds(base, args.records)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    m = {k: statistics.median(v) for k, v in rw.items()}
    t = Table(["figure", "kvstore", "raw O_DIRECT", "ratio", "target"])
    for what, a, b in (("write 2 MiB blocks", "ssd_w", "raw_w"), ("read 2 MiB blocks", "ssd_r", "raw_r")):
        ratio = m[a] / m[b]
        t.add([what, f"{m[a]:.2f} GB/s", f"{m[b]:.2f} GB/s", f"{ratio:.2f}",
               f"≥0.85×: {'PASS' if ratio >= 0.85 else 'FAIL'}"])
    if args.records:
        t.add([f"restart: {args.records} records ready", f"{scan:.2f} s", "", "", f"≤10 s: "
               f"{'PASS' if scan <= 10 else 'FAIL'}"])
    print(t)
    res = {"gbps": rw, "blocks": args.blocks, "block_bytes": BLOCK,
           "restart_s": scan if args.records else None, "records": args.records}
    print(f"\nwrote {write_json('ssd', res)}")


if __name__ == "__main__":
    main()
