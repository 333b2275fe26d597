"""The donated tier (issue 17 item 5, SwiftCache §3.2) through the daemon: a get served from memory another process
lent, and the reclaim that gives that memory back.

- donated-hit get, p50/p99, per block size (2 MiB: 32 layers × K+V × 16 tokens × 8 heads × 128 × fp16; 64 KiB: one
  layer of it): a get of one block the host pool does not hold and the donated tier does (acquire → the daemon
  copies it out of the donor's memory, checks its CRC-32C, into a host slot → the client copies it out → release).
  Three baselines, in the same run, sample by sample: (a) a host-hit get of the same block right after it (the
  floor: what every get pays); (b) an SSD-hit get of a block of the same size, in the same daemon (the tier the
  donated one sits above); (c) a numpy copy of the same bytes (a memcpy). How: a donor lends a region; a first set
  of blocks is put through a 32 MiB host pool, those evicted land in the region, and the region is reclaimed (they
  move to the SSD); a second region takes the blocks a second set evicts (which blocks the pool evicted is asked by
  `lookup`). Each sample gets one block of each set (order alternating), a host-hit get and a memcpy of each, and
  deletes both (the next promotion finds a free host slot); the daemon's counters confirm per sample that the
  donated tier (`reads` of its tier row) or the SSD (`reads_ssd`) served it (else the sample is left out, and
  listed in the JSON), and every byte is checked.
- reclaim: a donor lends a region, the host pool evicts blocks into it until it is full, and the donor reclaims it
  with a generous deadline (every block should move to the SSD) and a short one (what the deadline does not allow
  is dropped), each without and with a concurrent reader (another client getting the region's blocks, bytes
  checked: a read hits, misses, or is wrong — never wrong). Figures over several reclaims: latency p50/p99 (the
  daemon's `seconds`; the donor's wall time beside it in the JSON), blocks moved to the SSD and dropped, MB/s moved
  (blocks moved × size ÷ seconds), reads during the reclaim.

`--kind memfd` (default): shared memory (memfd), every machine. `--kind cuda`: GPU memory by CUDA IPC (CuPy; the
daemon runs with `donated.kind: cuda`); exits 77 with the reason where CuPy or a GPU is missing. The memfd path never
imports CuPy.

    .venv/bin/python bench/bench_donated.py [--quick] [--kind memfd|cuda] [--samples N] [--reps N] [--region-mib N]
"""
from __future__ import annotations

import argparse
import atexit
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Daemon, Table, progress, summary, warn_if_busy, write_json  # noqa: E402

from kvstore.client import Client  # noqa: E402
from kvstore.client.donor import Donor  # noqa: E402
from kvstore.protocol.geometry import Geometry  # noqa: E402
from kvstore.protocol.keys import NamespaceSpec  # noqa: E402

GEOMS = {"2 MiB": Geometry(layers=32, tokens=16, kv_heads=8, head_dim=128, dtype="float16"),
         "64 KiB": Geometry(layers=1, tokens=16, kv_heads=8, head_dim=128, dtype="float16")}
HOST_BYTES = 32 << 20               # the host pool: small, so that a few puts fill it
SPARE = 8                           # blocks of each set beyond the samples (the pool keeps some headroom)
BATCH = 16                          # blocks per put, at most a quarter of the host pool
GENEROUS_S, SHORT_S = 10.0, 0.02
SKIPPED = 77                        # bench/run_all.sh: this machine cannot run it


# ----- blocks -----
class Blocks:
    """Distinct, checkable content without holding every block: one random base, the key's index stamped at both
    ends (a block served under the wrong key differs, and so does a torn one)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.base = np.random.default_rng(17).integers(0, 256, nbytes, dtype=np.uint8).tobytes()

    def content(self, i: int) -> bytearray:
        b = bytearray(self.base)
        stamp = i.to_bytes(8, "little")
        b[:8], b[-8:] = stamp, stamp
        return b

    def check(self, i: int, got: bytes | bytearray) -> bool:
        stamp = i.to_bytes(8, "little")
        return got[:8] == stamp and got[-8:] == stamp and got[8:-8] == self.base[8:-8]


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def put(ns: Any, blocks: Blocks, ids: range) -> None:
    step = max(1, min(BATCH, HOST_BYTES // blocks.nbytes // 4))
    for lo in range(ids.start, ids.stop, step):
        batch = range(lo, min(lo + step, ids.stop))
        assert ns.put([key(i) for i in batch], [blocks.content(i) for i in batch]).stored == len(batch)


# ----- the donor: memfd or CUDA -----
class MemfdLender:
    """Lends shared memory (a memfd). One Donor connection per region: a Donor keeps every region it was given
    back mapped until it closes, and a run lends gigabytes one region after the other."""
    kind = "memfd"

    def __init__(self, sock: str) -> None:
        self.sock = sock
        self.donors: dict[int, Donor] = {}

    def lend(self, nbytes: int) -> int:
        donor = Donor(self.sock)
        region = self._donate(donor, nbytes)
        self.donors[region] = donor
        return region

    def _donate(self, donor: Donor, nbytes: int) -> int:
        return donor.donate_memfd(nbytes, "bench")

    def reclaim(self, region: int, deadline_s: float) -> dict[str, Any]:
        """The daemon's reply, with `wall_s`: the donor's wait for it (not the unmap in the donor that follows)."""
        donor = self.donors.pop(region)
        try:
            t0 = time.perf_counter()
            reply = donor.reclaim(region, deadline_s)
            return {**reply, "wall_s": time.perf_counter() - t0}
        finally:
            self._free(region)
            donor.close()

    def _free(self, region: int) -> None:
        pass

    def close(self) -> None:
        for region in list(self.donors):
            self.donors.pop(region).close()
            self._free(region)


class CudaLender(MemfdLender):
    """Lends GPU memory: a cudaMalloc of its own per region (a CuPy pool's block would be part of a larger
    allocation, and an IPC handle names a whole allocation), freed once the daemon has given it back."""
    kind = "cuda"

    def __init__(self, sock: str, device: int = 0) -> None:
        super().__init__(sock)
        import cupy  # only here: the memfd path never imports CUDA
        self.rt = cupy.cuda.runtime
        self.cupy = cupy
        self.device = device
        self.ptrs: dict[int, int] = {}

    def _donate(self, donor: Donor, nbytes: int) -> int:
        with self.cupy.cuda.Device(self.device):
            ptr = self.rt.malloc(nbytes)
        try:
            region = donor.donate_cuda(ptr, nbytes, self.device, "bench")
        except BaseException:
            self.rt.free(ptr)
            raise
        self.ptrs[region] = ptr
        return region

    def _free(self, region: int) -> None:
        ptr = self.ptrs.pop(region, None)
        if ptr is not None:
            with self.cupy.cuda.Device(self.device):
                self.rt.free(ptr)


def cuda_missing() -> str | None:
    """Why `--kind cuda` cannot run here (None: it can)."""
    try:
        import cupy
    except ImportError as e:
        return f"--kind cuda needs CuPy (pip install cupy-cuda12x beside kvstore): {e}"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:      # no driver, no device: CUDARuntimeError
        return f"--kind cuda needs a CUDA GPU: {type(e).__name__}: {e}"
    return None if n > 0 else "--kind cuda needs a CUDA GPU: cupy sees none"


def lender(kind: str, sock: str) -> MemfdLender:
    return CudaLender(sock) if kind == "cuda" else MemfdLender(sock)


# ----- the daemon -----
def start_daemon(base: str, kind: str, ssd_capacity: str) -> Daemon:
    """A daemon with a small host pool, an SSD tier in `base` with room to stage a whole region, and the donated
    tier on."""
    ssd = tempfile.mkdtemp(prefix="ssd-", dir=base)
    env = {"KVSTORE_SSD_DIR": ssd, "KVSTORE_SSD_CAPACITY": ssd_capacity, "KVSTORE_SSD_STAGING_BYTES": "1GiB",
           "KVSTORE_DONATED_ENABLED": "true", "KVSTORE_DONATED_KIND": kind}
    return Daemon(f"{HOST_BYTES >> 20}MiB", f"{HOST_BYTES >> 20}MiB", env=env).start()


def donate_socket(d: Daemon) -> str:
    return os.path.join(os.path.dirname(d.socket), "donate.sock")


def tier_row(s: dict[str, Any], name: str) -> dict[str, Any]:
    return next(t for t in s["tiers"] if t["tier"] == name)


def settle(c: Client, timeout: float = 60.0) -> dict[str, Any]:
    """Stats once every demotion is filled and every SSD write done: the books a measurement starts from."""
    deadline = time.monotonic() + timeout
    while True:
        s = c.stats()
        lanes = [r for p in s["traffic"] if p["path"] in ("ssd", "mem", "gpu") for r in p["lanes"].values()]
        if tier_row(s, "ssd")["staged_blocks"] == 0 and s["pinned"] == 0 and \
                not any(r["queued"] or r["in_flight"] for r in lanes):
            return s
        if time.monotonic() > deadline:
            raise TimeoutError(f"the daemon did not settle in {timeout} s")
        time.sleep(0.01)


def below_host(c: Client, ns: Any, ids: range) -> list[int]:
    """The blocks of `ids` the host pool does not hold (the pool evicts a put's chain tail first: which blocks of
    a run of puts went below is the daemon's choice, asked here)."""
    return [i for i in ids if c.call("lookup", ns=ns.id, keys=key(i))["host"] == 0]


def served(c: Client) -> tuple[int, int]:
    """(reads served by the donated tier, promotions read from the SSD) so far."""
    s = c.stats()
    return tier_row(s, "donated")["counters"].get("reads", 0), s["counters"]["reads_ssd"]


# ----- gets -----
@dataclass
class GetSamples:
    donated: list[float] = field(default_factory=list)
    ssd: list[float] = field(default_factory=list)
    host: list[float] = field(default_factory=list)
    memcpy: list[float] = field(default_factory=list)
    rejected: list[dict[str, Any]] = field(default_factory=list)    # gets not served by the tier meant


def one_get(c: Client, ns: Any, blocks: Blocks, i: int, tier: str, out: bytearray, copy_to: np.ndarray,
            res: GetSamples) -> None:
    """A lower-tier get of block i (kept if the counters say `tier` served it), its host-hit get, a memcpy of its
    bytes; then the block is deleted (its host slot is free for the next promotion)."""
    before = served(c)
    t0 = time.perf_counter()
    n = ns.get([key(i)], [out])
    took = time.perf_counter() - t0
    after = served(c)
    if n != 1 or not blocks.check(i, out):
        raise AssertionError(f"block {i} ({tier}): got {n} blocks, bytes {'ok' if n else 'missing'}: wrong bytes")
    want, got = (1, 0) if tier == "donated" else (0, 1), (after[0] - before[0], after[1] - before[1])
    if got != want:
        res.rejected.append({"meant": tier, "donated_reads": got[0], "ssd_reads": got[1], "ms": took * 1e3})
    else:
        getattr(res, tier).append(took)
        t0 = time.perf_counter()
        assert ns.get([key(i)], [out]) == 1
        res.host.append(time.perf_counter() - t0)
        src = np.frombuffer(out, np.uint8)
        t0 = time.perf_counter()
        np.copyto(copy_to, src)
        res.memcpy.append(time.perf_counter() - t0)
    ns.delete([key(i)])


def get_latency(base: str, kind: str, label: str, geom: Geometry, samples: int) -> dict[str, Any]:
    """Donated-hit against SSD-hit, host-hit and memcpy for one block size (see the module docstring)."""
    nbytes, blocks = geom.full_bytes, Blocks(geom.full_bytes)
    host_blocks = HOST_BYTES // nbytes
    each = samples + SPARE
    region_bytes = (host_blocks + each + SPARE) * nbytes
    ssd_ids, don_ids = range(0, host_blocks + each), range(1 << 32, (1 << 32) + host_blocks + each)
    d = start_daemon(base, kind, f"{max(256, 4 * region_bytes >> 20)}MiB")
    lend = lender(kind, donate_socket(d))
    try:
        with d.client() as c:
            ns = c.namespace(NamespaceSpec("bench-donated", geom))
            progress(f"{label}: {len(ssd_ids)} blocks through the host pool, those evicted into a "
                     f"{region_bytes >> 20} MiB region, reclaimed to the SSD")
            first = lend.lend(region_bytes)
            put(ns, blocks, ssd_ids)
            settle(c)
            lend.reclaim(first, GENEROUS_S)
            on_ssd = below_host(c, ns, ssd_ids)
            progress(f"{label}: {len(don_ids)} more, those evicted into a second region; {samples} samples")
            lend.lend(region_bytes)
            put(ns, blocks, don_ids)
            c.evict(nbytes=4 * nbytes)              # free host slots: a promotion evicts no victim
            settle(c)
            in_region = below_host(c, ns, don_ids)
            res = sample_gets(c, ns, blocks, on_ssd, in_region, min(samples, len(on_ssd), len(in_region)), nbytes)
    finally:
        lend.close()
        d.stop()
    return {"block_bytes": nbytes, "samples": res}


def sample_gets(c: Client, ns: Any, blocks: Blocks, ssd_ids: list[int], don_ids: list[int], samples: int,
                nbytes: int) -> GetSamples:
    res = GetSamples()
    out, copy_to = bytearray(nbytes), np.empty(nbytes, np.uint8)
    for j in range(samples):
        order = [("donated", don_ids[j]), ("ssd", ssd_ids[j])]
        for tier, i in order if j % 2 == 0 else order[::-1]:
            one_get(c, ns, blocks, i, tier, out, copy_to, res)
    if res.rejected:
        progress(f"  {len(res.rejected)} samples left out, not served by the tier meant: {res.rejected}")
    return res


# ----- reclaim -----
@dataclass
class Reads:
    hit: int = 0
    miss: int = 0
    wrong: int = 0


def reader(sock: str, geom: Geometry, blocks: Blocks, ids: list[int], ready: threading.Event, go: threading.Event,
           stop: threading.Event, reads: Reads) -> None:
    """Get the region's blocks in random order while the reclaim runs (from `go` to `stop`); every byte checked."""
    rng = random.Random(3)
    out = bytearray(geom.full_bytes)
    with Client(sock) as c:
        ns = c.namespace(NamespaceSpec("bench-donated", geom))
        ready.set()
        go.wait()
        while not stop.is_set():
            i = rng.choice(ids)
            if ns.get([key(i)], [out]) != 1:
                reads.miss += 1
            elif blocks.check(i, out):
                reads.hit += 1
            else:
                reads.wrong += 1


def one_reclaim(d: Daemon, lend: MemfdLender, geom: Geometry, blocks: Blocks, ids: range, region_bytes: int,
                deadline_s: float, with_reader: bool) -> dict[str, Any]:
    """Fill a fresh region with blocks evicted from the host pool, then reclaim it (with a reader running)."""
    with d.client() as c:
        ns = c.namespace(NamespaceSpec("bench-donated", geom))
        region = lend.lend(region_bytes)
        put(ns, blocks, ids)
        held = tier_row(settle(c), "donated")["blocks"]
        below = below_host(c, ns, ids)                      # the region's blocks (and any it moved down)
        reads, ready, go, stop = Reads(), threading.Event(), threading.Event(), threading.Event()
        t = threading.Thread(target=reader, args=(d.socket, geom, blocks, below, ready, go, stop, reads))
        if with_reader:
            t.start()
            ready.wait(30)
        go.set()
        reply = lend.reclaim(region, deadline_s)
        stop.set()
        if with_reader:
            t.join(60)
        settle(c)
        ns.delete([key(i) for i in ids])                    # the SSD keeps no more than one region's blocks
    return {"held": held, "reads": reads.__dict__,
            **{k: reply[k] for k in ("migrated", "dropped", "seconds", "wall_s", "deadline_passed", "unmapped")}}


def reclaims(base: str, kind: str, region_mib: int, reps: int) -> list[dict[str, Any]]:
    """Every (deadline, reader) configuration `reps` times, configurations taking turns, 2 MiB blocks."""
    geom = GEOMS["2 MiB"]
    blocks, nbytes = Blocks(geom.full_bytes), geom.full_bytes
    region_bytes = region_mib << 20
    per_rep = HOST_BYTES // nbytes + region_bytes // nbytes
    configs = [(dl, rd) for dl in (GENEROUS_S, SHORT_S) for rd in (False, True)]
    out = [{"deadline_s": dl, "reader": rd, "runs": []} for dl, rd in configs]
    d = start_daemon(base, kind, f"{max(1024, 4 * region_mib)}MiB")
    lend = lender(kind, donate_socket(d))
    try:
        for rep in range(reps):
            progress(f"reclaim of a {region_mib} MiB region: repetition {rep + 1}/{reps}")
            for k, (dl, rd) in enumerate(configs):
                ids = range((rep * len(configs) + k) * per_rep, (rep * len(configs) + k + 1) * per_rep)
                out[k]["runs"].append(one_reclaim(d, lend, geom, blocks, ids, region_bytes, dl, rd))
    finally:
        lend.close()
        d.stop()
    return out


# ----- the report -----
def ms(xs: list[float], q: str) -> str:
    return f"{summary(xs, 1e3)[q]:.3f}" if xs else "-"


def get_table(gets: dict[str, dict[str, Any]]) -> Table:
    t = Table(["block", "path", "p50 ms", "p99 ms", "÷ host-hit", "÷ memcpy", "÷ SSD-hit", "n"])
    for label, g in gets.items():
        r: GetSamples = g["samples"]
        host, mem, ssd = (summary(x)["median"] if x else float("nan") for x in (r.host, r.memcpy, r.ssd))
        for name, xs in (("donated-hit get", r.donated), ("SSD-hit get", r.ssd), ("host-hit get (a)", r.host),
                         ("memcpy (numpy) (c)", r.memcpy)):
            p50 = summary(xs)["median"] if xs else float("nan")
            t.add([label, name, ms(xs, "median"), ms(xs, "p99"), f"{p50 / host:.2f}", f"{p50 / mem:.1f}",
                   f"{p50 / ssd:.2f}", len(xs)])
    return t


def reclaim_table(rec: list[dict[str, Any]], region_mib: int, nbytes: int) -> Table:
    t = Table(["deadline", "reader", "region", "p50 ms", "p99 ms", "moved", "dropped", "MB/s moved",
               "reads hit/miss/wrong", "n"])
    for cfg in rec:
        runs = cfg["runs"]
        secs = [r["seconds"] for r in runs]
        rates = [r["migrated"] * nbytes / r["seconds"] / 1e6 for r in runs if r["seconds"] > 0]
        reads = {k: sum(r["reads"][k] for r in runs) for k in ("hit", "miss", "wrong")}
        t.add([f"{cfg['deadline_s'] * 1e3:g} ms", "yes" if cfg["reader"] else "no", f"{region_mib} MiB",
               ms(secs, "median"), ms(secs, "p99"),
               f"{sum(r['migrated'] for r in runs)}/{sum(r['held'] for r in runs)}",
               sum(r["dropped"] for r in runs), f"{summary(rates)['median']:.0f}" if rates else "-",
               f"{reads['hit']}/{reads['miss']}/{reads['wrong']}" if cfg["reader"] else "-", len(runs)])
    return t


def to_json(gets: dict[str, dict[str, Any]], rec: list[dict[str, Any]], args: argparse.Namespace,
            load: float) -> dict[str, Any]:
    out_gets = {}
    for label, g in gets.items():
        r: GetSamples = g["samples"]
        out_gets[label] = {"block_bytes": g["block_bytes"], "rejected": r.rejected,
                           **{f"{k}_ms": summary(getattr(r, k), 1e3) for k in ("donated", "ssd", "host", "memcpy")
                              if getattr(r, k)}}
    return {"kind": args.kind, "quick": args.quick, "samples": args.samples, "reps": args.reps,
            "region_mib": args.region_mib, "host_pool_bytes": HOST_BYTES, "load_before": load,
            "load_after": os.getloadavg()[0], "gets": out_gets, "reclaims": rec}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--kind", choices=("memfd", "cuda"), default="memfd")
    ap.add_argument("--samples", type=int, default=0, help="donated/SSD gets per block size (30 quick, 150)")
    ap.add_argument("--reps", type=int, default=0, help="reclaims per configuration (3 quick, 8)")
    ap.add_argument("--region-mib", type=int, default=0, help="the reclaimed region (64 quick, 256)")
    args = ap.parse_args()
    args.samples = args.samples or (30 if args.quick else 150)
    args.reps = args.reps or (3 if args.quick else 8)
    args.region_mib = args.region_mib or (64 if args.quick else 256)
    if args.kind == "cuda" and (why := cuda_missing()) is not None:
        print(why)
        sys.exit(SKIPPED)
    load = warn_if_busy()
    base = tempfile.mkdtemp(prefix="kvs-donated-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
    atexit.register(shutil.rmtree, base, True)
    gets = {label: get_latency(base, args.kind, label, geom, args.samples) for label, geom in GEOMS.items()}
    rec = reclaims(base, args.kind, args.region_mib, args.reps)
    print(f"donated tier ({args.kind}): gets, one block each; host pool {HOST_BYTES >> 20} MiB")
    print(get_table(gets))
    print(f"\nreclaim of a region full of 2 MiB blocks (deadlines {GENEROUS_S:g} s and {SHORT_S * 1e3:g} ms)")
    print(reclaim_table(rec, args.region_mib, GEOMS["2 MiB"].full_bytes))
    print(f"\nwrote {write_json('donated', to_json(gets, rec, args, load))}")
    wrong = sum(r["reads"]["wrong"] for cfg in rec for r in cfg["runs"])
    if wrong:
        print(f"FAIL: {wrong} reads during reclaims returned wrong bytes")
        sys.exit(1)


if __name__ == "__main__":
    main()
