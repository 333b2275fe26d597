"""Run by tests/connectors/test_vllm_workflow.py and test_vllm_durable.py in a fresh process: one vLLM engine (CPU,
block size 32, the tiny Llama that tests/vllm_engine_run.py builds) with kvstore's connector, going through steps of
two kinds:

    python tests/connectors/workflow_engine_run.py MODEL SOCKET EXTRA_JSON STEPS_JSON

- {"tokens": [...], "max_tokens": N, "kv_transfer_params": {...} or null}: one greedy request, its params passed as
  vLLM's OpenAI server passes a request body's `kv_transfer_params` (SamplingParams.extra_args); prints
  `RESULT {"output", "num_cached_tokens", "keys"}`, `keys` being the kvstore keys (hex) of the prompt's full blocks,
  from vLLM's own block hashing in this process (sha256_cbor, chained), folded as the connector folds them;
- {"check": NAME}: prints `CHECK {"name", "keys", "workflows"}`: what the daemon holds at that point, from its own
  listing (the `list` op behind `kvstore ls`: every key of the engine's one namespace) and its `workflows` stats.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BLOCK = 32


def prompt_keys(tokens: list[int]) -> list[str]:
    """The connector's keys of the prompt's full blocks: vLLM's chained block hashes (this process's NONE_HASH,
    set by the engine), folded by block_key."""
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import hash_block_tokens

    from kvstore.protocol.keys import block_key

    keys, parent = [], None
    for i in range(len(tokens) // BLOCK):
        parent = hash_block_tokens(sha256_cbor, parent, tokens[i * BLOCK:(i + 1) * BLOCK], None)
        keys.append(block_key(bytes(parent)).hex())
    return keys


def check(socket: str, name: str) -> dict[str, Any]:
    from kvstore.client import Client

    with Client(socket) as c:
        rows = c.list()["namespaces"]
        keys = [bytes(k).hex() for row in rows for k, _ in c.list(ns=row["id"], limit=10_000)["keys"]]
        return {"name": name, "keys": keys, "workflows": c.stats().get("workflows")}


def main(model: str, socket: str, extra: dict, steps: list[dict]) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    sys.path.insert(0, ROOT)               # connectors/ importable in the engine-core process
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    ktc = KVTransferConfig(kv_connector="KVStoreConnector",
                           kv_connector_module_path="kvstore.connectors.vllm_connector", kv_role="kv_both",
                           kv_load_failure_policy="recompute",
                           kv_connector_extra_config={"socket": socket, "retry_s": 0.5, "timeout_s": 5, **extra})
    llm = LLM(model=model, dtype="float32", block_size=BLOCK, enable_prefix_caching=False,
              prefix_caching_hash_algo="sha256_cbor", max_model_len=1024, seed=0, enforce_eager=True,
              kv_transfer_config=ktc)
    for step in steps:
        if "check" in step:
            print("CHECK " + json.dumps(check(socket, step["check"])), flush=True)
            continue
        params = step.get("kv_transfer_params")
        sampling = SamplingParams(temperature=0.0, max_tokens=step.get("max_tokens", 4), ignore_eos=True,
                                  extra_args={"kv_transfer_params": params} if params is not None else None)
        out = llm.generate([TokensPrompt(prompt_token_ids=step["tokens"])], sampling, use_tqdm=False)[0]
        print("RESULT " + json.dumps({"output": list(out.outputs[0].token_ids), "keys": prompt_keys(step["tokens"]),
                                      "num_cached_tokens": out.num_cached_tokens}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4]))
