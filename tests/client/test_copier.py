"""The client's copy engine: every path of a checked copy (inline, pipelined with a checksum thread, split over copy
threads) copies every byte and returns each destination's CRC-32C, in the order of the pairs."""
from __future__ import annotations

import numpy as np
import pytest

from kvstore.checksum import crc32c
from kvstore.client.copier import Copier


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("block, n", [(8 << 10, 5), (768 << 10, 7), (2 << 20, 4)])
def test_copy_checked_copies_and_checksums_each_block(threads: int, block: int, n: int) -> None:
    rng = np.random.default_rng(block + n)
    srcs = [rng.integers(0, 256, block, dtype=np.uint8) for _ in range(n)]
    dsts = [np.zeros(block, np.uint8) for _ in range(n)]
    c = Copier(threads)
    try:
        crcs = c.copy_checked(list(zip(dsts, srcs)))
    finally:
        c.close()
    assert all(np.array_equal(d, s) for d, s in zip(dsts, srcs))
    assert crcs == [crc32c(s.tobytes()) for s in srcs]
    assert len(set(crcs)) == n
