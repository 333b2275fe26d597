"""Issue 14 part 7: workflow hints from a real vLLM engine, sent as `kv_transfer_params`, steer the daemon's eviction.

One vLLM engine process (CPU, a tiny random Llama; tests/connectors/workflow_engine_run.py) and one daemon whose host
pool holds 32 blocks (1 MiB of 32 KiB blocks: 2 layers × K,V × 32 tokens × 2 heads × 32 dims × fp32). Every prompt
is 200 tokens: 6 full blocks saved (the 7th holds the last prompt token, always computed).

- Workflow "w1" (type codegen) runs three agents, planner, coder and tester, whose prompts share a 4-block prefix
  (plus 2 blocks of their own): 10 distinct blocks; the coder and the tester hit the shared prefix (128 tokens,
  through the connector: the engine's own prefix caching is off).
- Between the coder and the tester, six one-shot workflows ("batch-i": each ends with its request) store 36 blocks:
  the pool overflows. While w1 is active its 8 blocks survive (the batch blocks are retired: they go first); under
  LRU they are the oldest and are evicted (the pressure is real).
- A chat session ("chat-9", never ended) stores 6 blocks, then the tester runs with `workflow_end`: w1 ends.
- Five more one-shot workflows store 30 blocks: now w1's blocks, retired, go before the session's older but active
  blocks; LRU would evict the session's blocks before w1's newer ones.
- Last, the newest request's prompt again with garbage hints (`{"workflow": 7, ...}`): no hint at all, so it hits
  like any request and the daemon's hint counters do not move.
Everything is asserted from the daemon's own listing of its keys (`kvstore ls`'s `list` op) and its workflow stats.

`pool.eviction: workflow` is what the survival assertions need (marked POLICY): where the daemon does not have that
policy the test runs LRU and asserts LRU's outcome instead (set KVSTORE_TEST_EVICTION=lru to see it either way).
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.policy import POLICIES
from tests.conftest import DaemonProc
from tests.engine_guard import engine_missing

pytestmark = pytest.mark.vllm

try:  # the engine runs in another process, which needs vLLM in this interpreter's environment
    import vllm  # noqa: F401
except Exception as e:  # noqa: BLE001 - any import failure means: no engine here
    engine_missing("vllm", e)

ROOT = Path(__file__).resolve().parents[2]
BUILD = str(ROOT / "tests" / "vllm_engine_run.py")
RUN = str(ROOT / "tests" / "connectors" / "workflow_engine_run.py")
ENV = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
       "TOKENIZERS_PARALLELISM": "false", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
# POLICY: the workflow policy when the daemon has it; KVSTORE_TEST_EVICTION=lru runs the LRU contrast.
EVICTION = os.environ.get("KVSTORE_TEST_EVICTION") or ("workflow" if "workflow" in POLICIES else "lru")
_RNG = random.Random(14)
SHARED = [_RNG.randrange(4, 1024) for _ in range(128)]          # w1's shared prefix: 4 blocks


def tokens(n: int) -> list[int]:
    return [_RNG.randrange(4, 1024) for _ in range(n)]


def agent(name: str, step: int, nxt: list[str], end: bool = False) -> dict:
    params = {"workflow": "w1", "workflow_type": "codegen", "agent": name, "step": step, "next": nxt}
    return {"tokens": SHARED + tokens(72), "kv_transfer_params": {**params, "workflow_end": True} if end else params}


def batch(i: int) -> dict:
    """A one-shot workflow: another workflow's traffic, retired as soon as its request is done."""
    return {"tokens": tokens(200), "kv_transfer_params": {"workflow": f"batch-{i}", "workflow_type": "batch",
                                                          "agent": "summarizer", "workflow_end": True}}


def run_engine(model: str, daemon: DaemonProc, steps: list[dict], log: Path) -> tuple[list[dict], dict[str, dict]]:
    with open(log, "w") as out:
        argv = [sys.executable, RUN, model, daemon.socket, "{}", json.dumps(steps)]
        rc = subprocess.run(argv, env=ENV, stdout=out, stderr=subprocess.STDOUT, timeout=300).returncode
    text = log.read_text(errors="replace")
    lines = text.splitlines()
    results = [json.loads(x[len("RESULT "):]) for x in lines if x.startswith("RESULT ")]
    checks = {c["name"]: c for c in (json.loads(x[len("CHECK "):]) for x in lines if x.startswith("CHECK "))}
    assert rc == 0 and len(results) + len(checks) == len(steps), f"engine failed ({rc}):\n{text[-4000:]}"
    return results, checks


def held(check: dict, keys: list[str]) -> int:
    return len(set(keys) & set(check["keys"]))


def test_an_active_workflow_survives_other_traffic_and_goes_first_once_ended(tmp_path, start_daemon):
    model = str(tmp_path / "llama")
    subprocess.run([sys.executable, BUILD, "build", model, "14"], check=True, env=ENV, capture_output=True,
                   timeout=120)
    daemon = start_daemon(capacity="1MiB", segment="1MiB", env={"KVSTORE_POOL_EVICTION": EVICTION})
    planner, coder = agent("planner", 1, ["coder"]), agent("coder", 2, ["tester"])
    tester = agent("tester", 3, [], end=True)
    chat = {"tokens": tokens(200), "kv_transfer_params": {"session": "chat-9", "agent": "assistant"}}
    last = batch(10)
    garbage = {"tokens": last["tokens"], "kv_transfer_params": {"workflow": 7, "agent": ["x"], "step": "3"}}
    steps = [planner, coder, *[batch(i) for i in range(6)], {"check": "pressure"},
             chat, tester, *[batch(i) for i in range(6, 10)], last, {"check": "after_end"},
             garbage, {"check": "garbage"}]
    results, checks = run_engine(model, daemon, steps, tmp_path / "engine.log")
    r_planner, r_coder, *r_batch1, r_chat, r_tester = results[:10]
    r_last, r_garbage = results[-2:]
    w1_before = r_planner["keys"] + r_coder["keys"][4:]          # the shared prefix, the planner's and the coder's
    w1 = w1_before + r_tester["keys"][4:]
    assert r_planner["keys"][:4] == r_coder["keys"][:4] == r_tester["keys"][:4]      # one prefix, three agents
    assert len(set(w1)) == 10
    # the coder's request hit the planner's prefix in the daemon: hints never cost a hit
    assert r_planner["num_cached_tokens"] == 0 and r_coder["num_cached_tokens"] == 128
    pressure, after = checks["pressure"], checks["after_end"]
    assert len(pressure["keys"]) == len(after["keys"]) == 32                       # the pool is full both times
    assert held(after, r_last["keys"]) == 6                                         # the newest request's blocks
    if EVICTION == "workflow":                                                      # POLICY
        assert held(pressure, w1_before) == 8            # 36 batch blocks later, the active workflow's 8 are all held
        assert r_tester["num_cached_tokens"] == 128      # so the tester hits the shared prefix
        assert held(after, w1) == 0                      # ended: w1's 10 blocks went first...
        assert held(after, r_chat["keys"]) == 6          # ...before the active session's older blocks
        assert after["workflows"]["blocks"] == {"retired": 26, "active": 6}    # the daemon's own count agrees
    else:                                                # LRU: the oldest blocks go, whoever needs them next
        assert held(pressure, w1_before) < 8
        assert r_tester["num_cached_tokens"] < 128
        assert held(after, r_chat["keys"]) < 6
    books = after["workflows"]                           # the daemon's books (hints, issue 14 part 1)
    assert books["active"] == 1                          # the chat session; w1 and the 11 batches ended
    assert books["retired_by"]["ended"] == 12 and books["ignored"] == {}   # every context named an active workflow
    # garbage hints are no hints: the request hits as any other, and the daemon heard nothing of it
    assert r_garbage["num_cached_tokens"] == 192 and r_garbage["output"] == r_last["output"]
    later = checks["garbage"]["workflows"]
    assert later["hints"] == books["hints"] and later["ignored"] == {}
    print(f"\n{EVICTION}: w1 blocks held under pressure {held(pressure, w1_before)}/8, after its end "
          f"{held(after, w1)}/10; the session's {held(after, r_chat['keys'])}/6; tester hit "
          f"{r_tester['num_cached_tokens']} tokens")
