"""Run by tests/connectors/test_vllm_connector.py and tests/install/ in fresh processes (vLLM wants a process of its
own).

    python tests/vllm_engine_run.py build DIR SEED [DIR SEED ...]   # tiny random Llamas + WordLevel tokenizers
    python tests/vllm_engine_run.py run --model DIR --socket PATH --steps '[{...}, ...]'
    python tests/vllm_engine_run.py run --model DIR --short-config --steps '[{...}, ...]'

`run` starts one vLLM engine (in-process engine core, CPU, block size 32, no local prefix caching, sha256_cbor
hashes) with kvstore's connector and generates greedily once per step. Each step is {"tokens": [...],
"max_tokens": N, "wait": PATH or null}: with "wait", the script prints `WAIT PATH` and waits for PATH to exist before
generating (the test changes the daemon meanwhile). After each step it prints one line
`RESULT {"output": [...], "num_cached_tokens": n, "seconds": s, "origin": {...}}` ("origin": where kvstore's
modules were imported from, whether vLLM loaded kvstore's plugin, the connector's module path as configured).

By default the connector is named by its module path, importable from this checkout (put on sys.path). With
`--short-config` the engine gets only `--kv-transfer-config '{"kv_connector": "KVStoreConnector", "kv_role":
"kv_both"}'` (parsed by vLLM's own argument parser) and nothing is added to sys.path: the installed kvstore's vLLM
plugin must register the name, and the socket comes from $KVSTORE_SERVER_SOCKET (tests/install runs a copy of this
script in a venv where kvstore is installed from its wheel).
"""
from __future__ import annotations

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK_SIZE = 32
VOCAB_WORDS = 1020


def wait_for_go(path: str | None) -> None:
    """A step with "wait": say `WAIT PATH`, then wait (at most 120 s) until the test creates PATH."""
    if not path:
        return
    print(f"WAIT {path}", flush=True)
    deadline = time.monotonic() + 120
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"nobody created {path}")
        time.sleep(0.05)


def save_tokenizer(path: str) -> int:
    """A WordLevel tokenizer over w0..w1019 (and 4 specials) saved beside a model; returns its vocabulary size."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "<pad>"] + [f"w{i}" for i in range(VOCAB_WORDS)]
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.save_pretrained(path)
    return len(words)


def save_random(model: object, path: str) -> None:
    """Weights drawn larger than the default init (outputs depend visibly on the KV; the caller seeds torch before
    it builds the model), saved with a tokenizer."""
    import torch

    with torch.no_grad():
        for p in model.parameters():  # type: ignore[attr-defined]
            p.normal_(0.0, 0.08)
    model.save_pretrained(path)  # type: ignore[attr-defined]
    save_tokenizer(path)


def build(path: str, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB_WORDS + 4, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
                      bos_token_id=1, eos_token_id=2, pad_token_id=3, torch_dtype="float32")
    torch.manual_seed(seed)
    save_random(LlamaForCausalLM(cfg), path)


SHORT_CONFIG = '{"kv_connector": "KVStoreConnector", "kv_role": "kv_both"}'
ORIGIN_MODULES = ("kvstore", "kvstore.connectors", "kvstore.connectors.vllm_connector",
                  "kvstore.connectors.vllm_plugin")


def run(model: str, socket: str | None, steps: list[dict], extra: dict, short: bool = False,
        batch: int = 0) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if not short:
        sys.path.insert(0, ROOT)           # connectors/ must be importable in the engine-core process
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    if short:                              # what a user types: `--kv-transfer-config '{...}'`, parsed by vLLM
        from vllm.engine.arg_utils import EngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
        ktc = parser.parse_args(["--model", model, "--kv-transfer-config", SHORT_CONFIG]).kv_transfer_config
    else:
        if socket is None:
            raise SystemExit("--socket is required without --short-config")
        ktc = KVTransferConfig(kv_connector="KVStoreConnector",
                               kv_connector_module_path="kvstore.connectors.vllm_connector",
                               kv_role="kv_both", kv_load_failure_policy="recompute",
                               kv_connector_extra_config={"socket": socket, "retry_s": 0.5, "timeout_s": 5, **extra})
    chunk = {"max_num_batched_tokens": batch} if batch else {}   # a prompt longer than `batch`: chunked prefill
    llm = LLM(model=model, dtype="float32", block_size=BLOCK_SIZE, enable_prefix_caching=False,
              prefix_caching_hash_algo="sha256_cbor", max_model_len=1024, seed=0, enforce_eager=True,
              kv_transfer_config=ktc, **chunk)
    # before this script imports anything of kvstore's: what vLLM itself loaded
    origin = {"plugin_loaded_by_vllm": "kvstore.connectors.vllm_plugin" in sys.modules,
              "kv_connector": ktc.kv_connector, "kv_connector_module_path": ktc.kv_connector_module_path,
              "modules": {name: getattr(sys.modules.get(name), "__file__", None) for name in ORIGIN_MODULES}}
    if origin["plugin_loaded_by_vllm"]:
        from kvstore.connectors.vllm_plugin import register

        register()                         # again, as a second load_general_plugins would: changes nothing
        origin["register_again"] = "ok"
    for step in steps:
        wait_for_go(step.get("wait"))
        params = SamplingParams(temperature=0.0, max_tokens=step.get("max_tokens", 16), ignore_eos=True)
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=step["tokens"])], params, use_tqdm=False)[0]
        result = {"output": list(out.outputs[0].token_ids), "num_cached_tokens": out.num_cached_tokens,
                  "seconds": round(time.perf_counter() - t0, 3), "origin": origin}
        print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    if sys.argv[1] == "build":
        for path, seed in zip(sys.argv[2::2], sys.argv[3::2]):
            build(path, int(seed))
        return
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("cmd")
    ap.add_argument("--model", required=True)
    ap.add_argument("--socket")
    ap.add_argument("--short-config", action="store_true")
    ap.add_argument("--steps", required=True)
    ap.add_argument("--extra", default="{}")
    ap.add_argument("--batch", type=int, default=0, help="vLLM's max_num_batched_tokens (0: its default)")
    a = ap.parse_args()
    run(a.model, a.socket, json.loads(a.steps), json.loads(a.extra), a.short_config, a.batch)


if __name__ == "__main__":
    main()
