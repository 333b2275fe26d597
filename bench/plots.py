"""PNG pictures of the comparisons, from the results of bench_vs_lmcache.py, bench_agentic.py and bench_workflows.py
(matplotlib, Agg).

    python bench/plots.py RESULT.json [OUTDIR]     # a vs_lmcache-*.json, agentic-*.json, workflows-*.json or a run's

Each picture: throughput bars (median, whiskers p25–p75) with the hardware limit measured in the same run drawn as
a horizontal line; latency CDFs per system.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"kvstore": "#1f77b4", "kvstore+hints": "#2ca02c", "lmcache": "#ff7f0e", "lmcache_fs": "#ff7f0e",
          "lmcache_fs_odirect": "#d62728", "raw_socket": "#7f7f7f"}
LABELS = {"kvstore": "kvstore", "kvstore+hints": "kvstore, workflow policy + hints", "lmcache": "LMCache",
          "lmcache_fs": "LMCache fs (page cache)", "lmcache_fs_odirect": "LMCache fs (O_DIRECT)",
          "raw_socket": "raw Unix socket"}


def _q(xs: list[float], q: float) -> float:
    s = sorted(xs)
    pos = (len(s) - 1) * q
    lo, hi = int(pos), min(int(pos) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _bars(ax: Any, groups: list[str], series: dict[str, list[list[float]]], limits: list[tuple[str, list[float]]],
          ylabel: str) -> None:
    """Grouped bars: series name → one sample list per group; limits: (label, one sample list per group)."""
    n = len(series)
    width = 0.8 / n
    for i, (name, per_group) in enumerate(series.items()):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
        med = [_q(v, 0.5) if v else 0 for v in per_group]
        err = [[m - _q(v, 0.25) if v else 0 for m, v in zip(med, per_group)],
               [_q(v, 0.75) - m if v else 0 for m, v in zip(med, per_group)]]
        ax.bar(xs, med, width, yerr=err, capsize=3, color=COLORS.get(name), label=LABELS.get(name, name))
        for x, m in zip(xs, med):
            ax.annotate(f"{m:.2f}", (x, m), ha="center", va="bottom", fontsize=7, xytext=(0, 2),
                        textcoords="offset points")
    for j, (label, per_group) in enumerate(limits):
        for g, v in enumerate(per_group):
            if v:
                ax.hlines(_q(v, 0.5), g - 0.45, g + 0.45, colors="k", linestyles=["-", "--", ":"][j % 3],
                          label=label if g == next(k for k, w in enumerate(per_group) if w) else None)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)


def _cdf(ax: Any, samples: dict[str, list[float]], xlabel: str, styles: dict[str, str] | None = None) -> None:
    for name, xs in samples.items():
        if not xs:
            continue
        s = sorted(xs)
        base = name.split(" ")[0]
        ax.plot(s, [(i + 1) / len(s) for i in range(len(s))], label=f"{LABELS.get(base, base)}{name[len(base):]}",
                color=COLORS.get(base), linestyle=(styles or {}).get(name, "-"))
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of operations ≤ x")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)


def _save(fig: Any, outdir: str, name: str, made: list[str]) -> None:
    path = os.path.join(outdir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    made.append(path)


def vs_lmcache(res: dict[str, Any], outdir: str, made: list[str]) -> None:
    dr = res.get("dram")
    if dr:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        _bars(ax, ["store", "retrieve"],
              {s: [dr[s]["store"], dr[s]["retrieve"]] for s in ("kvstore", "lmcache")},
              [("memcpy, 1 thread (limit)", [dr["memcpy"], dr["memcpy"]]),
               ("memcpy gathered from paged KV", [dr["gather"], dr["gather"]])], "GB/s")
        ax.set_title("DRAM tier: 2 MiB blocks, batches of 32, from another process")
        _save(fig, outdir, "dram_throughput.png", made)
        fig, ax = plt.subplots(figsize=(7, 4.2))
        _cdf(ax, {f"{s} {op}": [x * 1e3 for x in dr[s][f"{op}_batch_s"]] for s in ("kvstore", "lmcache")
                  for op in ("store", "retrieve")}, "ms per batch of 32 × 2 MiB",
             {f"{s} retrieve": "--" for s in ("kvstore", "lmcache")})
        ax.set_title("DRAM tier: latency of one batch (store; retrieve = lookup + load)")
        _save(fig, outdir, "dram_latency_cdf.png", made)
        if dr.get("lookup_us"):
            fig, ax = plt.subplots(figsize=(7, 4.2))
            _cdf(ax, {k: [x * 1e6 for x in v] for k, v in dr["lookup_us"].items()}, "µs per lookup of 32 blocks")
            ax.set_title("lookup of 32 present blocks (raw socket: 64-byte round trip)")
            _save(fig, outdir, "lookup_latency_cdf.png", made)
    dk = res.get("disk")
    if dk:
        names = [s for s in ("kvstore", "lmcache_fs", "lmcache_fs_odirect") if s in dk]
        fig, ax = plt.subplots(figsize=(8, 4.4))
        _bars(ax, ["store (reply)", "store (on disk)", "retrieve (from disk)"],
              {s: [dk[s]["store"], dk[s]["store_to_disk"], dk[s]["retrieve"]] for s in names},
              [("O_DIRECT write+fdatasync / read (limit)", [dk["odirect_write"], dk["odirect_write"],
                                                           dk["odirect_read"]])], "GB/s")
        ax.set_title(f"disk tier: {dk['blocks']} × 2 MiB through 256 MiB of DRAM")
        _save(fig, outdir, "disk_throughput.png", made)
        fig, ax = plt.subplots(figsize=(7, 4.2))
        _cdf(ax, {s: [x * 1e3 for x in dk[s]["retrieve_batch_s"]] for s in names}, "ms per batch of 32 × 2 MiB")
        ax.set_title("disk tier: latency of one retrieve batch (blocks on disk only)")
        _save(fig, outdir, "disk_latency_cdf.png", made)


def agentic(res: dict[str, Any], outdir: str, made: list[str]) -> None:
    variants = res.get("variants") or {}
    if not variants:
        return
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4.2))
    groups = list(variants)
    systems = [s for s in ("kvstore", "kvstore+hints", "lmcache") if s in variants[groups[0]][0]]
    _bars(a1, groups, {s: [[r[s]["hit_rate"] * 100 for r in variants[v]] for v in groups] for s in systems},
          [("ideal (unbounded cache)", [[r["ideal_hit_rate"] * 100 for r in variants[v]] for v in groups])],
          "hit rate, % of chunks looked up")
    a1.set_title(f"agentic trace: {res['sessions']} sessions × {res['turns']} turns")
    width = 0.8 / len(systems)
    for i, s in enumerate(systems):
        xs = [g + (i - (len(systems) - 1) / 2) * width for g in range(len(groups))]
        loaded = [variants[v][0][s]["bytes_loaded"] / 1e9 for v in groups]
        stored = [variants[v][0][s]["bytes_stored"] / 1e9 for v in groups]
        a2.bar(xs, loaded, width, color=COLORS[s], label=f"{LABELS[s]}: loaded")
        a2.bar(xs, stored, width, bottom=loaded, color=COLORS[s], alpha=0.45, hatch="//",
               label=f"{LABELS[s]}: stored (= recomputed)")
    a2.set_xticks(range(len(groups)), groups)
    a2.set_ylabel("GB moved through the cache")
    a2.legend(fontsize=8)
    a2.grid(axis="y", alpha=0.3)
    a2.set_title(f"working set {res['working_set_bytes'] >> 20} MiB, DRAM {res['capacity_dram_bytes'] >> 20} MiB")
    _save(fig, outdir, "agentic.png", made)


WORKFLOW_LINES = (("oracle_hit_rate", "Belady oracle (offline)", "k", "--"),
                  ("lru_offline_hit_rate", "LRU (offline)", "#7f7f7f", ":"),
                  ("lru", "kvstore, LRU", "#1f77b4", "-"),
                  ("nohints", "kvstore, workflow policy, no hints", "#9467bd", "-."),
                  ("hints", "kvstore, workflow policy + hints", "#2ca02c", "-"))


def workflows(res: dict[str, Any], outdir: str, made: list[str]) -> None:
    """One panel per mix: hit rate against host capacity (share of the peak live working set) per policy."""
    mixes = res.get("mixes") or {}
    if not mixes:
        return
    fig, axes = plt.subplots(1, len(mixes), figsize=(3.6 * len(mixes), 3.8), squeeze=False)
    for ax, (name, m) in zip(axes[0], mixes.items()):
        cells = m["cells"]
        xs = [c["fraction"] * 100 for c in cells]
        for key, label, color, style in WORKFLOW_LINES:
            ys = [(c[key] if key in c else c["kvstore"][key]["hit_rate"]) * 100 for c in cells]
            ax.plot(xs, ys, style, color=color, marker="o", ms=3, label=label)
        ax.axhline(m["ideal_hit_rate"] * 100, color="#bbbbbb", lw=0.8, label="ideal (unbounded)")
        ax.set_title(f"{name} ({m['requests']} requests)")
        ax.set_xlabel("host capacity, % of peak live")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("hit rate, % of chunks looked up")
    axes[0][0].legend(fontsize=6, loc="upper left")
    fig.suptitle(f"agent workflow traces, gaps gamma(shape {res.get('gap_shape', '?')})", fontsize=10)
    _save(fig, outdir, "workflows.png", made)


TTFT_LINES = (("recompute", "recompute (no cache)", "#7f7f7f", "-"),
              ("example_cold", "ExampleConnector, files cold", "#ff7f0e", ":"),
              ("example", "ExampleConnector, page cache", "#ff7f0e", "-"),
              ("kvstore_ssd", "kvstore, SSD tier", "#1f77b4", ":"),
              ("kvstore", "kvstore, host pool", "#1f77b4", "-"),
              ("kvstore_floor", "floor: vLLM's own prefix cache", "#bbbbbb", "--"))


def vllm_ttft(res: dict[str, Any], outdir: str, made: list[str]) -> None:
    """TTFT (median) against prompt length, log-log, one line per way of getting the prompt's KV."""
    sizes = res.get("sizes") or []
    if not sizes:
        return
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    xs = [r["tokens"] for r in sizes]
    for key, label, color, style in TTFT_LINES:
        ys = [_q([t for t, _ in r[key]], 0.5) for r in sizes]
        ax.plot(xs, ys, style, color=color, marker="o", ms=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token, s (median)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    ax.set_title(f"vLLM on the CPU, {res.get('geometry', '?')} KV geometry", fontsize=10)
    _save(fig, outdir, "vllm_ttft.png", made)


def make(results: dict[str, Any], outdir: str) -> list[str]:
    """Every picture for a whole-run JSON ({"benchmarks": {name: result}}) or one benchmark's JSON."""
    os.makedirs(outdir, exist_ok=True)
    made: list[str] = []
    benches = results.get("benchmarks") or {results.get("benchmark", ""): results}
    if "vs_lmcache" in benches:
        vs_lmcache(benches["vs_lmcache"], outdir, made)
    if "agentic" in benches:
        agentic(benches["agentic"], outdir, made)
    if "workflows" in benches:
        workflows(benches["workflows"], outdir, made)
    if "vllm_ttft" in benches:
        vllm_ttft(benches["vllm_ttft"], outdir, made)
    return made


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        data = json.load(f)
    out = sys.argv[2] if len(sys.argv) > 2 else os.path.splitext(sys.argv[1])[0]
    for p in make(data, out):
        print(p)
