"""Run by tests/connectors/test_vllm_durable.py in a fresh process: one vLLM engine (CPU, block size 32, the tiny
Llama that tests/vllm_engine_run.py builds) with kvstore's connector, generating once per step, where a step may
carry the request's `kv_transfer_params` (what an OpenAI server passes through as vLLM's `extra_args`).
    python tests/connectors/durable_engine_run.py MODEL SOCKET EXTRA_JSON STEPS_JSON
Each step: {"tokens": [...], "max_tokens": N, "kv_transfer_params": {...} or null}; prints `RESULT {...}` after it.
"""
from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
    llm = LLM(model=model, dtype="float32", block_size=32, enable_prefix_caching=False,
              prefix_caching_hash_algo="sha256_cbor", max_model_len=1024, seed=0, enforce_eager=True,
              kv_transfer_config=ktc)
    for step in steps:
        params = step.get("kv_transfer_params")
        sampling = SamplingParams(temperature=0.0, max_tokens=step.get("max_tokens", 4), ignore_eos=True,
                                  extra_args={"kv_transfer_params": params} if params is not None else None)
        out = llm.generate([TokensPrompt(prompt_token_ids=step["tokens"])], sampling, use_tqdm=False)[0]
        print("RESULT " + json.dumps({"output": list(out.outputs[0].token_ids),
                                      "num_cached_tokens": out.num_cached_tokens}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4]))
