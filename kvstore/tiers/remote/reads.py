"""The remote tier's reads: the longest verified prefix into host slots; a block that fails its check is a miss.

Reads move a block straight into its host slot (the pool's segments are registered with the transfer engine the
first time one of their slots moves) with its trailer into a small registered pad, in chunks all in flight at once,
each verified as it lands (`on_ready` grows the prefix). A transfer already writing into host slots is always waited
for — its late bytes would land in a slot the pool has handed to another block — so Mooncake's own transfer timeout
(MC_TRANSFER_TIMEOUT, set from remote.timeout_s) bounds it; a read still queued at `remote.timeout_s` is cancelled
and is a miss.

Blocks still in staging (the write-back's, writeback.py) are served from there first, copied and checked against
their writers' CRCs, as the leading run of the prefix. A block the store did not serve leaves the books (books.py):
one whose value failed its check (its length or its CRC-32C) is quarantined for remote.known_s and removed from the
store, so that a good copy can be put again; one whose transfer failed (the node holding it is gone) is a miss for
remote.unreachable_s without asking. `read_async` is one block's read as a transfer (a prefetch).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from functools import partial
from typing import TYPE_CHECKING, Any

from kvstore.checksum import crc32c
from kvstore.tiers.remote import trailer
from kvstore.tiers.remote.books import KNOWN_MAX
from kvstore.tiers.remote.client import NOT_FOUND, TRANSFER_FAILED, StoreDown, store_key
from kvstore.tiers.remote.wire import TierPart, Wire, pieces
from kvstore.traffic import Busy, Lane

if TYPE_CHECKING:
    from kvstore.tiers.remote.books import Books
    from kvstore.tiers.remote.link import Link

log = logging.getLogger("kvstore")
CHUNK = 1024                    # blocks per read transfer at most
READ_BYTES = 128 << 20          # a read moves at most this per transfer (one batch call is Mooncake's fastest)


class Reads(TierPart):
    def __init__(self, wire: Wire, link: Link, books: Books) -> None:
        super().__init__(wire)
        self.link = link
        self.books = books
        self.staged = books.staged

    def read(self, bids: Sequence[bytes], outs: Sequence[memoryview], lane: Lane,
             on_ready: Callable[[int], None] | None = None, crcs: list[int | None] | None = None) -> int:
        """The longest verified prefix of `bids` into `outs` (host slots): staged blocks copied, the rest got
        from the store in chunks all in flight at once, each verified as it lands."""
        n = self._read_staged(bids, outs, crcs)
        if n and on_ready is not None:
            on_ready(n)
        if n == len(bids) or not self.link.up:
            return n
        t0 = time.perf_counter()
        chunks = [(n + a, n + b) for a, b in pieces([o.nbytes for o in outs[n:]], READ_BYTES, CHUNK)]
        futures: list[Future[Any]] = []
        try:
            for a, b in chunks:
                futures.append(self.path.submit(lane, sum(o.nbytes for o in outs[a:b]),
                                                partial(self._get_chunk, bids[a:b], outs[a:b]), tag=bids[a]))
        except Busy:
            pass                                     # the chunks queued so far: a shorter prefix
        for k, fut in enumerate(futures):
            a, b = chunks[k]
            try:
                got = self.wire.wait(fut, False)
            except (StoreDown, FutureTimeout, CancelledError) as e:
                if isinstance(e, StoreDown):
                    self.link.record_down(e)
                got = []
            if crcs is not None:
                crcs.extend(got)
            n += len(got)
            if len(got) < b - a:
                self._settle(futures[k + 1:])
                break
            if on_ready is not None:
                on_ready(n)
        self.seconds["get_s"] += time.perf_counter() - t0
        return n

    def _settle(self, rest: list[Future[Any]]) -> None:
        """The transfers after a failed chunk: cancelled if still queued, else waited for (they may be writing
        into host slots that the caller is about to give back)."""
        for fut in rest:
            if not fut.cancel():
                try:
                    fut.result()
                except Exception:
                    pass

    def _read_staged(self, bids: Sequence[bytes], outs: Sequence[memoryview],
                     crcs: list[int | None] | None) -> int:
        """The leading blocks still in staging, copied and checked against their writers' CRCs."""
        n = 0
        with self.lock:
            while n < len(bids):
                got = self._copy_staged_locked(bids[n], outs[n])
                if got is False:
                    break
                if crcs is not None:
                    crcs.append(got)
                n += 1
        return n

    def _copy_staged_locked(self, bid: bytes, out: memoryview) -> int | None | bool:
        """(Under the tier lock.) A staged block's bytes into `out`, checked: its writer's CRC-32C (None if none),
        or False where it is not staged (filled) or fails its check."""
        s = self.staged.get(bid)
        if s is None or s.deleted or not s.filled or self.staging is None:
            return False
        out[:s.nbytes] = self.staging.view(s.off, s.nbytes)
        if s.crc is not None and crc32c(out[:s.nbytes]) != s.crc:
            self.counters["crc_mismatch"] += 1
            return False
        self.counters["staged_reads"] += 1
        return s.crc

    def _get_chunk(self, bids: Sequence[bytes], outs: Sequence[memoryview]) -> list[int | None]:
        """(A transfer on the network path.) Get blocks with their trailers; the writers' CRCs of the leading
        blocks that arrived whole and match them."""
        poff = self.wire.trailers(len(bids))
        if poff is None:
            return []
        try:
            parts = [[(self.wire.addr(o), o.nbytes), (self.pad.addr + poff + i * trailer.SIZE, trailer.SIZE)]
                     for i, o in enumerate(outs)]
            self.pad.mm[poff:poff + len(bids) * trailer.SIZE] = bytes(len(bids) * trailer.SIZE)   # no stale one
            codes = self.client.get([store_key(b) for b in bids], parts)
            got: list[int | None] = []
            from_store = 0
            now = time.monotonic()
            with self.lock:                 # one look at the books for the chunk: staged here, or not to be served
                staged = {i for i, bid in enumerate(bids) if bid in self.staged}
                gone = {i for i, bid in enumerate(bids) if self.books.absent_locked(bid, now)}
            for i, (bid, out, code) in enumerate(zip(bids, outs, codes)):
                t = poff + i * trailer.SIZE
                ok, crc = trailer.unpack(self.pad.mm[t:t + trailer.SIZE], out.nbytes) if code >= 0 else (False, None)
                if i in staged:
                    with self.lock:
                        here = self._copy_staged_locked(bid, out)   # staged, maybe not put yet: its bytes are here
                    if here is not False:
                        got.append(here)
                        continue
                if i in gone:                               # deleted here (its removal pending), or quarantined
                    self.counters["absent"] += 1
                    break
                if not ok or code != out.nbytes + trailer.SIZE:
                    self._miss(bid, _why_missed(code))
                    break
                if crc is not None and crc32c(out) != crc:
                    self._miss(bid, "crc_mismatch")
                    log.warning("remote: block %s from the store does not match its writer's CRC-32C; a miss",
                                bid.hex()[:16])
                    break
                got.append(crc)
                from_store += 1
            self.counters["gets"] += from_store
            self.counters["get_bytes"] += sum(o.nbytes for o in outs[:len(got)])
            return got
        finally:
            self.wire.give_pad(poff)

    def _miss(self, bid: bytes, why: str) -> None:
        """A block the store did not serve. One whose value failed its check is quarantined here for
        remote.known_s (not asked for again) and removed from the store, so that a good copy can be put again. One
        whose transfer failed (the node holding it is gone, and the master still names it until its client_ttl
        ends) is a miss for remote.unreachable_s without asking: each lookup would otherwise report it and each
        get wait seconds for the transfer to fail again."""
        self.counters[why] += 1
        hold = {"absent": 0.0, "unreachable": self.cfg.unreachable_s}.get(why, self.cfg.known_s)
        with self.lock:
            self.books.forgot_locked([bid])
            if hold:
                self.books.bad[bid] = time.monotonic() + hold
                if len(self.books.bad) > KNOWN_MAX:
                    self.books.bad.pop(next(iter(self.books.bad)))
        if why not in ("absent", "unreachable"):
            self.books.remove_later([bid])

    def read_async(self, bid: bytes, out: memoryview, lane: Lane,
                   on_done: Callable[[Future[Any]], None]) -> Future[Any] | None:
        """One block's verified read as a transfer (a prefetch); its result is the writer's CRC-32C or False."""
        if not self.books.has(bid):
            return None

        def one() -> int | None | bool:
            crcs: list[int | None] = []
            if self._read_staged([bid], [out], crcs):
                return crcs[0]
            got = self._get_chunk([bid], [out])
            return got[0] if got else False
        return self.path.submit(lane, out.nbytes, one, tag=bid, on_done=on_done)


def _why_missed(code: int) -> str:
    """A get's code for a block it did not serve: absent (not in the store, or the master did not answer),
    unreachable (the bytes did not arrive: the node holding them is gone), or bad_value (its length is wrong)."""
    if code == TRANSFER_FAILED:
        return "unreachable"
    if code == NOT_FOUND or code <= -900:
        return "absent"
    return "bad_value"
