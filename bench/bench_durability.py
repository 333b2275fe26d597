"""How long a stored block takes to become durable (issue 19): the time from a `put`'s reply to its block being on
disk and synced in the SSD tier, with write-through on, idle and under load — against the raw disk's own write and
fdatasync of the same bytes, in the same run, so the figures are ratios.

- raw disk: O_DIRECT pwrite of one 2 MiB block + fdatasync, in a file on the SSD tier's file system;
- put reply → durable: a plain put (write-through queues the block at its commit), then `wait_durable` on it: the
  lag the put's caller would see if it asked right after the reply;
- durable put: `put(..., durable=True)` end to end (reserve, copy, commit, wait for the disk);
- the daemon's own lag histogram (commit → synced, `kvstore stats` write_through.lag, bucket bounds) and its max;
- under load: writer threads storing blocks as fast as they can into a host pool smaller than their data (the pool
  fills: evictions and demotions) with write-through on (the SSD write path stays busy), while the probe above runs.

    python bench/bench_durability.py [--quick]
"""
from __future__ import annotations

import argparse
import atexit
import mmap
import os
import shutil
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Daemon, Table, progress, summary, warn_if_busy, write_json  # noqa: E402

from kvstore.histogram import bucket_quantile  # noqa: E402
from kvstore.protocol.geometry import Geometry  # noqa: E402
from kvstore.protocol.keys import NamespaceSpec  # noqa: E402

GEOM = Geometry(layers=32, tokens=16, kv_heads=8, head_dim=128, dtype="float16")   # 2 MiB
BLOCK = GEOM.full_bytes
SPEC = NamespaceSpec("bench-durability", GEOM)
WRITERS = 2
WRITER_BATCH = 8                      # blocks per writer put


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def raw_write_sync(path: str, samples: int) -> list[float]:
    """O_DIRECT pwrite of one block + fdatasync, each into its own place of a preallocated file."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    buf = mmap.mmap(-1, BLOCK)
    buf.write(os.urandom(BLOCK))
    try:
        os.posix_fallocate(fd, 0, samples * BLOCK)
        os.fsync(fd)
        out = []
        for i in range(samples):
            t0 = time.perf_counter()
            os.pwrite(fd, buf, i * BLOCK)
            os.fdatasync(fd)
            out.append(time.perf_counter() - t0)
        return out
    finally:
        os.close(fd)
        buf.close()


def probe(d: Daemon, first: int, samples: int, pause_s: float) -> tuple[list[float], list[float], dict]:
    """`samples` plain puts each followed by wait_durable (the lag after the reply), and as many durable puts
    (end to end); keys from `first`. Also what did not end durable: a plain put's block gone before the wait
    (evicted and dropped: its write-through skipped under load, nothing left to persist), other answers."""
    data = os.urandom(BLOCK)
    lags, rounds, not_durable = [], [], {"gone": 0}
    with d.client() as c:
        ns = c.namespace(SPEC)
        for i in range(samples):
            h = key(first + 2 * i)
            ns.put([h], [data])
            t0 = time.perf_counter()
            answer = ns.wait_durable([h], timeout_s=20)
            if answer["blocks"] == 0 and ns.lookup([h]) == 0:
                not_durable["gone"] += 1
            else:
                lags.append(time.perf_counter() - t0)
                if answer["durability"] != "durable":
                    kind = f"wait: {answer['durability']}"
                    not_durable[kind] = not_durable.get(kind, 0) + 1
            t0 = time.perf_counter()
            r = ns.put([key(first + 2 * i + 1)], [data], durable=True, durable_timeout_s=20)
            rounds.append(time.perf_counter() - t0)
            if r.durability != "durable":
                not_durable[f"put: {r.durability}"] = not_durable.get(f"put: {r.durability}", 0) + 1
            time.sleep(pause_s)
    return lags, rounds, not_durable


def load(d: Daemon, w: int, stop: threading.Event, stored: list[int]) -> None:
    """Store fresh blocks as fast as possible until `stop`."""
    data = os.urandom(BLOCK)
    n = 0
    with d.client() as c:
        ns = c.namespace(SPEC)
        while not stop.is_set():
            hs = [key((w + 1) << 40 | (n + i)) for i in range(WRITER_BATCH)]
            stored[w] += ns.put(hs, [data] * WRITER_BATCH).stored
            n += WRITER_BATCH


def daemon_lag(d: Daemon) -> dict:
    with d.client() as c:
        s = c.stats()
    wt = s["write_through"]
    return {"lag": wt["lag"], "max_lag_s": wt["max_lag_s"], "oldest_pending_s": wt["oldest_pending_s"],
            "skipped": s["counters"]["write_through_skipped"], "evictions": s["counters"]["evictions"],
            "settled": wt["settled"]}


def lag_between(before: dict, after: dict) -> dict:
    """The daemon's lag histogram of the blocks settled between two snapshots: count, p50 and p99 bounds."""
    buckets = [a - b for a, b in zip(after["lag"]["buckets"], before["lag"]["buckets"])]
    p50, p99 = bucket_quantile(buckets, 0.5), bucket_quantile(buckets, 0.99)
    return {"count": sum(buckets), "p50_le_s": None if p50 == float("inf") else p50,
            "p99_le_s": None if p99 == float("inf") else p99, "max_lag_s": after["max_lag_s"]}


def run(base: str, samples: int, load_s: float) -> dict:
    env = {"KVSTORE_SSD_DIR": os.path.join(base, "ssd"), "KVSTORE_SSD_CAPACITY": "3GiB",
           "KVSTORE_SSD_WRITE_THROUGH": "true", "KVSTORE_SSD_STAGING_BYTES": "256MiB"}
    res: dict = {}
    progress(f"raw disk: {samples} × O_DIRECT pwrite of {BLOCK >> 20} MiB + fdatasync")
    res["raw"] = raw_write_sync(os.path.join(base, "raw"), samples)
    with Daemon("256MiB", "64MiB", env) as d:
        progress(f"idle: {samples} puts → wait_durable, {samples} durable puts")
        before = daemon_lag(d)
        res["idle_lag"], res["idle_durable_put"], bad_idle = probe(d, 1, samples, 0.02)
        after = daemon_lag(d)
        res["idle_daemon"] = lag_between(before, after)
        progress(f"load: {WRITERS} writers into a 256 MiB pool with write-through, probing for ~{load_s:.0f} s")
        stop, stored = threading.Event(), [0] * WRITERS
        writers = [threading.Thread(target=load, args=(d, w, stop, stored)) for w in range(WRITERS)]
        for t in writers:
            t.start()
        time.sleep(min(3.0, load_s / 3))                    # the pool fills first
        before = daemon_lag(d)
        t0 = time.monotonic()
        res["load_lag"], res["load_durable_put"], bad_load = probe(d, 1 << 30, samples, load_s / samples / 2)
        took = time.monotonic() - t0
        after = daemon_lag(d)
        stop.set()
        for t in writers:
            t.join()
        res["load_daemon"] = lag_between(before, after)
        res["load_info"] = {"seconds": took, "writer_blocks": sum(stored), "writer_mb_s": sum(stored) * BLOCK / 1e6
                            / (took + min(3.0, load_s / 3)), "evictions": after["evictions"],
                            "write_through_skipped": after["skipped"], "oldest_pending_s_at_end":
                            after["oldest_pending_s"], "settled": after["settled"]}
        res["not_durable"] = {"idle": bad_idle, "load": bad_load}
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--samples", type=int)
    args = ap.parse_args()
    samples = args.samples or (15 if args.quick else 60)
    load_s = 8.0 if args.quick else 30.0
    busy = warn_if_busy()
    base = tempfile.mkdtemp(prefix="kvs-durability-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
    atexit.register(shutil.rmtree, base, True)
    r = run(base, samples, load_s)
    raw_p50 = summary(r["raw"])["median"]
    table = Table(["what", "n", "p50 ms", "p99 ms", "max ms", "p50 / raw p50"])
    series = {}
    for name, label in (("raw", "raw disk: O_DIRECT write + fdatasync"), ("idle_lag", "idle: put reply → durable"),
                        ("idle_durable_put", "idle: durable put, end to end"),
                        ("load_lag", "load: put reply → durable"),
                        ("load_durable_put", "load: durable put, end to end")):
        s = summary(r[name], 1e3)
        series[name] = s
        table.add([label, s["n"], f"{s['median']:.2f}", f"{s['p99']:.2f}", f"{s['max']:.2f}",
                   f"{s['median'] / 1e3 / raw_p50:.2f}×"])
    for name in ("idle_daemon", "load_daemon"):
        h = r[name]
        fmt = (lambda v: "> 1000" if v is None else f"≤ {v * 1e3:g}")
        table.add([f"{name.split('_')[0]}: daemon's lag histogram, commit → synced", h["count"], fmt(h["p50_le_s"]),
                   fmt(h["p99_le_s"]), f"{h['max_lag_s'] * 1e3:.2f} (run)", ""])
    print(f"\nDurability lag, {BLOCK >> 20} MiB blocks, write-through on, ssd.sync batch (load average {busy:.2f}, "
          f"{os.cpu_count()} CPUs)\n")
    print(table)
    info = r["load_info"]
    print(f"\nload: {info['writer_blocks']} blocks stored by {WRITERS} writers ({info['writer_mb_s']:.0f} MB/s), "
          f"{info['evictions']} evictions, {info['write_through_skipped']} write-through skips; not durable: "
          f"{r['not_durable']} (gone: a plain put's block evicted and dropped before the wait; answers: other "
          "than durable, by kind)")
    out = {"block_bytes": BLOCK, "samples": samples, "load_seconds": load_s, "load_average_before": busy,
           "series_ms": series, "daemon_lag": {"idle": r["idle_daemon"], "load": r["load_daemon"]},
           "load": info, "not_durable": r["not_durable"]}
    print(f"\nwrote {write_json('durability', out)}")


if __name__ == "__main__":
    main()
