"""Run by tests/connectors/test_forkkv_reference.py in a process of its own: ForkKV agents that read a context back
from the daemon (kvstore.connectors.forkkv_reference) and rebuild their K and V from what they find.

    python tests/connectors/forkkv_reference_run.py

It reads "PLAN OUT" lines on stdin (one process serves several reads, paying for torch's import once), answers
each with its agents' stats, one JSON line per agent, then `DONE`; any exception ends it with a traceback.
PLAN (torch.save'd): {"socket": path, "config": TinyConfig fields, "tokens": [...], "adapters": [[name, seed], ...]
in the order the agents run, "probes": [layers, heads, head_dim] query vectors}. Each agent runs `prepare` (loads
both stored prefixes, computes and puts what is missing) and `rebuild`; and, per layer, `residual_attention` of its
layer's probe query at the position after the context over the loaded parts. OUT (torch.save'd): {name: {"k": [per
layer [S, G, D]], "v": [...], "probe": [per layer [H·D]], "stats": prepare's stats}}.
"""
from __future__ import annotations

import json
import sys

import torch

from kvstore.client import Client
from kvstore.connectors.forkkv_reference import (
    Adapter,
    ForkKVClient,
    TinyConfig,
    TinyLlama,
    rebuild,
    residual_attention,
)


def main(plan_path: str, out_path: str) -> None:
    plan = torch.load(plan_path, weights_only=True)
    cfg = TinyConfig(**plan["config"])
    model = TinyLlama(cfg)
    out = {}
    with Client(plan["socket"]) as c:
        fc = ForkKVClient(c, model)
        for name, seed in plan["adapters"]:
            adapter = Adapter.make(cfg, name, seed)
            p = fc.prepare(plan["tokens"], adapter)
            kv = rebuild(model, adapter, p.base, p.residual)
            at = torch.tensor([p.base[0][0].shape[0]])
            probe = [residual_attention(model, plan["probes"][i][None], at, p.base[i], p.residual[i], adapter.bk[i],
                                        adapter.bv[i])[0] for i in range(cfg.layers)]
            out[name] = {"k": [k for k, _ in kv], "v": [v for _, v in kv], "probe": probe, "stats": p.stats}
            print(json.dumps({name: p.stats}), flush=True)
    torch.save(out, out_path)


if __name__ == "__main__":
    for line in sys.stdin:
        main(*line.split())
        print("DONE", flush=True)
