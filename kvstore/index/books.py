"""The index: which key lives in which host slot, who holds it, and which slots are reserved or being promoted. It
keeps the books and moves no byte (clients copy into and out of the slots it hands out; movers copy between tiers).

`Index` is the face the daemon, the movers and the tests see; it composes parts over one set of shared books
(kvstore.index.state: the key table, pins, reservations, the pool, the policy, quotas, counters, the clock):

- the request side: `stores.Stores` (two-phase stores, promotions, deletes, expiry, a connection's end) and
  `reads.Reads` (lookups, pins and releases, inspection and walks);
- the capacity side (kvstore.index.capacity): `allocation.Allocation` (a slot within the cap),
  `removal.Removal` (pins' last release, removal, frees, retiring segments and drain steps) and `trim.Trim`
  (the operator's eviction and resize).

Each part gets the books and the other parts' operations it uses, and nothing else; `Index` binds each public
operation to the part that makes it, so a call costs what it cost before the split.

Guarantees (each stated in full where it is kept)
- Two-phase store (stores): `reserve` hands out slots; the client copies; `commit` makes the blocks visible; until
  then no lookup or acquire sees them; `abort` — or the client's connection ending — frees them. Promotion from a
  lower tier is two-phase too (`plan_promotion`, `finish_promotion`), unless a delete came in between.
- `host_prefix` and `acquire` answer the longest contiguous prefix of the keys asked (reads).
- A pinned block is never evicted, overwritten or freed; a delete of a pinned block hides it at once and frees its
  slot at the last release (removal). Pins and reservations belong to a connection (its `Holdings`) and are dropped
  with it; they count against its `Holdings.held_share` of the pool (stores).
- Keys carry their namespace id, so namespaces never see each other's blocks (kvstore.index.namespaces).
- Capacity: allocation never exceeds the pool's cap; evictions are decisions handed to the eviction sink.

Every method runs under the daemon's state lock; the operator's walks (`keys_some`, `evict_some`) are made a chunk at
a time, and the caller may let go of the lock between chunks. A request the books cannot honour raises a `Refused`
(kvstore.index.errors) and changes nothing.
"""
from __future__ import annotations

from collections import Counter

from kvstore.index.allocation import Allocation
from kvstore.index.capacity import EvictionSink
from kvstore.index.namespaces import Holdings, NamespaceEntry
from kvstore.index.quotas import Quotas
from kvstore.index.reads import Reads
from kvstore.index.removal import Removal
from kvstore.index.state import open_books
from kvstore.index.stores import Stores
from kvstore.index.trim import Trim
from kvstore.protocol.keys import NamespaceSpec
from kvstore.tiers.host import HostPool
from kvstore.workflows import Workflows


class Index:
    # Slots: over 30 attributes, an instance dict would lose CPython's shared-key fast path for every `index.x`.
    __slots__ = ("_books", "_stores", "pool", "quotas", "on_evict", "table", "workflows", "namespaces", "policy",
                 "promoting", "cancelled", "pending", "deleting", "pins", "zombies", "moving", "counters", "used_at",
                 "asked", "host_prefix", "holds", "slot", "acquire", "release", "pin", "crcs_of", "stats", "blocks",
                 "walk", "keys_some", "reserve", "commit", "abort", "renew", "expire", "at_cap", "plan_promotion",
                 "finish_promotion", "delete", "begin_delete", "end_delete", "disconnect", "let_go", "evict_block",
                 "drain_some", "evict", "evict_plan", "evict_some", "resize")

    def __init__(self, pool: HostPool, policy: str = "lru", on_evict: EvictionSink | None = None,
                 counters: Counter[str] | None = None, workflows: Workflows | None = None,
                 quotas: Quotas | None = None, tenant_policies: dict[str, str] | None = None) -> None:
        books = self._books = open_books(pool, policy, on_evict, counters, workflows, quotas, tenant_policies or {})
        # the shared books, as the daemon, the movers and the tests read them (never replaced: changed in place)
        self.pool = books.pool
        self.quotas = books.quotas
        self.on_evict = books.on_evict
        self.table = books.table
        self.workflows = books.workflows
        self.namespaces = books.namespaces
        self.policy = books.policy
        self.promoting = books.promoting
        self.cancelled = books.cancelled
        self.pending = books.pending
        self.deleting = books.deleting
        self.pins = books.pins
        self.zombies = books.zombies
        self.moving = books.moving
        self.counters = books.counters
        self.used_at = books.clock.used_at

        removal = Removal(books)
        stores = self._stores = Stores(books, removal, Allocation(books, removal))
        reads = Reads(books, removal, stores.may_hold)
        trim = Trim(books, removal)

        # reads, pins, inspection
        self.asked = reads.asked
        self.host_prefix = reads.host_prefix
        self.holds = reads.holds
        self.slot = reads.slot
        self.acquire = reads.acquire
        self.release = reads.release
        self.pin = reads.pin
        self.crcs_of = reads.crcs_of
        self.stats = reads.stats
        self.blocks = reads.blocks
        self.walk = reads.walk
        self.keys_some = reads.keys_some
        # two-phase stores, promotions, deletes, a connection's end
        self.reserve = stores.reserve
        self.commit = stores.commit
        self.abort = stores.abort
        self.renew = stores.renew
        self.expire = stores.expire
        self.at_cap = stores.at_cap
        self.plan_promotion = stores.plan_promotion
        self.finish_promotion = stores.finish_promotion
        self.delete = stores.delete
        self.begin_delete = stores.begin_delete
        self.end_delete = stores.end_delete
        self.disconnect = stores.disconnect
        # capacity: blocks and segments leaving, the operator's trims
        self.let_go = removal.let_go
        self.evict_block = removal.evict_block
        self.drain_some = removal.drain_some
        self.evict = trim.evict
        self.evict_plan = trim.evict_plan
        self.evict_some = trim.evict_some
        self.resize = trim.resize

    @property
    def stopped(self) -> str | None:
        """Why the last `reserve` stored no more of its chain (Stores.reserve): "share", "room", or None."""
        return self._stores.stopped

    @property
    def coupled(self) -> bool:
        """pool.pair_eviction coupled: a base block's residual blocks leave with it (kvstore.index.removal)."""
        return self._books.coupled

    @coupled.setter
    def coupled(self, value: bool) -> None:
        self._books.coupled = value

    # ----- namespaces -----
    def register(self, spec: NamespaceSpec, holder: Holdings) -> NamespaceEntry:
        return self.namespaces.register(spec, holder, self.pool.capacity)

    def namespace(self, nid: int, holder: Holdings) -> NamespaceEntry:
        return self.namespaces.of(nid, holder)
