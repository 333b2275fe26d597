"""Promotion (kvstore.movers.promotion) from a block that moves down under it: the donated tier moves a block to the
SSD under its own lock, not the daemon's state lock, so a reclaim can take the block out of donated memory between
the promotion choosing the donated tier and reading it. The promotion looks the block's holders up again and reads it
from the SSD: a reclaim that drops nothing never turns a get into a miss. The move is forced at each point of that
window (the daemon-level race is tests/tiers/test_donated_daemon.py's)."""
from __future__ import annotations

import fcntl
import os
import random
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path as FsPath
from threading import Condition, Lock
from typing import Any

import pytest

from kvstore.checksum import crc32c
from kvstore.daemon.config import SsdConfig
from kvstore.index import Holdings, Index, NamespaceEntry
from kvstore.movers.promotion import Promotion
from kvstore.protocol.geometry import Geometry
from kvstore.protocol.keys import NamespaceSpec
from kvstore.tiers import LowerTiers
from kvstore.tiers.donated.memory import MemfdMemory
from kvstore.tiers.donated.tier import DonatedTier
from kvstore.tiers.host import HostPool
from kvstore.tiers.ssd.record import HEADER_BYTES, padded
from kvstore.tiers.ssd.tier import SsdTier
from kvstore.traffic import Lane, Path

GEOM = Geometry(layers=2, tokens=16, kv_heads=2, head_dim=32, dtype="float16")
BLOCK = GEOM.full_bytes
REGION = 16 * BLOCK


class Rig:
    """A host pool and its index, the donated tier (one memfd region, no donor process) over a real SSD tier, and
    the promotion mover over both."""

    def __init__(self, ssd_dir: FsPath) -> None:
        self.ssd = SsdTier(SsdConfig(dir=str(ssd_dir), capacity=64 * (HEADER_BYTES + padded(BLOCK)),
                                     io="threads")).open(wait=True)
        self.path = Path("mem", workers=2, nominal_bps=10e9)
        self.donated = DonatedTier(self.path, self.ssd)
        self.region = self.donated.add_region("test", MemfdMemory(_memfd(REGION), REGION), owner=1)
        self.pool = HostPool(capacity=1 << 20, segment_bytes=1 << 20)
        self.index = Index(self.pool)
        self.lock = Lock()
        self.counters: Counter[str] = Counter()
        self.promotion = Promotion(self.index, self.pool, LowerTiers([self.donated, self.ssd]), self.lock,
                                   Condition(self.lock), lambda: None, lambda key: False, counters=self.counters)
        self.holder = Holdings()
        self.ns: NamespaceEntry = self.index.register(NamespaceSpec("tiny", GEOM), self.holder)

    def put_donated(self, h: bytes) -> None:
        """The block evicted into donated memory (as a demotion would: staged, then filled)."""
        data = payload(h)
        buf = self.donated.stage(self.ns.block_id(h), BLOCK, crc32c(data))
        assert not isinstance(buf, bool)
        self.donated.fill(self.ns.block_id(h), buf, memoryview(data))

    def reclaim(self) -> None:
        """The donor takes the region back, time enough to move every block to the SSD."""
        reply = self.donated.reclaim(self.region, 10.0)
        assert reply["dropped"] == 0 and reply["migrated"] >= 1, reply

    def promote(self, h: bytes) -> bytes | None:
        with self.lock:
            gids = self.promotion.promote(self.ns, [h], self.holder, Lane.CRITICAL)
        if not gids:
            return None
        with self.pool.view(gids[0]) as v:
            return bytes(v)

    def close(self) -> None:
        self.donated.close()
        self.path.close()
        self.ssd.close()


def _memfd(size: int) -> int:
    fd = os.memfd_create("kvstore-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


def payload(h: bytes) -> bytes:
    return random.Random(h).randbytes(BLOCK)


def once_before(fn: Callable[..., Any], first: Callable[[], None]) -> Callable[..., Any]:
    """`fn`, with `first` run before its first call only."""
    left = [1]

    def wrapped(*args: Any, **kw: Any) -> Any:
        if left[0]:
            left[0] = 0
            first()
        return fn(*args, **kw)
    return wrapped


@pytest.fixture
def rig(tmp_path: FsPath) -> Iterator[Rig]:
    r = Rig(tmp_path / "ssd")
    yield r
    r.close()


def test_a_block_moved_down_between_the_choice_and_the_read_is_read_from_the_ssd(rig: Rig,
                                                                                monkeypatch: pytest.MonkeyPatch):
    """The donated tier chosen (the only holder then), the reclaim moves the block before its read: the read
    misses there, and the promotion reads it from the SSD, where it went."""
    h = bytes(range(16))
    rig.put_donated(h)
    monkeypatch.setattr(rig.donated, "read", once_before(rig.donated.read, rig.reclaim))
    assert rig.promote(h) == payload(h)
    assert rig.counters["reads_donated"] == 1 and rig.counters["reads_ssd"] == 1
    assert rig.donated.counters["read_misses"] == 1


def test_a_block_moved_down_right_after_the_holders_were_looked_up_is_read_from_the_ssd(
        rig: Rig, monkeypatch: pytest.MonkeyPatch):
    """The move lands between the holders' lookup and the count of the run the chosen tier holds: nothing is
    read from the donated tier, the SSD serves it."""
    h = bytes(range(1, 17))
    rig.put_donated(h)
    has = rig.donated.has

    def has_then_move(bid: bytes) -> bool:          # answers for the moment before the move
        held = has(bid)
        monkeypatch.setattr(rig.donated, "has", has)
        rig.reclaim()
        return held

    monkeypatch.setattr(rig.donated, "has", has_then_move)
    assert rig.promote(h) == payload(h)
    assert rig.counters["reads_donated"] == 0 and rig.counters["reads_ssd"] == 1


def test_each_tier_is_tried_once_and_a_block_no_tier_serves_is_a_miss(rig: Rig, monkeypatch: pytest.MonkeyPatch):
    """A block every read of which fails: one read per tier that holds it, then a miss (the retries are
    bounded)."""
    h = bytes(range(2, 18))
    rig.put_donated(h)
    monkeypatch.setattr(rig.donated, "read", once_before(rig.donated.read, rig.reclaim))
    monkeypatch.setattr(rig.ssd, "read", lambda *a, **kw: 0)
    assert rig.promote(h) is None
    assert rig.counters["reads_donated"] == 1 and rig.counters["reads_ssd"] == 1
