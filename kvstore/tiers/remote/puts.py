"""The remote tier's puts: write-through from host slots, and the put in pieces that every put goes through.

Write-through (`remote.placement` write_through or both): a committed block is put from its host slot in the store
lane (kvstore.movers.publish), no copy at all. Its id is `announce`d first, under the daemon's state lock, so that
a delete from then on cancels it: `write` puts only announced blocks, and one deleted while it was being put is
removed from the store again (a delete is a delete for every node sharing the namespace). While the store is down
a write is skipped (counted), never queued.

`put` moves blocks, each followed by its trailer (its length and its writer's CRC-32C: trailer.py) from the pad
(wire.py), in pieces of at most PIECE_BYTES, one after the other, each a transfer in the caller's lane: a critical
read waits behind one piece at most (DESIGN.md, "Traffic manager"). One piece is on the wire at a time (Mooncake's
TCP transport moves two batch calls at once at half the speed of one, measured here) while the next piece's blocks
are checked against their writers' CRCs: a store never takes a block that does not match (counted, logged). The
write-back (writeback.py) puts its staged blocks through it too. What the store took goes into the books
(books.py) as put here.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import CancelledError, Future
from functools import partial
from typing import TYPE_CHECKING, Any

from kvstore.checksum import crc32c
from kvstore.tiers import TierWrite
from kvstore.tiers.remote import trailer
from kvstore.tiers.remote.client import Part, StoreDown, store_key
from kvstore.tiers.remote.wire import TierPart, Wire, pieces
from kvstore.traffic import Busy, Lane

if TYPE_CHECKING:
    from kvstore.tiers.remote.books import Books
    from kvstore.tiers.remote.link import Link

log = logging.getLogger("kvstore")
PIECE_BYTES = 32 << 20          # a put moves at most this per transfer (what a critical read may wait behind)


class Puts(TierPart):
    def __init__(self, wire: Wire, link: Link, books: Books) -> None:
        super().__init__(wire)
        self.link = link
        self.books = books

    def announce(self, bids: list[bytes]) -> None:
        with self.lock:
            self.books.announced.update(bids)

    def write(self, items: Sequence[TierWrite], lane: Lane) -> int:
        """Put announced blocks straight from their host slots; how many the store holds now."""
        with self.lock:
            live = [it for it in items if it[0] in self.books.announced]
            if not self.link.up:
                self.books.announced.difference_update(it[0] for it in items)
                self.counters["write_skipped"] += len(items)
                return 0
        views = [memoryview(it[1]).cast("B") for it in live]
        sizes = [v.nbytes for v in views]
        try:
            ok = self.put([(bid, v, crc) for (bid, _, crc), v in zip(live, views)],
                          [self.wire.addr(v) for v in views], lane)
        except (StoreDown, Busy) as e:
            if isinstance(e, StoreDown):
                self.link.record_down(e)
            self.counters["write_skipped"] += len(live)
            ok = [False] * len(live)
        finally:
            for v in views:
                v.release()
            with self.lock:
                gone = [it[0] for it in live if it[0] not in self.books.announced]
                self.books.announced.difference_update(it[0] for it in items)
        stored = [(it[0], n) for it, n, s in zip(live, sizes, ok) if s and it[0] not in gone]
        with self.lock:
            for bid, nbytes in stored:
                self.books.mine_locked(bid, nbytes)
            self.counters["written_through"] += len(stored)
        if gone:                                     # deleted while being put: not kept in the store
            self.books.remove_later(gone)
        return len(stored)

    def put(self, items: Sequence[tuple[bytes, memoryview, int | None]], addrs: Sequence[int],
            lane: Lane) -> list[bool]:
        """Put blocks, each with its trailer, in pieces of at most PIECE_BYTES, one after the other — each a
        transfer in `lane`, so that a critical read waits behind one piece at most (DESIGN.md, "Traffic
        manager"); per item whether the store holds it now. One piece is on the wire at a time (Mooncake's TCP
        transport moves two batch calls at once at half the speed of one, measured here) while the next piece's
        blocks are checked against their writers' CRCs (those that fail are not put). Every piece queued is waited
        for (it reads memory the caller gives back afterwards): Mooncake's transfer timeout bounds it. Raises
        StoreDown (the master did not answer) or Busy (no room to queue any: try later)."""
        t0 = time.perf_counter()
        ok = [False] * len(items)
        flying: tuple[list[int], int, Future[Any]] | None = None     # (items, pad offset, transfer)
        sent = no_room = False
        down: StoreDown | None = None

        def land() -> None:
            nonlocal flying, down
            if flying is None:
                return
            keep, poff, fut = flying
            flying = None
            try:
                codes = fut.result()
            except StoreDown as e:
                down = e
                return
            except CancelledError:
                return
            finally:
                self.wire.give_pad(poff)
            for i, code in zip(keep, codes):
                ok[i] = code == 0              # (a key the store holds already also answers 0: as good as stored)
                self.counters["puts" if ok[i] else "put_refused"] += 1
                self.counters["put_bytes"] += items[i][1].nbytes if ok[i] else 0
        try:
            for a, b in pieces([it[1].nbytes for it in items], PIECE_BYTES):
                keep = [i for i in range(a, b) if self._intact(items[i])]     # while the piece before moves
                land()
                if not keep or down is not None:
                    continue
                poff = self.wire.trailers(len(keep))
                if poff is None:
                    no_room = True
                    break
                parts: list[list[Part]] = []
                for j, i in enumerate(keep):
                    t = poff + j * trailer.SIZE
                    self.pad.mm[t:t + trailer.SIZE] = trailer.pack(items[i][1].nbytes, items[i][2])
                    parts.append([(addrs[i], items[i][1].nbytes), (self.pad.addr + t, trailer.SIZE)])
                keys = [store_key(items[i][0]) for i in keep]
                try:
                    fut = self.path.submit(lane, sum(items[i][1].nbytes for i in keep),
                                           partial(self.client.put, keys, parts))
                except Busy:
                    self.wire.give_pad(poff)
                    no_room = True
                    break
                flying, sent = (keep, poff, fut), True
        finally:
            land()
        self.seconds["put_s"] += time.perf_counter() - t0
        if down is not None:
            raise down
        if no_room and not sent:
            raise Busy(self.name, lane, len(items))
        return ok

    def _intact(self, item: tuple[bytes, memoryview, int | None]) -> bool:
        """Whether a block about to be put matches its writer's CRC-32C (a store never takes a block that does
        not: counted, logged)."""
        bid, view, crc = item
        if crc is None or crc32c(view) == crc:
            return True
        self.counters["crc_mismatch"] += 1
        log.warning("remote: block %s does not match its writer's CRC-32C; not put", bid.hex()[:16])
        return False
