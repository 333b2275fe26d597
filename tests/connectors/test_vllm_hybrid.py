"""Hybrid models on vLLM's CPU build with its hybrid KV cache manager on, kvstore's connector and a real daemon (issue
35): sliding-window + full attention (Gemma-3-style) and a recurrent state + full attention (LFM2-style: short
convolutions, vLLM's MambaSpec in its align mode), tiny and random, built here.

Engines run in fresh processes (tests/hybrid_engine_run.py). The model's window is 64 tokens, its blocks 32: a
prefix end needs the 2 sliding-window blocks before it (kvstore.connectors.kv_groups), and a save keeps them at
every step end, where the prompt left the chains the daemon held, and (configured here) every 16th block. The checks
are exact: a fresh engine that loads a prefix from kvstore gives the same greedy tokens and the same top-5 logprobs
as a full recompute (an engine that loads nothing, whose own prefix cache has nothing to offer) and as vLLM's own
prefix-cache hit, and a prefix whose sliding-window blocks are gone is never reported as a hit.
"""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.protocol.geometry import Geometry
from kvstore.protocol.keys import NamespaceSpec, block_key
from tests.conftest import DaemonProc
from tests.connectors.test_vllm_connector import ENV, ROOT, Engine, alter_all_blocks
from tests.engine_guard import engine_missing

pytestmark = pytest.mark.vllm

try:
    import vllm  # noqa: F401
except Exception as e:  # noqa: BLE001 - any import failure means: no engine here
    engine_missing("vllm", e)

SCRIPT = str(ROOT / "tests" / "hybrid_engine_run.py")
BLOCK = 32
_RNG = random.Random(35)
P1 = [_RNG.randrange(4, 1024) for _ in range(1000)]             # 31 full blocks
P2 = P1[:700] + [_RNG.randrange(4, 1024) for _ in range(100)]   # shares 21 full blocks (672 tokens) with P1
CHECKPOINT = 16 * BLOCK                                          # a window checkpoint of P1 below 672 tokens
P2B = P1[:700] + [_RNG.randrange(4, 1024) for _ in range(100)]  # another prompt sharing P1's first 700
P3 = P1 + [_RNG.randrange(4, 1024) for _ in range(68)]           # the next turn of a chat that began with P1


def build(tmp_path_factory: pytest.TempPathFactory, arch: str) -> str:
    path = str(tmp_path_factory.mktemp("models") / f"{arch}-tiny")
    subprocess.run([sys.executable, SCRIPT, "build", path, "1", arch], check=True, env=ENV, capture_output=True,
                   timeout=120)
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build(tmp_path_factory, "gemma3")


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build(tmp_path_factory, "lfm2")


def start(model: str, daemon: DaemonProc, steps: list[dict], log: Path, batch: int = 0, own_cache: bool = True,
          **extra: object) -> Engine:
    """An engine process going through `steps`; it starts now, and `results` reads what it says."""
    args = ["--extra", json.dumps(extra), "--batch", str(batch), *([] if own_cache else ["--no-own-cache"])]
    return Engine(model, daemon, steps, log, *args, script=SCRIPT)


def results(e: Engine, n: int) -> list[dict]:
    """The engine's next `n` step results, each from an engine that kept vLLM's hybrid manager on."""
    out = [e.result() for _ in range(n)]
    assert all(r["hybrid_manager"] for r in out)
    return out


def close(e: Engine) -> None:
    """Wait for a clean exit; the connector was never turned off, nor the hybrid manager."""
    try:
        text = e.finish()
    finally:
        e.kill()
    assert "Turning off hybrid kv cache manager" not in text
    assert "kvstore connector disabled" not in text, text[-3000:]


def engine(model: str, daemon: DaemonProc, steps: list[dict], log: Path, **kw: object) -> list[dict]:
    """Run an engine through `steps` and return their results."""
    e = start(model, daemon, steps, log, **kw)
    try:
        out = results(e, len(steps))
    except BaseException:
        e.kill()
        raise
    close(e)
    return out


def step(tokens: list[int], max_tokens: int = 4, wait: Path | None = None, reset: bool = False) -> dict:
    """One prompt; with `wait`, the engine waits for the test first; with `reset`, it empties its own prefix cache
    (what follows runs as in a fresh engine)."""
    return {"tokens": tokens, "max_tokens": max_tokens, "wait": str(wait) if wait else None, "reset": reset}


def same(a: dict, b: dict) -> bool:
    """Same greedy tokens and the same top-5 logprobs at every generated position (to float32 rounding)."""
    if a["output"] != b["output"] or len(a["logprobs"]) != len(b["logprobs"]):
        return False
    for pa, pb in zip(a["logprobs"], b["logprobs"]):
        if [t for t, _ in pa] != [t for t, _ in pb] or any(abs(x - y) > 1e-4 for (_, x), (_, y) in zip(pa, pb)):
            return False
    return True


def block_keys(tokens: list[int]) -> list[bytes]:
    """vLLM's sha256_cbor block hashes of `tokens` (no extra keys), folded to kvstore keys as the connector does."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as ku

    fn = get_hash_fn_by_name("sha256_cbor")
    ku.init_none_hash(fn)
    out, parent = [], None
    for i in range(len(tokens) // BLOCK):
        parent = ku.hash_block_tokens(fn, parent, tokens[i * BLOCK:(i + 1) * BLOCK], None)
        out.append(block_key(bytes(parent)))
    return out


def group_namespaces(daemon: DaemonProc) -> dict[str, dict]:
    with daemon.client() as c:
        return {row["kv_group"]: row for row in c.list()["namespaces"]}


def delete_blocks(daemon: DaemonProc, kind: str, positions: list[int]) -> int:
    """Delete P1's blocks at `positions` from the namespace of the group of `kind` (as the connector opened it)."""
    row = next(r for g, r in group_namespaces(daemon).items() if kind in g)
    rank, size = map(int, row["tp"].split("/"))
    spec = NamespaceSpec(model=row["model"], geometry=Geometry.from_dict(row["geometry"]), adapter=row["adapter"],
                         tp_rank=rank, tp_size=size, role=row["role"], salt=row["salt"])
    keys = block_keys(P1)
    with daemon.client() as c:
        return c.namespace(spec).delete([keys[p] for p in positions])


def test_a_sliding_window_model_restores_exactly_and_never_without_its_window(model, tmp_path, start_daemon):
    daemon = start_daemon(capacity="64MiB", segment="1MiB")
    # the references (a full recompute: no load, no save, vLLM's own cache off) run beside the first engine
    ref = start(model, daemon, [step(P2), step(P2B), step(P3)], tmp_path / "ref.log", own_cache=False, load=False,
                save=False)
    try:
        engine(model, daemon, [step(P1, 8)], tmp_path / "a.log", load=False, window_checkpoint_blocks=16)
        refs = results(ref, 3)
    except BaseException:
        ref.kill()
        raise
    close(ref)
    assert [r["num_cached_tokens"] for r in refs] == [0, 0, 0]
    ref_p2, ref_p2b, ref_p3 = refs
    groups = group_namespaces(daemon)
    assert sorted(groups) == ["0:window64", "1:full"]
    # full attention keeps all 31 blocks of P1; the window group the 2 blocks before block 16 (a checkpoint, as
    # configured) and before block 31 (the step's end): 4 blocks, an eighth of the bytes
    assert groups["1:full"]["blocks"] == 31
    assert groups["0:window64"]["blocks"] == 4

    # P2 shares 21 blocks with P1, but P1's windows are kept only before blocks 16 and 31: 16 blocks restorable.
    # Its engine saves the window before block 21, where P2 left what the daemon held
    (got_p2,) = engine(model, daemon, [step(P2)], tmp_path / "b.log")
    assert got_p2["num_cached_tokens"] == CHECKPOINT
    assert same(got_p2, ref_p2)

    # one engine, then (its own cache emptied) as a fresh one once the windows before blocks 16 and 21 are gone
    gone = tmp_path / "gone"
    e = start(model, daemon, [step(P2B), step(P2B), step(P3), step(P2B, wait=gone, reset=True)], tmp_path / "c.log",
              save=False)
    try:
        got_p2b, own_p2b, got_p3 = results(e, 3)
        assert got_p2b["num_cached_tokens"] == 21 * BLOCK      # the shared prefix, to its last full block
        assert same(got_p2b, ref_p2b)
        assert own_p2b["num_cached_tokens"] > 0 and same(own_p2b, ref_p2b)   # vLLM's own hit agrees
        assert got_p3["num_cached_tokens"] == 31 * BLOCK      # the turn resumes where the last one stopped
        assert same(got_p3, ref_p3)

        # no prefix of P2B is restorable now, though its full blocks are there
        e.wait_point()
        assert delete_blocks(daemon, "window", [14, 15, 19, 20]) == 4
        e.go()
        (lost,) = results(e, 1)
    except BaseException:
        e.kill()
        raise
    close(e)
    assert lost["num_cached_tokens"] == 0
    assert same(lost, ref_p2b)


def test_a_recurrent_state_model_restores_only_where_its_state_was_kept(lfm2, tmp_path, start_daemon):
    daemon = start_daemon(capacity="64MiB", segment="1MiB")
    # the references (no load, no save) run beside the first engine
    ref = start(lfm2, daemon, [step(P2), step(P3)], tmp_path / "ref.log", load=False, save=False)
    try:
        # prefilled in chunks of 512 tokens (vLLM's align mode ends each on a block): the convolution state is kept
        # where the engine computed it, after blocks 16 and 31; never under a key it does not belong to
        engine(lfm2, daemon, [step(P1, 8)], tmp_path / "a.log", batch=512, load=False)
        ref_p2, ref_p3 = results(ref, 2)
    except BaseException:
        ref.kill()
        raise
    close(ref)
    assert ref_p2["num_cached_tokens"] == 0 and ref_p3["num_cached_tokens"] == 0
    groups = group_namespaces(daemon)
    assert sorted(groups) == ["0:state", "1:full"]
    assert (groups["1:full"]["blocks"], groups["0:state"]["blocks"]) == (31, 2)

    # one engine standing for three fresh ones (its own cache emptied before each phase): loads as kept, loads of
    # altered blocks, and loads where the states are gone
    altered, gone = tmp_path / "altered", tmp_path / "gone"
    steps = [step(P2), step(P3), step(P2, wait=altered, reset=True), step(P3), step(P2, wait=gone, reset=True),
             step(P3)]
    e = start(lfm2, daemon, steps, tmp_path / "b.log", save=False)
    try:
        got_p2, got_p3 = results(e, 2)
        assert got_p2["num_cached_tokens"] == CHECKPOINT      # between two states: the one before (block 16)
        assert same(got_p2, ref_p2)
        assert got_p3["num_cached_tokens"] == 31 * BLOCK
        assert same(got_p3, ref_p3)

        # every stored block altered behind the daemon's back: the loads fail their checks, and the engine (which
        # takes a load error of a hybrid model only per request) recomputes the requests from their start, exactly
        e.wait_point()
        assert alter_all_blocks(daemon, lfm2) == 33
        e.go()
        bad_p2, bad_p3 = results(e, 2)
        assert "does not match its checksum" in e.read_log()
        assert same(bad_p2, ref_p2) and same(bad_p3, ref_p3)

        e.wait_point()
        assert delete_blocks(daemon, "state", [15, 30]) == 2  # the attention KV is all there, the states are not
        e.go()
        lost_p2, lost_p3 = results(e, 2)
    except BaseException:
        e.kill()
        raise
    close(e)
    assert (lost_p2["num_cached_tokens"], lost_p3["num_cached_tokens"]) == (0, 0)
    assert same(lost_p2, ref_p2) and same(lost_p3, ref_p3)
