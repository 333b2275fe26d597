"""Namespaces as the daemon books them, and what each connection holds.

A namespace is registered once per digest (what makes KV bytes identical, kvstore.protocol.keys) and gets a small
id; its blocks' index keys are that id (4 bytes, big endian) + the block hash (16 bytes): 20 bytes, unique in
this daemon's lifetime, cheap to hash. Across restarts and tiers a block is named by its block id instead: the
namespace digest + the block hash (32 bytes). A connection may use only the namespaces it said hello to.

Tenants: a namespace belongs to the tenant of the connection that registered it. The tenant is part of its digest
(the default tenant "" leaves digests as they were), so two tenants never share a key, a record or a hit; and its
eviction class is per (tenant, block size), as the host pool's slot classes are: a tenant's blocks live in its own
segments.

An entry is forgotten when no connection holds it (said hello to it), the host pool holds none of its blocks and
nothing is reserved for it: ids are never reused, and the lower tiers name blocks by digest, so nothing is lost.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from kvstore.index.errors import OverLimit, TooLarge, UnknownNamespace
from kvstore.index.sharing import MAX_MODELS, Pairs, ShareGroups
from kvstore.protocol.keys import NamespaceSpec

PREFIX_BYTES = 4        # a namespace id at the start of each index key
SlotKey = tuple[str, int]   # (tenant, slot bytes): a slot class of the host pool, and an eviction class


@dataclass(slots=True)
class NamespaceEntry:
    id: int
    spec: NamespaceSpec
    digest: bytes
    prefix: bytes               # the 4 bytes that start each of its index keys
    slot_bytes: int
    cls: int                    # eviction class: one per (tenant, block size)
    tenant: str = ""
    blocks: int = 0             # blocks of it in the host pool
    users: int = 0              # connections that said hello to it
    pending: int = 0            # its slots reserved (stores and promotions in progress)
    models: set[str] = field(default_factory=set)   # models that said hello to it (a share group: several)
    # what it served since registered (for `kvstore top`): lookups, blocks found and not, blocks pinned for gets
    # (host hits and promotions), blocks committed
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    got: int = 0
    put: int = 0

    @property
    def slot_key(self) -> SlotKey:
        return (self.tenant, self.slot_bytes)

    def key(self, block_hash: bytes) -> bytes:
        """The index key of one of its blocks."""
        return self.prefix + block_hash

    def block_id(self, block_hash: bytes) -> bytes:
        """The block id of one of its blocks, as the lower tiers name it."""
        return self.digest + block_hash


@dataclass(slots=True)
class Holdings:
    """What one connection (or one mover) holds: released when it ends; and the limits the daemon set for it."""
    reserved: dict[bytes, int] = field(default_factory=dict)   # index key → gid
    pins: Counter[int] = field(default_factory=Counter)        # gid → count
    namespaces: set[int] = field(default_factory=set)
    segments: set[int] = field(default_factory=set)             # whose handles were sent on this connection
    leases: OrderedDict[bytes, float] = field(default_factory=OrderedDict)   # stores' reservations → lease end
    refresh: dict[bytes, list[bytes]] = field(default_factory=dict)   # reserved key → blocks stored already before
    #                                                                    it, refreshed at its commit (Index.reserve)
    carry: list[bytes] = field(default_factory=list)   # blocks stored already at the end of a reserve with `more`
    run: set[bytes] = field(default_factory=set)       # the chain of reserves with `more` so far: not evicted for it
    _held: int = 0              # held_bytes: bytes of the slots it reserves or pins (each slot once)
    held_share: float = 0.0     # at most this share of the pool's capacity held at once (0: no cap)
    _reserved: int = 0          # reserved_bytes: bytes of its store reservations not committed yet
    reserved_share: float = 0.0  # at most this share of the pool reserved for stores at once (0: no cap)
    max_namespaces: int = 0     # namespaces it may say hello to (0: no cap)
    tenant: str | None = None   # fixed at the connection's first hello
    groups: tuple[HoldGroup, ...] = ()   # its tenant's and its user's sums: held to the same shares (`join`)

    @property
    def held_bytes(self) -> int:
        return self._held

    @held_bytes.setter
    def held_bytes(self, value: int) -> None:
        for g in self.groups:
            g.held += value - self._held
        self._held = value

    @property
    def reserved_bytes(self) -> int:
        return self._reserved

    @reserved_bytes.setter
    def reserved_bytes(self, value: int) -> None:
        for g in self.groups:
            g.reserved += value - self._reserved
        self._reserved = value

    def join(self, group: HoldGroup) -> None:
        """Count this holder's bytes in `group` too, from now on (what it holds already included)."""
        if group not in self.groups:
            group.held += self._held
            group.reserved += self._reserved
            self.groups = (*self.groups, group)

    def over(self, share: float, capacity: int, nbytes: int, reserved: bool = False) -> bool:
        """Whether `nbytes` more would take it, or one of its groups, over `share` of `capacity` (held bytes, or
        with `reserved` the reservations not committed yet)."""
        room = share * capacity
        if (self._reserved if reserved else self._held) + nbytes > room:
            return True
        return any((g.reserved if reserved else g.held) + nbytes > room for g in self.groups)


class HoldGroup:
    """The bytes held and reserved by several holders together: a tenant's connections, or one user's. Without
    them a share is per connection, and two connections hold twice as much (issue 29)."""

    __slots__ = ("name", "held", "reserved")

    def __init__(self, name: str) -> None:
        self.name, self.held, self.reserved = name, 0, 0


class Namespaces:
    """The registry: specs by id and by digest, an eviction class per block size, and what is shared across models
    and adapters (kvstore.index.sharing: share groups' geometries, base/residual pairs, forks)."""

    def __init__(self) -> None:
        self.by_id: dict[int, NamespaceEntry] = {}
        self._by_digest: dict[bytes, NamespaceEntry] = {}
        self.classes: dict[SlotKey, int] = {}         # (tenant, slot bytes) → eviction class id
        self.class_tenants: dict[int, str] = {}       # eviction class id → its tenant
        self.forgotten = 0
        self._next_id = 1
        self.groups = ShareGroups()
        self.pairs = Pairs()

    def register(self, spec: NamespaceSpec, holder: Holdings, pool_capacity: int) -> NamespaceEntry:
        """The namespace of `spec` in the holder's tenant ("" if none was set), registered on the holder."""
        tenant = holder.tenant or ""
        digest = spec.digest(tenant)
        ns = self._by_digest.get(digest)
        if ns is not None and ns.id in holder.namespaces:
            return ns
        if holder.max_namespaces and len(holder.namespaces) >= holder.max_namespaces:
            raise OverLimit(f"this connection said hello to {len(holder.namespaces)} namespaces, the most one "
                            "connection may (server.max_namespaces_per_connection)")
        if ns is None:
            self.groups.admit(spec, tenant)
            ns = self._new(spec, digest, tenant, pool_capacity)
            self.groups.joined(ns)
        if len(ns.models) < MAX_MODELS:
            ns.models.add(spec.model)
        ns.users += 1
        holder.namespaces.add(ns.id)
        return ns

    def _new(self, spec: NamespaceSpec, digest: bytes, tenant: str, pool_capacity: int) -> NamespaceEntry:
        slot = spec.geometry.full_bytes
        if slot > pool_capacity:
            raise TooLarge(f"a block of this geometry is {slot} bytes, larger than the whole pool "
                           f"({pool_capacity} bytes)")
        nid = self._next_id                           # never reused: an id names one namespace for good
        self._next_id += 1
        cls = self.classes.setdefault((tenant, slot), len(self.classes))
        self.class_tenants[cls] = tenant
        ns = NamespaceEntry(nid, spec, digest, nid.to_bytes(PREFIX_BYTES, "big"), slot, cls, tenant)
        self.by_id[nid] = ns
        self._by_digest[digest] = ns
        return ns

    def left(self, holder: Holdings) -> None:
        """A connection ended (its reservations and pins already dropped): it no longer holds its namespaces."""
        for nid in holder.namespaces:
            ns = self.by_id.get(nid)
            if ns is not None and ns.users > 0:
                ns.users -= 1
                self.forget_unused(ns)
        holder.namespaces.clear()

    def forget_unused(self, ns: NamespaceEntry) -> None:
        """Drop the entry of a namespace nobody uses: no connection holds it, no block or slot of it is in the host
        pool. O(1); called whenever one of those counts may have reached zero."""
        if ns.users == 0 and ns.blocks == 0 and ns.pending == 0 and self.by_id.get(ns.id) is ns:
            del self.by_id[ns.id]
            del self._by_digest[ns.digest]
            self.groups.left(ns)
            self.pairs.forget(ns)
            self.forgotten += 1

    def of(self, nid: int, holder: Holdings) -> NamespaceEntry:
        if nid not in holder.namespaces:
            raise UnknownNamespace(f"namespace {nid} was not registered on this connection (send hello with its "
                                   "spec first)")
        return self.by_id[nid]

    def owner(self, key: bytes) -> NamespaceEntry:
        """The namespace of an index key (stored or reserved: its entry is alive)."""
        return self.by_id[int.from_bytes(key[:PREFIX_BYTES], "big")]

    def get(self, nid: int) -> NamespaceEntry | None:
        return self.by_id.get(nid)

    def tenant_of_digest(self, digest: bytes) -> str | None:
        """The tenant of a registered namespace digest (None if none is registered). Called by a lower tier's
        writer without the state lock: one dict read."""
        ns = self._by_digest.get(digest)
        return None if ns is None else ns.tenant

    def __len__(self) -> int:
        return len(self.by_id)

    def values(self) -> list[NamespaceEntry]:
        return list(self.by_id.values())
