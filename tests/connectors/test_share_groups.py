"""Share groups end to end (issue 18 part 1, ICaRus §3): models whose KV-producing weights are identical produce
identical KV for the same tokens, so engines of different models that declare one group (vLLM's
`kv_connector_extra_config: {"group": ...}`) serve each other's prefixes from the daemon.

Three tiny random Llamas of one geometry, made here:
- A (seed 3);
- B: A's weights with its own output head: `lm_head` (untied from the embeddings) and the final norm re-drawn. Every
  weight that any layer's K or V depends on (embeddings, every layer's norms, projections and MLPs) is A's, so B's KV
  equals A's for the same tokens while its greedy outputs differ;
- C (seed 4): other weights, the same geometry.

Real vLLM engines (CPU, fresh processes, local prefix caching off: every hit comes through the connector), one
daemon: A in group g1 stores a prompt's blocks; B in group g1 — another model name (the connector names the model by
its path) — loads A's prefix and generates exactly what B computes alone (B without any daemon); C in its default
group (its own model name) never hits. Then `kvstore ls --json` shows group g1 and the two models that used it.

vLLM's block hashes hold nothing model-specific (vllm/v1/core/kv_cache_utils.py `hash_block_tokens`: the parent
hash, the block's tokens and extra keys for LoRA, multimodal inputs, cache_salt and prompt embeddings; the first
parent, NONE_HASH, comes from a fixed seed for sha256_cbor): the connector's namespace alone (group or model,
kvstore/protocol/keys.py) decides whether two models meet."""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import DaemonProc
from tests.engine_guard import engine_missing

pytestmark = pytest.mark.vllm

try:  # the engine runs in another process, which needs vLLM in this interpreter's environment
    import vllm  # noqa: F401
except Exception as e:  # noqa: BLE001 - any import failure means: no engine here
    engine_missing("vllm", e)

ROOT = Path(__file__).resolve().parents[2]
RUN = str(ROOT / "tests" / "vllm_engine_run.py")
_RNG = random.Random(18)
PROMPT = [_RNG.randrange(4, 1024) for _ in range(4 * 32 + 2)]   # 4 full blocks of 32 and 2 tokens
HIT_BLOCKS = 4
HIT = HIT_BLOCKS * 32
GROUP = "g1"
ENV = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
       "TOKENIZERS_PARALLELISM": "false", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
HEAD = ("lm_head.weight", "model.norm.weight")   # what B re-draws: nothing any layer's K or V depends on


def build_models(tmp: Path) -> tuple[str, str, str]:
    """A and C by tests/vllm_engine_run.py (seeds 3 and 4); B = A's directory with a new head."""
    from safetensors.numpy import load_file, save_file

    a, b, c = (str(tmp / name) for name in ("model-a", "model-b", "model-c"))
    subprocess.run([sys.executable, RUN, "build", a, "3", c, "4"], check=True, env=ENV, capture_output=True,
                   timeout=120)
    assert json.loads(Path(a, "config.json").read_text())["tie_word_embeddings"] is False   # lm_head is its own
    shutil.copytree(a, b)
    import numpy as np

    weights = load_file(os.path.join(a, "model.safetensors"))
    rng = np.random.default_rng(1018)
    head = {name: rng.normal(0.0, 0.08, weights[name].shape).astype(weights[name].dtype) for name in HEAD}
    save_file({**weights, **head}, os.path.join(b, "model.safetensors"), metadata={"format": "pt"})
    # the fixtures are what they claim: B shares every KV-producing tensor with A, C none
    wa, wb, wc = (load_file(os.path.join(d, "model.safetensors")) for d in (a, b, c))
    assert wa.keys() == wb.keys() == wc.keys()
    for name in wa:
        assert np.array_equal(wa[name], wb[name]) == (name not in HEAD), name
        assert not np.array_equal(wa[name], wc[name]), name
    return a, b, c


def launch(model: str, socket: str, extra: dict[str, Any], log: Path) -> subprocess.Popen:
    """One engine process (vllm_engine_run.py: kvstore's connector, `extra` merged into its extra config), one greedy
    request of PROMPT; it starts now and `collect` reads its result."""
    steps = [{"tokens": PROMPT, "max_tokens": 8, "wait": None}]
    argv = [sys.executable, RUN, "run", "--model", model, "--socket", socket, "--steps", json.dumps(steps),
            "--extra", json.dumps(extra)]
    with open(log, "w") as out:
        return subprocess.Popen(argv, env=ENV, stdout=out, stderr=subprocess.STDOUT)


def collect(proc: subprocess.Popen, log: Path) -> dict[str, Any]:
    """The engine's result (output token ids and num_cached_tokens: tokens loaded from the daemon), once it exits."""
    try:
        rc = proc.wait(300)
    finally:
        proc.kill()
    text = log.read_text(errors="replace")
    results = [json.loads(line[len("RESULT "):]) for line in text.splitlines() if line.startswith("RESULT ")]
    assert rc == 0 and len(results) == 1, f"engine failed ({rc}):\n{text[-4000:]}"
    return results[0]


def run_engine(model: str, socket: str, extra: dict[str, Any], log: Path) -> dict[str, Any]:
    return collect(launch(model, socket, extra, log), log)


def block_hits(daemon: DaemonProc) -> int:
    with daemon.client() as c:
        return int(c.stats()["counters"]["hits"])


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The three models, one daemon and four engine runs, in this order: A (g1), B (g1), B alone (no daemon),
    C (its default group); the daemon's block hits after each run that talks to it."""
    tmp = tmp_path_factory.mktemp("share-groups")
    a, b, c = build_models(tmp)
    daemon = DaemonProc(capacity="64MiB", segment="1MiB")
    try:
        daemon.start()
        out: dict[str, Any] = {"models": (a, b, c), "daemon": daemon, "tmp": tmp}
        # B's own recompute: no daemon at the configured socket, so the connector serves without it (it touches
        # nothing of the others', so it runs beside A)
        alone = launch(b, str(tmp / "no-daemon.sock"), {}, tmp / "engine-b-alone.log")
        try:
            out["a"] = run_engine(a, daemon.socket, {"group": GROUP}, tmp / "engine-a.log")
        finally:
            out["b_alone"] = collect(alone, tmp / "engine-b-alone.log")
        out["hits_a"] = block_hits(daemon)
        out["b"] = run_engine(b, daemon.socket, {"group": GROUP}, tmp / "engine-b.log")
        out["hits_b"] = block_hits(daemon)
        out["c"] = run_engine(c, daemon.socket, {}, tmp / "engine-c.log")
        out["hits_c"] = block_hits(daemon)
        yield out
    finally:
        daemon.cleanup()


def test_a_group_serves_another_models_prefix_and_nothing_outside_it(shared: dict[str, Any]) -> None:
    a, b, c = shared["models"]
    ra, rb, alone, rc = shared["a"], shared["b"], shared["b_alone"], shared["c"]
    print("\ncached tokens A, B (g1), B alone, C (own group):",
          [r["num_cached_tokens"] for r in (ra, rb, alone, rc)],
          "\noutputs A, B, B alone, C:", [r["output"] for r in (ra, rb, alone, rc)],
          "\nseconds per request:", [r["seconds"] for r in (ra, rb, alone, rc)],
          "\ndaemon block hits after A, B, C:", [shared[k] for k in ("hits_a", "hits_b", "hits_c")])
    assert ra["num_cached_tokens"] == 0 and shared["hits_a"] == 0          # an empty daemon
    # B, another model in A's group, loaded A's prefix: every full block but the one holding the last prompt token
    assert rb["num_cached_tokens"] == HIT
    assert shared["hits_b"] - shared["hits_a"] >= HIT_BLOCKS
    # ... and generated its own model's output: the same token ids as B computing everything itself
    assert alone["num_cached_tokens"] == 0
    assert rb["output"] == alone["output"]
    # the heads differ: A's output is not B's (were B's engine running A's model, the line above could not tell)
    assert ra["output"] != rb["output"]
    # C (other weights, same geometry, its default group = its model name) never hits A's or B's blocks
    assert rc["num_cached_tokens"] == 0
    assert shared["hits_c"] == shared["hits_b"]
    with shared["daemon"].client() as cl:
        rows = cl.list()["namespaces"]
    # A and B share one namespace (the digest holds the group, not the model); C has its own
    g1 = [r for r in rows if r["group"] == GROUP]
    assert len(g1) == 1 and g1[0]["model"] in (a, b) and g1[0]["blocks"] == HIT_BLOCKS, rows
    [own] = [r for r in rows if r["model"] == c]
    assert own["group"] == c and own["blocks"] == HIT_BLOCKS, rows
    assert len(rows) == 2, rows


def test_ls_shows_groups_and_the_models_that_used_them(shared: dict[str, Any]) -> None:
    a, b, c = shared["models"]
    daemon = shared["daemon"]
    cli = [sys.executable, "-m", "kvstore", "--socket", daemon.socket, "ls", "--json"]
    listed = json.loads(subprocess.run(cli, env={**os.environ, "KVSTORE_SERVER_SOCKET": daemon.socket}, check=True,
                                       capture_output=True, text=True, timeout=30).stdout)
    assert "groups" in listed, f"`kvstore ls --json` has no groups: {sorted(listed)}"
    groups = listed["groups"]
    [g1] = [g for g in groups if g["group"] == GROUP]
    assert set(g1["models"]) == {a, b}, g1                                  # both models used g1; C did not
    assert c not in g1["models"]
    assert g1["tenant"] == ""
    assert g1["namespaces"] == 1 and g1["blocks"] == HIT_BLOCKS
    ns = next(r for r in listed["namespaces"] if r["group"] == GROUP)
    assert g1["bytes"] == ns["bytes"] > 0
    assert g1["declared"] is True            # g1 was named in the engines' configuration
    # C's default group is its model name, and C alone used it
    [own] = [g for g in groups if g["group"] == c]
    assert own["models"] == [c] and own["blocks"] == HIT_BLOCKS, own
    assert own["declared"] is False
    # C is in no group with A or B: wherever C's model appears, A's and B's do not
    for g in groups:
        if c in g["models"]:
            assert not {a, b} & set(g["models"]), g
