"""kill -9 cycles against an oracle: a daemon with an SSD tier (write-through, sync=always) is killed at a random
moment while clients put, delete and get blocks, restarted on the same directory, and read back whole. No block
is ever served with bytes other than its own, no delete acknowledged before the kill comes back, and no block
durable before the kill goes missing (tests/oracle.py): acknowledged, then the SSD tier seen settled; or a put
answered `durable`; or a write-through put older than a watermark the daemon's stats showed (its oldest pending
write). Each restarted daemon is checked once its SSD scan is done, or as soon as it answers with the oracle's
CHECK_BEFORE_SCAN switch (for when lookups see the disk during the scan).

KVSTORE_KILL9_CYCLES sets the number of kills (20 here; `make stress` runs 1000)."""
from __future__ import annotations

import os
import random
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import DaemonProc
from tests.crash_load import UNIVERSE, Killer, Load, start, verify
from tests.oracle import DELETED, PRESENT, Oracle

CYCLES = int(os.environ.get("KVSTORE_KILL9_CYCLES", "20"))
pytestmark = pytest.mark.timeout(300 + 6 * CYCLES)    # a few seconds a cycle on a busy machine


def test_kill_9_cycles_never_serve_wrong_bytes_resurrect_deletes_or_lose_durable_blocks(
        tmp_path: Path, daemons: list[DaemonProc]) -> None:
    ssd_dir = str(tmp_path / "ssd")
    oracle = Oracle()
    rng = random.Random(int(os.environ.get("KVSTORE_KILL9_SEED", "1309")))
    cut = 0.0
    seen: Counter[str] = Counter()
    killed: DaemonProc | None = None
    for life in range(CYCLES):
        d = start(ssd_dir, daemons)
        # after each restart: every promise the last kill could test
        failures = verify(d, oracle, cut)
        assert not failures, f"after kill {life}: " + "\n".join(failures[:10]) + _evidence(killed, d)
        seen.update(oracle.expect(k, cut) for k in UNIVERSE)
        # then load until the kill: at a random moment, or right after an acknowledged delete
        assert d.proc is not None
        killer = Killer(d.proc.pid, after_delete=rng.random() < 0.3)
        load = Load(d, life, oracle, rng, killer)
        wrong = load.run(rng.uniform(0.2, 0.7), checkpoints=rng.choice((0, 1, 1, 2)), then=killer.fire)
        assert not wrong, "\n".join(wrong[:10])
        d.proc.wait()
        d.stop()
        cut, killed = killer.cut, d
    d = start(ssd_dir, daemons)
    failures = verify(d, oracle, cut)
    assert not failures, "after the last kill: " + "\n".join(failures[:10]) + _evidence(killed, d)
    # the kills tested something: blocks that had to survive them and deletes that had to stay deleted
    assert seen[PRESENT] and seen[DELETED], f"expectations over all restarts: {dict(seen)}"


def _evidence(killed: DaemonProc | None, restarted: DaemonProc) -> str:
    """What the killed daemon logged above info, and the restarted one's SSD counters: for a failure's message."""
    lines = [ln for ln in killed.read_log().splitlines() if " WARNING " in ln or " ERROR " in ln] if killed else []
    with restarted.client() as c:
        ssd = c.stats()["tiers"][1]["counters"]
    return f"\nkilled daemon's warnings: {lines[-20:]}\nrestarted daemon's SSD counters: {ssd}"
