"""Tiers: where block bytes live. Each tier owns its bytes and its capacity; none decides what to evict (the index and
its policies do) and none serves a byte it cannot prove is the one stored under the key.

The host pool (`host`) is the staging tier: shared-memory slots that clients copy into and out of, booked by the
index. Every other tier sits below it behind `LowerTier`, addressed by block id — the namespace digest (16 bytes)
and the block hash (16 bytes), stable across restarts and nodes — and is reached only through the movers:

- demotion: an evicted block is `stage`d (the tier books it and hands out a buffer), its bytes are copied in by
  `fill` after the daemon's state lock is left, and the tier writes it when it likes (in the background lane);
- write-through and persistence: `announce` the ids of a batch (under the state lock: a delete from then on
  cancels them), then `write` them from host slots (without the lock);
- promotion and prefetch: `read` (the longest verified prefix into host slots) and `read_async` (one block, as a
  transfer in a lane); a block that fails its check is a miss, never served;
- `has`, `delete`, `resize`, `stats` for the books and the operator.

Every block travels with its writer's CRC-32C (kvstore.checksum; None where its writer gave none): a tier checks
the bytes against it before it stores them and keeps it with them, and reads hand it back, so the host slot a block
is promoted into carries the writer's CRC on; a tier never replaces it with one computed from bytes it was handed.

A tier's disk or network access is a transfer on one of the traffic manager's paths. `LowerTiers` keeps the tiers
below the host pool in order (fastest first): evictions go to the first, reads find a block in whichever holds it.
Optional capabilities are protocols a tier implements or not, checked with isinstance (never by looking up a
method's name): `SharedTier` (shared with other nodes, the remote store: lookups ask it about the blocks no local
tier holds with `probe`, without the state lock, and committed blocks are put in it at once where its placement says
so), `DurableTier` (its blocks outlive the daemon: durable puts wait for it, a graceful stop persists the host pool
to it), `TenantBooks` (quotas per tenant) and `PacedTier` (bulk evictions wait for its staging). A tier that sits
above another and moves blocks down to it is listed in `registry.STACKED`. How to add a tier: kvstore.tiers.registry;
what every tier must do: tests/tiers/test_conformance.py.
"""
from __future__ import annotations

import mmap
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from kvstore.traffic import Lane, Path

if TYPE_CHECKING:
    from kvstore.traffic.manager import TrafficManager
    from kvstore.workflows import Workflows

BLOCK_ID_BYTES = 32                 # namespace digest + block hash
Buffer = bytes | bytearray | memoryview | mmap.mmap
StagingBuffer = bytearray | mmap.mmap | memoryview
TierWrite = tuple[bytes, Buffer, "int | None"]     # block id, its bytes, its writer's CRC-32C (None: none)


class TierUnavailable(RuntimeError):
    """A configured tier cannot start (its directory is taken, refused, unreachable); the message says why."""


class LowerTier(Protocol):
    """A tier below the host pool (see the module docstring for who calls what, and when)."""
    name: str
    path: Path          # the traffic path its transfers take (cancel and escalate act on it)

    def has(self, bid: bytes) -> bool: ...

    def stage(self, bid: bytes, nbytes: int, crc: int | None = None) -> StagingBuffer | bool:
        """Book an evicted block (`crc`: its writer's CRC-32C): a buffer for `fill`, True if the tier holds it
        already, False if it cannot take it now (dropped, counted). Present for `has` and reads from here on."""
        ...

    def fill(self, bid: bytes, buf: StagingBuffer, data: memoryview) -> None:
        """(Without the state lock.) Copy the evicted block's bytes into the buffer `stage` gave."""
        ...

    def announce(self, bids: list[bytes]) -> None:
        """(Under the state lock.) The ids of a coming `write`: a delete from now on cancels them."""
        ...

    def write(self, items: Sequence[TierWrite], lane: Lane) -> int:
        """Store announced blocks from where they are (host slots); returns how many were stored (a block whose
        bytes fail its writer's CRC is not)."""
        ...

    def read(self, bids: Sequence[bytes], outs: Sequence[memoryview], lane: Lane,
             on_ready: Callable[[int], None] | None = None, crcs: list[int | None] | None = None) -> int:
        """Read the longest prefix of `bids` this tier holds and verifies into `outs`; its length. `on_ready(n)`
        reports the prefix as it grows; `crcs` receives each block's writer's CRC-32C (None where it has none).
        A tier whose class sets `reads_in_pieces = True` also takes `on_piece=` (i, nbytes): the first nbytes of
        block i are in `outs[i]` and verified while the rest is still being read (the SSD tier: records with
        marks); it is passed only to such tiers, so a tier written before it needs no change."""
        ...

    def read_async(self, bid: bytes, out: memoryview, lane: Lane,
                   on_done: Callable[[Future[Any]], None]) -> Future[Any] | None:
        """One block's verified read as a transfer; None if not held. The result is its writer's CRC-32C (None
        if none) or False for a block that failed its check. Raises traffic.Busy when the lane's queue is full."""
        ...

    def delete(self, bid: bytes) -> bool: ...

    def delete_many(self, bids: Sequence[bytes]) -> list[bool]:
        """Forget blocks (per block: whether the tier held it); durable when it returns, where the tier can be."""
        ...

    def resize(self, capacity: int) -> dict[str, Any]:
        """Set the cap; the reply fields of the resize op (capacity, evicted, mapped_bytes). ValueError if the
        capacity is too small for this tier, RuntimeError if it cannot resize now."""
        ...

    def namespaces(self) -> dict[bytes, int]:
        """Blocks held per namespace digest."""
        ...

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


@runtime_checkable
class SharedTier(LowerTier, Protocol):
    """A lower tier shared with other nodes (the remote store): what it holds beyond what this daemon put there is
    known only by asking it, which `probe` does without the daemon's state lock."""
    write_through: bool     # committed blocks are put in it at once (kvstore.movers.publish)
    up: bool                # it answers now: a put would be taken (while down, publishing waits)

    def probe(self, bids: Sequence[bytes]) -> int:
        """How many leading blocks of `bids` the tier holds (one batched question; none if it does not answer)."""
        ...

    def probe_each(self, bids: Sequence[bytes]) -> list[bool]:
        """Which of `bids` the tier holds, each on its own (one batched question; none if it does not answer)."""
        ...


@runtime_checkable
class DurableTier(LowerTier, Protocol):
    """A lower tier whose blocks outlive the daemon (the SSD): it can say when a block is on its medium, which the
    durable puts and flushes and the write-through wait for (kvstore.movers.writethrough), and a graceful stop
    writes the host pool to it when `persist_on_stop` (kvstore.movers.persist)."""
    persist_on_stop: bool

    def want(self, bids: Sequence[bytes]) -> None:
        """These blocks are to be written through (a durable put or flush named them)."""
        ...

    def unwant(self, bids: Sequence[bytes]) -> None: ...

    def when_written(self, bids: Sequence[bytes], done: Callable[[bytes], None]) -> None:
        """Call `done(bid)` once each block is synced to the medium (at once for one that is)."""
        ...

    def staged_keys(self, digests: set[bytes]) -> list[bytes]:
        """The blocks of these namespaces waiting in staging for their write."""
        ...

    def on_disk(self, bid: bytes) -> bool: ...


@runtime_checkable
class TenantBooks(Protocol):
    """A tier that keeps quotas per tenant (the SSD's, kvstore.tiers.ssd.owners): it learns which namespace is
    whose from the daemon, shows its rows in `kvstore tenants`, and takes quota changes online."""
    quotas_on: bool

    def know_tenants(self, tenant_of: Callable[[bytes], str | None]) -> None:
        """The daemon's map from a registered namespace digest to its tenant."""
        ...

    def tenant_rows(self, tenants: Sequence[str]) -> dict[str, dict[str, int]]: ...

    def set_quota(self, tenant: str, nbytes: int) -> int:
        """Set a tenant's quota; its quota before. ValueError where the quotas would not fit the tier."""
        ...


@runtime_checkable
class PacedTier(Protocol):
    """A tier whose demotions go through bounded staging: an operator's bulk eviction waits for room instead of
    evicting faster than the tier writes (and dropping what staging cannot hold)."""

    def wait_room(self, nbytes: int, timeout: float) -> int:
        """(Without the daemon's state lock.) Wait until `nbytes` of staging are free, or `timeout`; the free
        bytes."""
        ...


class LowerTiers:
    """The tiers below the host pool, fastest first: an evicted block goes to the first; a read finds a block in
    whichever tier holds it; a delete reaches all of them."""

    def __init__(self, tiers: Sequence[LowerTier]) -> None:
        self.tiers = list(tiers)

    def __bool__(self) -> bool:
        return bool(self.tiers)

    def __iter__(self) -> Iterator[LowerTier]:
        return iter(self.tiers)

    @property
    def first(self) -> LowerTier:
        return self.tiers[0]

    def named(self, name: str) -> LowerTier | None:
        return next((t for t in self.tiers if t.name == name), None)

    @property
    def shared(self) -> SharedTier | None:
        """The tier shared with other nodes, if one is configured."""
        return next((t for t in self.tiers if isinstance(t, SharedTier)), None)

    def holder(self, bid: bytes) -> LowerTier | None:
        return next((t for t in self.tiers if t.has(bid)), None)

    def delete(self, bid: bytes) -> bool:
        return self.delete_many([bid])[0]

    def delete_many(self, bids: Sequence[bytes]) -> list[bool]:
        found = [False] * len(bids)
        for t in self.tiers:
            found = [a or b for a, b in zip(t.delete_many(bids), found)]
        return found

    def stats(self) -> list[dict[str, Any]]:
        return [t.stats() for t in self.tiers]

    def close(self) -> None:
        """Fastest first: a tier that moves blocks down (the donated tier) stops before the tier it moves them to."""
        for t in self.tiers:
            t.close()


@dataclass(frozen=True)
class TierContext:
    """What the daemon lends a tier at start, besides its own configuration section."""
    traffic: TrafficManager                 # every byte a tier moves is a transfer on one of its paths
    workflows: Workflows | None = None      # the hint books, which a workflow-aware eviction policy reads
    socket: str = ""                        # the daemon's socket: a tier with a socket of its own puts it beside
    quotas: Mapping[str, tuple[dict[str, int], int]] = field(default_factory=dict)   # per section: tenant → bytes
                                            # guaranteed, and the default of a tenant not listed
    opened: tuple[str, ...] = ()            # the names of the tiers opened before this one
    below: LowerTier | None = None          # (stacked tiers) the tier they move blocks down to
