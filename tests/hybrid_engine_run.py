"""Run by tests/connectors/test_vllm_hybrid.py in fresh processes: a tiny random hybrid model on vLLM's CPU build with
its hybrid KV cache manager on and kvstore's connector.

    python tests/hybrid_engine_run.py build DIR SEED [gemma3|lfm2]    # Gemma-3-style: 2 sliding, 2 full layers;
                                                                     # LFM2-style: 2 short-conv, 2 full layers
    python tests/hybrid_engine_run.py run --model DIR --socket PATH --steps '[{...}]' [--extra '{...}'] [--batch N]
                                                                     [--no-own-cache]

`run` starts one engine (in-process engine core, block size 32, vLLM's own prefix cache on as in production,
sha256_cbor hashes, hybrid manager left to vLLM's choice) and generates greedily once per step; a step is
{"tokens": [...], "max_tokens": N, "wait": PATH or null, "reset": bool} as in tests/vllm_engine_run.py ("reset":
empty vLLM's own prefix cache first, so one process stands for fresh engines in turn). It prints one line per step:
`RESULT {"output": [...], "num_cached_tokens": n, "logprobs": [[[token, logprob], ...] per output position],
"hybrid_manager": bool, "groups": [...]}` (top-5 logprobs of every generated token; "hybrid_manager": whether
vLLM kept its hybrid KV cache manager on; "groups": the engine's KV cache groups, kind and layers).
"""
from __future__ import annotations

import json
import os
import sys

from vllm_engine_run import BLOCK_SIZE, ROOT, VOCAB_WORDS, save_random, wait_for_go

WINDOW = 64         # tokens of sliding window: 2 blocks of 32 before a prefix end (cdiv(63, 32))
LAYERS = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def build(path: str, seed: int, arch: str = "gemma3") -> None:
    if arch == "lfm2":
        return build_lfm2(path, seed)
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(vocab_size=VOCAB_WORDS + 4, hidden_size=128, intermediate_size=256,
                           num_hidden_layers=len(LAYERS), num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=3,
                           torch_dtype="float32", tie_word_embeddings=True, sliding_window=WINDOW,
                           layer_types=LAYERS)
    torch.manual_seed(seed)
    save_random(Gemma3ForCausalLM(cfg), path)


def build_lfm2(path: str, seed: int) -> None:
    """An LFM2-style model: short-convolution layers (a recurrent state, vLLM's MambaSpec) and full attention."""
    import torch
    from transformers import Lfm2Config, Lfm2ForCausalLM

    cfg = Lfm2Config(vocab_size=VOCAB_WORDS + 4, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, conv_L_cache=3, max_position_embeddings=2048,
                     layer_types=["conv", "full_attention", "conv", "full_attention"], block_auto_adjust_ff_dim=False,
                     bos_token_id=1, eos_token_id=2, pad_token_id=3, torch_dtype="float32", tie_word_embeddings=False)
    torch.manual_seed(seed)
    save_random(Lfm2ForCausalLM(cfg), path)
    with open(os.path.join(path, "config.json")) as f:   # vLLM 0.32 reads these under their older names
        config = json.load(f)
    config.update(conv_dim=128, conv_dim_out=128, block_dim=128, block_ff_dim=256)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def run(model: str, socket: str, steps: list[dict], extra: dict, batch: int = 0, own_cache: bool = True) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    sys.path.insert(0, ROOT)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    ktc = KVTransferConfig(kv_connector="KVStoreConnector",
                           kv_connector_module_path="kvstore.connectors.vllm_connector", kv_role="kv_both",
                           kv_load_failure_policy="recompute",
                           kv_connector_extra_config={"socket": socket, "retry_s": 0.5, "timeout_s": 5, **extra})
    llm = LLM(model=model, dtype="float32", block_size=BLOCK_SIZE, enable_prefix_caching=own_cache,
              prefix_caching_hash_algo="sha256_cbor", max_model_len=2048, seed=0, enforce_eager=True,
              kv_transfer_config=ktc, **({"max_num_batched_tokens": batch} if batch else {}))
    config = llm.llm_engine.vllm_config
    hybrid = not config.scheduler_config.disable_hybrid_kv_cache_manager
    for step in steps:
        wait_for_go(step.get("wait"))
        if step.get("reset"):
            assert llm.reset_prefix_cache(), "vLLM could not empty its own prefix cache"
        params = SamplingParams(temperature=0.0, max_tokens=step.get("max_tokens", 4), ignore_eos=True, logprobs=5)
        out = llm.generate([TokensPrompt(prompt_token_ids=step["tokens"])], params, use_tqdm=False)[0]
        first = out.outputs[0]
        logprobs = [sorted(([t, lp.logprob] for t, lp in pos.items()), key=lambda x: x[0])
                    for pos in (first.logprobs or [])]
        print("RESULT " + json.dumps({"output": list(first.token_ids), "num_cached_tokens": out.num_cached_tokens,
                                      "logprobs": logprobs, "hybrid_manager": hybrid}), flush=True)


def main() -> None:
    if sys.argv[1] == "build":
        build(sys.argv[2], int(sys.argv[3]), *sys.argv[4:5])
        return
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("cmd")
    ap.add_argument("--model", required=True)
    ap.add_argument("--socket", required=True)
    ap.add_argument("--steps", required=True)
    ap.add_argument("--extra", default="{}")
    ap.add_argument("--batch", type=int, default=0, help="vLLM's max_num_batched_tokens (0: its default)")
    ap.add_argument("--no-own-cache", action="store_true", help="vLLM's own prefix cache off (a full recompute)")
    a = ap.parse_args()
    run(a.model, a.socket, json.loads(a.steps), json.loads(a.extra), a.batch, not a.no_own_cache)


if __name__ == "__main__":
    main()
