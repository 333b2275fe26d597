"""Hybrid models (issue 35): bytes stored per cached token and hit rate at equal DRAM, for a Gemma-3-like
sliding-window model and a Mamba-like state model against a dense model of the same layer count, through the real
daemon and client.

Models (6 layers each; one layer's KV for one 256-token block: 16 KiB on the agentic trace, 2 KiB on Mooncake's):
- dense: 6 full-attention layers, one namespace, every block;
- hybrid SWA (Gemma 3: 5 sliding-window layers to 1 full, window 1024 tokens = 4 blocks, vLLM's cdiv(W-1, 256)):
  a `full` group (1 layer) and a `window` group (5 layers), each a namespace of its own (salt `|kv_group=...`, as
  the vLLM connector names them), under each retention rule for the window group: every block (`all`), the window
  before each saved step end only (`every=0`: request ends, prefill chunk ends, decode block ends), the same plus a
  window before every K-th block (`every=K`, K = 16, 32 and 64: the connector's window_checkpoint_blocks), and the
  connector's default: step ends plus the end of the prefix the prompt shared with the daemon's chains (`divergence`);
- hybrid state (LFM2 / Mamba-like): a `full` group (1 layer) and a `state` group (5 recurrent layers) whose state at
  a block end is 1/8 of those layers' attention KV for one block; a state is kept where vLLM's align mode computes
  one: prefill chunk ends, the prompt's last block boundary, decode block ends.
A connector that stores every layer of every block (vLLM with its hybrid manager off) stores exactly what the
dense model stores: same layer count, same KV dims, same keys.

Each request does what kvstore's vLLM connector does (connectors/vllm_scheduler.py): a chained `lookup` on the full
group's namespace over the prompt's blocks (never the block holding its last token), `held` on the window or state
group's, `kv_groups.usable_end` for the hit; an `acquire` (released at once: the engine's copy is not measured) of
exactly what each group needs at that end (`GroupRule.needed`); then the saves: the full group's whole chain (the
hit blocks refreshed, the rest stored), the window or state group's `GroupRule.keep(hit end, end, step ends,
every)`, all with `Namespace.put` (random bytes of the group's geometry, CRC-32C). No engine-side prefix cache: every
request asks the daemon. Prefill runs in chunks of `--chunk-tokens` (vLLM's max_num_batched_tokens: 8192 by
default, its OpenAI server's default on H100/H200; 2048 on smaller GPUs), so a long prefill ends a step at each chunk
end; a request's reply (its decode) is saved as it is generated, a step end at every block it completes. The other
chunk sizes given are replayed against the unlimited store only (their bytes and rule-only hit rate).

Every variant replays the same requests on a fresh daemon with the same host-pool capacity (equal DRAM: 25% and 50%
of the dense model's working set), LRU. The same replay against an unlimited store (Python sets, no daemon) gives
what the rule alone costs: its hit rate with no eviction, and the bytes it stores per cached token (all groups'
distinct blocks × their bytes, over the tokens of the distinct full-group blocks).

Traces: the agentic multi-turn trace of bench_agentic.py (its generator: sessions that append to their context,
each turn resumes at the previous turn's end; the reply of each turn, 100 tokens, is decoded and saved), and the
public Mooncake synthetic trace (../shared/traces/mooncake-synthetic.jsonl.gz: each hash id is a 512-token
prefix block, here two 256-token blocks; a prompt ends at input_length; no sessions; all 3993 requests, quick: the
first 1000).
Geometries are small (a few KiB per block) so the run is short: only ratios matter.

    .venv-bench/bin/python bench/bench_hybrid.py [--quick] [--traces agentic,mooncake] [--dram-fraction 0.25,0.5]
        [--chunk-tokens 8192,2048] [--sessions S] [--turns T] [--requests N]
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import struct
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH))
sys.path.insert(0, BENCH)
from bench_agentic import trace as agentic_trace  # noqa: E402
from common import Daemon, Table, busy_cpus, progress, warn_if_busy, write_json  # noqa: E402

from kvstore.connectors.kv_groups import FULL, STATE, WINDOW, GroupRule, usable_end  # noqa: E402
from kvstore.protocol.geometry import Geometry  # noqa: E402
from kvstore.protocol.keys import HASH_BYTES, NamespaceSpec, chain_hashes  # noqa: E402

BLOCK = 256                        # tokens per block
LAYERS = 6                         # every model's layer count
SWA_LAYERS = 5                     # Gemma 3: 5 sliding-window layers to 1 full
WINDOW_TOKENS = 1024               # Gemma 3's sliding window
WINDOW_BLOCKS = -(-(WINDOW_TOKENS - 1) // BLOCK)     # vLLM: cdiv(W - 1, block_size) = 4
STATE_SHARE = 8                    # a recurrent layer's state is 1/8 of its attention KV for one block
HEAD_DIM = {"agentic": 16, "mooncake": 2}     # one layer-block: 2 × 256 × head_dim × 2 bytes (16 KiB, 2 KiB)
MOONCAKE = next((p for p in (os.path.join(os.path.dirname(os.path.dirname(BENCH)), "shared", "traces",
                                           "mooncake-synthetic.jsonl.gz"),
                              "/work/shared/traces/mooncake-synthetic.jsonl.gz") if os.path.exists(p)),
                "/work/shared/traces/mooncake-synthetic.jsonl.gz")   # ../shared beside the checkout
DECODE_SALT = 1 << 40              # token ids / hash ids of decoded tokens: never in any prompt


def geom(layers: int, head_dim: int, state: bool = False) -> Geometry:
    if state:   # the recurrent layers' state at one block end: 1/STATE_SHARE of their KV for one block
        return Geometry(layers=layers, tokens=BLOCK // STATE_SHARE, kv_heads=1, head_dim=head_dim)
    return Geometry(layers=layers, tokens=BLOCK, kv_heads=1, head_dim=head_dim)


@dataclass(frozen=True)
class Group:
    label: str
    rule: GroupRule
    layers: int
    every: int = 0           # window/state groups: a restorable end every this many blocks (1: every block)
    diverge: bool = False    # and the window before where the prompt left the stored chains (the connector's rule)


@dataclass(frozen=True)
class Variant:
    name: str
    model: str
    groups: tuple[Group, ...]
    what: str


FULL1 = Group("full", GroupRule(FULL), LAYERS - SWA_LAYERS)


def variants() -> list[Variant]:
    win = GroupRule(WINDOW, WINDOW_BLOCKS)
    return [
        Variant("dense", "dense", (Group("", GroupRule(FULL), LAYERS),), "6 full layers, every block"),
        Variant("swa all blocks", "swa", (FULL1, Group("window", win, SWA_LAYERS, 1)),
                "window group keeps every block"),
        Variant("swa step ends", "swa", (FULL1, Group("window", win, SWA_LAYERS, 0)),
                "window before each step end (every=0)"),
        Variant("swa ends+16", "swa", (FULL1, Group("window", win, SWA_LAYERS, 16)),
                "step ends + every 16 blocks"),
        Variant("swa ends+32", "swa", (FULL1, Group("window", win, SWA_LAYERS, 32)),
                "step ends + every 32 blocks"),
        Variant("swa ends+64", "swa", (FULL1, Group("window", win, SWA_LAYERS, 64)),
                "step ends + every 64 blocks"),
        Variant("swa ends+divergence", "swa", (FULL1, Group("window", win, SWA_LAYERS, 0, True)),
                "step ends + where the prompt left the stored chains (the default)"),
        Variant("swa ends+16+divergence", "swa", (FULL1, Group("window", win, SWA_LAYERS, 16, True)),
                "step ends + every 16 blocks + divergence"),
        Variant("state step ends", "state", (FULL1, Group("state", GroupRule(STATE), SWA_LAYERS, 0)),
                "state at chunk/prompt/decode block ends"),
    ]


@dataclass
class Request:
    hashes: list[bytes]     # every full block of prompt + reply
    prompt: int             # prompt tokens
    session: int = -1


def agentic_requests(sessions: int, turns: int) -> list[Request]:
    """bench_agentic's trace; each turn's reply is the 100 tokens the session's next prompt carries after it."""
    ts = agentic_trace(sessions, turns)
    nxt: dict[int, list[int]] = {}
    out: list[Request] = []
    for session, tokens in reversed(ts):
        later = nxt.get(session)
        seq = later[:len(tokens) + 100] if later is not None else tokens
        out.append(Request(chain_hashes(seq, BLOCK), len(tokens), session))
        nxt[session] = tokens
    return out[::-1]


def mooncake_requests(n: int, path: str = MOONCAKE) -> list[Request]:
    """The first `n` requests: hash id k covers prompt tokens [512k, 512k + 512), two blocks here; blocks past the
    prompt's last full block (its tail and its reply, output_length tokens) are the request's own."""
    out: list[Request] = []
    with gzip.open(path, "rt") as f:
        for i, line in enumerate(f):
            if len(out) >= n:
                break
            if not line.strip():
                continue
            r = json.loads(line)
            p, total = r["input_length"], r["input_length"] + r["output_length"]
            h = bytes(HASH_BYTES)
            hs = []
            for b in range(total // BLOCK):
                if b < p // BLOCK and b // 2 < len(r["hash_ids"]):
                    what = struct.pack("<qq", r["hash_ids"][b // 2], b % 2)
                else:
                    what = struct.pack("<qq", DECODE_SALT + i, b)
                h = hashlib.blake2b(h + what, digest_size=HASH_BYTES).digest()
                hs.append(h)
            out.append(Request(hs, p))
    return out


def step_ends(start: int, prompt: int, total_blocks: int, chunk: int) -> list[int]:
    """Block ends of the steps that compute a request from block `start`: each prefill chunk's end, the prompt's
    (its last block boundary: vLLM's align mode stops there), and every block a decode step completes."""
    ends = [(start * BLOCK + k) // BLOCK for k in range(chunk, prompt - start * BLOCK, chunk)]
    ends.append(prompt // BLOCK)
    ends += range(prompt // BLOCK + 1, total_blocks + 1)
    return sorted(set(e for e in ends if e > start))


class SetStore:
    """Unlimited DRAM: what each group's namespace would hold with no eviction."""

    def __init__(self, v: Variant) -> None:
        self.sets: list[set[bytes]] = [set() for _ in v.groups]

    def lookup(self, g: int, hs: list[bytes]) -> int:
        s = self.sets[g]
        return next((k for k, h in enumerate(hs) if h not in s), len(hs))

    def held(self, g: int, hs: list[bytes]) -> list[bool]:
        return [h in self.sets[g] for h in hs]

    def load(self, g: int, hs: list[bytes]) -> int:
        return sum(h in self.sets[g] for h in hs)

    def save(self, g: int, hs: list[bytes]) -> int:
        s = self.sets[g]
        new = sum(h not in s for h in hs)
        s.update(hs)
        return new

    def close(self) -> None:
        pass


class DaemonStore:
    """A fresh daemon of `capacity` bytes, one namespace per group, driven as the vLLM connector drives it."""
    POOL_BUFS = 64

    def __init__(self, v: Variant, head_dim: int, capacity: int) -> None:
        self.d = Daemon(f"{capacity}", "1MiB", {"KVSTORE_SERVER_MAX_RESERVED_FRACTION": "1",
                                                  "KVSTORE_POOL_EVICTION": "lru"}).start()
        self.c = self.d.client()
        rng = np.random.default_rng(35)
        self.ns, self.bufs = [], []
        for g in v.groups:
            gm = geom(g.layers, head_dim, g.rule.kind == STATE)
            salt = f"|kv_group={g.label}" if g.label else ""
            self.ns.append(self.c.namespace(NamespaceSpec(f"bench-hybrid-{v.model}", gm, salt=salt)))
            self.bufs.append([rng.integers(0, 256, gm.full_bytes, np.uint8) for _ in range(self.POOL_BUFS)])

    def lookup(self, g: int, hs: list[bytes]) -> int:
        return self.ns[g].lookup(hs) if hs else 0

    def held(self, g: int, hs: list[bytes]) -> list[bool]:
        return self.ns[g].held(hs) if hs else []

    def load(self, g: int, hs: list[bytes]) -> int:
        n = 0
        for i in range(0, len(hs), self.c.max_keys):
            with self.ns[g].acquire(hs[i:i + self.c.max_keys]) as lease:
                n += len(lease)
        return n

    def save(self, g: int, hs: list[bytes]) -> int:
        if not hs:
            return 0
        bufs = self.bufs[g]
        r = self.ns[g].put(hs, [bufs[k % len(bufs)] for k in range(len(hs))], batch=256)
        return r.stored

    def close(self) -> None:
        self.c.close()
        self.d.stop()


def replay(reqs: list[Request], v: Variant, store: Any, label: str, chunk: int) -> dict[str, Any]:
    rules = [g.rule for g in v.groups]
    hit_tokens = prompt_tokens = hit_blocks = lost = 0
    stored = [0] * len(v.groups)
    tick = max(1, len(reqs) // 4)
    t0 = time.perf_counter()
    for i, r in enumerate(reqs):
        usable = min((r.prompt - 1) // BLOCK, len(r.hashes))
        hs = r.hashes[:usable]
        n = usable
        for g, grp in enumerate(v.groups):         # chained: the full groups' common prefix
            if grp.rule.kind == FULL and n:
                n = min(n, store.lookup(g, hs[:n]))
        held = [None if grp.rule.kind == FULL else store.held(g, hs[:n]) for g, grp in enumerate(v.groups)]
        end = usable_end(rules, n, held) if len(v.groups) > 1 else n
        for g, grp in enumerate(v.groups):         # exactly what each group needs to resume at `end`
            need = [hs[p] for p in grp.rule.needed(end)]
            got = store.load(g, need)
            if got < len(need):                    # evicted between the lookup and the load: a real engine
                lost += 1                          # would then recompute; never happens with one client
        hit_tokens += end * BLOCK
        hit_blocks += end
        prompt_tokens += r.prompt
        ends = step_ends(end, r.prompt, len(r.hashes), chunk)
        top = len(r.hashes)
        for g, grp in enumerate(v.groups):
            mine = [*ends, n] if grp.diverge and n > end else ends
            where = range(top) if grp.rule.kind == FULL else grp.rule.keep(end, top, mine, grp.every)
            stored[g] += store.save(g, [r.hashes[p] for p in where])
        if (i + 1) % tick == 0 and label:
            progress(f"  {label}: {i + 1}/{len(reqs)} requests, hit {hit_tokens / prompt_tokens:.1%}, "
                     f"{time.perf_counter() - t0:.1f} s")
    return {"hit_tokens": hit_tokens, "prompt_tokens": prompt_tokens, "hit_rate": hit_tokens / prompt_tokens,
            "hit_blocks": hit_blocks, "blocks_stored": stored, "loads_short": lost,
            "seconds": time.perf_counter() - t0}


def group_bytes(v: Variant, head_dim: int) -> list[int]:
    return [geom(g.layers, head_dim, g.rule.kind == STATE).full_bytes for g in v.groups]


def unlimited(reqs: list[Request], v: Variant, gb: list[int], chunk: int) -> dict[str, Any]:
    """The replay against a store that evicts nothing: the rule's own hit rate and the bytes it keeps."""
    store = SetStore(v)
    r = replay(reqs, v, store, "", chunk)
    full_blocks = len(store.sets[0])
    held = sum(len(s) * b for s, b in zip(store.sets, gb))
    return {**r, "distinct_blocks": [len(s) for s in store.sets], "bytes_held": held,
            "cached_tokens": full_blocks * BLOCK, "bytes_per_cached_token": held / (full_blocks * BLOCK),
            "blocks_per_cached_block": sum(len(s) for s in store.sets) / full_blocks}


def run_trace(name: str, reqs: list[Request], fractions: list[float], chunks: list[int]) -> dict[str, Any]:
    head_dim = HEAD_DIM[name]
    dense_block = geom(LAYERS, head_dim).full_bytes
    working = len({h for r in reqs for h in r.hashes})
    caps = {str(f): max(32 << 20, int(working * dense_block * f) >> 20 << 20) for f in fractions}
    out: dict[str, Any] = {"requests": len(reqs), "prompt_tokens": sum(r.prompt for r in reqs),
                           "distinct_blocks": working, "dense_block_bytes": dense_block,
                           "dense_working_set_bytes": working * dense_block, "capacity_bytes": caps,
                           "variants": {}}
    pools = ", ".join(f"{c >> 20} MiB" for c in caps.values())
    progress(f"{name}: {len(reqs)} requests, {out['prompt_tokens'] / 1e6:.2f} M prompt tokens, dense working set "
             f"{working * dense_block / 2**20:.0f} MiB; pools of {pools}, the same for every variant")
    for v in variants():
        gb = group_bytes(v, head_dim)
        rule_only = {str(c): unlimited(reqs, v, gb, c) for c in chunks}
        dram = {}
        for f, cap in caps.items():
            progress(f"{name} / {v.name}: daemon replay, pool {cap >> 20} MiB")
            store = DaemonStore(v, head_dim, cap)
            try:
                real = replay(reqs, v, store, f"{name} / {v.name} / {cap >> 20} MiB", chunks[0])
            finally:
                store.close()
            written = sum(n * b for n, b in zip(real["blocks_stored"], gb))
            dram[f] = {**real, "capacity_bytes": cap, "chunk_tokens": chunks[0], "bytes_written": written,
                       "hit_tokens_per_mib_written": real["hit_tokens"] / max(written / 2**20, 1e-9)}
        out["variants"][v.name] = {
            "what": v.what, "group_bytes_per_block": gb,
            "groups": [{"label": g.label or "all", "kind": g.rule.kind, "layers": g.layers,
                        "window_blocks": g.rule.window_blocks, "every": g.every} for g in v.groups],
            "unlimited": rule_only[str(chunks[0])], "unlimited_by_chunk": rule_only, "dram": dram}
    return out


def print_trace(name: str, tr: dict[str, Any], fractions: list[float], chunks: list[int]) -> None:
    dense = tr["variants"]["dense"]
    d_bpt = dense["unlimited"]["bytes_per_cached_token"]
    pools = ", ".join(f"{f:.0%} = {tr['capacity_bytes'][str(f)] >> 20} MiB" for f in fractions)
    print(f"\n{name}: {tr['requests']} requests, {tr['prompt_tokens'] / 1e6:.2f} M prompt tokens, prefill chunk "
          f"{chunks[0]}; host pool as a share of the dense working set ({tr['dense_working_set_bytes'] >> 20} MiB): "
          f"{pools}, the same for every variant")
    heads = ["variant", "retention", "blocks/cached block", "bytes/cached token", "vs dense", "hit (unlimited)"]
    for f in fractions:
        heads += [f"hit @{f:.0%} DRAM (vs dense)", f"hit tok/MiB written @{f:.0%}"]
    tab = Table(heads)
    rows = list(tr["variants"].items())
    rows.insert(1, ("swa every layer", {**dense, "what": "a connector storing every layer of every block"}))
    for vname, r in rows:
        u = r["unlimited"]
        row = [vname, r["what"], f"{u['blocks_per_cached_block']:.2f}", f"{u['bytes_per_cached_token']:.0f}",
               f"{u['bytes_per_cached_token'] / d_bpt:.2f}×", f"{u['hit_rate']:.1%}"]
        for f in fractions:
            d, dd = r["dram"][str(f)], dense["dram"][str(f)]
            row += [f"{d['hit_rate']:.1%} ({d['hit_rate'] / max(dd['hit_rate'], 1e-9):.2f}×)",
                    f"{d['hit_tokens_per_mib_written']:.0f}"]
        tab.add(row)
    print(tab)
    if len(chunks) > 1:
        print(f"\n{name}, the rule alone (unlimited store) by prefill chunk: bytes/cached token vs dense, hit rate")
        tab = Table(["variant"] + [f"chunk {c}" for c in chunks])
        for vname, r in tr["variants"].items():
            by, d_by = r["unlimited_by_chunk"], dense["unlimited_by_chunk"]
            tab.add([vname] + [f"{by[str(c)]['bytes_per_cached_token'] / d_by[str(c)]['bytes_per_cached_token']:.2f}"
                               f"×  {by[str(c)]['hit_rate']:.1%}" for c in chunks])
        print(tab)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller traces, one pool size (≤ 60 s)")
    ap.add_argument("--traces", default="agentic,mooncake")
    ap.add_argument("--sessions", type=int, help="agentic sessions (default 32, quick 16)")
    ap.add_argument("--turns", type=int, help="agentic turns per session (default 24, quick 12)")
    ap.add_argument("--requests", type=int, help="Mooncake requests, from the first (default all 3993, quick 1000)")
    ap.add_argument("--mooncake-trace", default=MOONCAKE, help=f"default {MOONCAKE}")
    ap.add_argument("--chunk-tokens", default="8192,2048",
                    help="prefill chunk sizes: the first for the DRAM replays, all for the unlimited store")
    ap.add_argument("--dram-fraction", help="host pool sizes as shares of the dense model's working set "
                                            "(default 0.25,0.5; quick 0.25)")
    args = ap.parse_args()
    chunks = [int(c) for c in args.chunk_tokens.split(",")]
    fractions = [float(f) for f in (args.dram_fraction or ("0.25" if args.quick else "0.25,0.5")).split(",")]
    started = time.perf_counter()
    load_before = warn_if_busy()
    res: dict[str, Any] = {
        "block_tokens": BLOCK, "layers": LAYERS, "swa_layers": SWA_LAYERS, "window_tokens": WINDOW_TOKENS,
        "window_blocks": WINDOW_BLOCKS, "state_share": STATE_SHARE, "chunk_tokens": chunks,
        "dram_fractions": fractions, "traces": {},
        "note": "small geometries (a few KiB per block): only ratios matter"}
    for name in args.traces.split(","):
        if name == "agentic":
            s = args.sessions or (16 if args.quick else 32)
            t = args.turns or (12 if args.quick else 24)
            reqs = agentic_requests(s, t)
            extra: dict[str, Any] = {"sessions": s, "turns": t}
        elif name == "mooncake":
            if not os.path.exists(args.mooncake_trace):
                progress(f"skipping mooncake: {args.mooncake_trace} not found")
                continue
            reqs = mooncake_requests(args.requests or (1000 if args.quick else 1 << 30), args.mooncake_trace)
            extra = {"trace_file": args.mooncake_trace}
        else:
            raise SystemExit(f"unknown trace {name!r}: agentic or mooncake")
        res["traces"][name] = {**extra, **run_trace(name, reqs, fractions, chunks)}
    print(f"\nmodels: {LAYERS} layers each. dense: {LAYERS} full-attention layers. swa (Gemma 3's 5:1): "
          f"{SWA_LAYERS} sliding-window layers (window {WINDOW_TOKENS} tokens = {WINDOW_BLOCKS} blocks) + "
          f"{LAYERS - SWA_LAYERS} full. state (LFM2/Mamba-like): {SWA_LAYERS} recurrent layers (a state = "
          f"1/{STATE_SHARE} of their KV for one block) + {LAYERS - SWA_LAYERS} full. {BLOCK}-token blocks; "
          f"geometries are small (a few KiB per block): only ratios matter. bytes/cached token and hit (unlimited): "
          f"the rule alone, no eviction; hit @DRAM: a fresh daemon of that pool size per variant, LRU")
    for name, tr in res["traces"].items():
        print_trace(name, tr, fractions, chunks)
    res["load_average"] = {"before": load_before, "after": busy_cpus()}
    res["seconds"] = time.perf_counter() - started
    print(f"\nwrote {write_json('hybrid', res)}  ({res['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
