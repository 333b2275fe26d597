"""Round trips through a real daemon: two-phase visibility, prefix lookup, layers, delete."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

from kvstore.client import KVStoreError
from tests.conftest import GEOM, block, hashes, spec


def test_put_get_roundtrip_is_byte_exact(daemon):
    with daemon.client() as c:
        ns = c.namespace(spec())
        hs = hashes(40)
        blocks = [block(i) for i in range(40)]
        r = ns.put(hs, blocks)
        assert (r.stored, r.existed) == (40, 0)
        outs = [bytearray(GEOM.full_bytes) for _ in hs]
        assert ns.get(hs, outs) == 40
        assert [hashlib.sha256(o).digest() for o in outs] == [hashlib.sha256(b).digest() for b in blocks]
        # storing again finds every block already there
        assert ns.put(hs, blocks).existed == 40


def test_reserved_blocks_are_invisible_until_commit(daemon):
    with daemon.client() as writer, daemon.client() as reader:
        w, r = writer.namespace(spec()), reader.namespace(spec())
        hs = hashes(4)
        res = w.reserve(hs)
        assert res.reserved == [0, 1, 2, 3]
        res.write_blocks([block(i) for i in range(4)])
        assert r.lookup(hs) == 0                      # written but not committed: invisible
        assert len(r.acquire(hs)) == 0
        assert res.commit() == 4
        assert r.lookup(hs) == 4                      # committed: visible to everyone


def test_abort_leaves_nothing_and_frees_slots(daemon):
    with daemon.client() as c:
        ns = c.namespace(spec())
        res = ns.reserve(hashes(8))
        assert c.stats()["reserved"] == 8
        res.abort()
        s = c.stats()
        assert (s["reserved"], s["blocks"], s["tiers"][0]["used_bytes"]) == (0, 0, 0)
        assert ns.lookup(hashes(8)) == 0


def test_lookup_is_longest_contiguous_prefix(daemon):
    with daemon.client() as c:
        ns = c.namespace(spec())
        hs = hashes(10)
        present = [0, 1, 2, 4, 5]                     # a hole at 3
        ns.put([hs[i] for i in present], [block(i) for i in present])
        assert ns.lookup(hs) == 3
        assert ns.lookup(hs[4:6]) == 2
        assert ns.lookup(hs[3:]) == 0
        outs = [bytearray(GEOM.full_bytes) for _ in hs]
        assert ns.get(hs, outs) == 3                  # loads take only the prefix


def test_layer_by_layer_write_and_read(daemon):
    with daemon.client() as c:
        ns = c.namespace(spec())
        hs = hashes(3)
        fulls = [block(100 + i) for i in range(3)]
        lb = GEOM.layer_bytes
        with ns.reserve(hs) as res:
            for layer in range(GEOM.layers):          # as an engine saves each layer after it runs
                res.write_layer(layer, [f[layer * lb:(layer + 1) * lb] for f in fulls])
            res.commit()
        with ns.acquire(hs) as lease:
            layer1 = [bytearray(lb) for _ in hs]
            lease.read_layer(1, layer1)
        assert [bytes(x) for x in layer1] == [f[lb:2 * lb] for f in fulls]
        outs = [bytearray(GEOM.full_bytes) for _ in hs]
        assert ns.get(hs, outs) == 3
        assert [bytes(o) for o in outs] == fulls      # the layers make the Full Block, block-major


def test_typed_view_follows_block_major_layout(daemon):
    with daemon.client() as c:
        ns = c.namespace(spec())
        arr = np.arange(GEOM.full_bytes // 2, dtype=np.float16)
        ns.put(hashes(1), [arr])
        with ns.acquire(hashes(1)) as lease:
            view = GEOM.typed_view(lease.views[0])
            assert view.shape == (2, 2, 16, 2, 32)
            assert np.array_equal(view[1].reshape(-1), arr[GEOM.layer_bytes // 2:])


def test_delete_hides_block_and_frees_slot(daemon):
    with daemon.client() as c:
        ns = c.namespace(spec())
        hs = hashes(5)
        ns.put(hs, [block(i) for i in range(5)])
        assert ns.delete(hs[2:4]) == 2
        assert ns.lookup(hs) == 2
        assert c.stats()["tiers"][0]["used_bytes"] == 3 * GEOM.full_bytes


def test_delete_of_pinned_block_frees_at_release(daemon):
    with daemon.client() as c:
        ns = c.namespace(spec())
        hs = hashes(1)
        ns.put(hs, [block(7)])
        lease = ns.acquire(hs)
        assert ns.delete(hs) == 1
        assert ns.lookup(hs) == 0                        # hidden at once
        assert bytes(lease.views[0]) == block(7)         # the holder still reads its bytes
        assert c.stats()["tiers"][0]["used_bytes"] == GEOM.full_bytes
        lease.release()
        assert c.stats()["tiers"][0]["used_bytes"] == 0  # freed at the last release


def test_wrong_block_size_is_refused_before_any_copy(daemon):
    with daemon.client() as c:
        ns = c.namespace(spec())
        with pytest.raises(ValueError, match="wrong geometry: block 0 is 100 bytes"):
            ns.put(hashes(1), [b"x" * 100])
        assert c.stats()["reserved"] == 0                # the reservation was rolled back
        assert ns.lookup(hashes(1)) == 0


def test_commit_of_unreserved_key_is_an_error_and_commits_nothing(daemon):
    with daemon.client() as c:
        ns = c.namespace(spec())
        res = ns.reserve(hashes(2))
        with pytest.raises(KVStoreError) as e:
            c.call("commit", ns=ns.id, keys=b"".join(hashes(3)))
        assert e.value.code == "not_found"
        assert ns.lookup(hashes(2)) == 0
        assert res.commit() == 2


def test_release_of_unheld_slot_is_refused(daemon):
    with daemon.client() as a, daemon.client() as b:
        na = a.namespace(spec())
        b.namespace(spec())                               # b may use the namespace, not a's pins
        na.put(hashes(1), [block(1)])
        lease = na.acquire(hashes(1))
        with pytest.raises(KVStoreError) as e:
            b.call("release", slots=lease.gids)          # b does not hold a's pin
        assert e.value.code == "not_found"
        assert a.stats()["pinned"] == 1


def test_commit_with_a_key_twice_is_refused_whole(daemon):
    with daemon.client() as c:
        ns = c.namespace(spec())
        res = ns.reserve(hashes(2))
        with pytest.raises(KVStoreError) as e:
            c.call("commit", ns=ns.id, keys=hashes(1)[0] * 2)
        assert e.value.code == "bad_request" and "twice" in e.value.message
        assert ns.lookup(hashes(2)) == 0 and c.stats()["reserved"] == 2
        assert res.commit() == 2


def test_checksummed_blocks_prove_their_bytes_to_readers(daemon):
    with daemon.client() as writer, daemon.client() as reader, daemon.client() as vandal:
        w = writer.namespace(spec())
        hs = hashes(6)
        assert w.put(hs, [block(i) for i in range(6)], checksum=True).stored == 6
        r = reader.namespace(spec())
        with r.acquire(hs) as lease:
            assert all(c is not None for c in lease.crcs) and lease.verified_prefix() == 6
        # another client scribbles over block 3's slot in place
        with vandal.namespace(spec()).acquire(hs[3:4]) as bad:
            bad.views[0][100:110] = 0x5A
        with r.acquire(hs) as lease:
            assert lease.verified_prefix() == 3           # the reader finds out before it uses the bytes
        w.put(hashes(1, start=50), [block(50)], checksum=False)   # committed without one: never "verified"
        with r.acquire(hashes(1, start=50)) as lease:
            assert lease.crcs == [None] and lease.verified_prefix() == 0


def test_commit_with_wrong_number_of_crcs_is_refused(daemon):
    with daemon.client() as c:
        ns = c.namespace(spec())
        res = ns.reserve(hashes(2))
        with pytest.raises(KVStoreError) as e:
            res.commit(crcs=[1])
        assert e.value.code == "bad_request" and "one CRC-32 per key" in e.value.message
        assert ns.lookup(hashes(2)) == 0
        res.done = False
        assert res.commit(crcs=res.checksums()) == 2
