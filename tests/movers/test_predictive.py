"""How the predictive prefetch keeps a workflow's chain from its requests' keys (kvstore.movers.predictive
.merge_chain): a long request reaches the daemon in batches, head first, and the
chain is put back together; a part of it keeps it; a request elsewhere, not in the same burst, replaces it."""
from __future__ import annotations

import pytest

from kvstore.movers.predictive import merge_chain

H = [bytes([i]) * 16 for i in range(64)]


def c(a: int, b: int) -> bytes:
    """Blocks a..b-1 of one chain."""
    return b"".join(H[a:b])


@pytest.mark.parametrize("chain, keys, burst, after", [
    (c(0, 32), c(32, 40), True, c(0, 40)),            # a request's second batch, right after its first
    (c(0, 40), c(32, 40), False, None),               # one batch of the chain kept: kept as it is
    (c(0, 40), c(0, 10), False, None),                # a shorter prefix: kept
    (c(0, 10), c(0, 20), False, c(0, 20)),            # the same head, longer: the new chain
    (c(0, 10), c(5, 20), False, c(0, 20)),            # begins inside: goes on from there
    (c(0, 10), c(40, 45), False, c(40, 45)),          # elsewhere, later: a new chain
    (c(0, 10), c(40, 45), True, c(0, 10) + c(40, 45)),   # elsewhere, in the burst: the next batch
    (b"", c(40, 45), True, c(40, 45)),
])
def test_a_chain_is_put_back_together_from_its_batches(chain, keys, burst, after):
    assert merge_chain(chain, keys, burst) == after


def test_a_hash_is_found_on_hash_boundaries_only():
    odd = bytes(8) + bytes([7]) * 16 + bytes(8)       # H[7]'s bytes straddling two hashes
    assert merge_chain(odd, H[7], False) == H[7]
