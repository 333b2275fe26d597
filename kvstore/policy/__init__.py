"""Eviction policies: who decides which block leaves a full tier. A policy never touches bytes.

Two shapes, by where a tier keeps its candidates:

`EvictionPolicy` — the host pool's, over the index's key table. It never sees pinned blocks: the index tells it when
a block is pinned (no longer a candidate) and unpinned (a candidate again).
- `accessed(key)`  — a block was read (acquired) or stored; recency-based policies move it to the fresh end.
- `pinned(key)`    — not a candidate until `unpinned(key)`.
- `unpinned(key)`  — a candidate again, as if just used.
- `victim(cls)`    — the block of slot class `cls` to evict next, or None if there is no candidate.
Blocks enter the key table already linked as the most recent of their class and leave it by removal, so a policy
built on the table's intrusive lists (LRU) needs no hooks for insert and remove.

`TierPolicy` — for a lower tier with books of its own (the SSD store): the tier tells it every block that comes
(`added(key, cls)`, the most recent of its class), goes (`removed`) or is read (`accessed`), and asks `victim(cls)`
when a class is full. Keys are whatever the tier books blocks by (the SSD: block ids); a class is a block size.

Later policies (workflow-aware eviction, PBKV §4.2; quotas) implement the same hooks with books of their own.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvstore.index.keytable import KeyTable

POLICIES = ("lru",)


class EvictionPolicy(Protocol):
    name: str

    def accessed(self, key: bytes) -> None: ...
    def pinned(self, key: bytes) -> None: ...
    def unpinned(self, key: bytes) -> None: ...
    def victim(self, cls: int) -> bytes | None: ...


class TierPolicy(Protocol):
    name: str

    def added(self, key: bytes, cls: int) -> None: ...
    def removed(self, key: bytes) -> None: ...
    def accessed(self, key: bytes) -> None: ...
    def victim(self, cls: int) -> bytes | None: ...


def make_policy(name: str, table: KeyTable) -> EvictionPolicy:
    """The host pool's policy by name, imported on use."""
    if name == "lru":
        from kvstore.policy.lru import LruPolicy

        return LruPolicy(table)
    raise ValueError(f"unknown eviction policy {name!r}; known: {', '.join(POLICIES)}")


def make_tier_policy(name: str) -> TierPolicy:
    """A lower tier's policy by name, imported on use."""
    if name == "lru":
        from kvstore.policy.lru import LruOrder

        return LruOrder()
    raise ValueError(f"unknown eviction policy {name!r}; known: {', '.join(POLICIES)}")
