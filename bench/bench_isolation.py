"""A tenant's durable put while a neighbour floods the durable queue (issue 29 part 4): the victim's latency with the
write-through's queues served tenant by tenant (deficit round robin, kvstore.movers.fair) against first come,
first served (the same daemon with KVSTORE_FAIR_QUEUES=0: one queue for all, the write-through before issue 29)
and against the victim alone, in one run.

Each configuration is a fresh daemon with an SSD tier (under --dir, default a temporary directory: put it on a real
disk) and two tenants with secrets. The neighbour runs `--flooders` threads, each putting `--flood-blocks` blocks
durable again and again (new keys each time, so every block is written); the victim puts 8 blocks durable every
`--every-ms`, `--samples` times, and its latency (put to durable answer) is recorded. Blocks are 64 KiB. Printed:
p50 / p99 / max of the victim's latency per configuration, and the neighbour's blocks made durable per second (the
fair queue must not cost it throughput).

    .venv/bin/python bench/bench_isolation.py [--quick] [--samples 40] [--flooders 4] [--flood-blocks 512]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time

import yaml

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH))
sys.path.insert(0, BENCH)
from common import Daemon, Table, progress, summary, warn_if_busy, write_json  # noqa: E402

from kvstore.client import Client  # noqa: E402
from kvstore.protocol.geometry import Geometry  # noqa: E402
from kvstore.protocol.keys import NamespaceSpec  # noqa: E402

GEOM = Geometry(layers=2, tokens=16, kv_heads=8, head_dim=64, dtype="float16")     # 64 KiB per block
SECRETS = {"victim": "sv", "neighbour": "sn"}
CONFIGS = (("alone", None), ("fair (DRR)", ""), ("first come, first served", "0"))
TIMEOUT_S = 15.0            # each durable put's deadline (below ssd.durable_timeout_max_s, 20)


def spec(model: str) -> NamespaceSpec:
    return NamespaceSpec(model=model, geometry=GEOM)


def keys(tag: str, start: int, n: int) -> list[bytes]:
    import hashlib

    return [hashlib.blake2b(f"{tag}:{i}".encode(), digest_size=16).digest() for i in range(start, start + n)]


def run(name: str, fair: str | None, args: argparse.Namespace, root: str) -> dict:
    conf = os.path.join(root, f"{len(name)}.yaml")
    with open(conf, "w") as f:
        yaml.safe_dump({"tenants": [{"name": n, "secret": s} for n, s in SECRETS.items()]}, f)
    ssd = tempfile.mkdtemp(dir=root)
    env = {"KVSTORE_CONFIG": conf, "KVSTORE_SSD_DIR": ssd, "KVSTORE_SSD_CAPACITY": "8GiB",
           "KVSTORE_SSD_SYNC": "batch"}
    if fair:
        env["KVSTORE_FAIR_QUEUES"] = fair
    block = bytes(GEOM.full_bytes)
    stop = threading.Event()
    flooded = [0]
    lat: list[float] = []
    with Daemon(capacity="1GiB", segment="64MiB", env=env) as d:
        def flood(i: int) -> None:
            with Client(d.socket, tenant="neighbour", secret=SECRETS["neighbour"], timeout=60) as c:
                ns, n = c.namespace(spec("n")), 0
                while not stop.is_set():
                    r = ns.put(keys(f"f{i}", n, args.flood_blocks), [block] * args.flood_blocks, durable=True,
                               durable_timeout_s=TIMEOUT_S)
                    n += args.flood_blocks
                    flooded[0] += r.stored - r.not_durable
                    ns.delete(keys(f"f{i}", n - args.flood_blocks, args.flood_blocks))     # room for the next

        threads = [threading.Thread(target=flood, args=(i,)) for i in range(args.flooders if fair is not None
                                                                               else 0)]
        for t in threads:
            t.start()
        time.sleep(args.warmup_s if threads else 0)
        t0 = time.monotonic()
        timeouts = 0
        with Client(d.socket, tenant="victim", secret=SECRETS["victim"], timeout=60) as c:
            ns = c.namespace(spec("v"))
            for i in range(args.samples):
                s = time.perf_counter()
                r = ns.put(keys("v", 8 * i, 8), [block] * 8, durable=True, durable_timeout_s=TIMEOUT_S)
                lat.append(time.perf_counter() - s)
                assert r.stored == 8, r
                timeouts += r.durability != "durable"      # not durable within the deadline: counted as such
                time.sleep(args.every_ms / 1000)
        wall = time.monotonic() - t0
        stop.set()
        for t in threads:
            t.join()
    shutil.rmtree(ssd, ignore_errors=True)
    row = {"config": name, "victim_ms": summary(lat, 1e3), "victim_timeouts": timeouts,
           "neighbour_blocks_per_s": flooded[0] / wall}
    progress(f"{name}: victim p50 {row['victim_ms']['median']:.1f} ms, p99 {row['victim_ms']['p99']:.1f} ms; "
             f"neighbour {row['neighbour_blocks_per_s']:.0f} blocks/s")
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="12 samples, 2 flooders")
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--flooders", type=int, default=4)
    ap.add_argument("--flood-blocks", type=int, default=512)
    ap.add_argument("--every-ms", type=float, default=50)
    ap.add_argument("--warmup-s", type=float, default=1.0)
    ap.add_argument("--dir", default=None, help="where the SSD tiers go (default: a temporary directory)")
    args = ap.parse_args()
    if args.quick:
        args.samples, args.flooders = 12, 2
    load = warn_if_busy()
    root = tempfile.mkdtemp(prefix="kvsb-iso-", dir=args.dir)
    try:
        rows = [run(name, fair, args, root) for name, fair in CONFIGS]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    table = Table(["write-through queue", "victim p50 ms", "p99 ms", "max ms", "÷ alone (p50)",
                   f"not durable in {TIMEOUT_S:g} s", "neighbour blocks/s"])
    alone = rows[0]["victim_ms"]["median"]
    for r in rows:
        v = r["victim_ms"]
        table.add([r["config"], f"{v['median']:.1f}", f"{v['p99']:.1f}", f"{v['max']:.1f}",
                   f"{v['median'] / alone:.1f}", f"{r['victim_timeouts']}/{v['n']}",
                   f"{r['neighbour_blocks_per_s']:.0f}" if r["config"] != "alone" else "-"])
    print(f"\na victim's 8-block durable put (64 KiB blocks) under a neighbour's flood ({args.flooders} threads x "
          f"{args.flood_blocks} blocks durable, again and again); {args.samples} samples")
    print(table)
    print(f"\nwrote {write_json('isolation', {'rows': rows, 'args': vars(args), 'load': load})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
