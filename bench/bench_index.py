"""Index cost: bytes per entry and 32-key prefix-lookup time at 10 thousand, 1 million and 10 million entries.

The native key table vs the pure-Python fallback vs a plain dict of the same keys (the baseline: the cheapest Python
map, with no LRU at all), measured in the same run. The fallback and the dict stop at `--py-max` entries (1 million:
10 million Python objects take minutes and gigabytes). Targets: ≤ 150 bytes per entry at 10 million entries, and
the 32-key lookup there ≤ 1.5× the lookup at 10 thousand.

Memory: the native table's own count (`nbytes()`, its arrays) with the process RSS growth over the build as a
cross-check (at 10 thousand entries the RSS figure also holds the freed smaller arrays malloc keeps); tracemalloc
for the fallback and the dict. Lookup: `prefix_len` of 32 present keys drawn at random, 2000 lookups per
repetition, the median of `--reps` repetitions after an untimed warm-up. Cold: each repetition looks up keys of
its own (at 10 million entries each key is then a memory miss: the target is read on this figure); warm: the
warm-up's lookups again (a hot set of 64 000 keys that the caches may hold, like popular prefixes).

    python bench/bench_index.py [--sizes 10000,1000000,10000000] [--reps 5] [--py-max 1000000]
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import tracemalloc
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Table, progress, write_json  # noqa: E402

from kvstore.index.keytable import PyKeyTable  # noqa: E402

try:
    from kvstore._kvindex import KeyTable as NativeKeyTable
except ImportError:
    NativeKeyTable = None

NS = (1).to_bytes(4, "big")
LOOKUPS = 2000
TARGET_BYTES, TARGET_RATIO, TARGET_AT = 150, 1.5, 10_000_000


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def fill(kind: str, raw: bytes, n: int) -> Any:
    if kind == "dict":
        d: dict[bytes, int] = {}
        for i in range(n):
            d[NS + raw[16 * i:16 * i + 16]] = i
        return d
    t = NativeKeyTable() if kind == "native" else PyKeyTable()
    insert = t.insert
    for i in range(n):
        insert(NS + raw[16 * i:16 * i + 16], i, i & 3)
    return t


def build(kind: str, raw: bytes, n: int) -> tuple[Any, dict[str, float]]:
    """A table of n keys, with its memory per entry and the build's time per insert."""
    gc.collect()
    if kind == "native":
        before = rss()
        t0 = time.perf_counter()
        table = fill(kind, raw, n)
        secs = time.perf_counter() - t0
        gc.collect()
        return table, {"bytes_per_entry": table.nbytes() / n, "rss_bytes_per_entry": (rss() - before) / n,
                       "insert_us": secs / n * 1e6}
    tracemalloc.start()
    t0 = time.perf_counter()
    table = fill(kind, raw, n)
    secs = time.perf_counter() - t0                   # under tracemalloc: slower than plain, a rough figure
    used, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return table, {"bytes_per_entry": used / n, "insert_us": secs / n * 1e6}


def lookup_times(kind: str, table: Any, hashes: np.ndarray, reps: int) -> tuple[list[float], list[float]]:
    """Seconds per 32-key prefix lookup of present keys drawn at random, one figure per repetition: cold (every
    repetition looks up keys of its own, so in a table larger than the caches each key is a memory miss) and warm
    (the warm-up's 2000 lookups again: a hot set of 64 000 keys that the caches may hold)."""
    rng = np.random.default_rng(7)
    sets = [[hashes[rng.integers(0, len(hashes), 32)].tobytes() for _ in range(LOOKUPS)] for _ in range(reps + 1)]
    if kind == "dict":
        def prefix_len(ns: bytes, blob: bytes) -> int:   # what prefix_len does, in Python over a dict
            n = 0
            for i in range(0, len(blob), 16):
                if ns + blob[i:i + 16] not in table:
                    break
                n += 1
            return n
    else:
        prefix_len = table.prefix_len
    assert all(prefix_len(NS, b) == 32 for b in sets[0])   # the warm-up, and a check of the table

    def timed(blobs: list[bytes]) -> float:
        t0 = time.perf_counter()
        for b in blobs:
            prefix_len(NS, b)
        return (time.perf_counter() - t0) / len(blobs)

    cold = [timed(blobs) for blobs in sets[1:]]
    warm = [timed(sets[0]) for _ in range(reps)]
    return cold, warm


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="10000,1000000,10000000", help="entry counts, comma-separated")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions of the 2000 lookups")
    p.add_argument("--py-max", type=int, default=1_000_000, help="largest size for the fallback and the dict")
    args = p.parse_args()
    sizes = sorted(int(s.replace("_", "")) for s in args.sizes.split(","))
    kinds = (["native"] if NativeKeyTable else []) + ["python", "dict"]
    if NativeKeyTable is None:
        progress("the native table is not built: measuring the fallback and the dict only")
    results = []
    for n in sizes:
        hashes = np.random.default_rng(n).integers(0, 256, (n, 16), dtype=np.uint8)
        raw = hashes.tobytes()
        for kind in kinds:
            if kind != "native" and n > args.py_max:
                continue
            progress(f"{kind}: {n:,} entries")
            table, mem = build(kind, raw, n)
            cold, warm = lookup_times(kind, table, hashes, args.reps)
            results.append({"kind": kind, "entries": n, **mem, "lookup32_us": statistics.median(cold) * 1e6,
                            "lookup32_us_min": min(cold) * 1e6, "lookup32_us_max": max(cold) * 1e6,
                            "warm_lookup32_us": statistics.median(warm) * 1e6})
            del table
            gc.collect()
        del hashes, raw
    smallest = {}
    for r in results:
        smallest.setdefault(r["kind"], r)
        r["vs_smallest"] = r["lookup32_us"] / smallest[r["kind"]]["lookup32_us"]
        r["warm_vs_smallest"] = r["warm_lookup32_us"] / smallest[r["kind"]]["warm_lookup32_us"]
    out = Table(["table", "entries", "bytes/entry", "RSS/entry", "insert", "lookup 32 keys, cold (min–max)",
                 "× its smallest", "warm", "× its smallest", "target (cold)"])
    verdicts = []
    for r in results:
        target = ""
        if r["kind"] == "native" and r["entries"] >= TARGET_AT:
            ok = r["bytes_per_entry"] <= TARGET_BYTES and r["vs_smallest"] <= TARGET_RATIO
            verdicts.append(ok)
            target = f"≤{TARGET_BYTES} B, ≤{TARGET_RATIO}× of {smallest['native']['entries']:,}: " + \
                ("PASS" if ok else "FAIL")
        rss_col = f"{r['rss_bytes_per_entry']:.0f}" if "rss_bytes_per_entry" in r else ""
        out.add([r["kind"], f"{r['entries']:,}", f"{r['bytes_per_entry']:.0f}", rss_col, f"{r['insert_us']:.2f} µs",
                 f"{r['lookup32_us']:.2f} µs ({r['lookup32_us_min']:.2f}–{r['lookup32_us_max']:.2f})",
                 f"{r['vs_smallest']:.2f}", f"{r['warm_lookup32_us']:.2f} µs", f"{r['warm_vs_smallest']:.2f}",
                 target])
    print(out)
    path = write_json("index", {"sizes": sizes, "reps": args.reps, "lookups_per_rep": LOOKUPS,
                                "targets": {"bytes_per_entry": TARGET_BYTES, "lookup_ratio": TARGET_RATIO,
                                            "at_entries": TARGET_AT},
                                "targets_met": all(verdicts) if verdicts else None, "results": results})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
