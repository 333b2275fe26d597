"""The remote tier as the daemon uses it (see the package docstring for the store itself).

Placement (`remote.placement`): *write-back* — a block evicted from the host pool is staged (copied into registered
staging memory, `remote.staging_bytes`; beyond it the block is dropped and counted) and put in the background lane;
*write-through* — a committed block is put from its host slot in the store lane (kvstore.movers.publish), no copy
at all. Without an SSD tier the remote tier is the first lower tier and takes the evictions (write-back by
default); beside an SSD tier the SSD takes them and the remote tier is written through (host → SSD, and → remote).

What the store holds is known without asking it under the daemon's lock: `has` answers from the blocks this daemon
staged, and those it put or the store said it held within `remote.known_s` (5 s: below Mooncake's lease, 10 s after
a put, a read or an existence query, during which the store does not evict the value — so the books do not promise
a block the store has evicted). `probe` — one batched existence query to
the master — runs without the state lock, for a lookup's blocks that no local tier holds.

Reads move a block straight into its host slot (the pool's segments are registered with the transfer engine the
first time one of their slots moves) with its trailer into a small registered pad, in chunks all in flight at once,
each verified as it lands (`on_ready` grows the prefix). A transfer already writing into host slots is always waited
for — its late bytes would land in a slot the pool has handed to another block — so Mooncake's own transfer timeout
(MC_TRANSFER_TIMEOUT, set from remote.timeout_s) bounds it; a read still queued at `remote.timeout_s` is cancelled
and is a miss.

Faults: a call the store does not answer marks the tier down; while it is down, lookups and reads are misses at once
(the host pool and the SSD keep serving), staged blocks wait, and a link thread asks the master every
`remote.retry_s` whether it answers again (Mooncake's client links again by itself to a restarted master, its
segment mounted again; the blocks the old master knew are gone). The client is set up once, in the link thread,
and only once the master's ports accept connections: its setup holds the GIL until it gives up.
"""
from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from kvstore.checksum import crc32c
from kvstore.tiers import StagingBuffer, TierContext, TierUnavailable, TierWrite
from kvstore.tiers.remote import address, trailer
from kvstore.tiers.remote.arena import Arena
from kvstore.tiers.remote.client import NOT_FOUND, TRANSFER_FAILED, MooncakeClient, Part, StoreDown, store_key
from kvstore.tiers.remote.config import RemoteConfig
from kvstore.traffic import Busy, Lane, Path

log = logging.getLogger("kvstore")
CHUNK = 1024                    # blocks per read transfer at most
PUT_BATCH = 32                  # staged blocks the write-back takes at a time
PIECE_BYTES = 32 << 20          # a put moves at most this per transfer (what a critical read may wait behind)
READ_BYTES = 128 << 20          # a read moves at most this per transfer (one batch call is Mooncake's fastest)
PAD_BYTES = 1 << 20             # registered memory for the trailers of transfers in flight
KNOWN_MAX = 1 << 20             # blocks the books remember the store holds, at most (expired ones go first)
EXISTS_MAX = 1024               # keys in one existence query
CLOSE_FLUSH_S = 5.0             # a graceful stop puts what is staged for at most this long
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


class RemoteTier:
    name = "remote"

    def __init__(self, cfg: RemoteConfig, path: Path, client: MooncakeClient, write_back: bool,
                 placement: str = "write_back") -> None:
        self.cfg = cfg
        self.placement = placement
        self.write_through = placement in ("write_through", "both")
        self.path = path
        self.client = client
        self.write_back = write_back
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.staging = Arena(cfg.staging_bytes) if write_back else None
        self.pad = Arena(PAD_BYTES)
        self.staged: dict[bytes, Staged] = {}
        self.queue: deque[bytes] = deque()          # staged blocks in the order they came, for the writer
        self.mine: dict[bytes, int] = {}            # blocks this daemon put → their bytes (insertion-ordered)
        self.mine_bytes = 0
        self.known: dict[bytes, float] = {}         # blocks the store said it held, until when believed
        self.announced: set[bytes] = set()          # write-through blocks on their way (a delete cancels)
        self.bad: dict[bytes, float] = {}           # values that failed their check, until when (removed too)
        self.counters: Counter[str] = Counter()
        self.seconds: dict[str, float] = {"put_s": 0.0, "get_s": 0.0}   # wall time of puts and of reads
        self.up = False
        self.down_since = time.monotonic()
        self.last_error = "not connected yet"
        self._stop = False
        self._link = threading.Thread(target=self._keep_linked, name="kvstore-remote-link", daemon=True)
        self._writer = threading.Thread(target=self._write_back, name="kvstore-remote-writer", daemon=True)

    def start(self) -> "RemoteTier":
        self._link.start()
        if self.write_back:
            self._writer.start()
        return self

    # ----- the link -----
    def _keep_linked(self) -> None:
        """Connect, and connect again whenever the store is found down (every remote.retry_s). While linked, ask
        the master every remote.retry_s whether it answers (one small RPC), so that a master gone while nothing
        called it is known down before a lookup or a put waits on it (and publishing holds its queue)."""
        while True:
            with self.cond:
                deadline = time.monotonic() + self.cfg.retry_s
                while self.up and not self._stop and time.monotonic() < deadline:
                    self.cond.wait(deadline - time.monotonic())
                if self._stop:
                    return
                up = self.up
            if up:
                if not self.client.healthy():
                    self._record_down(StoreDown(f"the master at {self.cfg.master} does not answer"))
                continue
            if not self._try_link():
                with self.cond:
                    self.cond.wait(self.cfg.retry_s)

    def _try_link(self) -> bool:
        """Set the client up (once, and only when the master's ports answer: see MooncakeClient.reachable), or see
        whether the master answers again (the client links again by itself after a restart)."""
        try:
            if not self.client.connected:
                why = self.client.reachable()
                if why is not None:
                    raise StoreDown(why)
                self.client.connect()
                self.counters["connects"] += 1
                self._report_endpoint()
            elif not self.client.healthy():
                raise StoreDown(f"the master at {self.cfg.master} does not answer")
            if self.staging is not None:
                self.client.register(self.staging.addr, self.staging.size)
            self.client.register(self.pad.addr, self.pad.size)
        except StoreDown as e:
            self._record_down(e, quiet=True)
            return False
        with self.cond:
            was = time.monotonic() - self.down_since
            self.up = True
            self.cond.notify_all()
        log.info("remote: linked to Mooncake Store at %s (down %.1f s before)", self.cfg.master, was)
        return True

    def _report_endpoint(self) -> None:
        """Say where the other nodes reach this node and where its transfer ports listen; warn where that is not
        what remote.hostname and remote.bind_address ask for (kvstore.tiers.remote.address)."""
        ep = self.client.endpoint
        if ep.get("advertised"):
            log.info("remote: this node's transfer endpoint is %s (ports %s), listening on %s", ep["advertised"],
                     ", ".join(str(p) for p in ep["ports"]) or "?", ", ".join(ep["listening"]) or "?")
        for problem in address.problems(ep, self.client.advertised, self.client.listen):
            log.warning("remote: %s", problem)

    def _record_down(self, e: Exception, quiet: bool = False) -> None:
        with self.cond:
            if self.up:
                self.up = False
                self.down_since = time.monotonic()
                self.counters["went_down"] += 1
                log.warning("remote: %s; remote lookups are misses until it answers again (tried every %g s)",
                            e, self.cfg.retry_s)
            elif not quiet:
                log.debug("remote: %s", e)
            self.last_error = str(e)
            self.cond.notify_all()

    # ----- memory -----
    def _addr(self, view: memoryview) -> int:
        """The address of a host slot's bytes, its segment registered with the transfer engine on first use."""
        base = view.obj
        if not isinstance(base, mmap.mmap):
            raise TypeError("remote: blocks move from and to the host pool's segments (mmap-backed views) only")
        addr = int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
        if not self.client.registered(addr, view.nbytes):
            whole = np.frombuffer(base, dtype=np.uint8)
            start, size = int(whole.ctypes.data), whole.nbytes
            del whole
            self.client.register(start, size)
        return addr

    def _trailers(self, n: int) -> int | None:
        with self.lock:
            return self.pad.take(trailer.SIZE * n)

    def _give_pad(self, off: int) -> None:
        with self.lock:
            self.pad.give(off)

    # ----- the books -----
    def has(self, bid: bytes) -> bool:
        with self.lock:
            return self._has_locked(bid, time.monotonic())

    def _has_locked(self, bid: bytes, now: float) -> bool:
        s = self.staged.get(bid)
        if s is not None:
            return not s.deleted
        if not self.up or self.bad and self.bad.get(bid, 0.0) > now:
            return False
        return self.known.get(bid, 0.0) > now

    def _learned(self, bids: Sequence[bytes]) -> None:
        """(Under the tier lock.) The store holds these now."""
        until = time.monotonic() + self.cfg.known_s
        if len(self.known) + len(bids) > KNOWN_MAX:
            now = time.monotonic()
            self.known = {b: t for b, t in self.known.items() if t > now}
            while len(self.known) + len(bids) > KNOWN_MAX:
                self.known.pop(next(iter(self.known)))
        for b in bids:
            self.known[b] = until

    def _mine(self, bid: bytes, nbytes: int) -> None:
        """(Under the tier lock.) This daemon put the block: known present for remote.known_s, like a block the
        store said it held (the store evicts by itself; kept below Mooncake's lease, 10 s after a put or a read,
        the books never promise a block it has evicted). `mine` only counts them, per namespace."""
        self._learned([bid])
        self.mine_bytes += nbytes - self.mine.get(bid, 0)
        self.mine[bid] = nbytes
        if len(self.mine) > KNOWN_MAX:
            self.mine_bytes -= self.mine.pop(next(iter(self.mine)))

    def _forgot(self, bids: Sequence[bytes]) -> None:
        """(Under the tier lock.) The store does not hold these (any more)."""
        for b in bids:
            self.mine_bytes -= self.mine.pop(b, 0)
            self.known.pop(b, None)

    def probe(self, bids: Sequence[bytes]) -> int:
        """(Without the daemon's state lock.) How many leading blocks of `bids` the store holds: the books first,
        then one existence query for the rest. A store that does not answer within remote.timeout_s: none."""
        now = time.monotonic()
        with self.lock:
            if not self.up:
                return 0
            n = 0
            while n < len(bids) and self._has_locked(bids[n], now):
                n += 1
        rest = list(bids[n:n + EXISTS_MAX])
        if not rest:
            return n
        keys = [store_key(b) for b in rest]
        try:
            found = self._wait(self.path.submit(Lane.CRITICAL, 0, lambda: self.client.exist(keys)), True)
        except (StoreDown, FutureTimeout, Busy, CancelledError) as e:
            self.counters["probe_failed"] += 1
            if isinstance(e, FutureTimeout):            # the master did not answer in time: down for lookups
                e = StoreDown(f"the master did not answer an existence query in {self.cfg.timeout_s} s")
            if isinstance(e, StoreDown):
                self._record_down(e)
            return n
        self.counters["probes"] += 1
        run = 0
        with self.lock:
            while run < len(found) and found[run] and not self.bad.get(rest[run], 0.0) > now:
                run += 1
            self._learned(rest[:run])
        return n + run

    def _wait(self, fut: Future[Any], cancel_late: bool) -> Any:
        """A transfer's result within remote.timeout_s; past it, one still queued is cancelled (FutureTimeout),
        one running is waited for unless `cancel_late` (it moves no bytes into host slots)."""
        try:
            return fut.result(timeout=self.cfg.timeout_s)
        except FutureTimeout:
            self.counters["timeouts"] += 1
            if fut.cancel() or cancel_late:
                raise
            return fut.result()

    # ----- write-back: demotion -----
    def stage(self, bid: bytes, nbytes: int, crc: int | None = None) -> StagingBuffer | bool:
        if self.staging is None:
            return False
        with self.lock:
            if self._has_locked(bid, time.monotonic()):    # in the store (or on its way) already: nothing to put
                return True
            off = self.staging.take(nbytes)
            if off is None:
                self.counters["dropped"] += 1
                return False
            self.staged[bid] = Staged(off, nbytes, crc)
            return self.staging.view(off, nbytes)

    def fill(self, bid: bytes, buf: StagingBuffer, data: memoryview) -> None:
        buf[:] = data
        with self.cond:
            s = self.staged.get(bid)
            if s is not None:
                s.filled = True
                self.queue.append(bid)
                self.cond.notify_all()

    def _write_back(self) -> None:
        """Put staged blocks, PUT_BATCH at a time, in the background lane; wait while the store is down."""
        while True:
            with self.cond:
                while not self._stop and (not self.queue or not self.up):
                    self.cond.wait(self.cfg.retry_s)
                if self._stop and (not self.queue or not self.up):
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
                self._unstage(bid, s)
                continue
            s.putting = True
            batch.append((bid, s))
        return batch

    def _unstage(self, bid: bytes, s: Staged) -> None:
        assert self.staging is not None
        if self.staged.get(bid) is s:
            del self.staged[bid]
        self.staging.give(s.off)

    def _put_staged(self, batch: list[tuple[bytes, Staged]]) -> None:
        assert self.staging is not None
        items = [(bid, self.staging.view(s.off, s.nbytes), s.crc) for bid, s in batch]
        addrs = [self.staging.addr + s.off for _, s in batch]
        try:
            ok = self._put(items, addrs, Lane.BACKGROUND)
        except (StoreDown, Busy, RuntimeError) as e:          # RuntimeError: the path is closing
            if isinstance(e, StoreDown):
                self._record_down(e)
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
                self._unstage(bid, s)
                if stored and not s.deleted:
                    self._mine(bid, s.nbytes)
                    self.counters["demoted"] += 1
                elif not stored:
                    self.counters["dropped"] += 1
            self.cond.notify_all()

    # ----- write-through -----
    def announce(self, bids: list[bytes]) -> None:
        with self.lock:
            self.announced.update(bids)

    def write(self, items: Sequence[TierWrite], lane: Lane) -> int:
        """Put announced blocks straight from their host slots; how many the store holds now."""
        with self.lock:
            live = [it for it in items if it[0] in self.announced]
            if not self.up:
                self.announced.difference_update(it[0] for it in items)
                self.counters["write_skipped"] += len(items)
                return 0
        views = [memoryview(it[1]).cast("B") for it in live]
        sizes = [v.nbytes for v in views]
        try:
            ok = self._put([(bid, v, crc) for (bid, _, crc), v in zip(live, views)],
                           [self._addr(v) for v in views], lane)
        except (StoreDown, Busy) as e:
            if isinstance(e, StoreDown):
                self._record_down(e)
            self.counters["write_skipped"] += len(live)
            ok = [False] * len(live)
        finally:
            for v in views:
                v.release()
            with self.lock:
                gone = [it[0] for it in live if it[0] not in self.announced]
                self.announced.difference_update(it[0] for it in items)
        stored = [(it[0], n) for it, n, s in zip(live, sizes, ok) if s and it[0] not in gone]
        with self.lock:
            for bid, nbytes in stored:
                self._mine(bid, nbytes)
            self.counters["written_through"] += len(stored)
        if gone:                                     # deleted while being put: not kept in the store
            self._remove_later(gone)
        return len(stored)

    def _put(self, items: Sequence[tuple[bytes, memoryview, int | None]], addrs: Sequence[int],
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
                self._give_pad(poff)
            for i, code in zip(keep, codes):
                ok[i] = code == 0              # (a key the store holds already also answers 0: as good as stored)
                self.counters["puts" if ok[i] else "put_refused"] += 1
                self.counters["put_bytes"] += items[i][1].nbytes if ok[i] else 0
        try:
            for a, b in _pieces([it[1].nbytes for it in items], PIECE_BYTES):
                keep = [i for i in range(a, b) if self._intact(items[i])]     # while the piece before moves
                land()
                if not keep or down is not None:
                    continue
                poff = self._trailers(len(keep))
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
                    self._give_pad(poff)
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

    # ----- reads -----
    def read(self, bids: Sequence[bytes], outs: Sequence[memoryview], lane: Lane,
             on_ready: Callable[[int], None] | None = None, crcs: list[int | None] | None = None) -> int:
        """The longest verified prefix of `bids` into `outs` (host slots): staged blocks copied, the rest got
        from the store in chunks all in flight at once, each verified as it lands."""
        n = self._read_staged(bids, outs, crcs)
        if n and on_ready is not None:
            on_ready(n)
        if n == len(bids) or not self.up:
            return n
        t0 = time.perf_counter()
        chunks = [(n + a, n + b) for a, b in _pieces([o.nbytes for o in outs[n:]], READ_BYTES, CHUNK)]
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
                got = self._wait(fut, False)
            except (StoreDown, FutureTimeout, CancelledError) as e:
                if isinstance(e, StoreDown):
                    self._record_down(e)
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
                s = self.staged.get(bids[n])
                if s is None or s.deleted or not s.filled or self.staging is None:
                    break
                out = outs[n]
                out[:s.nbytes] = self.staging.view(s.off, s.nbytes)
                if s.crc is not None and crc32c(out[:s.nbytes]) != s.crc:
                    self.counters["crc_mismatch"] += 1
                    break
                if crcs is not None:
                    crcs.append(s.crc)
                n += 1
        self.counters["staged_reads"] += n
        return n

    def _get_chunk(self, bids: Sequence[bytes], outs: Sequence[memoryview]) -> list[int | None]:
        """(A transfer on the network path.) Get blocks with their trailers; the writers' CRCs of the leading
        blocks that arrived whole and match them."""
        poff = self._trailers(len(bids))
        if poff is None:
            return []
        try:
            parts = [[(self._addr(o), o.nbytes), (self.pad.addr + poff + i * trailer.SIZE, trailer.SIZE)]
                     for i, o in enumerate(outs)]
            self.pad.mm[poff:poff + len(bids) * trailer.SIZE] = bytes(len(bids) * trailer.SIZE)   # no stale one
            codes = self.client.get([store_key(b) for b in bids], parts)
            got: list[int | None] = []
            for i, (bid, out, code) in enumerate(zip(bids, outs, codes)):
                t = poff + i * trailer.SIZE
                ok, crc = trailer.unpack(self.pad.mm[t:t + trailer.SIZE], out.nbytes) if code >= 0 else (False, None)
                if not ok or code != out.nbytes + trailer.SIZE:
                    self._miss(bid, _why_missed(code))
                    break
                if crc is not None and crc32c(out) != crc:
                    self._miss(bid, "crc_mismatch")
                    log.warning("remote: block %s from the store does not match its writer's CRC-32C; a miss",
                                bid.hex()[:16])
                    break
                got.append(crc)
            self.counters["gets"] += len(got)
            self.counters["get_bytes"] += sum(o.nbytes for o in outs[:len(got)])
            return got
        finally:
            self._give_pad(poff)

    def _miss(self, bid: bytes, why: str) -> None:
        """A block the store did not serve. One whose value failed its check is quarantined here for
        remote.known_s (not asked for again) and removed from the store, so that a good copy can be put again. One
        whose transfer failed (the node holding it is gone, and the master still names it until its client_ttl
        ends) is a miss for remote.unreachable_s without asking: each lookup would otherwise report it and each
        get wait seconds for the transfer to fail again."""
        self.counters[why] += 1
        hold = {"absent": 0.0, "unreachable": self.cfg.unreachable_s}.get(why, self.cfg.known_s)
        with self.lock:
            self._forgot([bid])
            if hold:
                self.bad[bid] = time.monotonic() + hold
                if len(self.bad) > KNOWN_MAX:
                    self.bad.pop(next(iter(self.bad)))
        if why not in ("absent", "unreachable"):
            self._remove_later([bid])

    def read_async(self, bid: bytes, out: memoryview, lane: Lane,
                   on_done: Callable[[Future[Any]], None]) -> Future[Any] | None:
        """One block's verified read as a transfer (a prefetch); its result is the writer's CRC-32C or False."""
        if not self.has(bid):
            return None

        def one() -> int | None | bool:
            crcs: list[int | None] = []
            if self._read_staged([bid], [out], crcs):
                return crcs[0]
            got = self._get_chunk([bid], [out])
            return got[0] if got else False
        return self.path.submit(lane, out.nbytes, one, tag=bid, on_done=on_done)

    # ----- deletes and the operator -----
    def delete(self, bid: bytes) -> bool:
        return self.delete_many([bid])[0]

    def delete_many(self, bids: Sequence[bytes]) -> list[bool]:
        """Forget blocks here and in the store (the store's removal is a background transfer: a delete is a
        delete for every node sharing the namespace)."""
        found = []
        now = time.monotonic()
        with self.lock:
            for bid in bids:
                found.append(self._has_locked(bid, now) or bid in self.announced)
                s = self.staged.get(bid)
                if s is not None:
                    s.deleted = True
                    if not s.putting and self.staging is not None:
                        self._unstage(bid, s)
                self.announced.discard(bid)
                self.bad.pop(bid, None)
                self._forgot([bid])
        if any(found):
            self._remove_later([b for b, f in zip(bids, found) if f])
        return found

    def _remove_later(self, bids: list[bytes]) -> None:
        keys = [store_key(b) for b in bids]
        try:
            self.path.submit(Lane.BACKGROUND, 0, lambda: self.client.remove(keys))
        except (Busy, RuntimeError):
            self.counters["remove_skipped"] += len(keys)

    def resize(self, capacity: int) -> dict[str, Any]:
        raise RuntimeError("remote: the store's capacity is the segments its nodes contribute "
                           "(remote.segment_bytes on each node); it is not resized from here")

    def namespaces(self) -> dict[bytes, int]:
        with self.lock:
            c = Counter(b[:16] for b in self.mine)
            c.update(b[:16] for b, s in self.staged.items() if not s.deleted)
        return dict(c)

    def stats(self) -> dict[str, Any]:
        """The tier's row (capacity: the segment this node lends the store; blocks: those it put or staged) and
        its books; its network path's lanes are in the traffic stats (path `net`)."""
        with self.lock:
            staged = sum(s.nbytes for s in self.staged.values())
            mapped = (self.staging.size if self.staging is not None else 0) + self.pad.size
            return {"tier": self.name, "capacity_bytes": self.cfg.segment_bytes, "mapped_bytes": mapped,
                    "used_bytes": staged + self.mine_bytes, "resident_bytes": mapped,
                    "blocks": len(self.mine) + len(self.staged), "put_here_bytes": self.mine_bytes,
                    "endpoint": dict(self.client.endpoint),
                    "segments": 1, "kind": "mooncake", "master": self.cfg.master, "up": self.up,
                    "down_s": 0.0 if self.up else round(time.monotonic() - self.down_since, 3),
                    "last_error": "" if self.up else self.last_error, "placement": self.placement,
                    "replicas": self.cfg.replicas, "blocks_put_here": len(self.mine), "blocks_known": len(self.known),
                    "blocks_quarantined": len(self.bad), "staged_blocks": len(self.staged), "staged_bytes": staged,
                    "staging_capacity": self.staging.size if self.staging is not None else 0,
                    "counters": dict(self.counters), "seconds": dict(self.seconds)}

    def close(self) -> None:
        """Put what is staged (for at most CLOSE_FLUSH_S), then let go of the store."""
        deadline = time.monotonic() + CLOSE_FLUSH_S
        with self.cond:
            while self.queue and self.up and time.monotonic() < deadline:
                self.cond.wait(0.05)
            self._stop = True
            self.cond.notify_all()
        if self.write_back:
            self._writer.join(timeout=CLOSE_FLUSH_S)
        self._link.join(timeout=1.0)
        self.path.close()                            # no transfer may call the client after its close
        self.client.close()
        if self.staging is not None:
            self.staging.close()
        self.pad.close()


def _why_missed(code: int) -> str:
    """A get's code for a block it did not serve: absent (not in the store, or the master did not answer),
    unreachable (the bytes did not arrive: the node holding them is gone), or bad_value (its length is wrong)."""
    if code == TRANSFER_FAILED:
        return "unreachable"
    if code == NOT_FOUND or code <= -900:
        return "absent"
    return "bad_value"


def _pieces(sizes: Sequence[int], limit: int, most: int = 1 << 30) -> list[tuple[int, int]]:
    """[a, b) ranges of consecutive items, each at most `limit` bytes and `most` items (at least one item)."""
    out: list[tuple[int, int]] = []
    a, total = 0, 0
    for i, n in enumerate(sizes):
        if i > a and (total + n > limit or i - a >= most):
            out.append((a, i))
            a, total = i, 0
        total += n
    out.append((a, len(sizes)))
    return out


def placement(cfg: RemoteConfig, below_first: str = "") -> str:
    """write_back or write_through or both, as configured; `auto`: write-back where the remote tier is the first
    lower tier, else write-through (`below_first`, the tier opened before it, takes the evictions)."""
    if cfg.placement == "auto":
        return "write_through" if below_first else "write_back"
    return cfg.placement


def open_tier(cfg: RemoteConfig, ctx: TierContext) -> RemoteTier | None:
    if not cfg.master:
        return None
    first = ctx.opened[0] if ctx.opened else ""
    where = placement(cfg, first)
    if first and where != "write_through":
        raise TierUnavailable(f"remote.placement {where}: beside an {first.upper()} tier the {first.upper()} takes "
                              f"the host pool's evictions; set remote.placement to write_through (or auto)")
    # Mooncake's own bound on a transfer that has started (a read into host slots is never abandoned)
    os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(max(1, int(round(cfg.timeout_s)))))
    # Mooncake's own log lines go to the daemon's stderr: its warnings and errors only, unless kvstore logs debug
    os.environ.setdefault("MC_LOG_LEVEL", "INFO" if log.isEnabledFor(logging.DEBUG) else "WARNING")
    advertised, listen = _endpoint_addresses(cfg)
    client = MooncakeClient(cfg, advertised, listen)
    path = ctx.traffic.path("net", cfg.in_flight, nominal_bps=1e9)
    tier = RemoteTier(cfg, path, client, write_back=where in ("write_back", "both"), placement=where).start()
    log.info("remote: Mooncake Store at %s (metadata %s, %s), %s, %d replica(s); this node is %s to the others; "
             "linking in the background", cfg.master, cfg.metadata or "the master's", cfg.protocol, where,
             cfg.replicas, advertised)
    return tier


def _endpoint_addresses(cfg: RemoteConfig) -> tuple[str, str | None]:
    """(the address the other nodes are told, the one the transfer ports bind or None for every address), with
    MC_TCP_BIND_ADDRESS set to the first: Mooncake advertises that, not the hostname its setup is given."""
    try:
        told = address.advertised(cfg.hostname)
    except OSError as e:
        raise TierUnavailable(f"remote.hostname {cfg.hostname!r} does not resolve ({e}); set it to this node's "
                              f"address as the other nodes reach it") from None
    before = os.environ.get("MC_TCP_BIND_ADDRESS")
    if before and before != told:
        log.warning("remote: MC_TCP_BIND_ADDRESS=%s in the environment is replaced by remote.hostname's %s (one "
                    "setting decides where this node's bytes travel: set remote.hostname)", before, told)
    os.environ["MC_TCP_BIND_ADDRESS"] = told
    listen = address.listen_address(told, cfg.bind_address)
    if listen is not None and not address.guard_loaded():
        log.warning("remote: the transfer engine's ports will listen on every address, not only %s: the bind "
                    "guard (native/kvbind.c) is not loaded (%s); firewall them, or set remote.bind_address: "
                    "0.0.0.0 to say that is meant", listen,
                    "not built: no C compiler at install" if address.library_path() is None else
                    "start the daemon with `kvstore serve`, which preloads it")
    return told, listen
