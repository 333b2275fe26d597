"""The SSD record store against raw O_DIRECT on the same file system, in the same run, batch by batch in turns.

kvstore: `SsdStore` as the daemon runs it (ssd.io auto: io_uring when it probes sound; 4 transfers in flight, the
daemon's traffic.ssd_in_flight; checksums on; sync policy batch). A write batch is 32 Full Blocks of 2 MiB: the 32
payloads (4 in flight), fdatasync of the file and its record map, the 32 headers (4 KiB each), fdatasync again. A
read batch is 32 blocks, 4 in flight, each read into a page-aligned buffer (as the daemon's host slots are) and
checked against its key and CRC-32C.

raw: plain os.pwritev/os.preadv of 2 MiB with O_DIRECT from page-aligned buffers in a preallocated file, 4 in
flight (threads), nothing else: a write batch is the 32 payloads, fdatasync, fdatasync (the store's two syncs; no
headers, no map, no checksums); a read batch is the 32 blocks. Three raw files:
- raw (the baseline of the ratio): each batch written in its turn and read back later, once, as the store's
  records are;
- cold: written, fdatasync'ed and dropped from the page cache (posix_fadvise DONTNEED) before the run, and read
  once: a file never read before, so that no cache of the VM's host can flatter the read figure;
- warm: the raw file's batch read a second time, right after the first read: what a host cache could give.
Target: kvstore ≥ 0.85× raw for both write and read (issue 16).

    python bench/bench_ssd.py [--dir DIR] [--blocks 256] [--reps 3] [--records 100000]
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
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Table, progress, write_json  # noqa: E402

from kvstore.tiers.ssd import uring  # noqa: E402
from kvstore.tiers.ssd.store import SsdStore  # noqa: E402
from kvstore.traffic import Path  # noqa: E402

BLOCK = 2 << 20
BATCH = 32
IN_FLIGHT = 4            # the daemon's traffic.ssd_in_flight


class Raw:
    """Plain O_DIRECT pwrite/pread of 2 MiB blocks in a preallocated file, IN_FLIGHT at a time: the disk's own
    speed at the store's depth."""

    def __init__(self, path: str, nblocks: int, pool: ThreadPoolExecutor) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        os.ftruncate(self.fd, nblocks * BLOCK)
        self.bufs = [mmap.mmap(-1, BLOCK) for _ in range(IN_FLIGHT)]
        self.pool = pool

    def write(self, first: int, blocks: list[bytes]) -> None:
        def one(i: int) -> None:
            buf = self.bufs[i % IN_FLIGHT]           # one buffer per lane of the pool: never two writes at once
            buf[:] = blocks[i]
            os.pwritev(self.fd, [buf], (first + i) * BLOCK)

        self._lanes(one, len(blocks))
        os.fdatasync(self.fd)
        os.fdatasync(self.fd)

    def read(self, first: int, n: int) -> None:
        self._lanes(lambda i: os.preadv(self.fd, [self.bufs[i % IN_FLIGHT]], (first + i) * BLOCK), n)

    def _lanes(self, fn: object, n: int) -> None:
        """fn(i) for i in 0..n-1, IN_FLIGHT at a time: lane k runs i = k, k + IN_FLIGHT, ... in order."""
        def lane(k: int) -> None:
            for i in range(k, n, IN_FLIGHT):
                fn(i)  # type: ignore[operator]
        list(self.pool.map(lane, range(IN_FLIGHT)))

    def drop_cache(self) -> None:
        os.fsync(self.fd)
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        os.close(self.fd)
        for b in self.bufs:
            b.close()


def timed(fn: object, *args: object) -> float:
    t0 = time.perf_counter()
    fn(*args)  # type: ignore[operator]
    return time.perf_counter() - t0


def measure(base: str, blocks: list[bytes], io: str) -> dict[str, list[float]]:
    """Batch by batch, raw and store take turns, so both see the same disk (a VM's disk speed drifts)."""
    pool = ThreadPoolExecutor(IN_FLIGHT)
    raw, cold = Raw(os.path.join(base, "raw"), len(blocks), pool), Raw(os.path.join(base, "cold"), len(blocks), pool)
    for i in range(0, len(blocks) - BATCH + 1, BATCH):
        cold.write(i, blocks[i:i + BATCH])
    cold.drop_cache()
    path = Path("ssd", workers=IN_FLIGHT)
    s = SsdStore(os.path.join(base, "ssd"), capacity=len(blocks) * (BLOCK + 8192) * 2, io=io, path=path).open()
    ns = bytes(16)
    outs = [memoryview(mmap.mmap(-1, BLOCK)) for _ in range(BATCH)]    # page-aligned, as the host slots are
    key = lambda j: j.to_bytes(16, "big")  # noqa: E731
    gb = BATCH * BLOCK / 1e9
    out: dict[str, list[float]] = {k: [] for k in ("raw_w", "ssd_w", "raw_r", "ssd_r", "cold_r", "warm_r")}
    try:
        for i in range(0, len(blocks) - BATCH + 1, BATCH):
            batch = blocks[i:i + BATCH]
            out["raw_w"].append(gb / timed(raw.write, i, batch))
            out["ssd_w"].append(gb / timed(s.put_many, [(ns, key(i + j), b) for j, b in enumerate(batch)]))
        for i in range(0, len(blocks) - BATCH + 1, BATCH):
            out["raw_r"].append(gb / timed(raw.read, i, BATCH))
            out["warm_r"].append(gb / timed(raw.read, i, BATCH))
            out["cold_r"].append(gb / timed(cold.read, i, BATCH))
            hs = [key(i + j) for j in range(BATCH)]
            t = timed(s.get_many, ns, hs, outs)
            assert bytes(outs[0]) == blocks[i]
            out["ssd_r"].append(gb / t)
    finally:
        s.close()
        path.close()
        raw.close()
        cold.close()
        pool.shutdown()
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


def table(m: dict[str, float], io: str) -> Table:
    t = Table(["figure", f"kvstore ({io})", "raw O_DIRECT", "ratio", "target", "raw: cold file", "raw: warm"])
    for what, a, b in (("write 2 MiB blocks", "ssd_w", "raw_w"), ("read 2 MiB blocks", "ssd_r", "raw_r")):
        ratio = m[a] / m[b]
        cold = f"{m['cold_r']:.2f} GB/s ({m[a] / m['cold_r']:.2f}×)" if a == "ssd_r" else ""
        warm = f"{m['warm_r']:.2f} GB/s" if a == "ssd_r" else ""
        t.add([what, f"{m[a]:.2f} GB/s", f"{m[b]:.2f} GB/s", f"{ratio:.2f}",
               f"≥0.85×: {'PASS' if ratio >= 0.85 else 'FAIL'}", cold, warm])
    return t


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", default=None, help="a directory on the file system to measure (default: a temp dir)")
    p.add_argument("--blocks", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--io", default="auto", choices=("auto", "io_uring", "threads"), help="the store's ssd.io")
    p.add_argument("--records", type=int, default=100_000, help="records for the restart figure (0: skip)")
    args = p.parse_args()
    base = tempfile.mkdtemp(prefix="kvs-bench-", dir=args.dir)
    blocks = [os.urandom(BLOCK) for _ in range(args.blocks)]
    rw: dict[str, list[float]] = {}
    try:
        for rep in range(args.reps):
            progress(f"repetition {rep + 1}/{args.reps}")
            d = os.path.join(base, str(rep))
            os.makedirs(d)
            for k, v in measure(d, blocks, args.io).items():
                rw.setdefault(k, []).extend(v)
        if args.records:
            progress(f"writing {args.records} records, then a restart")
            scan = restart_seconds(base, args.records)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    io = "threads" if args.io == "threads" else uring.backend()
    m = {k: statistics.median(v) for k, v in rw.items()}
    t = table(m, io)
    if args.records:
        t.add([f"restart: {args.records} records ready", f"{scan:.2f} s", "", "", f"≤10 s: "
               f"{'PASS' if scan <= 10 else 'FAIL'}", "", ""])
    print(t)
    res = {"gbps": rw, "blocks": args.blocks, "block_bytes": BLOCK, "in_flight": IN_FLIGHT, "io": io,
           "restart_s": scan if args.records else None, "records": args.records}
    print(f"\nwrote {write_json('ssd', res)}")


if __name__ == "__main__":
    main()
