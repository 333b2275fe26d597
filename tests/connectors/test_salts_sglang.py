"""Salts separate tenants through SGLang too (issue 13 part 7): real SGLang engine processes (CPU, a tiny random
Llama, HiCache writing through to kvstore, page size 4) send the same 300 prompt tokens under per-request
`cache_salt`s. SGLang seeds the storage hash chain of a request with its extra key and salt (`storage_namespace_seed`
in sglang.srt.mem_cache.utils), and the backend keys pages by those hashes, so a fresh engine never finds another
salt's pages in the daemon and does find its own salt's. Runs in .venv-sglang (tests/setup_sglang_env.sh)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engine_guard import engine_missing
from tests.sglang_engine_run import engine_env

pytestmark = pytest.mark.sglang

try:
    import sglang  # noqa: F401
except Exception as e:  # noqa: BLE001 - any import failure means: no SGLang here
    engine_missing("sglang", e)

ROOT = Path(__file__).resolve().parents[2]
BUILD = str(ROOT / "tests" / "sglang_engine_run.py")
RUN = str(ROOT / "tests" / "connectors" / "salted_sglang_run.py")
PAGES = 74                 # full pages of a 300-token prompt written through (the last one is always computed)
HIT = 296


def test_cache_salts_never_hit_each_other_through_the_daemon(daemon, tmp_path):
    env = engine_env(str(tmp_path))
    model = str(tmp_path / "llama")
    subprocess.run([sys.executable, BUILD, "build", model], env=env, check=True, capture_output=True, timeout=120)

    def engine(name: str, salt: str, *args: str) -> dict:
        log = tmp_path / f"{name}.log"
        with open(log, "w") as out:
            rc = subprocess.run([sys.executable, RUN, "run", model, daemon.socket, "300", *args],
                                env={**env, "KVSTORE_TEST_CACHE_SALT": salt}, stdout=out, stderr=subprocess.STDOUT,
                                timeout=240).returncode
        text = log.read_text(errors="replace")
        results = [line for line in text.splitlines() if line.startswith("RESULT ")]
        assert rc == 0 and results, f"engine {name} failed ({rc}):\n{text[-4000:]}"
        return json.loads(results[-1][len("RESULT "):])

    a = engine("a", "tenant-a", "--expect-blocks", str(PAGES))
    assert a["cached"] == 0
    b = engine("b", "tenant-b", "--expect-blocks", str(2 * PAGES))   # a fresh engine, the same tokens, salt b
    assert b["cached"] == 0, "a request hit another salt's pages"
    with daemon.client() as c:
        [row] = c.list()["namespaces"]
    assert row["blocks"] >= 2 * PAGES                  # both salts' pages, none shared
    again = engine("a2", "tenant-a")                   # a fresh engine, salt a again: from the daemon
    assert (again["cached"], again["output"]) == (HIT, a["output"])
    print(f"\ncached tokens: salt a {a['cached']}, salt b {b['cached']}, salt a again {again['cached']}")
