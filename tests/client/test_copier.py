"""The client's copy engine: every path of a checked copy (one pass per block where the native copy is built, or
inline, pipelined with a checksum thread, split over copy threads) copies every byte and returns each
destination's CRC-32C, in the order of the pairs."""
from __future__ import annotations

import numpy as np
import pytest

from kvstore.checksum import FUSED, crc32c
from kvstore.client.copier import Copier

FUSED_KINDS = [pytest.param(True, marks=pytest.mark.skipif(not FUSED, reason="kvstore._kvcopy not built"),
                            id="one-pass"), pytest.param(False, id="two-pass")]


@pytest.mark.parametrize("fused", FUSED_KINDS)
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("block, n", [(8 << 10, 5), (768 << 10, 7), (2 << 20, 4), (2 << 20, 5)])
def test_copy_checked_copies_and_checksums_each_block(fused: bool, threads: int, block: int, n: int) -> None:
    rng = np.random.default_rng(block + n)
    srcs = [rng.integers(0, 256, block, dtype=np.uint8) for _ in range(n)]
    dsts = [np.zeros(block, np.uint8) for _ in range(n)]
    c = Copier(threads, fused=fused)
    try:
        crcs = c.copy_checked(list(zip(dsts, srcs)))
    finally:
        c.close()
    assert all(np.array_equal(d, s) for d, s in zip(dsts, srcs))
    assert crcs == [crc32c(s.tobytes()) for s in srcs]
    assert len(set(crcs)) == n


def test_the_one_pass_copy_is_the_default_where_built() -> None:
    c = Copier(2)
    try:
        assert c.fused == FUSED
    finally:
        c.close()
