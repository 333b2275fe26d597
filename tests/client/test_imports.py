"""A client process imports nothing of the daemon: the client, its asyncio flavour and the connectors' modules load
no daemon-side package (daemon, index, tiers, movers, traffic, policy) and not PyYAML. Each import runs in a fresh
interpreter, whose `sys.modules` is then checked.

The engine connectors (vLLM, SGLang) are checked only where their engine imports: the engine itself, and the engine
modules the connector imports, are loaded first and what they bring in is not held against kvstore."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DAEMON_SIDE = ("kvstore.daemon", "kvstore.index", "kvstore.tiers", "kvstore.movers", "kvstore.traffic",
               "kvstore.policy", "yaml")

PROBE = """
import importlib, json, sys
engine, statement, forbidden = sys.argv[1], sys.argv[2], tuple(sys.argv[3].split(","))
def loaded():
    return {m for m in sys.modules if any(m == f or m.startswith(f + ".") for f in forbidden)}
if engine:
    try:
        for name in engine.split(","):
            importlib.import_module(name)
    except ImportError as e:
        print(json.dumps({"skip": f"{type(e).__name__}: {e}"}))
        sys.exit(0)
before = loaded()
exec(statement)
print(json.dumps({"leaked": sorted(loaded() - before), "kvstore": sys.modules["kvstore"].__file__}))
"""


def probe(statement: str, engine: str = "") -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, engine, statement, ",".join(DAEMON_SIDE)], cwd=ROOT,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, f"`{statement}` failed:\n{out.stderr[-4000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("statement", [
    "import kvstore",
    "from kvstore import Client, AsyncClient, KVStoreError, Geometry, NamespaceSpec, chain_hashes",
    "import kvstore.protocol",
    "import kvstore.client",
    "import kvstore.client.aio",
    "import kvstore.connectors.kv_pages",
    "import kvstore.connectors.daemon_link",
    "import kvstore.connectors.vllm_layout",
])
def test_client_side_imports_load_nothing_of_the_daemon(statement):
    result = probe(statement)
    assert result["leaked"] == [], f"`{statement}` loads daemon-side modules: {', '.join(result['leaked'])}"
    assert Path(result["kvstore"]).resolve().parent == ROOT / "kvstore"     # this tree's kvstore, not another


# engine-dependent connectors: (statement, the engine modules the connector imports at its top)
ENGINE_CONNECTORS = {
    "vllm": ("import kvstore.connectors.vllm_connector", "vllm,vllm.distributed.kv_transfer.kv_connector.v1.base"),
    "sglang": ("import kvstore.connectors.sglang_backend", "sglang,torch,sglang.srt.mem_cache.hicache_storage"),
    "forkkv": ("import kvstore.connectors.forkkv_reference", "torch,numpy"),
}


@pytest.mark.parametrize("engine", sorted(ENGINE_CONNECTORS))
def test_engine_connectors_load_nothing_of_the_daemon(engine):
    statement, engine_modules = ENGINE_CONNECTORS[engine]
    result = probe(statement, engine_modules)
    if "skip" in result:
        pytest.skip(f"{engine} does not import here ({result['skip']})")
    assert result["leaked"] == [], f"`{statement}` loads daemon-side modules: {', '.join(result['leaked'])}"


def test_the_probe_sees_a_leak():
    """The check itself: an import that does load the daemon is caught, and named."""
    result = probe("import kvstore.client, kvstore.daemon.config")
    assert "kvstore.daemon" in result["leaked"] and "yaml" in result["leaked"], result
