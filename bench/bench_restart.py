"""A restart of `kvstore serve` on a full SSD tier: how long engines miss.

For each record count (100 k and 500 k by default) a daemon stores that many blocks, one 4 KiB payload each by
default (a record of 8 KiB on disk: 4 KiB header + payload; small blocks make 500 k records fit this disk), written
through to its SSD tier (`ssd.write_through: true`, `ssd.sync: batch`), 256 blocks per durable put. Then, after a
graceful stop (SIGTERM) and after a kill -9, a new `kvstore serve` starts on the same directory and a client
measures, from the moment the process is spawned:
- answers: the first ping answered;
- first hit: the first lookup that finds a block of a fixed random sample (2,000 keys by default), looked up one key
  at a time, pass after pass, from the first answer on;
- full: the end of the first pass in which the sample hits as often as it did before the stop (every key);
- verified: the SSD tier's restart pass (scan or validation of the record maps) done, as `kvstore stats` says.
Baseline in the same run: reading every record file of the directory sequentially with O_DIRECT (8 MiB reads), the
time a restart that reads everything before it serves could not beat; `full / raw` is the ratio.

    python bench/bench_restart.py [--records 100000,500000] [--payload 4096] [--sample 2000] [--dir DIR] [--quick]
"""
from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, Daemon, Table, progress, warn_if_busy, write_json  # noqa: E402

from kvstore.client import Client  # noqa: E402
from kvstore.protocol.geometry import Geometry  # noqa: E402
from kvstore.protocol.keys import NamespaceSpec  # noqa: E402

PUT_BATCH = 256
READ_CHUNK = 8 << 20
DEADLINE_S = 600.0


def geometry(payload: int) -> Geometry:
    """A one-layer geometry whose Full Block is `payload` bytes (float16 K+V, 16 tokens, 1 head)."""
    head_dim = payload // (2 * 16 * 2)
    if head_dim * 64 != payload:
        raise SystemExit(f"--payload must be a multiple of 64 bytes, got {payload}")
    return Geometry(layers=1, tokens=16, kv_heads=1, head_dim=head_dim, dtype="float16")


def keys(n: int) -> list[bytes]:
    return [hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest() for i in range(n)]


class Serve(Daemon):
    """`kvstore serve` on a fixed SSD directory; `spawn` returns at once (the caller times the start)."""

    def __init__(self, ssd_dir: str, ssd_capacity: int) -> None:
        super().__init__("256MiB", "16MiB", env={
            "KVSTORE_SSD_DIR": ssd_dir, "KVSTORE_SSD_CAPACITY": str(ssd_capacity),
            "KVSTORE_SSD_WRITE_THROUGH": "true", "KVSTORE_SSD_SYNC": "batch"})

    def spawn(self) -> float:
        log = open(self.log_path, "ab")
        t0 = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "kvstore", "serve"], env=self.env, cwd=ROOT, stdout=log,
                                     stderr=subprocess.STDOUT)
        log.close()
        return t0

    def halt(self, sig: int) -> float:
        """Stop the process with `sig` (its directory stays); the seconds it took to exit."""
        assert self.proc is not None
        t0 = time.monotonic()
        self.proc.send_signal(sig)
        self.proc.wait(300)
        return time.monotonic() - t0


def ssd_stats(c: Client) -> dict[str, Any]:
    return next(t for t in c.stats()["tiers"] if t.get("tier") == "ssd")


def settle(c: Client) -> None:
    """Until the write-through has nothing queued or in flight and the SSD tier nothing staged."""
    while True:
        s = c.stats()
        wt = s.get("write_through") or {}
        if not wt.get("queued") and not wt.get("writing") and not ssd_stats(c).get("staged_blocks"):
            return
        time.sleep(0.2)


def fill(d: Serve, spec: NamespaceSpec, hs: list[bytes], payload: int) -> float:
    blob = os.urandom(payload)
    blocks = [blob] * PUT_BATCH
    t0 = time.monotonic()
    with d.client() as c:
        ns = c.namespace(spec)
        for i in range(0, len(hs), PUT_BATCH):
            part = hs[i:i + PUT_BATCH]
            # durable: each batch waits for its blocks on disk (write-through alone skips blocks when it lags)
            r = ns.put(part, blocks[:len(part)], batch=PUT_BATCH, durable=True)
            if r.durability != "durable" or r.stored + r.existed < len(part):
                raise SystemExit(f"blocks {i}..{i + len(part)}: {r}")
            if i % (PUT_BATCH * 200) == 0:
                progress(f"  stored {i}/{len(hs)}")
        settle(c)
        blocks_on_ssd = ssd_stats(c)["blocks"]
    if blocks_on_ssd < len(hs):
        raise SystemExit(f"only {blocks_on_ssd} of {len(hs)} blocks reached the SSD tier")
    return time.monotonic() - t0


def hits(ns: Any, sample: list[bytes]) -> tuple[int, float | None]:
    """One pass over the sample, a lookup per key: how many hit, and when the first did."""
    n, first = 0, None
    for h in sample:
        if ns.lookup([h]):
            n += 1
            first = first or time.monotonic()
    return n, first


def connect(socket: str) -> Client:
    while True:
        try:
            c = Client(socket, timeout=60)
            c.ping()
            return c
        except (ConnectionError, OSError):
            time.sleep(0.002)


def measure_start(d: Serve, spec: NamespaceSpec, sample: list[bytes], want: int) -> dict[str, float | None]:
    """Spawn `kvstore serve` and time its answers, first hit and full hit rate over the sample."""
    t0 = d.spawn()
    c = connect(d.socket)
    out: dict[str, float | None] = {"answers_s": time.monotonic() - t0, "first_hit_s": None, "full_s": None}
    ns = c.namespace(spec)
    while out["full_s"] is None:
        n, first = hits(ns, sample)
        if first is not None and out["first_hit_s"] is None:
            out["first_hit_s"] = first - t0
        if n >= want:
            out["full_s"] = time.monotonic() - t0
        if time.monotonic() - t0 > DEADLINE_S:
            break
    while (scan := ssd_stats(c).get("scan", {})).get("state") not in ("ready", "stopped", None):
        if time.monotonic() - t0 > DEADLINE_S:
            break
        time.sleep(0.01)
    out["verified_s"] = time.monotonic() - t0
    out["scan"] = scan  # type: ignore[assignment]
    c.close()
    return out


def raw_read(directory: str) -> tuple[float, int]:
    """Every file of the directory read sequentially with O_DIRECT: seconds, bytes."""
    buf = mmap.mmap(-1, READ_CHUNK)
    total = 0
    t0 = time.monotonic()
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if not os.path.isfile(path) or os.path.islink(path):
            continue
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            while (n := os.readv(fd, [buf])) > 0:
                total += n
        finally:
            os.close(fd)
    buf.close()
    return time.monotonic() - t0, total


def run_size(base: str, n: int, payload: int, sample_n: int) -> list[dict[str, Any]]:
    spec = NamespaceSpec(model="bench-restart", geometry=geometry(payload))
    hs = keys(n)
    sample = random.Random(n).sample(hs, min(sample_n, n))
    ssd_dir = tempfile.mkdtemp(prefix=f"restart-{n}-", dir=base)
    record = 4096 + -(-payload // 4096) * 4096
    capacity = int(n * record * 1.25) + (64 << 20)
    rows = []
    d = Serve(ssd_dir, capacity)
    try:
        d.start()
        progress(f"{n} records of {payload} B: storing")
        fill_s = fill(d, spec, hs, payload)
        with d.client() as c:
            before, _ = hits(c.namespace(spec), sample)
        progress(f"  stored and settled in {fill_s:.1f} s; {before}/{len(sample)} of the sample hit")
        for mode, sig in (("graceful", signal.SIGTERM), ("kill -9", signal.SIGKILL)):
            stop_s = d.halt(sig)
            raw_s, raw_bytes = raw_read(ssd_dir)
            m = measure_start(d, spec, sample, before)
            progress(f"  after {mode}: answers {m['answers_s']:.2f} s, first hit {m['first_hit_s']}, full "
                     f"{m['full_s']}, verified {m['verified_s']:.2f} s; raw read {raw_s:.2f} s")
            rows.append({"records": n, "payload_bytes": payload, "stop": mode, "stop_s": stop_s, "fill_s": fill_s,
                         "sample": len(sample), "sample_hits_before": before, "raw_read_s": raw_s,
                         "raw_read_bytes": raw_bytes, **m})
    finally:
        d.stop()
        shutil.rmtree(ssd_dir, ignore_errors=True)
    return rows


def fmt(x: float | None) -> str:
    return "never" if x is None else f"{x:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", default="100000,500000")
    ap.add_argument("--payload", type=int, default=4096, help="bytes of one block (a record adds a 4 KiB header)")
    ap.add_argument("--sample", type=int, default=2000)
    ap.add_argument("--dir", default=None, help="where the record files go (default: a directory under /tmp)")
    ap.add_argument("--quick", action="store_true", help="10 k records only")
    a = ap.parse_args()
    sizes = [10_000] if a.quick else [int(s) for s in a.records.split(",")]
    load = warn_if_busy()
    base = tempfile.mkdtemp(prefix="kvs-restart-", dir=a.dir)
    try:
        rows = [r for n in sizes for r in run_size(base, n, a.payload, a.sample)]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    t = Table(["records", "stop", "stop s", "answers s", "first hit s", "full hit rate s", "verified s",
               "raw read s", "full / raw"])
    for r in rows:
        ratio = "-" if r["full_s"] is None else f"{r['full_s'] / r['raw_read_s']:.3f}"
        t.add([r["records"], r["stop"], f"{r['stop_s']:.2f}", fmt(r["answers_s"]), fmt(r["first_hit_s"]),
               fmt(r["full_s"]), fmt(r["verified_s"]), f"{r['raw_read_s']:.2f}", ratio])
    record = 4096 + -(-a.payload // 4096) * 4096
    print(f"\nRestart of `kvstore serve` on a full SSD tier ({a.payload} B blocks, {record} B records on disk); "
          f"seconds from spawn; a sample of {a.sample} keys looked up one at a time")
    print(t)
    path = write_json("restart", {"rows": rows, "load_before": load, "args": vars(a)})
    print(f"\n{path}")


if __name__ == "__main__":
    main()
