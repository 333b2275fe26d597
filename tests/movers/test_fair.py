"""The deficit-round-robin queue the write-through serves tenants with (kvstore.movers.fair)."""
from __future__ import annotations

import pytest

from kvstore.movers.fair import FairQueue


def queue(quantum: int = 1 << 20) -> FairQueue[tuple[str, int, int]]:
    return FairQueue(lambda e: e[0], lambda e: e[1], quantum)     # (tenant, bytes, sequence number)


def test_a_few_blocks_behind_a_flood_wait_one_quantum_not_the_flood() -> None:
    q = queue()
    for i in range(1000):
        q.append(("a", 8192, i))
    for i in range(8):
        q.append(("b", 8192, i))
    order = [q.popleft() for _ in range(len(q))]
    last_b = max(k for k, e in enumerate(order) if e[0] == "b")
    assert last_b < (1 << 20) // 8192 + 8 + 1                      # within a's first quantum, not after 1000
    assert [e[2] for e in order if e[0] == "a"] == list(range(1000))   # each tenant keeps its order
    assert [e[2] for e in order if e[0] == "b"] == list(range(8))
    assert not q and len(q) == 0 and not q.bytes_of


def test_tenants_get_equal_bytes_whatever_their_block_sizes() -> None:
    q = queue(quantum=256 << 10)
    for i in range(4000):
        q.append(("big", 64 << 10, i))
        q.append(("small", 8 << 10, i))
    served = {"big": 0, "small": 0}
    for _ in range(2000):
        e = q.popleft()
        served[e[0]] += e[1]
    assert abs(served["big"] - served["small"]) <= 2 * (256 << 10) + (64 << 10)
    assert q.bytes_of["big"] == 4000 * (64 << 10) - served["big"]


def test_an_empty_queue_refuses_a_pop_and_a_tenant_returning_starts_afresh() -> None:
    q = queue()
    with pytest.raises(IndexError):
        q.popleft()
    q.append(("a", 100, 0))
    assert q.popleft() == ("a", 100, 0)
    q.append(("b", 100, 1))
    q.append(("a", 100, 2))
    assert [q.popleft()[2] for _ in range(2)] == [1, 2] and list(q) == []
