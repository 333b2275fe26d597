"""The sharing books in process (kvstore.index.sharing): a group's geometry is kept while a namespace of it lives
and forgotten with the last; forks are bounded in count and in the bytes of their contexts; a forgotten namespace
leaves no pair or fork behind."""
from __future__ import annotations

import pytest

from kvstore.index.namespaces import Holdings, Namespaces
from kvstore.index.sharing import MAX_FORK_BYTES, GroupMismatch
from kvstore.protocol.geometry import Geometry
from tests.conftest import GEOM, spec

RES = Geometry(layers=GEOM.layers, tokens=GEOM.tokens, kv_heads=1, head_dim=8)
WIDE = Geometry(layers=GEOM.layers, tokens=GEOM.tokens, kv_heads=4, head_dim=32)


def test_a_groups_geometry_lives_as_long_as_one_of_its_namespaces():
    books, a, b = Namespaces(), Holdings(), Holdings()
    books.register(spec("m1", group="g"), a, 1 << 30)
    with pytest.raises(GroupMismatch, match="first declared by model 'm1'"):
        books.register(spec("m2", WIDE, group="g"), b, 1 << 30)
    books.register(spec("m2", WIDE, group="g", tp_size=2), b, 1 << 30)   # another tensor-parallel place
    books.left(a)                                                        # m1's namespace is forgotten
    books.register(spec("m2", WIDE, group="g"), b, 1 << 30)
    with pytest.raises(GroupMismatch, match="first declared by model 'm2'"):
        books.register(spec("m1", group="g"), a, 1 << 30)


def test_forks_are_bounded_by_their_contexts_bytes_and_forgotten_with_their_namespaces():
    books, h = Namespaces(), Holdings()
    h.max_namespaces = 0
    base = books.register(spec("m", group="g"), h, 1 << 30)
    children = [books.register(spec("m", RES, group="g", adapter=f"a{i}", role="residual"), h, 1 << 30)
                for i in range(4)]
    context = bytes(MAX_FORK_BYTES // 4 + 16)                          # three fit, not four
    for child in children:
        books.pairs.fork(base, child, None, context, 0)
    assert sorted(books.pairs.forks) == [c.id for c in children[1:]]     # the oldest went for the bytes
    assert books.pairs.residuals[base.id] == {c.id for c in children}
    books.left(h)                                                        # every namespace forgotten
    assert books.pairs.forks == {} and books.pairs.residuals == {}
