"""Write-through: blocks that engines store are also written to the first lower tier at once, in the store lane, so
they survive a daemon restart and their later eviction costs no write (DualPath persists each full block as soon as
it fills). For every committed block with `ssd.write_through` (off by default: it spends write bandwidth on blocks
that may never be evicted), and for the blocks of a durable commit or a flush whatever that setting.

No copy: the tier's write reads straight from the committed slot, pinned only while its batch is written (BATCH
blocks at a time), so the plain write-through never holds the pool's room: a block queued but not written yet can be
evicted like any other, and then goes down by demotion — flagged urgent in the tier (`want`), so its staged copy is
written next, in the store lane, never behind background demotions. The plain queue is bounded (`ssd.staging_bytes`
of blocks): beyond it a block is skipped (write_through_skipped) and goes down on eviction, in the background.
Blocks a request waits for (a durable commit, a flush of named blocks) have their own queue, written first and never
skipped, and are pinned from the request until written: under load an evicted block may find the staging area full
and be dropped, which would make the request's answer `failed`; they are bounded by the requests in flight (a
request names at most server.max_keys_per_request blocks), and the write-through's pins by `pin_cap` bytes in all
(the state gives the share of the pool one connection may hold reserved, server.max_reserved_fraction: clients
asking for durability faster than the disk writes cannot pin the whole pool; beyond it a block waited for is queued
first in line unpinned, counted as pin_cap). A tenant-wide flush pins nothing (it may name the whole pool):
its blocks may still be evicted, and then go down urgently by demotion, or are dropped (answer `failed`).

Every queued block is booked in the durability books (durability.py) until its fate is known — written, deleted,
or lost to the durable path — and the requests waiting for it are told there: that is how a durable commit or a
flush learns its answer, and where `kvstore stats` finds the lag from commit to synced and the oldest block still
on its way. A block deleted meanwhile is not published (the tier drops a write whose block was deleted after
`announce`) and counts as done: nothing to persist.
"""
from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Sequence
from threading import Condition

from kvstore.index import Holdings, Index, NamespaceEntry
from kvstore.movers.durability import Books, Entry, Ticket
from kvstore.movers.fair import FairQueue
from kvstore.movers.slots import SlotWriter
from kvstore.testpoints import fault_point
from kvstore.tiers import DurableTier
from kvstore.tiers.host import HostPool

log = logging.getLogger("kvstore")
BATCH = 32
TENANT_SHARE = 0.5          # of the plain queue's bytes (ssd.staging_bytes) one tenant may fill: others find room


# bench/bench_isolation.py's baseline: KVSTORE_FAIR_QUEUES=0 puts every tenant in one queue, first come, first
# served, with no per-tenant bound (the write-through before issue 29), so the benchmark compares both in one run.
FAIR = os.environ.get("KVSTORE_FAIR_QUEUES", "1") != "0"


def _tenant(e: Entry) -> str:
    return e.ns.tenant if FAIR else ""


def _size(e: Entry) -> int:
    return e.ns.slot_bytes


class WriteThrough(SlotWriter[Entry]):
    what = "a write-through"

    def __init__(self, index: Index, pool: HostPool, tier: DurableTier, changed: Condition, counters: Counter[str],
                 max_bytes: int, enabled: bool = True, synced: bool = True, pin_cap: int = 1 << 62) -> None:
        self.index = index
        self.pool = pool
        self.tier = tier
        self.changed = changed                  # on the state lock: notified when there is work
        self.counters = counters
        self.max_bytes = max_bytes
        self.pin_cap = pin_cap
        self.enabled = enabled                  # ssd.write_through: every commit, not only durable ones
        self.books = Books(synced)
        self.holder = Holdings()
        # blocks a request waits for: written first; then the plain write-through, bounded by max_bytes (and by
        # half of it per tenant); each served tenant by tenant in turn (kvstore.movers.fair)
        self.urgent: FairQueue[Entry] = FairQueue(_tenant, _size)
        self.queue: FairQueue[Entry] = FairQueue(_tenant, _size)
        self.queued_bytes = 0
        self.pinned_bytes = 0                   # slots pinned: waited for (at most pin_cap), or being written
        self._stop = False
        self._watching: list[bytes] = []        # the batch's blocks evicted and staged: demotion writes them
        self.start("kvstore-writethrough")

    # ----- what gets queued (under the state lock) -----
    def committed(self, ns: NamespaceEntry, hashes: list[bytes], durable: bool = False) -> Ticket | None:
        """Queue the writes of blocks just committed (nothing pinned yet): all of them with ssd.write_through,
        else only a durable commit's. A durable commit gets the ticket it waits on."""
        if not durable and not self.enabled:
            return None
        ticket = Ticket() if durable else None
        self._queue_all([(ns, h) for h in hashes], ticket, urgent=durable, committed=True, pin=durable)
        return ticket

    def flush_blocks(self, ns: NamespaceEntry, hashes: list[bytes]) -> Ticket:
        """A ticket on these blocks reaching the disk: those in the host pool only are queued first in line,
        those being demoted are flagged urgent."""
        ticket = Ticket()
        self._queue_all([(ns, h) for h in hashes], ticket, urgent=True, committed=False, pin=True)
        return ticket

    def flush_namespaces(self, namespaces: list[NamespaceEntry]) -> Ticket:
        """A ticket on every block of these namespaces (a tenant's, or one) stored before now reaching the disk:
        here those on their way already; the caller adds the host pool's (`flush_more`, a chunk at a time: the
        pool may hold millions) and then the staged ones (`flush_staged`: those evicted meanwhile too)."""
        ticket = Ticket()
        mine = {n.id for n in namespaces}
        with self.books.cond:
            for e in self.books.of_namespaces(mine):
                self.books.attach(e, ticket)
        return ticket

    def flush_more(self, ns: NamespaceEntry, hashes: list[bytes], ticket: Ticket) -> None:
        """(Under the state lock.) Host-pool blocks of a flushed namespace: those the tier lacks are queued first
        in line, not pinned."""
        self._queue_all([(ns, h) for h in hashes], ticket, urgent=True, committed=False)

    def flush_staged(self, namespaces: list[NamespaceEntry], ticket: Ticket) -> None:
        """(Under the state lock.) The flushed namespaces' blocks in the tier's staging area: flagged urgent."""
        by_digest = {n.digest: n for n in namespaces}
        staged = self.tier.staged_keys(set(by_digest))
        self._queue_all([(by_digest[bid[:16]], bid[16:]) for bid in staged], ticket, urgent=True, committed=False)

    def forget(self, ns: NamespaceEntry, hashes: list[bytes]) -> None:
        """The blocks are being deleted: nothing to persist, their waiters count them as done."""
        bids = [ns.block_id(h) for h in hashes]
        with self.books.cond:
            for bid in bids:
                e = self.books.entries.get(bid)
                if e is not None:
                    self.books.settle(e, True, "deleted")
        self.tier.unwant(bids)

    def wait(self, ticket: Ticket, timeout: float) -> dict[str, object]:
        """(Without the state lock.) The answer once the ticket's blocks are settled, or at the deadline."""
        return self.books.wait(ticket, timeout)

    def abandon(self, ticket: Ticket) -> int:
        """(Under the state lock.) Its waiter gave up (the deadline came first): the blocks no other waiter waits
        for leave the first-in-line queue and their pins; they join the plain write-through queue, within its
        bounds (their writes go on behind the blocks requests wait for), or else leave the durable path (counted
        `abandoned`: they reach the disk like any other block, by demotion when evicted). So requests that gave up
        leave no backlog ahead of those still waiting, and pin nothing. How many left the first line."""
        dropped: list[Entry] = []
        with self.books.cond:
            gone = [e for e in ticket.entries if not e.done and not e.waived and all(t.gave_up for t in e.tickets)]
            for e in gone:
                e.waived = True
                size = e.ns.slot_bytes
                if self.queued_bytes + size <= self.max_bytes and \
                        self.queue.bytes_of[e.ns.tenant] + size <= self.max_bytes * TENANT_SHARE:
                    self.queue.append(e)
                    self.queued_bytes += size
                else:
                    self.books.settle(e, False, "abandoned")
                    dropped.append(e)
        self._unpin(gone)
        if dropped:
            self.tier.unwant([e.bid for e in dropped])
        return len(gone)

    def _queue_all(self, blocks: list[tuple[NamespaceEntry, bytes]], ticket: Ticket | None, urgent: bool,
                   committed: bool, pin: bool = False) -> None:
        wanted, watched = [], []
        with self.books.cond:
            for ns, h in blocks:
                where = self._queue_one(ns, h, ticket, urgent, committed, pin)
                if where == "slot":
                    wanted.append(ns.block_id(h))
                elif where == "staged":
                    watched.append(ns.block_id(h))
        if wanted:
            self.tier.want(wanted)
            self.changed.notify_all()
        if watched:
            self.tier.when_written(watched, self._demoted)

    def _queue_one(self, ns: NamespaceEntry, h: bytes, ticket: Ticket | None, urgent: bool,
                   committed: bool, pin: bool) -> str:
        """(Under the books' lock.) Book one block: queued from its slot ("slot", pinned there with `pin`),
        watched in the tier's staging ("staged"), or nothing to do ("" : on disk already, on its way already,
        stored nowhere, or skipped)."""
        bid = ns.block_id(h)
        e = self.books.entries.get(bid)
        if e is not None:
            self.books.attach(e, ticket)
            if pin and not e.pinned and self.index.slot(ns, h) == e.gid:    # on its way, now waited for:
                self._hold(e)                                                # held and first in line
                e.waived = False
                self.urgent.append(e)
            return ""
        if self.tier.on_disk(bid):
            return ""
        gid = self.index.slot(ns, h)
        if self.tier.has(bid):                               # evicted: on its way down by demotion
            self.books.add(bid, ns, h, gid or 0, committed, ticket)
            return "staged"
        if gid is None:
            return ""                                        # deleted, or never stored: nothing to persist
        if not urgent and (self.queued_bytes + ns.slot_bytes > self.max_bytes or
                           self.queue.bytes_of[ns.tenant] + ns.slot_bytes > self.max_bytes * TENANT_SHARE):
            self.counters["write_through_skipped"] += 1
            return ""
        e = self.books.add(bid, ns, h, gid, committed, ticket)
        assert e is not None
        if pin:
            self._hold(e)
        if urgent:
            self.urgent.append(e)
        else:
            self.queue.append(e)
            self.queued_bytes += ns.slot_bytes
        return "slot"

    def _hold(self, e: Entry) -> None:
        """(Under the state lock.) Pin a waited-for block in its slot until written, within pin_cap."""
        if self.pinned_bytes + e.ns.slot_bytes > self.pin_cap:
            self.books.counts["pin_cap"] += 1
            return
        e.pinned = self.index.pin(e.ns, e.block_hash, self.holder) == e.gid
        self.pinned_bytes += e.ns.slot_bytes if e.pinned else 0

    def _demoted(self, bid: bytes) -> None:
        """(The tier's callback, without the state lock.) A watched block left the tier's staging."""
        with self.books.cond:
            e = self.books.entries.get(bid)
            if e is not None:
                on_disk = self.tier.on_disk(bid)
                self.books.settle(e, on_disk, "written" if on_disk else "lost")
        self.tier.unwant([bid])

    # ----- the writer (kvstore.movers.slots: the loop) -----
    def _ready(self) -> bool:
        return bool(self.urgent or self.queue)

    def _finished(self) -> bool:
        return not self.urgent and not self.queue         # a stop writes what is queued first

    def _take(self) -> tuple[list[Entry], list[bytes], list[int]]:
        fault_point("write_through_loop")
        live, self._watching = self._sort(self._pull(BATCH))
        for e in live:
            if not e.pinned:                                     # held for this write only
                e.pinned = self.index.pin(e.ns, e.block_hash, self.holder) == e.gid
                self.pinned_bytes += e.ns.slot_bytes if e.pinned else 0
        return live, [e.bid for e in live], [e.gid for e in live]

    def _announced(self, batch: Sequence[Entry]) -> None:
        if self._watching:
            self.tier.when_written(self._watching, self._demoted)

    def _settle(self, batch: Sequence[Entry], stored: int) -> None:
        self.counters["written_through"] += stored
        self._unpin(list(batch))
        self._written(list(batch))

    def _pull(self, n: int) -> list[Entry]:
        """(Under the state lock.) Up to `n` entries still to settle, those a request waits for first."""
        out: list[Entry] = []
        while len(out) < n and (self.urgent or self.queue):
            if self.urgent:
                e = self.urgent.popleft()
                if e.waived and not e.done:         # its waiter gave up: it waits in the plain queue now
                    continue
            else:
                e = self.queue.popleft()
                self.queued_bytes -= e.ns.slot_bytes
            if e.done:
                self._unpin([e])                    # deleted meanwhile
            elif not any(o is e for o in out):      # (in both queues: waited for once on its way)
                out.append(e)
        return out

    def _unpin(self, entries: list[Entry]) -> None:
        """(Under the state lock.) Let go of the slots pinned for these entries."""
        gids = [e.gid for e in entries if e.pinned]
        for e in entries:
            self.pinned_bytes -= e.ns.slot_bytes if e.pinned else 0
            e.pinned = False
        if gids:
            self.index.release(gids, self.holder)

    def _sort(self, batch: list[Entry]) -> tuple[list[Entry], list[bytes]]:
        """(Under the state lock.) Blocks still in their slot and not in the tier (written now); blocks evicted
        meanwhile and staged (watched: demotion writes them, urgently); the others are settled here: on disk
        already, or evicted and dropped (lost to the durable path)."""
        live, watched, settled = [], [], []
        with self.books.cond:
            for e in batch:
                if self.tier.on_disk(e.bid):
                    self.books.settle(e, True, "on_disk")
                    settled.append(e.bid)
                elif self.index.slot(e.ns, e.block_hash) == e.gid and not self.tier.has(e.bid):
                    live.append(e)
                elif self.tier.has(e.bid):
                    watched.append(e.bid)
                else:
                    self.books.settle(e, False, "lost")
                    settled.append(e.bid)
        self._unpin([e for e in batch if e not in live])
        if settled:
            self.tier.unwant(settled)
        return live, watched

    def _written(self, live: list[Entry]) -> None:
        """(Under the state lock.) A batch's writes are over: each block on disk now, or not (deleted meanwhile:
        settled by `forget` already; or its write failed)."""
        with self.books.cond:
            for e in live:
                ok = self.tier.on_disk(e.bid)
                self.books.settle(e, ok, "written" if ok else "write_failed")
        self.tier.unwant([e.bid for e in live])

    def stats(self) -> dict[str, object]:
        """(Under the state lock.) Blocks waiting for their write, blocks being written (pinned), and the
        durable path: blocks on their way, the oldest one's age, the lag from commit to synced."""
        with self.books.cond:
            books = self.books.stats()
        return {"enabled": self.enabled, "queued": len(self.urgent) + len(self.queue), "writing": self.writing,
                "pinned_bytes": self.pinned_bytes, "restarts": self._worker.restarts, **books}

    def close(self) -> None:
        """Write what is queued (a graceful stop keeps it), then stop."""
        with self.changed:
            self._stop = True
            self.changed.notify_all()
        self._worker.join(timeout=60)
