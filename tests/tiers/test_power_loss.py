"""Power loss, modelled: a daemon with an SSD tier (write-through, sync=always) records every write and sync it
makes (KVSTORE_DISKIO_RECORD) while clients put, delete and get blocks; from that log, the directories a power cut
could leave (tests/power_cut.py: writes not yet synced lost or torn at 4 KiB, files not yet in a synced directory
gone) are rebuilt, and a daemon restarted on each must keep the oracle's promises (tests/oracle.py): no wrong
byte, no delete acknowledged before the cut come back, no block durable before the cut missing.

KVSTORE_POWERLOSS_STATES sets the number of states (20 here; `make stress` runs 200)."""
from __future__ import annotations

import os
import random
import shutil
import signal
from collections import Counter
from pathlib import Path

import pytest

from kvstore.tiers.ssd import diskio
from tests.conftest import DaemonProc
from tests.crash_load import UNIVERSE, Killer, Load, start, verify
from tests.oracle import DELETED, PRESENT, Oracle
from tests.power_cut import cut_at, cut_plan, load, materialize

STATES = int(os.environ.get("KVSTORE_POWERLOSS_STATES", "20"))
pytestmark = pytest.mark.timeout(300 + 5 * STATES)    # a few seconds a state on a busy machine


def test_power_cuts_never_serve_wrong_bytes_resurrect_deletes_or_lose_synced_blocks(tmp_path: Path,
                                                                                  daemons: list[DaemonProc]) -> None:
    rng = random.Random(int(os.environ.get("KVSTORE_POWERLOSS_SEED", "2024")))
    log_path = str(tmp_path / "io.log")
    oracle = Oracle()
    d = start(str(tmp_path / "ssd"), daemons, **{diskio.RECORD_ENV: log_path})
    assert d.proc is not None
    killer = Killer(d.proc.pid)
    wrong = Load(d, 0, oracle, rng, killer).run(1.5, checkpoints=4, then=killer.fire)
    assert not wrong, "\n".join(wrong[:10])
    d.proc.wait()
    entries = load(log_path)
    assert entries, f"the daemon recorded no I/O:\n{d.read_log()[-2000:]}"
    seen: Counter[str] = Counter()
    settles = [end for _, _, end in oracle.settles]
    acks = [op.ack for ops in oracle.ops.values() for op in ops if op.kind == "delete" and op.ack is not None]
    for i, (at, keep) in enumerate(cut_plan(entries, STATES, rng, settles, acks)):
        cut = cut_at(entries, at, rng, keep, end=killer.cut)
        state = str(tmp_path / f"state-{i}")
        materialize(cut, state)
        restarted = start(state, daemons)
        failures = verify(restarted, oracle, cut.time)
        assert not failures, (f"power cut before entry {at} of {len(entries)} (keep {cut.keep}): "
                              + "\n".join(failures[:10]))
        seen.update(oracle.expect(k, cut.time) for k in UNIVERSE)
        _discard(restarted, state)
    # the states tested something: blocks that had to survive and deletes that had to stay deleted
    assert seen[PRESENT] and seen[DELETED], f"expectations over all states: {dict(seen)}"


def _discard(d: DaemonProc, state: str) -> None:
    d.stop(signal.SIGKILL)
    shutil.rmtree(state, ignore_errors=True)
