"""The remote tier (Mooncake Store) with real vLLM engines: daemons of two "nodes" share one real mooncake_master, and
the engine on node B gets node A's prefix from the store, with the same greedy output as a recompute.

Each daemon has its own socket, host pool and store segment (tests/mooncake_master.py: the master's env), placement
`both` (every committed block is written through to the store at once). Node B's daemon starts empty: a hit there can
only come from the store. A third daemon serving another model (same architecture, same geometry, same prompt, so
the same block hashes) must not hit A's blocks: only the namespace tells them apart, and it is part of the store key.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import DaemonProc
from tests.connectors.test_vllm_connector import HIT, models, run_engine, step  # noqa: F401 - models: a fixture
from tests.mooncake_master import MooncakeMaster, master_binary

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake]

BLOCKS = HIT // 32          # the prompt's full blocks (200 tokens in blocks of 32: 6; the 7th is always computed)


@pytest.fixture
def master(tmp_path: Path) -> Iterator[MooncakeMaster]:
    if master_binary() is None:     # a failure where the run requires mooncake (tests/engine_guard.py)
        pytest.skip("mooncake is not installed: no mooncake_master for the remote tier "
                    "(pip install 'kvstore[mooncake]')")
    (tmp_path / "master").mkdir()
    m = MooncakeMaster(str(tmp_path / "master")).start()
    yield m
    m.stop()


def remote(d: DaemonProc) -> tuple[dict, dict]:
    """(the daemon's counters, its remote tier's stats)."""
    with d.client() as c:
        s = c.stats()
    tiers = [t for t in s["tiers"] if t.get("tier") == "remote"]
    assert len(tiers) == 1, s["tiers"]
    return s["counters"], tiers[0]


def wait_for(d: DaemonProc, what: str, ok: Any, timeout: float = 60.0) -> tuple[dict, dict]:
    deadline = time.monotonic() + timeout
    while True:
        counters, tier = remote(d)
        if ok(counters, tier):
            return counters, tier
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {timeout} s\ncounters {counters}\nremote tier {tier}\n"
                                 f"daemon log:\n{d.read_log()[-4000:]}")
        time.sleep(0.1)


def linked(d: DaemonProc) -> None:
    """Until the daemon's remote tier is connected to the store (its link thread connects after the start)."""
    wait_for(d, "remote tier up", lambda c, t: t["up"])


def test_node_b_gets_node_a_prefix_from_the_store(models: tuple[str, str], tmp_path: Path,  # noqa: F811
                                                  start_daemon: Any, master: MooncakeMaster) -> None:
    m1, m2 = models
    env = master.env(KVSTORE_REMOTE_PLACEMENT="both")
    node_a, node_b, node_c = (start_daemon(capacity="64MiB", segment="1MiB", env=env) for _ in range(3))
    for d in (node_a, node_b, node_c):
        linked(d)

    # node A: a recompute (nothing anywhere yet); its 6 full blocks are stored in A and written through to the store
    (a,), _ = run_engine(m1, node_a, [step()], tmp_path / "a.log")
    assert a["num_cached_tokens"] == 0
    a_counters, a_tier = wait_for(node_a, "A's blocks put in the store",
                                  lambda c, t: t["blocks_put_here"] >= BLOCKS
                                  and t["counters"].get("written_through", 0) >= BLOCKS)
    assert a_tier["counters"].get("puts", 0) >= BLOCKS, a_tier
    assert a_counters["hits_remote"] == 0, a_counters

    # node B, empty: the lookup finds the prefix in the store, the blocks are read from it into B's host pool
    (b,), b_log = run_engine(m1, node_b, [step()], tmp_path / "b.log")
    b_counters, b_tier = remote(node_b)
    assert b["num_cached_tokens"] == HIT, (b, b_counters, b_tier, node_b.read_log()[-4000:])
    assert b["output"] == a["output"], "node B's output from the store's KV is not the recompute's"
    assert b_counters["hits_remote"] >= BLOCKS, b_counters
    assert b_tier["counters"].get("gets", 0) >= BLOCKS, b_tier
    assert b_tier["counters"].get("crc_mismatch", 0) == 0, b_tier

    # node C, another model on the same prompt: the same block hashes, another namespace: no hit from A's blocks
    (c,), _ = run_engine(m2, node_c, [step()], tmp_path / "c.log")
    c_counters, c_tier = remote(node_c)
    assert c["num_cached_tokens"] == 0, (c, c_counters, c_tier)
    assert c_counters["hits_remote"] == 0, c_counters
    assert c_tier["counters"].get("gets", 0) == 0, c_tier
    assert c["output"] != a["output"]
    print(f"\nA {a}\nA remote {a_tier['counters']}\nB {b}\nB counters hits_remote={b_counters['hits_remote']} "
          f"remote {b_tier['counters']}\nC {c}\nC remote {c_tier['counters']}")
