"""The vLLM connector asks for durability (issue 19): a request's saves go to the daemon's SSD tier at once when the
request asks for it (`kv_transfer_params: {"kvstore_durable": true}`) or the configuration does (`durable: true`),
while the daemon's write-through is off — so nothing else would write them before an eviction. One real vLLM engine
process (CPU, a tiny random Llama) per configuration, a real daemon."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import DaemonProc, ssd_settled
from tests.engine_guard import engine_missing

pytestmark = pytest.mark.vllm

try:
    import vllm  # noqa: F401
except Exception as e:  # noqa: BLE001 - any import failure means: no engine here
    engine_missing("vllm", e)

ROOT = Path(__file__).resolve().parents[2]
RUN = str(ROOT / "tests" / "connectors" / "workflow_engine_run.py")     # steps with kv_transfer_params
BUILD = str(ROOT / "tests" / "vllm_engine_run.py")
ENV = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
       "TOKENIZERS_PARALLELISM": "false", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
BLOCKS = 6                  # a 200-token prompt in blocks of 32: 6 full blocks saved (the 7th holds the last token)


def prompt(seed: int) -> list[int]:
    return [random.Random(seed).randrange(4, 1024) for _ in range(200)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("models") / "llama")
    subprocess.run([sys.executable, BUILD, "build", path, "1"], check=True, env=ENV, capture_output=True, timeout=120)
    return path


def run_engine(model: str, daemon: DaemonProc, extra: dict, steps: list[dict]) -> list[dict]:
    p = subprocess.run([sys.executable, RUN, model, daemon.socket, json.dumps(extra), json.dumps(steps)], env=ENV,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return [json.loads(line[len("RESULT "):]) for line in p.stdout.splitlines() if line.startswith("RESULT ")]


def ssd_blocks(daemon: DaemonProc) -> dict:
    with daemon.client() as c:
        s = ssd_settled(c)
    return {"ssd": s["tiers"][1]["blocks"], "host": s["tiers"][0]["blocks"],
            "written": s["write_through"]["settled"].get("written", 0)}


def test_a_request_asking_for_durability_has_its_blocks_written_to_ssd(model, tmp_path, start_daemon):
    daemon = start_daemon(capacity="64MiB", segment="1MiB", env={"KVSTORE_SSD_DIR": str(tmp_path / "ssd")})
    steps = [{"tokens": prompt(1)},                                           # no ask: host pool only
             {"tokens": prompt(2), "kv_transfer_params": {"kvstore_durable": True}}]
    results = run_engine(model, daemon, {}, steps)
    assert len(results) == 2
    # both requests' blocks are stored; only the second one's went to disk (write-through is off)
    assert ssd_blocks(daemon) == {"ssd": BLOCKS, "host": 2 * BLOCKS, "written": BLOCKS}


def test_the_durable_configuration_writes_every_save_to_ssd(model, tmp_path, start_daemon):
    daemon = start_daemon(capacity="64MiB", segment="1MiB", env={"KVSTORE_SSD_DIR": str(tmp_path / "ssd")})
    results = run_engine(model, daemon, {"durable": True, "durable_wait_s": 2}, [{"tokens": prompt(3)}])
    assert len(results) == 1
    assert ssd_blocks(daemon) == {"ssd": BLOCKS, "host": BLOCKS, "written": BLOCKS}
    with daemon.client() as c:        # the step waited for the disk: its commit's answer was counted as durable
        assert c.stats()["write_through"]["settled"].get("answer.durable", 0) >= 1
