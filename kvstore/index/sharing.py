"""Sharing KV across models and adapters: share groups (ICaRus §3) and base/residual pairs with forks (ForkKV §5).

Share groups. Models that keep a shared frozen "logical encoder" produce identical KV for identical tokens, so they
declare one group and their namespaces' digests are equal (kvstore.protocol.keys: the group stands in for the
model). Equal digests need equal geometries, so models of one group whose geometries differ would silently keep
separate caches; worse, the operator would believe they share. `ShareGroups` therefore books, per declared group
(and tenant, adapter, role, tensor-parallel place and salt), the geometry its first namespace declared, and refuses
another one with both named. The default group (the model itself) is not checked: one model's engines may well
keep its KV in two dtypes.

Pairs (ForkKV §5.1). A block of a LoRA agent splits into a large base part, the base model's projections keyed by
tokens alone (a namespace of role `base`), and a small residual part, the adapter's down-projection `xA` (role
`residual`, one namespace per adapter, its geometry rank-r wide). A pair names the two; a lookup or acquire of a
pair answers both prefixes in one round trip, so an engine sees a partial hit (the residual outlived its base:
recompute only the base). The index keeps which residual namespaces were paired with each base namespace: the
accounting (`rows`) and, under `pool.pair_eviction: coupled`, the cascade (a base block leaving the host pool takes
its residuals along, as a radix tree's eviction takes a node's children; the default, decoupled, lets each part
live by its own recency, ForkKV's decoupled eviction).

Forks (ForkKV §5.2). A new agent forks a context: it inherits the base blocks by reference — they are the base
namespace's blocks, keyed by tokens, so nothing is copied and every agent's view names the same slots — and writes
only its own residuals. Its view cannot be broken by its parent's residuals leaving: they are other keys. A fork is
booked (child, parent, base, the context's keys) so that `kvstore ls` shows who forked from whom and how much of
each inherited context the base namespace still holds.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstore.index.errors import Refused
from kvstore.protocol.geometry import Geometry
from kvstore.protocol.keys import NamespaceSpec

if TYPE_CHECKING:
    from kvstore.index.namespaces import NamespaceEntry

MAX_MODELS = 64             # model names remembered per namespace (shown by `kvstore ls`)
MAX_FORKS = 4096            # forks booked; the oldest is forgotten first ...
MAX_FORK_BYTES = 8 << 20    # ... and so when their contexts' keys would take more than this


class GroupMismatch(Refused):
    """A namespace whose geometry differs from its share group's."""


class NotAPair(Refused):
    """Two namespaces that cannot be a base and its residual."""


GroupPlace = tuple[str, str, str, str, int, int, str]   # tenant, group, adapter, role, tp rank, tp size, salt


@dataclass(slots=True)
class _Declared:
    geometry: Geometry
    model: str                  # who declared it first
    namespaces: int = 0         # live namespaces booked here


@dataclass(slots=True)
class Fork:
    child: int                  # the child's residual namespace
    base: int
    parent: int | None          # the parent's residual namespace, if it named one
    context: bytes              # the context's keys (16 bytes each) at the fork
    inherited: int              # base blocks of the context held (any tier) at the fork
    at: float = field(default_factory=time.time)


class ShareGroups:
    """The geometry each declared group holds, and its guard."""

    def __init__(self) -> None:
        self._declared: dict[GroupPlace, _Declared] = {}

    @staticmethod
    def place(spec: NamespaceSpec, tenant: str) -> GroupPlace:
        return (tenant, spec.group, spec.adapter, spec.role, spec.tp_rank, spec.tp_size, spec.salt)

    def admit(self, spec: NamespaceSpec, tenant: str) -> None:
        """Refuse a namespace of a declared group whose geometry is not the group's."""
        if not spec.group:
            return
        d = self._declared.get(self.place(spec, tenant))
        if d is not None and d.namespaces and d.geometry != spec.geometry:
            where = f"role {spec.role}" + (f", adapter {spec.adapter!r}" if spec.adapter else "")
            raise GroupMismatch(
                f"share group {spec.group!r} ({where}, tp {spec.tp_rank}/{spec.tp_size}) holds KV of geometry "
                f"{_brief(d.geometry)}, first declared by model {d.model!r}; model {spec.model!r} declares "
                f"{_brief(spec.geometry)}. Models of one group must produce identical KV (same layers, heads, "
                "head size, dtype, block size and layout): fix the model's group, or give it its own")

    def joined(self, ns: NamespaceEntry) -> None:
        if ns.spec.group:
            d = self._declared.setdefault(self.place(ns.spec, ns.tenant), _Declared(ns.spec.geometry, ns.spec.model))
            if not d.namespaces:
                d.geometry, d.model = ns.spec.geometry, ns.spec.model
            d.namespaces += 1

    def left(self, ns: NamespaceEntry) -> None:
        place = self.place(ns.spec, ns.tenant)
        d = self._declared.get(place)
        if ns.spec.group and d is not None:
            d.namespaces -= 1
            if d.namespaces <= 0:
                del self._declared[place]


class Pairs:
    """Which residual namespaces were paired with each base namespace, and the forks."""

    def __init__(self) -> None:
        self.residuals: dict[int, set[int]] = {}    # base id → residual ids
        self.forks: dict[int, Fork] = {}            # child id → its latest fork
        self._fork_bytes = 0                        # of the forks' contexts

    @staticmethod
    def check(base: NamespaceEntry, residual: NamespaceEntry) -> None:
        b, r = base.spec, residual.spec
        if b.role != "base":
            raise NotAPair(f"namespace {base.id} has role {b.role}; a pair's `ns` is its base namespace")
        if r.role != "residual":
            raise NotAPair(f"namespace {residual.id} has role {r.role}; a pair's `residual` must have role residual")
        if b.share_group != r.share_group or (b.tp_rank, b.tp_size) != (r.tp_rank, r.tp_size):
            raise NotAPair(f"namespaces {base.id} (group {b.share_group!r}, tp {b.tp_rank}/{b.tp_size}) and "
                           f"{residual.id} (group {r.share_group!r}, tp {r.tp_rank}/{r.tp_size}) are not one "
                           "model's base and residual: group and tensor-parallel place must match")
        if b.geometry.tokens != r.geometry.tokens:
            raise NotAPair(f"namespaces {base.id} and {residual.id} have blocks of {b.geometry.tokens} and "
                           f"{r.geometry.tokens} tokens: a base and its residual cover the same tokens per block")

    def pair(self, base: NamespaceEntry, residual: NamespaceEntry) -> None:
        self.check(base, residual)
        self.residuals.setdefault(base.id, set()).add(residual.id)

    def fork(self, base: NamespaceEntry, child: NamespaceEntry, parent: NamespaceEntry | None, context: bytes,
             inherited: int) -> Fork:
        self.pair(base, child)
        if parent is not None:
            self.pair(base, parent)
        self._drop_fork(child.id)
        while self.forks and (len(self.forks) >= MAX_FORKS or self._fork_bytes + len(context) > MAX_FORK_BYTES):
            self._drop_fork(next(iter(self.forks)))
        f = self.forks[child.id] = Fork(child.id, base.id, parent.id if parent else None, context, inherited)
        self._fork_bytes += len(context)
        return f

    def _drop_fork(self, child: int) -> None:
        f = self.forks.pop(child, None)
        if f is not None:
            self._fork_bytes -= len(f.context)

    def forget(self, ns: NamespaceEntry) -> None:
        """A namespace's entry is gone: so are its pairs and forks (its ids are never reused)."""
        self.residuals.pop(ns.id, None)
        self._drop_fork(ns.id)
        for rs in self.residuals.values():
            rs.discard(ns.id)


def _brief(g: Geometry) -> str:
    return (f"{g.layers} layers × {g.kv_heads} heads × {g.head_dim} × {g.tokens} tokens, {g.dtype}, "
            f"layout {g.layout}")
