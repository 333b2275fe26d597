"""Deletes in the SSD record store stay deleted: a superseded copy of a key is wiped too, and a delete made while
the restart scan runs wins over a copy the scan has not reached yet. (Durability across kill -9 and power loss:
tests/daemon/test_kill9.py and tests/tiers/test_power_loss.py.)"""
from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from kvstore.tiers.ssd.store import SsdStore
from tests.tiers.ssd_blocks import NS, RECORD, gate_restart, h, payload, read


@pytest.fixture
def ssd_dir(tmp_path: Path) -> str:
    return str(tmp_path / "ssd")


def test_a_superseded_copy_never_brings_a_deleted_key_back(ssd_dir: str) -> None:
    s = SsdStore(ssd_dir, 64 * RECORD, sync="always").open()
    assert s.put_many([(NS, h(1), payload(1, 0))]) == 1
    assert s.put_many([(NS, h(1), payload(1, 1))]) == 1      # a newer copy: the first record is superseded
    assert read(s, 1) == payload(1, 1)
    assert s.delete(NS, h(1))
    s.close()
    s = SsdStore(ssd_dir, 64 * RECORD).open()                  # a restart finds neither copy
    assert read(s, 1) is None and not s.index
    s.close()


@pytest.mark.parametrize("maps", [False, True], ids=["full-scan", "record-map"])
def test_a_delete_during_the_scan_beats_the_copy_the_scan_finds_later(ssd_dir: str, maps: bool,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a record map (a directory written before them) a delete during the scan waits for it, so that the
    copy the scan has not reached is wiped before the delete is reported. With the map every copy is known from
    the start: the delete wipes them at once and does not wait for the validation of the headers."""
    s = SsdStore(ssd_dir, 256 * RECORD, sync="always").open()
    assert s.put_many([(NS, h(i), payload(i)) for i in range(8)]) == 8
    s.close()
    if not maps:
        for name in os.listdir(ssd_dir):
            if name.endswith(".map"):
                os.unlink(os.path.join(ssd_dir, name))
    gate = gate_restart(monkeypatch)
    s = SsdStore(ssd_dir, 256 * RECORD, sync="always").open(wait=False)
    assert s.scan.state == ("validating" if maps else "scanning")
    assert s.put_many([(NS, h(5), payload(5, 1))]) == 1      # written during the scan: a newer copy of 5
    deleting = threading.Thread(target=s.delete, args=(NS, h(5)))
    deleting.start()
    deleting.join(0.3 if not maps else 30)
    if maps:
        assert not deleting.is_alive(), "with a record map a delete need not wait for the validation"
    else:
        assert deleting.is_alive(), "the delete returned before the scan had wiped the copy it has not reached"
    gate.set()
    deleting.join(30)
    s.scanner.wait()
    assert not deleting.is_alive() and s.scan.state == "ready"
    # the old copy: found by the scan and wiped as deleted, or known from the map and wiped as superseded
    assert read(s, 5) is None and s.counters["bad.deleted" if not maps else "bad.superseded"] == 0 + (not maps)
    assert [read(s, i) == payload(i) for i in range(8)] == [i != 5 for i in range(8)]
    s.close()
    s = SsdStore(ssd_dir, 256 * RECORD).open()
    assert read(s, 5) is None and len(s.index) == 7
    s.close()


def test_a_tier_delete_waits_for_the_announced_write_it_cancels(ssd_dir: str) -> None:
    """A write announced (write-through, a demotion batch) and then deleted must not leave a synced record of the
    block on disk once the delete has returned: the delete waits for the write, which publishes nothing."""
    from kvstore.daemon.config import SsdConfig
    from kvstore.tiers.ssd.tier import SsdTier
    from kvstore.traffic import Lane

    tier = SsdTier(SsdConfig(dir=ssd_dir, capacity=64 * RECORD, sync="always", io="threads")).open(wait=True)
    bid = NS + h(7)
    tier.announce([bid])                                   # a write-through batch took the block
    deleting = threading.Thread(target=tier.delete, args=(bid,))
    deleting.start()
    deleting.join(0.3)
    blocked = deleting.is_alive()
    assert tier.write([(bid, payload(7), None)], Lane.STORE) == 0     # cancelled: not published
    deleting.join(30)
    tier.close()
    assert blocked, "the delete returned while the write it cancelled could still put the block on disk"


def test_a_block_twice_in_one_batch_is_stored_once(ssd_dir: str) -> None:
    """The write-through can queue a block twice (put, delete, put again into the same slot before its queue
    drains): the batch must store it, not cancel both copies (found by tests/daemon/test_kill9.py)."""
    s = SsdStore(ssd_dir, 64 * RECORD, sync="always").open()
    assert s.put_many([(NS, h(1), payload(1)), (NS, h(2), payload(2)), (NS, h(1), payload(1))]) == 2
    assert read(s, 1) == payload(1) and read(s, 2) == payload(2)
    s.close()
    s = SsdStore(ssd_dir, 64 * RECORD).open()
    assert read(s, 1) == payload(1) and len(s.index) == 2 and not s.counters["bad.superseded"]
    s.close()

