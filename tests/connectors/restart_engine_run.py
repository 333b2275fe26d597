"""Run by tests/connectors/test_restart_engine.py in a process of its own: one vLLM engine (in-process engine core,
CPU, block size 32, no local prefix caching, sha256_cbor hashes: the setup of tests/vllm_engine_run.py) with kvstore's
connector, which keeps serving while the test stops, kills and restarts the daemon under it.

    python tests/connectors/restart_engine_run.py --model DIR --socket PATH [--extra JSON]

Commands come on stdin, one JSON object a line; answers are lines on stdout (vLLM's log lines come between them):
- {"prompts": [[token, ...], ...]}: one generate() of these prompts →
  `RESULT {"outputs": [[token, ...], ...], "cached": [n, ...], "finish": [reason, ...]}`;
- {"loop": [[token, ...], ...], "until": PATH}: generate the prompts one at a time, in turn, round after round, until
  PATH exists (at least one round). After each generate:
  `ROUND {"i": i, "prompt": j, "start": t0, "end": t1, "cached": n, "output": [...], "finish": reason}`, where t0
  and t1 are time.monotonic() when it was submitted and when it returned (one clock for every process of the
  machine, the test's too); then
  `RESULT {"generates": i}`.
Every generate is greedy, 12 new tokens, ignore_eos. The script prints `READY` once the engine is built. Any
exception ends the process with a traceback: what the test must never see.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_TOKENS = 12


def engine(model: str, socket: str, extra: dict[str, Any]) -> Any:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    sys.path.insert(0, ROOT)                   # connectors/ must be importable in the engine-core process
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from tests.vllm_engine_run import BLOCK_SIZE

    ktc = KVTransferConfig(kv_connector="KVStoreConnector",
                           kv_connector_module_path="kvstore.connectors.vllm_connector", kv_role="kv_both",
                           kv_load_failure_policy="recompute",
                           kv_connector_extra_config={"socket": socket, **extra})
    return LLM(model=model, dtype="float32", block_size=BLOCK_SIZE, enable_prefix_caching=False,
               prefix_caching_hash_algo="sha256_cbor", max_model_len=1024, seed=0, enforce_eager=True,
               kv_transfer_config=ktc)


def generate(llm: Any, prompts: list[list[int]]) -> list[Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)


def say(tag: str, fields: dict[str, Any]) -> None:
    print(f"{tag} {json.dumps(fields)}", flush=True)


def loop(llm: Any, prompts: list[list[int]], until: str) -> None:
    i = 0
    while i == 0 or not os.path.exists(until):
        j = i % len(prompts)
        start = time.monotonic()
        [out] = generate(llm, [prompts[j]])
        say("ROUND", {"i": i, "prompt": j, "start": start, "end": time.monotonic(), "cached": out.num_cached_tokens,
                      "output": list(out.outputs[0].token_ids), "finish": out.outputs[0].finish_reason})
        i += 1
    say("RESULT", {"generates": i})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--socket", required=True)
    ap.add_argument("--extra", default="{}")
    a = ap.parse_args()
    llm = engine(a.model, a.socket, json.loads(a.extra))
    print("READY", flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if "loop" in cmd:
            loop(llm, cmd["loop"], cmd["until"])
            continue
        outs = generate(llm, cmd["prompts"])
        say("RESULT", {"outputs": [list(o.outputs[0].token_ids) for o in outs],
                       "cached": [o.num_cached_tokens for o in outs],
                       "finish": [o.outputs[0].finish_reason for o in outs]})


if __name__ == "__main__":
    main()
