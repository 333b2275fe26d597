"""Namespace isolation: any difference in what makes KV bytes identical means no hit; a shared group hits."""
from __future__ import annotations

import dataclasses

import pytest

from kvstore.protocol.keys import NamespaceSpec, block_key, chain_hashes
from tests.conftest import GEOM, block, hashes, spec

BASE = spec("llama")
VARIANTS = {
    "model": spec("mistral"),
    "adapter": spec("llama", adapter="lora-1"),
    "tp_rank": spec("llama", tp_rank=1, tp_size=2),
    "tp_size": spec("llama", tp_size=2),
    "role": spec("llama", role="residual"),
    "salt": spec("llama", salt="tenant-b"),
    "layout": spec("llama", geometry=dataclasses.replace(GEOM, layout="vllm-cpu:heads,tokens,2*dim")),
    "dtype": spec("llama", geometry=dataclasses.replace(GEOM, dtype="bfloat16")),
}


@pytest.mark.parametrize("field", sorted(VARIANTS))
def test_namespaces_never_see_each_others_blocks(daemon, field):
    other = VARIANTS[field]
    assert other.digest() != BASE.digest()
    with daemon.client() as c:
        a, b = c.namespace(BASE), c.namespace(other)
        a.put(hashes(4), [block(i) for i in range(4)])
        assert b.lookup(hashes(4)) == 0
        assert len(b.acquire(hashes(4))) == 0
        assert b.delete(hashes(4)) == 0
        assert a.lookup(hashes(4)) == 4


def test_models_in_one_share_group_hit_each_other(daemon):
    # ICaRus: models with a shared frozen encoder declare one group and produce identical KV
    m1, m2 = spec("agent-a", group="icarus-8b"), spec("agent-b", group="icarus-8b")
    assert m1.digest() == m2.digest()
    with daemon.client() as c1, daemon.client() as c2:
        c1.namespace(m1).put(hashes(3), [block(i) for i in range(3)])
        out = [bytearray(GEOM.full_bytes) for _ in range(3)]
        assert c2.namespace(m2).get(hashes(3), out) == 3
        assert [bytes(o) for o in out] == [block(i) for i in range(3)]
        assert len(c1.list()["namespaces"]) == 1


def test_digest_is_stable_and_spec_round_trips():
    assert BASE.digest() == NamespaceSpec.from_dict(BASE.to_dict()).digest()
    assert BASE.digest().hex() == spec("llama").digest().hex()


def test_chain_hashes_name_whole_prefixes():
    a = chain_hashes(list(range(64)), 16)
    b = chain_hashes(list(range(48)) + [999] * 16, 16)
    assert len(a) == 4 and all(len(h) == 16 for h in a)
    assert a[:3] == b[:3] and a[3] != b[3]
    c = chain_hashes([7] + list(range(1, 64)), 16)
    assert all(x != y for x, y in zip(a, c))      # a change in block 0 changes every later hash
    assert chain_hashes(list(range(40)), 16) == a[:2]   # the partial tail gets no hash


def test_block_key_folds_long_engine_hashes():
    h32 = bytes(range(32))
    assert len(block_key(h32)) == 16 and block_key(h32) == block_key(h32)
    assert block_key(bytes(16)) == bytes(16)
    with pytest.raises(ValueError, match="at least 128 bits"):
        block_key(b"short")
