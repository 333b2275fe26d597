"""The remote tier's write-back: blocks evicted from the host pool, staged and put in the background.

Under `remote.placement` write_back (or both) a block evicted from the host pool is `stage`d: booked (present for
lookups and reads from then on: books.py) and given room in registered staging memory (`remote.staging_bytes`, an
arena: arena.py); beyond it the block is dropped and counted. Its bytes are copied in by `fill`, after the daemon's
state lock is left, which queues it for the writer; a block the store holds already (the books say so) is not
staged at all.

The writer thread takes PUT_BATCH staged blocks at a time, in the order they came, and puts them from staging in
the background lane (puts.py: in pieces, each checked against its writer's CRC-32C); while the store is down they
wait, in order. A block the store refused (full: it evicts after refusing) is offered RETRIES more times, at the end
of the line; then it is dropped. A block deleted while staged leaves staging at once, or, when it is in a put
transfer now, once the writer has it back (its room in the arena is read by the transfer until then).

`queue` and each block's `Staged` entry are guarded by the tier's lock (wire.py), together with the books; the
writer waits on its condition (a filled block, the store up again, the tier closing: link.py).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.tiers import StagingBuffer
from kvstore.tiers.remote.client import StoreDown
from kvstore.tiers.remote.wire import TierPart, Wire
from kvstore.traffic import Busy, Lane

if TYPE_CHECKING:
    from kvstore.tiers.remote.books import Books
    from kvstore.tiers.remote.link import Link
    from kvstore.tiers.remote.puts import Puts

PUT_BATCH = 32                  # staged blocks the write-back takes at a time
RETRIES = 1                     # a staged block the store refused is offered once more before it is dropped


@dataclass(slots=True, eq=False)
class Staged:
    off: int                    # in the staging arena
    nbytes: int
    crc: int | None
    filled: bool = False        # its bytes are in (fill done)
    putting: bool = False       # in a put transfer now: its room is given back by the writer
    deleted: bool = False
    tries: int = 0              # puts the store refused (full: it evicts after refusing, so one more is tried)


class WriteBack(TierPart):
    def __init__(self, wire: Wire, link: Link, books: Books, puts: Puts) -> None:
        super().__init__(wire)
        self.link = link
        self.books = books
        self.puts = puts
        self.staged = books.staged
        self.queue: deque[bytes] = deque()          # staged blocks in the order they came, for the writer
        self.filling: dict[int, tuple[bytes, Staged]] = {}   # id of the view `stage` handed out → its booking
        self.thread = threading.Thread(target=self._write_back, name="kvstore-remote-writer", daemon=True)

    def stage(self, bid: bytes, nbytes: int, crc: int | None = None) -> StagingBuffer | bool:
        if self.staging is None:
            return False
        with self.lock:
            if self.books.has_locked(bid, time.monotonic()):    # in the store (or on its way) already: nothing to put
                return True
            off = self.staging.take(nbytes)
            if off is None:
                self.counters["dropped"] += 1
                return False
            s = self.staged[bid] = Staged(off, nbytes, crc)
            view = self.staging.view(off, nbytes)
            self.filling[id(view)] = (bid, s)
            return view

    def fill(self, bid: bytes, buf: StagingBuffer, data: memoryview) -> None:
        """Copy the block in and queue it for the writer; a block deleted since its `stage` gives its room back
        here, not before (its room is written by this copy: handed to another block sooner, the copy would land
        on that block)."""
        buf[:] = data
        with self.cond:
            booked = self.filling.pop(id(buf), None)
            if booked is None:
                return
            _, s = booked
            if s.deleted or self.staged.get(bid) is not s:
                self.unstage(bid, s)
                return
            s.filled = True
            self.queue.append(bid)
            self.cond.notify_all()

    def _write_back(self) -> None:
        """Put staged blocks, PUT_BATCH at a time, in the background lane; wait while the store is down."""
        while True:
            with self.cond:
                while not self.link.stopping and (not self.queue or not self.link.up):
                    self.cond.wait(self.cfg.retry_s)
                if self.link.stopping and (not self.queue or not self.link.up):
                    return
                batch = self._take_staged()
            if batch:
                self._put_staged(batch)

    def _take_staged(self) -> list[tuple[bytes, Staged]]:
        """(Under the tier lock.) The next staged blocks to put, marked as being put."""
        batch: list[tuple[bytes, Staged]] = []
        while self.queue and len(batch) < PUT_BATCH:
            bid = self.queue.popleft()
            s = self.staged.get(bid)
            if s is None or s.putting:
                continue
            if s.deleted:
                self.unstage(bid, s)
                continue
            s.putting = True
            batch.append((bid, s))
        return batch

    def unstage(self, bid: bytes, s: Staged) -> None:
        """(Under the tier lock.) The block leaves staging: out of the books, its room back in the arena."""
        assert self.staging is not None
        if self.staged.get(bid) is s:
            del self.staged[bid]
        self.staging.give(s.off)

    def _put_staged(self, batch: list[tuple[bytes, Staged]]) -> None:
        assert self.staging is not None
        items = [(bid, self.staging.view(s.off, s.nbytes), s.crc) for bid, s in batch]
        addrs = [self.staging.addr + s.off for _, s in batch]
        try:
            ok = self.puts.put(items, addrs, Lane.BACKGROUND)
        except (StoreDown, Busy, RuntimeError) as e:          # RuntimeError: the path is closing
            if isinstance(e, StoreDown):
                self.link.record_down(e)
            with self.cond:                 # back in line, in order, once the store answers again
                for bid, s in reversed(batch):
                    s.putting = False
                    self.queue.appendleft(bid)
            time.sleep(0.01 if isinstance(e, Busy) else 0)
            return
        finally:
            for v in items:
                v[1].release()
        with self.cond:
            for (bid, s), stored in zip(batch, ok):
                if not stored and not s.deleted and s.tries < RETRIES:
                    s.tries += 1                 # refused (the store full): once more, at the end of the line
                    s.putting = False
                    self.queue.append(bid)
                    continue
                self.unstage(bid, s)
                if stored and not s.deleted:
                    self.books.mine_locked(bid, s.nbytes)
                    self.counters["demoted"] += 1
                elif not stored:
                    self.counters["dropped"] += 1
            self.cond.notify_all()
