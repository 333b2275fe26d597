"""kvstore.hll: the distinct count within a few standard errors (0.8 % at p = 14) from 100 to 2 M keys, duplicates
not counted twice, the same hash in two namespaces (salts) counted twice, and the ceiling 1 − distinct / added."""
from __future__ import annotations

import numpy as np
import pytest

from kvstore.hll import HyperLogLog


def keys(n: int, start: int = 0) -> bytes:
    """n distinct 16-byte keys that are not random at all (counters): the mixing must spread them."""
    ids = np.arange(start, start + n, dtype=np.uint64)
    return np.stack([ids, np.zeros_like(ids)], axis=1).tobytes()


@pytest.mark.parametrize("n", [100, 5_000, 40_000, 2_000_000])
def test_the_distinct_count_is_within_three_percent(n):
    h = HyperLogLog()
    blob = keys(n)
    for i in range(0, len(blob), 16 * 1024):
        h.add_keys(blob[i:i + 16 * 1024])
    assert h.added == n
    assert abs(h.distinct() / n - 1) < 0.03


def test_duplicates_count_once_and_salts_apart():
    h = HyperLogLog()
    for _ in range(4):
        h.add_keys(keys(30_000))                  # the same keys 4 times: 120 k looked up, 30 k distinct
    assert abs(h.distinct() / 30_000 - 1) < 0.03
    assert abs(h.ceiling() - 0.75) < 0.01
    h.add_keys(keys(30_000), salt=7)              # the same hashes in another namespace
    assert abs(h.distinct() / 60_000 - 1) < 0.03


def test_empty():
    h = HyperLogLog()
    h.add_keys(b"")
    assert h.ceiling() is None and h.distinct() == 0
