"""Demotion staging shared by tenants (issue 29; kvstore.tiers.ssd.staging and demoter): one tenant's flood of
evictions fills at most its share of staging, so another tenant's evicted blocks still find room; and the writer
takes background batches tenant by tenant in turn, so a tenant's few staged blocks are written next, not behind the
flood. On the staging books and the writer's batch choice, without its thread: nothing is timed."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvstore.tiers.ssd.config import SsdConfig
from kvstore.tiers.ssd.demoter import WRITE_BATCH, Demoter
from kvstore.tiers.ssd.staging import TENANT_SHARE, Staging
from kvstore.tiers.ssd.store import SsdStore

BLOCK = 8192
NS = {"a": b"A" * 16, "b": b"B" * 16, "": b"C" * 16}
OWNER = {d: t for t, d in NS.items() if t}


@pytest.fixture
def area(tmp_path: Path) -> Iterator[Callable[[int], tuple[Staging, Demoter]]]:
    """Staging of `n` blocks over a record store whose namespaces belong to OWNER's tenants; its writer's batch
    choice, its thread not started."""
    stores: list[SsdStore] = []

    def make(n: int) -> tuple[Staging, Demoter]:
        store = SsdStore(str(tmp_path), 4 << 20)
        store.tenant_of = OWNER.get
        stores.append(store.open())
        staging = Staging(SsdConfig(dir=str(tmp_path), capacity=4 << 20, staging_bytes=n * BLOCK), store)
        return staging, Demoter(staging, store)

    yield make
    for store in stores:
        store.close()


def stage(s: Staging, tenant: str, ids: range) -> int:
    """Stage (and fill) blocks of `tenant`: how many staging took."""
    took = 0
    for i in ids:
        buf = s.stage(NS[tenant] + i.to_bytes(16, "big"), BLOCK)
        if not isinstance(buf, bool):
            s.fill(NS[tenant] + i.to_bytes(16, "big"), buf, memoryview(bytes(BLOCK)))
            took += 1
    return took


def test_a_tenants_flood_of_evictions_leaves_room_for_another_tenants(area):
    s, _ = area(64)
    assert stage(s, "b", range(100)) == 64 * TENANT_SHARE           # b's flood: its share, the rest dropped
    assert s.dropped_share["b"] == 100 - 32 and s.tenant_bytes["b"] == 32 * BLOCK
    assert stage(s, "a", range(8)) == 8                             # a's evictions still staged
    assert stage(s, "", range(24)) == 24                            # the default tenant: no share, the rest
    assert s.nbytes == 64 * BLOCK and stage(s, "a", range(8, 9)) == 0   # full: dropped as before
    s.drop_locked(NS["b"] + (0).to_bytes(16, "big"))                # a delete gives b's share back
    assert s.tenant_bytes["b"] == 31 * BLOCK


def test_the_writer_takes_tenants_in_turn_not_the_order_staged(area):
    s, writer = area(1024)
    stage(s, "b", range(4 * WRITE_BATCH))                           # b's backlog first ...
    stage(s, "a", range(3))                                         # ... then a's few blocks
    with s.lock:
        first, _ = writer._next_batch()
        for k, _ in first:
            s.forget_locked(k)                                      # written
        second, _ = writer._next_batch()
    tenants = [{OWNER[k[:16]] for k, _ in batch} for batch in (first, second)]
    assert tenants == [{"a"}, {"b"}] or tenants == [{"b"}, {"a"}]   # a waits one batch of b's at most
    assert len(first) + len(second) == WRITE_BATCH + 3
