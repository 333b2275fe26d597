"""Salts separate tenants (issue 13 part 7): a real vLLM engine (CPU, a tiny random Llama) sends the same prompt
tokens under different per-request `cache_salt`s; the connector's keys must differ, so a request never hits
another salt's blocks in the daemon, while the same salt again does. (Users of other systems report cross-tenant
hits where the external cache keyed blocks by tokens alone and dropped the salt.)

vLLM folds `cache_salt` into the extra keys of a request's first block, and block hashes are chained, so every
block hash of a salted request differs; the connector keys blocks by those hashes (connectors/vllm_connector.py,
`_hashes`). Local prefix caching is off in the engine: every hit comes through the connector."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import DaemonProc
from tests.engine_guard import engine_missing

pytestmark = pytest.mark.vllm

try:  # the engine runs in another process, which needs vLLM in this interpreter's environment
    import vllm  # noqa: F401
except Exception as e:  # noqa: BLE001 - any import failure means: no engine here
    engine_missing("vllm", e)

ROOT = Path(__file__).resolve().parents[2]
BUILD = str(ROOT / "tests" / "vllm_engine_run.py")
RUN = str(ROOT / "tests" / "connectors" / "salted_engine_run.py")
_RNG = random.Random(11)
PROMPT = [_RNG.randrange(4, 1024) for _ in range(200)]     # (one generator: not one token 200 times)
HIT = 192          # 6 blocks of 32; the 7th holds the last prompt token
ENV = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
       "TOKENIZERS_PARALLELISM": "false", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def run_engine(model: str, daemon: DaemonProc, salts: list[str | None], log: Path) -> list[dict]:
    """One engine process, one greedy request per salt (same tokens every time); each request's result."""
    steps = [{"tokens": PROMPT, "max_tokens": 8, "wait": None, "cache_salt": s} for s in salts]
    with open(log, "w") as out:
        argv = [sys.executable, RUN, "run", "--model", model, "--socket", daemon.socket, "--steps", json.dumps(steps)]
        rc = subprocess.run(argv, env=ENV, stdout=out, stderr=subprocess.STDOUT, timeout=300).returncode
    text = log.read_text(errors="replace")
    results = [json.loads(line[len("RESULT "):]) for line in text.splitlines() if line.startswith("RESULT ")]
    assert rc == 0 and len(results) == len(salts), f"engine failed ({rc}):\n{text[-4000:]}"
    return results


def test_cache_salts_never_hit_each_other_and_the_same_salt_hits(tmp_path, start_daemon):
    model = str(tmp_path / "llama")
    subprocess.run([sys.executable, BUILD, "build", model, "3"], check=True, env=ENV, capture_output=True,
                   timeout=120)
    daemon = start_daemon(capacity="64MiB", segment="1MiB")
    a1, b1, a2, plain, b2 = run_engine(model, daemon, ["tenant-a", "tenant-b", "tenant-a", None, "tenant-b"],
                                       tmp_path / "engine.log")
    assert a1["num_cached_tokens"] == 0                  # an empty daemon
    assert b1["num_cached_tokens"] == 0                  # the same tokens under another salt: no hit
    assert a2["num_cached_tokens"] == HIT                # the first salt again: its 6 blocks
    assert plain["num_cached_tokens"] == 0               # no salt is a salt of its own
    assert b2["num_cached_tokens"] == HIT
    assert a1["output"] == b1["output"] == a2["output"] == plain["output"] == b2["output"]   # same KV, greedy
    with daemon.client() as c:
        [row] = c.list()["namespaces"]                   # one model, one namespace: only the keys differ
        assert row["blocks"] == 3 * 6                    # three salts' blocks, none shared
        listed = c.list(ns=row["id"], limit=100)["keys"]
    assert len({bytes(k) for k, _ in listed}) == 18
    print("\ncached tokens: salt a, salt b, salt a again, no salt, salt b again:",
          [r["num_cached_tokens"] for r in (a1, b1, a2, plain, b2)])
