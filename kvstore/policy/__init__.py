"""Eviction policies: who decides which committed, unpinned block leaves a full tier.

A policy never touches bytes and never sees pinned blocks: the index tells it when a block is pinned (no longer a
candidate) and unpinned (a candidate again). The contract:

- `accessed(key)`  — a block was read (acquired) or stored; recency-based policies move it to the fresh end.
- `pinned(key)`    — not a candidate until `unpinned(key)`.
- `unpinned(key)`  — a candidate again, as if just used.
- `victim(cls)`    — the block of slot class `cls` to evict next, or None if there is no candidate.

Blocks enter the index's key table already linked as the most recent of their class and leave it by removal, so a
policy built on the table's intrusive lists (LRU) needs no hooks for insert and remove. Later policies (workflow-aware
eviction, PBKV §4.2; quotas) keep their own books beside the table.
"""
from __future__ import annotations

from typing import Protocol

from kvstore.index.keytable import KeyTable


class EvictionPolicy(Protocol):
    name: str

    def accessed(self, key: bytes) -> None: ...
    def pinned(self, key: bytes) -> None: ...
    def unpinned(self, key: bytes) -> None: ...
    def victim(self, cls: int) -> bytes | None: ...


def make_policy(name: str, table: KeyTable) -> EvictionPolicy:
    """Policies by name, imported on use."""
    if name == "lru":
        from kvstore.policy.lru import LruPolicy

        return LruPolicy(table)
    raise ValueError(f"unknown eviction policy {name!r}; known: lru")
