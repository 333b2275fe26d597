"""The results page of a whole benchmark run: one JSON and one Markdown page with the pictures beside them.

    python bench/report.py RUNDIR

RUNDIR (bench/results/<date>-<host>/, made by run_all.sh) holds one `<benchmark>.log` per benchmark run (its
printed output, whose `wrote PATH` or `results in PATH` line names its JSON) and `skipped.txt` (one
`name: reason` a line). Writes bench/results/<date>-<host>.json (machine, versions, every benchmark's JSON),
bench/results/<date>-<host>.md and the PNGs in RUNDIR.
"""
from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, quantile  # noqa: E402

ORDER = ["vs_lmcache", "agentic", "pool", "index", "ssd", "ssd_tier", "vllm_ttft"]


def load(rundir: str) -> tuple[dict[str, Any], dict[str, str], dict[str, str]]:
    """(benchmark name → its JSON, benchmark name → its printed table, script → why skipped)."""
    results, tables, skipped = {}, {}, {}
    for f in sorted(os.listdir(rundir)):
        if not f.endswith(".log"):
            continue
        text = open(os.path.join(rundir, f), errors="replace").read()
        m = re.search(r"(?:wrote|results in) (/\S+\.json)", text)       # the line naming its JSON
        if not m or not os.path.exists(m.group(1)):
            skipped[f[:-4]] = "no result written (see its log: " + f + ")"
            continue
        with open(m.group(1)) as j:
            data = json.load(j)
        name = data.get("benchmark", f[:-4])
        results[name] = data
        tables[name] = table_text(text[:m.start()])
    sk = os.path.join(rundir, "skipped.txt")
    if os.path.exists(sk):
        for line in open(sk):
            if ":" in line:
                k, v = line.split(":", 1)
                skipped[k.strip()] = v.strip()
    return results, tables, skipped


def table_text(out: str) -> str:
    """The printed table(s): everything but progress lines and warnings."""
    keep = [ln for ln in out.splitlines() if ln.strip() and not ln.startswith("[") and "Warning" not in ln
            and "warnings.warn" not in ln]
    return "\n".join(keep[-60:])


def med(xs: list[float]) -> float:
    return quantile(xs, 0.5) if xs else float("nan")


def spread(xs: list[float], d: int = 2) -> str:
    if not xs:
        return "–"
    return f"{med(xs):.{d}f} ({quantile(xs, 0.25):.{d}f}–{quantile(xs, 0.75):.{d}f}, n={len(xs)})"


def ratio(a: list[float], b: list[float]) -> float:
    return med([x / y for x, y in zip(a, b) if y]) if a and b else float("nan")


def vs_lmcache_md(r: dict[str, Any]) -> list[str]:
    out = ["## kvstore against LMCache's daemon (MP mode), same workload, same run", "",
           "2 MiB blocks (LMCache: 256-token chunks of the same size) stored and retrieved in batches of 32 by a "
           "client process against a daemon process. Medians of the timed repetitions (p25–p75, n); ratios are "
           "taken repetition by repetition, then their median. Limits measured between the repetitions.", "",
           "| figure | kvstore GB/s | LMCache GB/s | limit GB/s | kvstore / LMCache | target | result |",
           "|---|---|---|---|---|---|---|"]
    dr, dk = r.get("dram"), r.get("disk")

    def row(name: str, a: list[float], b: list[float], lim: list[float], lim_name: str, target: float | None) -> None:
        if not a or not b:                              # a phase that failed (its error is listed below)
            out.append(f"| {name} | {spread(a)} | {spread(b)} | | | | no figures |")
            return
        q = ratio(a, b)
        res = "" if target is None else ("PASS" if q >= target else "FAIL")
        out.append(f"| {name} | {spread(a)} | {spread(b)} | {med(lim):.2f} ({lim_name}) | {q:.2f}× | "
                   f"{'≥ %g×' % target if target else ''} | {res} |")

    if dr:
        row("DRAM store", dr["kvstore"]["store"], dr["lmcache"]["store"], dr["memcpy"], "memcpy", 4)
        row("DRAM retrieve (lookup + load)", dr["kvstore"]["retrieve"], dr["lmcache"]["retrieve"], dr["memcpy"],
            "memcpy", 4)
    if dk:
        for lmn, label, tgt in (("lmcache_fs_odirect", "fs, O_DIRECT", 2.0), ("lmcache_fs", "fs, page cache", None)):
            row(f"disk store, reply (vs LMCache {label})", dk["kvstore"]["store"], dk[lmn]["store"],
                dk["odirect_write"], "O_DIRECT write", None)
            row(f"disk store, on disk (vs LMCache {label})", dk["kvstore"]["store_to_disk"], dk[lmn]["store_to_disk"],
                dk["odirect_write"], "O_DIRECT write", tgt)
            row(f"disk retrieve, from disk (vs LMCache {label})", dk["kvstore"]["retrieve"], dk[lmn]["retrieve"],
                dk["odirect_read"], "O_DIRECT read", tgt)
    out.append("")
    if dr and dr.get("visibility"):
        v = dr["visibility"]
        k, m = v["kvstore"], v["lmcache"]
        out += ["| lookup issued right after a completed store of 32 blocks | kvstore | LMCache | target |",
                "|---|---|---|---|",
                f"| lookups that missed | {k['missed_lookups']} of {k['lookups']} | {m['missed_lookups']} of "
                f"{m['lookups']} | 0 ({'PASS' if k['missed_lookups'] == 0 else 'FAIL'}) |",
                f"| blocks missed | {k['missed_blocks']} | {m['missed_blocks']} | 0 |", ""]
    if dr and dr.get("lookup_us"):
        lk = {n: [x * 1e6 for x in v] for n, v in dr["lookup_us"].items()}
        out += ["| lookup of 32 present blocks | p50 µs | p99 µs |", "|---|---|---|"]
        for n, label in (("kvstore", "kvstore"), ("lmcache", "LMCache (LOOKUP + prefetch status)"),
                         ("raw_socket", "limit: 64-byte Unix-socket round trip")):
            out.append(f"| {label} | {med(lk[n]):.0f} | {quantile(lk[n], 0.99):.0f} |")
        out.append("")
    if dk:
        out += ["| disk: blocks lost | kvstore | LMCache fs | LMCache fs O_DIRECT |", "|---|---|---|---|",
                "| read back after a paced store (per rep) | " + " | ".join(
                    str(dk[s]["missed_blocks"]) for s in ("kvstore", "lmcache_fs", "lmcache_fs_odirect")) + " |",
                f"| burst: {dk['blocks']} blocks stored as fast as the client can, never written to disk | "
                + " | ".join(
                    "– (not run)" if dk[s]["burst_store"] is None else
                    f"{dk[s]['burst_not_on_disk']} (store reply {dk[s]['burst_store']:.2f} GB/s)"
                    for s in ("kvstore", "lmcache_fs", "lmcache_fs_odirect")) + " |", ""]
    if dr and dr.get("lookup_probe"):
        never = [s for s, p in dr["lookup_probe"].items() if p.get("visible_after_s") is None]
        miss = {s: m for s, m in (dr.get("lookup_misses") or {}).items() if m.get("missed_lookups")}
        out += [f"- lookup latency: {s} never showed the whole probe batch (32 blocks) within the deadline"
                for s in never]
        out += [f"- lookup latency: {s} missed {m['missed_lookups']} of {m['lookups']} timed lookups "
                f"({m['missed_blocks']} blocks)" for s, m in miss.items()]
        out += [""] if never or miss else []
    errors = [e for part in ("dram", "disk") for e in (r.get(part) or {}).get("errors", [])]
    out += [f"- error: {e}" for e in errors] + ([""] if errors else [])
    return out


def agentic_md(r: dict[str, Any]) -> list[str]:
    out = ["## Agentic multi-turn trace", "",
           f"{r['sessions']} sessions × {r['turns']} turns (shared system prompt, each turn the whole context plus "
           f"~430 new tokens, then a 100-token reply), prompts up to {r['max_prompt_tokens']} tokens (mean "
           f"{r['mean_prompt_tokens']:.0f}); working set {r['working_set_bytes'] >> 20} MiB of 2 MiB chunks against "
           f"{r['capacity_dram_bytes'] >> 20} MiB of DRAM in each system. Scaled down from DualPath's traces (157 "
           "turns, 32.7 K context, 429 appended tokens). Hit rate = chunks loaded / chunks looked up; ideal = with "
           "an unbounded cache.", "",
           "| variant | system | hit rate, median (min–max) | of ideal | GB loaded | GB stored = recomputed | "
           "replay s |", "|---|---|---|---|---|---|---|"]
    for v, runs in r["variants"].items():
        for s in (s for s in ("kvstore", "kvstore+hints", "lmcache") if s in runs[0]):
            hr = [x[s]["hit_rate"] for x in runs]
            out.append(f"| {v} | {NAMES[s]} | {med(hr):.1%} ({min(hr):.1%}–{max(hr):.1%}) "
                       f"| {med([x[s]['of_ideal'] for x in runs]):.1%} | {runs[0][s]['bytes_loaded'] / 1e9:.2f} | "
                       f"{runs[0][s]['bytes_stored'] / 1e9:.2f} | {med([x[s]['seconds'] for x in runs]):.1f} |")
        out.append(f"| {v} | ideal | {runs[0]['ideal_hit_rate']:.1%} | 100% | | | |")
        if v == "dram" and "capacity_bound_hit_rate" in r:
            b = r["capacity_bound_hit_rate"]
            out.append(f"| {v} | capacity bound (any cache of this size) | {b:.1%} | "
                       f"{b / runs[0]['ideal_hit_rate']:.1%} | | | |")
    out.append("")
    return out


NAMES = {"kvstore": "kvstore (LRU)", "kvstore+hints": "kvstore (workflow policy + session hints)",
         "lmcache": "LMCache"}


def workflows_md(r: dict[str, Any]) -> list[str]:
    out = ["## Agent workflow traces (issue 14)", "",
           f"Traces of bench/workflows.py (gaps between a workflow's calls gamma, shape {r.get('gap_shape')}), "
           "replayed through the daemon at 10/25/50% of each trace's peak live working set, against plain LRU and "
           "Belady's oracle replayed offline. Gap closed = (policy − LRU) / (oracle − LRU).", "",
           "| mix | capacity | oracle | LRU | kvstore LRU | workflow, no hints | workflow + hints | gap closed |",
           "|---|---|---|---|---|---|---|---|"]
    for name, m in r["mixes"].items():
        for c in m["cells"]:
            k = c["kvstore"]
            out.append(f"| {name} | {c['fraction']:.0%} | {c['oracle_hit_rate']:.1%} | "
                       f"{c['lru_offline_hit_rate']:.1%} | {k['lru']['hit_rate']:.1%} | "
                       f"{k['nohints']['hit_rate']:.1%} | {k['hints']['hit_rate']:.1%} | "
                       f"{k['hints']['gap_closed']:.0%} |")
    out.append("")
    return out


def vllm_ttft_md(r: dict[str, Any]) -> list[str]:
    """Issue 16's engine targets, one row per prompt length (bench_vllm_ttft's summary)."""
    if not r.get("sizes") or "summary" not in r["sizes"][0]:
        return []
    out = ["## Engine load path: vLLM TTFT (issue 16)", "",
           f"A real vLLM engine on the CPU, {r.get('geometry')} KV geometry, a fresh engine per figure; floor = "
           "vLLM's own prefix cache, run right after each hit in the same engine. Targets: time above the floor "
           "≤ 0.5× ExampleConnector's (page cache), and the connector's copy ≥ 0.7× memcpy of the same pages.", "",
           "| tokens | KV | recompute | floor | Example hit | kvstore hit | kvstore SSD | above floor kvstore / "
           "Example (≤ 0.5) | copy GB/s ÷ memcpy (≥ 0.7) |", "|---|---|---|---|---|---|---|---|---|"]
    for s in r["sizes"]:
        m = s["summary"]
        out.append(f"| {s['tokens']} | {s['kv_bytes'] / 2**20:.0f} MiB | {m['recompute']:.2f} s | "
                   f"{m['kvstore_floor']:.3f} s | {m['example']:.3f} s | {m['kvstore']:.3f} s | "
                   f"{m['kvstore_ssd']:.3f} s | {m['above_kvstore']:.3f} / {m['above_example']:.3f} = "
                   f"**{m['above_ratio']:.2f}** {'met' if m['above_ratio'] <= 0.5 else 'missed'} | "
                   f"{s['load_copy_gbps']:.1f} ÷ {s['memcpy_gbps']:.1f} = **{m['copy_ratio']:.2f}** "
                   f"{'met' if m['copy_ratio'] >= 0.7 else 'missed'} |")
    out.append("")
    return out


NOTES = """## What favoured which side

- **Transfer mode.** LMCache ran `lmcache_driven` (its daemon copies out of the client's KV cache, registered as
  POSIX shared memory): its faster CPU mode here; `engine_driven` measured ~0.2 GB/s in a trial and is not shown.
  kvstore's client copies contiguous 2 MiB blocks; LMCache's daemon gathers each chunk from a paged layout (8 runs of
  256 KiB). The "memcpy gathered" limit in the DRAM picture shows what that gather costs by itself.
- **Store completion.** LMCache replies to a STORE before the chunks are committed (they become visible a little
  later, hence the misses right after a store); its store figure is taken at the reply. kvstore's put returns after
  its commit.
- **Durability.** kvstore syncs SSD records in batches (`ssd.sync: batch`); LMCache's fs tier does not fsync. By
  default LMCache reads and writes its fs tier through the page cache (column "fs, page cache", which this machine's
  23 GB of RAM makes a memory read); the "O_DIRECT" rows use its `use_odirect` option, kvstore reads with O_DIRECT.
- **Write-back against write-through.** kvstore writes a block to SSD only when the host pool evicts it; LMCache
  writes every chunk to the fs tier. "store, on disk" waits, batch by batch, until each system's disk writes have
  caught up — for kvstore that is fewer bytes (the last 256 MiB stay in DRAM).
- **DRAM given.** Disk runs: kvstore pool 256 MiB (+ its 256 MiB staging area for demotions); LMCache L1 1 GiB with
  its eviction watermark at 0.25 (≈256 MiB kept; with a 256–512 MiB L1 its 64 MiB batch stores failed for want of
  free L1 and were silently dropped). DRAM runs: kvstore pool 1 GiB, LMCache L1 2 GiB, both emptied between
  repetitions. Agentic: 256 MiB each.
- **Where a disk retrieve was served from.** Both are read back in store order after 1 GiB went through 256 MiB
  of DRAM. kvstore promotes every block from SSD (a promotion evicts the least recently used block, the newest
  stored ones go too before they are read). LMCache evicts in steps of 20% of its L1 (here 1 GiB), so some of the
  last chunks it stored may still be in L1 when read: its O_DIRECT retrieve above the raw O_DIRECT read limit says
  part of it came from memory. Its page-cache column reads files written seconds before, from the page cache.
- **Lookups.** LMCache answers a LOOKUP through a prefetch job whose status the client polls (here every 0.2 ms,
  not the 50 ms its own CLI uses); its periodic notifier (5 ms by default) was not tuned.
- **Machine.** 2 shared cores: the daemon, the client and other work compete for them; figures move between runs,
  ratios less so. Load averages are in the JSON.
"""


def main() -> None:
    rundir = os.path.abspath(sys.argv[1])
    stamp = os.path.basename(rundir.rstrip("/"))
    results, tables, skipped = load(rundir)
    from plots import make

    pngs = make({"benchmarks": results}, rundir)
    mach = machine()
    versions: dict[str, Any] = {}
    for r in results.values():
        versions.update(r.get("versions") or {})
    whole = {"run": stamp, "machine": mach, "versions": versions, "skipped": skipped, "benchmarks": results,
             "pictures": [os.path.relpath(p, os.path.dirname(rundir)) for p in pngs]}
    base = os.path.join(os.path.dirname(rundir), stamp)
    with open(base + ".json", "w") as f:
        json.dump(whole, f, indent=1)
    md = [f"# kvstore benchmarks — {stamp}", "",
          f"Machine: {mach['cpu']}, {mach['cores']} cores, {mach['memory_bytes'] / 2**30:.1f} GiB, kernel "
          f"{mach['kernel']}, Python {mach['python']}; kvstore commit {mach['commit']}"
          f"{' (uncommitted changes in the tree)' if mach['dirty'] else ''}. Versions: "
          + ", ".join(f"{k} {v}" for k, v in sorted(versions.items()) if v) + ".", ""]
    if "vs_lmcache" in results:
        md += vs_lmcache_md(results["vs_lmcache"])
    if "agentic" in results:
        md += agentic_md(results["agentic"])
    if "workflows" in results:
        md += workflows_md(results["workflows"])
    if "vllm_ttft" in results:
        md += vllm_ttft_md(results["vllm_ttft"])
    for p in pngs:
        rel = os.path.relpath(p, os.path.dirname(rundir))
        md.append(f"![{os.path.basename(p)[:-4]}]({rel})")
    md += ["", NOTES]
    for name in sorted(results, key=lambda n: ORDER.index(n) if n in ORDER else len(ORDER)):
        if name in ("vs_lmcache", "agentic"):
            continue
        md += [f"## `{name}` (printed table)", "", "```", tables.get(name, ""), "```", ""]
    for name in ("vs_lmcache", "agentic"):
        if name in tables:
            md += [f"## `{name}` (printed table)", "", "```", tables[name], "```", ""]
    if skipped:
        md += ["## Skipped", ""] + [f"- `{k}`: {v}" for k, v in skipped.items()] + [""]
    with open(base + ".md", "w") as f:
        f.write("\n".join(md))
    print(f"wrote {base}.json, {base}.md and {len(pngs)} pictures in {rundir}")


if __name__ == "__main__":
    main()
