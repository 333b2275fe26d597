"""The durability books: which committed blocks are on their way to the first lower tier, since when, and which
requests wait for them (a durable commit, a flush).

Each block on its way has one `Entry` (by block id) from the moment it is queued (at its commit, or by a flush) until
its fate is known: its record written and synced (durable), or not to be written any more (deleted: nothing to
persist, counted as done), or lost to the durable path (its write failed, or it was evicted and dropped before its
write: `failed`). A waiter holds a `Ticket` on the entries it waits for; `wait` answers once none is left, or at
its deadline. The answer names what the request got:

- `durable`: every block it waited for is on disk and synced (or was deleted meanwhile);
- `unsynced`: they are written, but ssd.sync is never, so nothing is synced: they survive a kill -9 of the daemon,
  not a power cut (the daemon never calls a write durable without a sync);
- `timeout`: the deadline came first; the blocks are stored (host pool or staging), and those no other request
  waits for leave the first line and their pins (`WriteThrough.abandon`: a request that gave up leaves no backlog
  ahead of those still waiting); their writes go on behind, in the plain write-through queue where it has room;
- `failed`: some could not be written (counted in `failed`); they may still be in the host pool;
- `no_ssd_tier`: the daemon has no tier to make anything durable on (the op's answer, not the books').

The books have their own lock (`cond`), taken under the daemon's state lock and never the other way round, so a
waiter waits without the state lock and the tier's writer can report a block written without it. The lag from a
block's commit to its record synced is kept in `lag` (kvstore.histogram) with its maximum; `oldest_s` is the age of
the oldest block still on its way — what `kvstore stats` shows under write_through.
"""
from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from kvstore.histogram import Histogram
from kvstore.index import NamespaceEntry

DURABLE, UNSYNCED, TIMEOUT, FAILED, NO_SSD_TIER = "durable", "unsynced", "timeout", "failed", "no_ssd_tier"
ANSWERS = (DURABLE, UNSYNCED, TIMEOUT, FAILED, NO_SSD_TIER)


@dataclass(eq=False)
class Ticket:
    """What one request waits for: `blocks` in all, `remaining` not settled yet, `failed` lost to the durable
    path."""
    blocks: int = 0
    remaining: int = 0
    failed: int = 0
    gave_up: bool = False       # its wait ended before its blocks were settled (or it never waited: timeout 0)
    entries: list[Entry] = field(default_factory=list)


@dataclass(eq=False)
class Entry:
    """A block on its way to the lower tier."""
    bid: bytes
    ns: NamespaceEntry
    block_hash: bytes
    gid: int                    # its host slot when queued (it may leave it: then demotion takes it down)
    since: float                # time.monotonic() when queued
    committed: bool             # queued at its commit (its lag counts), not by a flush of an older block
    tickets: list[Ticket] = field(default_factory=list)
    done: bool = False
    pinned: bool = False        # its slot is pinned by the write-through until written (a request waits for it)
    waived: bool = False        # its waiters gave up: no longer first in line (WriteThrough.abandon)


class Books:
    def __init__(self, synced: bool) -> None:
        self.synced = synced                    # False under ssd.sync never: written is all there is
        self.cond = threading.Condition()
        self.entries: OrderedDict[bytes, Entry] = OrderedDict()     # oldest first
        self.lag = Histogram()
        self.max_lag = 0.0
        self.counts: Counter[str] = Counter()   # settled blocks by fate; answers given by kind

    def add(self, bid: bytes, ns: NamespaceEntry, block_hash: bytes, gid: int, committed: bool,
            ticket: Ticket | None) -> Entry | None:
        """(Under `cond`.) Book a block on its way, with `ticket` waiting for it; None if it was on its way
        already (the ticket then waits for that entry)."""
        e = self.entries.get(bid)
        if e is not None:
            self.attach(e, ticket)
            return None
        e = self.entries[bid] = Entry(bid, ns, block_hash, gid, time.monotonic(), committed)
        self.attach(e, ticket)
        return e

    @staticmethod
    def attach(e: Entry, ticket: Ticket | None) -> None:
        if ticket is not None:
            e.tickets.append(ticket)
            ticket.entries.append(e)
            ticket.blocks += 1
            ticket.remaining += 1

    def settle(self, e: Entry, ok: bool, why: str) -> None:
        """(Under `cond`.) The block's fate is known: `ok` (on disk, or nothing to persist) or lost to the
        durable path; `why` is counted. Its waiters are told."""
        if e.done:
            return
        e.done = True
        if self.entries.get(e.bid) is e:
            del self.entries[e.bid]
        self.counts[why] += 1
        if ok and why == "written" and e.committed:
            lag = time.monotonic() - e.since
            self.lag.observe(lag)
            self.max_lag = max(self.max_lag, lag)
        for t in e.tickets:
            t.remaining -= 1
            t.failed += not ok
        if e.tickets:
            self.cond.notify_all()

    def wait(self, ticket: Ticket, timeout: float) -> dict[str, object]:
        """(Without the daemon's state lock.) Wait until the ticket's blocks are settled, at most `timeout`
        seconds; the reply fields: the answer (`durability`), and the blocks still pending and failed."""
        with self.cond:
            self.cond.wait_for(lambda: ticket.remaining <= 0, timeout)
            pending, failed = ticket.remaining, ticket.failed
            ticket.gave_up = pending > 0
            answer = FAILED if failed else TIMEOUT if pending else DURABLE if self.synced else UNSYNCED
            if timeout > 0:                     # (0: a commit that only queues its blocks, as a put's parts do)
                self.counts[f"answer.{answer}"] += 1
        return {"durability": answer, "blocks": ticket.blocks, "pending": pending, "failed": failed}

    def of_namespaces(self, ids: set[int]) -> list[Entry]:
        """(Under `cond`.) The entries of these namespaces (by id)."""
        return [e for e in self.entries.values() if e.ns.id in ids]

    def stats(self) -> dict[str, object]:
        """(Under `cond`.) What `kvstore stats` shows of the durable path."""
        oldest = next(iter(self.entries.values()), None)
        return {"pending": len(self.entries),
                "oldest_pending_s": time.monotonic() - oldest.since if oldest is not None else 0.0,
                "lag": self.lag.to_dict(), "max_lag_s": self.max_lag, "settled": dict(self.counts)}
