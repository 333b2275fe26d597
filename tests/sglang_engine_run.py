"""A real SGLang engine (CPU, a tiny random Llama built here) with HiCache on and kvstore as its storage backend.

    python tests/sglang_engine_run.py build MODEL_DIR
    python tests/sglang_engine_run.py run MODEL_DIR SOCKET PROMPT_LEN [--expect-blocks N] [--wait PATH]

`run` sends one greedy request of PROMPT_LEN tokens and prints `RESULT {json}` (output ids, cached tokens); with
--expect-blocks it then waits (at most 60 s) until the daemon holds N blocks, so the pages written through to storage
are in before the engine stops. With --wait, the engine, once started, prints `WAIT PATH` and waits (at most 180 s)
for PATH to exist before it generates (a test lines it up with another engine). Runs with SGLANG_USE_CPU_ENGINE=1 and
the workarounds of connectors/sglang_patches.py.
"""
from __future__ import annotations

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def engine_env(workdir: str) -> dict[str, str]:
    """The environment a test runs this script in: SGLang spawns its scheduler, so the CPU workarounds go in by a
    sitecustomize in `workdir`/site; the repository on the path."""
    site = os.path.join(workdir, "site")
    os.makedirs(site, exist_ok=True)
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write("import kvstore.connectors.sglang_patches as p\np.apply()\n")
    return {**os.environ, "PYTHONPATH": f"{site}:{ROOT}", "SGLANG_USE_CPU_ENGINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}


MODEL = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=2048)


def build(out: str) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**MODEL, torch_dtype="float32")).save_pretrained(out)
    words = ["<unk>", "<s>", "</s>", "<pad>"] + [f"w{i}" for i in range(MODEL["vocab_size"] - 4)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(out)


def run(model: str, socket: str, prompt_len: int, expect_blocks: int, wait: str | None) -> None:
    import sglang as sgl

    extra = {"backend_name": "kvstore", "module_path": "kvstore.connectors.sglang_backend",
             "class_name": "KVStoreHiCache",
             "interface_v1": 1, "prefetch_threshold": 4, "socket": socket}
    engine = sgl.Engine(model_path=model, device="cpu", dtype="float32", page_size=4, mem_fraction_static=0.05,
                        max_total_tokens=2048, disable_cuda_graph=True, skip_server_warmup=True, log_level="info",
                        enable_hierarchical_cache=True, hicache_ratio=2.0, hicache_mem_layout="layer_first",
                        hicache_io_backend="direct", hicache_write_policy="write_through",
                        hicache_storage_prefetch_policy="wait_complete", hicache_storage_backend="dynamic",
                        hicache_storage_backend_extra_config=json.dumps(extra))
    try:
        prompt = [4 + (i * 37) % 1000 for i in range(prompt_len)]
        if wait:
            print(f"WAIT {wait}", flush=True)
            deadline = time.monotonic() + 180
            while not os.path.exists(wait):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"nobody created {wait}")
                time.sleep(0.05)
        out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 8, "temperature": 0})
        print("RESULT " + json.dumps({"output": out["output_ids"], "cached": out["meta_info"].get("cached_tokens"),
                                      "prompt": out["meta_info"].get("prompt_tokens")}), flush=True)
        if expect_blocks:
            from kvstore.client import Client

            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                with Client(socket) as c:       # this engine's pages only: other engines may share the daemon
                    rows = c.list()["namespaces"]
                if sum(r["blocks"] for r in rows if r["geometry"]["layout"].startswith("sglang")) >= expect_blocks:
                    break
                time.sleep(0.2)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    from kvstore.connectors.sglang_patches import apply

    apply()
    if sys.argv[1] == "build":
        build(sys.argv[2])
    else:
        opts = dict(zip(sys.argv[5::2], sys.argv[6::2]))
        run(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(opts.get("--expect-blocks", 0)), opts.get("--wait"))
