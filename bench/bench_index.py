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

With `--policy lru,history,workflow` (issue 14 parts 2 and 3, issue 34) it also measures the host pool's eviction
policy over the native table, at each size: bytes per block of table + policy books, and per operation the index's
calls of a read (pin, touch, unpin), an eviction (victim, removed, key-table remove) and a commit (key-table insert,
added), each the median of `--reps` runs of 20 000, and each against LRU's at the same size (issue 34: ≤ 1.5×); for
`history`, also its history's bytes per record it can keep (issue 34: ≤ 32; the policy's hooks only: the shadows
it runs per request are in bench_policies' whole-path figure); for `workflow`, also a workflow's end (per block of
its groups). Blocks sit
at gids as in the host pool (segments of 16384 slots: 64 MiB of 4 KiB blocks), in 4 classes; under `workflow`,
256 active workflows, each block tagged by the one that stored it (runs of 1000 blocks) and one in four also by
the next one (a shared prefix), every operation with a hint context (a read: the workflow that stored the block).

    python bench/bench_index.py [--sizes 10000,1000000,10000000] [--reps 5] [--py-max 1000000]
                                [--policy lru,history,workflow]
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
from kvstore.policy import make_policy  # noqa: E402
from kvstore.workflows import Touch, Workflows  # noqa: E402

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


SEG_SLOTS = 16384             # slots of a host segment: 64 MiB of 4 KiB blocks
FLOWS = 256                   # active workflows (policy runs)
OPS = 20_000                  # operations per timed repetition (policy runs)


def gid_of(i: int) -> int:
    return (i // SEG_SLOTS + 1) << 32 | i % SEG_SLOTS


def policy_run(policy: str, raw: bytes, n: int, reps: int) -> dict[str, Any]:
    """The host pool's policy over a native table of n blocks: memory and per-operation costs (module docstring)."""
    assert NativeKeyTable is not None
    extra: dict[int, bytes] = {}

    def key_at(gid: int) -> bytes:
        i = ((gid >> 32) - 1) * SEG_SLOTS + (gid & 0xFFFFFFFF)
        got = extra.get(i)
        return got if got is not None else NS + raw[16 * i:16 * i + 16]

    gc.collect()
    before = rss()
    table = NativeKeyTable()
    flows = Workflows()
    touches = [Touch(f"w{j}", "agent") for j in range(FLOWS)]
    for t in touches:
        flows.call(t.workflow, t.agent, "bench")
    pol = make_policy(policy, table, flows, key_at, lambda seg: SEG_SLOTS)
    t0 = time.perf_counter()
    for i in range(n):
        key = NS + raw[16 * i:16 * i + 16]
        table.insert(key, gid_of(i), i & 3)
        pol.added(key, i & 3, touches[i // 1000 % FLOWS])
    for i in range(0, n, 4):                       # a shared prefix: the next workflow reads it too
        pol.accessed(NS + raw[16 * i:16 * i + 16], touches[(i // 1000 + 1) % FLOWS])
    build_s = time.perf_counter() - t0
    gc.collect()
    books = getattr(pol, "nbytes", lambda: 0)()
    out: dict[str, Any] = {"policy": policy, "entries": n, "bytes_per_entry": (table.nbytes() + books) / n,
                           "policy_bytes_per_entry": books / n, "rss_bytes_per_entry": (rss() - before) / n,
                           "build_us": build_s / n * 1e6}
    rng = np.random.default_rng(n + 1)
    reads, evicts, commits = [], [], []
    fresh = n
    ops = min(OPS, n // 2)
    for _ in range(reps):
        picks = [(NS + raw[16 * i:16 * i + 16], touches[i // 1000 % FLOWS])
                 for i in map(int, rng.integers(0, n, ops))]
        picks = [(k, t) for k, t in picks if k in table]     # read by the workflow that stored it
        t0 = time.perf_counter()
        for key, touch in picks:
            pol.pinned(key)
            pol.accessed(key, touch)
            pol.unpinned(key)
        reads.append((time.perf_counter() - t0) / len(picks))
        freed = []
        t0 = time.perf_counter()
        for j in range(ops):
            victim = pol.victim(j & 3)
            assert victim is not None
            pol.removed(victim)
            freed.append((table.remove(victim), j & 3))
        evicts.append((time.perf_counter() - t0) / ops)
        new = []
        for gid, _ in freed:
            i = ((gid >> 32) - 1) * SEG_SLOTS + (gid & 0xFFFFFFFF)
            extra[i] = NS + fresh.to_bytes(16, "big")
            fresh += 1
            new.append(extra[i])
        t0 = time.perf_counter()
        for j, ((gid, cls), key) in enumerate(zip(freed, new)):
            table.insert(key, gid, cls)
            pol.added(key, cls, touches[j % FLOWS])
        commits.append((time.perf_counter() - t0) / ops)
    out.update(read_us=statistics.median(reads) * 1e6, evict_us=statistics.median(evicts) * 1e6,
               commit_us=statistics.median(commits) * 1e6)
    report = getattr(pol, "report", lambda: {})()
    if report.get("history_capacity"):                 # the history policy: its memory per record it can keep
        out.update(history_capacity=report["history_capacity"],
                   history_bytes_per_record=report["history_bytes"] / report["history_capacity"])
    if policy == "workflow":
        ending = flows.active[touches[FLOWS // 2].workflow]        # one the evictions above did not take from
        moved = sum(pol.groups[x].size for x in pol._with[ending.num])  # type: ignore[attr-defined]
        t0 = time.perf_counter()
        flows.end(ending.wid)
        secs = time.perf_counter() - t0
        out.update(end_moved=moved, end_us_per_block=secs / max(moved, 1) * 1e6)
    del pol, table
    gc.collect()
    return out


def policy_table(runs: list[dict[str, Any]]) -> Table:
    t = Table(["policy", "entries", "bytes/entry (table + policy)", "of which policy", "RSS/entry", "build",
               "read (pin+touch+unpin)", "eviction", "commit", "× lru (read / evict / commit)", "history B/record",
               "workflow end", "target"])
    lru = {r["entries"]: r for r in runs if r["policy"] == "lru"}
    for r in runs:
        end = f"{r['end_us_per_block']:.2f} µs/block ({r['end_moved']:,})" if "end_moved" in r else ""
        base = lru.get(r["entries"])
        ops = ("read_us", "evict_us", "commit_us")
        ratio = "" if base is None else " / ".join(f"{r[f] / base[f]:.2f}" for f in ops)
        per_record = f"{r['history_bytes_per_record']:.1f}" if "history_bytes_per_record" in r else ""
        target = ""
        if r["entries"] >= TARGET_AT:
            target = f"≤{TARGET_BYTES} B: " + ("PASS" if r["bytes_per_entry"] <= TARGET_BYTES else "FAIL")
        t.add([r["policy"], f"{r['entries']:,}", f"{r['bytes_per_entry']:.0f}", f"{r['policy_bytes_per_entry']:.0f}",
               f"{r['rss_bytes_per_entry']:.0f}", f"{r['build_us']:.2f} µs",
               f"{r['read_us']:.2f} µs ({1 / r['read_us']:.2f} M/s)",
               f"{r['evict_us']:.2f} µs ({1 / r['evict_us']:.2f} M/s)",
               f"{r['commit_us']:.2f} µs ({1 / r['commit_us']:.2f} M/s)", ratio, per_record, end, target])
    return t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="10000,1000000,10000000", help="entry counts, comma-separated")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions of the 2000 lookups")
    p.add_argument("--py-max", type=int, default=1_000_000, help="largest size for the fallback and the dict")
    p.add_argument("--policy", default="", help="also measure these host eviction policies (lru,history,workflow)")
    p.add_argument("--kinds", default="native,python,dict", help="which tables to measure")
    args = p.parse_args()
    sizes = sorted(int(s.replace("_", "")) for s in args.sizes.split(","))
    wanted = args.kinds.split(",")
    kinds = [k for k in (["native"] if NativeKeyTable else []) + ["python", "dict"] if k in wanted]
    policies = [x for x in args.policy.split(",") if x]
    runs: list[dict[str, Any]] = []
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
        for policy in policies if NativeKeyTable is not None else []:
            progress(f"native + {policy} policy: {n:,} entries")
            runs.append(policy_run(policy, raw, n, args.reps))
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
    if runs:
        print()
        print(policy_table(runs))
    path = write_json("index", {"policies": runs,"sizes": sizes, "reps": args.reps, "lookups_per_rep": LOOKUPS,
                                "targets": {"bytes_per_entry": TARGET_BYTES, "lookup_ratio": TARGET_RATIO,
                                            "at_entries": TARGET_AT},
                                "targets_met": all(verdicts) if verdicts else None, "results": results})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
