"""Namespaces as the daemon books them, and what each connection holds.

A namespace is registered once per digest (what makes KV bytes identical, kvstore.protocol.keys) and gets a small
id; its blocks' index keys are that id (4 bytes, big endian) + the block hash (16 bytes): 20 bytes, unique in
this daemon's lifetime, cheap to hash. Across restarts and tiers a block is named by its block id instead: the
namespace digest + the block hash (32 bytes). A connection may use only the namespaces it said hello to.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvstore.index.errors import TooLarge, UnknownNamespace
from kvstore.protocol.keys import NamespaceSpec

PREFIX_BYTES = 4        # a namespace id at the start of each index key


@dataclass(slots=True)
class NamespaceEntry:
    id: int
    spec: NamespaceSpec
    digest: bytes
    prefix: bytes               # the 4 bytes that start each of its index keys
    slot_bytes: int
    cls: int                    # eviction class: one per block size
    blocks: int = 0             # blocks of it in the host pool

    def key(self, block_hash: bytes) -> bytes:
        """The index key of one of its blocks."""
        return self.prefix + block_hash

    def block_id(self, block_hash: bytes) -> bytes:
        """The block id of one of its blocks, as the lower tiers name it."""
        return self.digest + block_hash


@dataclass(slots=True)
class Holdings:
    """What one connection (or one mover) holds: released when it ends."""
    reserved: dict[bytes, int] = field(default_factory=dict)   # index key → gid
    pins: Counter[int] = field(default_factory=Counter)        # gid → count
    namespaces: set[int] = field(default_factory=set)
    segments: set[int] = field(default_factory=set)             # whose handles were sent on this connection


class Namespaces:
    """The registry: specs by id and by digest, and an eviction class per block size."""

    def __init__(self) -> None:
        self.by_id: dict[int, NamespaceEntry] = {}
        self._by_digest: dict[bytes, NamespaceEntry] = {}
        self.classes: dict[int, int] = {}             # slot bytes → eviction class id

    def register(self, spec: NamespaceSpec, holder: Holdings, pool_capacity: int) -> NamespaceEntry:
        digest = spec.digest()
        ns = self._by_digest.get(digest)
        if ns is None:
            slot = spec.geometry.full_bytes
            if slot > pool_capacity:
                raise TooLarge(f"a block of this geometry is {slot} bytes, larger than the whole pool "
                               f"({pool_capacity} bytes)")
            nid = len(self.by_id) + 1
            cls = self.classes.setdefault(slot, len(self.classes))
            ns = NamespaceEntry(nid, spec, digest, nid.to_bytes(PREFIX_BYTES, "big"), slot, cls)
            self.by_id[nid] = ns
            self._by_digest[digest] = ns
        holder.namespaces.add(ns.id)
        return ns

    def of(self, nid: int, holder: Holdings) -> NamespaceEntry:
        if nid not in holder.namespaces:
            raise UnknownNamespace(f"namespace {nid} was not registered on this connection (send hello with its "
                                   "spec first)")
        return self.by_id[nid]

    def owner(self, key: bytes) -> NamespaceEntry:
        """The namespace of an index key."""
        return self.by_id[int.from_bytes(key[:PREFIX_BYTES], "big")]

    def get(self, nid: int) -> NamespaceEntry | None:
        return self.by_id.get(nid)

    def __len__(self) -> int:
        return len(self.by_id)

    def values(self) -> list[NamespaceEntry]:
        return list(self.by_id.values())
