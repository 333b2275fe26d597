"""Eviction policies: who decides which block leaves a full tier. A policy never touches bytes.

One contract in two sizes, by where a tier keeps its candidates, and one registry: `REGISTRY` maps a policy's name
(what `pool.eviction`, `ssd.eviction` and `tenants[].policy` say) to its module, imported on use; the module offers
`host_policy(table, workflows, key_at, slots_of)` and `tier_policy(workflows)`. A new policy is one module and one
line in REGISTRY (tests/policy/test_registry.py registers a toy one from a test module).

`EvictionPolicy` — the host pool's, over the index's key table. It never sees pinned blocks: the index tells it when
a block is pinned (no longer a candidate) and unpinned (a candidate again).
- `added(key, cls, touch)` — a block was published (after the key table has it), the most recent of its class.
- `removed(key)`   — a block leaves (before the key table lets go of it).
- `accessed(key, touch)` — a block was read (acquired) or stored again; recency-based policies move it to the
  fresh end. A re-store refreshes, as a read does (issue 14 part 5).
- `pinned(key)`    — not a candidate until `unpinned(key)`.
- `unpinned(key)`  — a candidate again, as if just used.
- `victim(cls)`    — the block of slot class `cls` to evict next, or None if there is no candidate.
- `moved(key, src, dst)` — a block moved from slot gid `src` to the free slot gid `dst` of the same class
  (compaction, kvstore.index.capacity; after the key table maps it to `dst`); its place in the policy's order is
  kept. Books per slot (the workflow policy's rows) follow the block; books by key (LRU's) have nothing to do. The
  index compacts a segment only under a policy that has this hook (another one's segments go as they stand).
`touch` is the request's hint context (kvstore.workflows.Touch: workflow and agent) or None. Blocks enter the
key table already linked as the most recent of their class and leave it by removal, so LRU, built on the table's
intrusive lists, does nothing on `added` and `removed`.

`TierPolicy` — the part of it a lower tier with books of its own uses (the SSD store), no pins, no moves: the tier
tells it every block that comes (`added(key, cls)`, the most recent of its class), goes (`removed`) or is read
(`accessed`), and asks `victim(cls)` when a class is full. Keys are whatever the tier books blocks by (the SSD: block
ids); a class is a block size.

`workflow` (PBKV §4.2: retired blocks first, then active ones by lookahead value) implements both: over the key
table in compact rows per host slot (kvstore.policy.compact) and in dicts for a lower tier (kvstore.policy.workflow),
one `Workflows` (the hints' books) shared by the tiers.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from kvstore.index.keytable import KeyTable
    from kvstore.workflows import Touch, Workflows

REGISTRY: dict[str, str] = {
    "lru": "kvstore.policy.lru",
    "history": "kvstore.policy.history",
    "workflow": "kvstore.policy.workflow",
}
POLICIES = tuple(REGISTRY)      # the built-in ones (REGISTRY also has those registered at run time)


def register(name: str, module: str) -> None:
    """Add a policy by name (before the configuration that names it is loaded)."""
    if name in REGISTRY:
        raise ValueError(f"an eviction policy named {name!r} is registered already")
    REGISTRY[name] = module


class TierPolicy(Protocol):
    name: str

    def added(self, key: bytes, cls: int, touch: Touch | None = None) -> None: ...
    def removed(self, key: bytes) -> None: ...
    def accessed(self, key: bytes, touch: Touch | None = None) -> None: ...
    def victim(self, cls: int) -> bytes | None: ...


class EvictionPolicy(TierPolicy, Protocol):
    def pinned(self, key: bytes) -> None: ...
    def unpinned(self, key: bytes) -> None: ...
    def moved(self, key: bytes, src: int, dst: int) -> None: ...


# Optional capabilities, checked with isinstance (never by looking a method up by name):
@runtime_checkable
class Admitting(Protocol):
    """A policy that may value a block coming below the victim it would evict for it (Belady's bypass, estimated:
    by the hints' lookahead in kvstore.policy.workflow, by reuse in kvstore.policy.history's `bypass` way): the index
    stops the put rather than evict a block worth more. Asked only where an eviction drops the block (no lower
    tier), with the request's hints or None, and the key of the block coming (where the policy remembers it)."""

    def admits(self, victim: bytes, touch: Touch | None, key: bytes | None = None) -> bool: ...


@runtime_checkable
class Refusing(Protocol):
    """An Admitting policy that remembers the blocks a put left out (`admits` refused their victims, or the put's
    own chain stood in the way): the request touched them all the same, so a block refused for one workflow and
    asked by the next is known as one the workflows share (kvstore.policy.evicted). Without it a block left out
    comes back as new every time, and a pool full of blocks worth more never lets it in."""

    def refused(self, keys: list[bytes], cls: int, touch: Touch) -> None: ...


@runtime_checkable
class Retiring(Protocol):
    """A policy that knows blocks no workflow will ask for again (retired): the predictive prefetch makes room for
    what is coming back by evicting those, and only those (None: none of this class)."""

    def retired_victim(self, cls: int) -> bytes | None: ...


@runtime_checkable
class Explaining(Protocol):
    """A policy that can say where a block stands and why (`kvstore ls --tags`) and count its blocks by standing
    (`retired`, `active`: `kvstore stats`, `kvstore workflows`); None / {} where it keeps no such books."""

    def describe(self, key: bytes) -> dict[str, Any] | None: ...

    def counts(self) -> dict[str, int]: ...


@runtime_checkable
class Asking(Protocol):
    """A policy that learns from what requests ask for, hit or not (the history policy's shadows score the prefix of
    each asked chain they would hold): the index tells it every lookup's and get's chain, head first, as keys."""

    def asked(self, keys: list[bytes], cls: int) -> None: ...


@runtime_checkable
class Reporting(Protocol):
    """A policy whose books say something an operator wants in `kvstore stats` (the host tier's `eviction`):
    the history policy's blocks per level, history size and each class's way."""

    def report(self) -> dict[str, Any]: ...


@runtime_checkable
class Routing(Protocol):
    """A policy that is several, one per tenant (kvstore.policy.tenants): the one deciding for a class."""

    def for_class(self, cls: int) -> EvictionPolicy: ...


def _module(name: str) -> object:
    module = REGISTRY.get(name)
    if module is None:
        raise ValueError(f"unknown eviction policy {name!r}; known: {', '.join(REGISTRY)}")
    return importlib.import_module(module)


def make_policy(name: str, table: KeyTable, workflows: Workflows | None = None,
                key_at: Callable[[int], bytes | None] | None = None,
                slots_of: Callable[[int], int] | None = None) -> EvictionPolicy:
    """The host pool's policy by name. `key_at(gid)` is the pool's reverse map (a policy with books per slot needs
    it); `workflows` are the hints' books (a private one if None); `slots_of(segment id)` sizes per-segment rows."""
    policy: EvictionPolicy = _module(name).host_policy(table, workflows, key_at, slots_of)  # type: ignore[attr-defined]
    return policy


def make_tier_policy(name: str, workflows: Workflows | None = None) -> TierPolicy:
    """A lower tier's policy by name (`workflows`: the hints' books, a private one if None)."""
    policy: TierPolicy = _module(name).tier_policy(workflows)  # type: ignore[attr-defined]
    return policy
