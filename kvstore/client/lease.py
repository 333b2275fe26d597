"""A namespace's reads: `Lease`, the two-phase load under `Namespace.get` (acquire → copy, whole blocks or layer by
layer, checked against each writer's CRC-32C → release), and `StreamLease`, a lease that grows as a streaming
acquire's replies arrive (blocks promoted from the SSD one after another). A lease owns its pinned slots' views
(mapped through its client) and their release; `Namespace` (kvstore.client.blocks) makes one with an `acquire`
request. A streaming lease reads its replies off the client's wire itself, so it must be read to its end (or
released) before the client's next request.

`StreamLease.read_streamed` is `Namespace.get`'s copy: each block is copied as its reply arrives and, where the
acquire asked for `pieces`, the next block's verified start as soon as the daemon reports it (a `landing`: the
daemon checked those bytes against the record's marks while the rest of the block is still on the disk), its CRC-32C
continued over the rest once the block is whole. An SSD-hit get then copies most of its block during the read.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore.checksum import copy_crc32c, crc32c

if TYPE_CHECKING:
    from kvstore.client.blocks import Namespace


class Lease:
    """Pinned blocks (the longest stored prefix of the hashes asked): readable until `release()`."""

    def __init__(self, ns: Namespace, gids: list[int], crcs: list[int | None] | None = None) -> None:
        self.ns = ns
        self.gids = gids
        self.crcs = crcs or [None] * len(gids)
        self.views = ns.client._views(gids)
        self.released = False

    def __len__(self) -> int:
        return len(self.gids)

    def verified_prefix(self) -> int:
        """How many leading blocks are provably the bytes committed, checked in their slots now: a block whose
        slot does not match its writer's CRC-32C (altered), or that was committed without one, ends it. A reader
        that copies the slots afterwards should check its copies instead (`read_verified`)."""
        for i, (view, crc) in enumerate(zip(self.views, self.crcs)):
            if crc is None or crc32c(view) != crc:
                return i
        return len(self.gids)

    def read_blocks(self, outs: Sequence[Any]) -> None:
        dsts = self.ns._check(list(outs)[: len(self)], self.ns.block_bytes, "output block", True)
        self.ns.client.copier.copy(list(zip(dsts, self.views)))

    def read_verified(self, outs: Sequence[Any]) -> int:
        """Copy the blocks into `outs` and check each copy against its writer's CRC-32C; returns how many leading
        copies are the bytes committed (a copy that fails, or a block without a CRC, ends the prefix). Checking
        the private copy, not the slot, leaves no window for the slot to change between check and use."""
        dsts = self.ns._check(list(outs)[: len(self)], self.ns.block_bytes, "output block", True)
        got = self.ns.client.copier.copy_checked(list(zip(dsts, self.views)))
        for i, (crc, want) in enumerate(zip(got, self.crcs)):
            if want is None or crc != want:
                return i
        return len(got)

    def read_layer(self, layer: int, outs: Sequence[Any]) -> None:
        a, b = self.ns.geometry.layer_range(layer)
        dsts = self.ns._check(list(outs)[: len(self)], b - a, "output layer block", True)
        self.ns.client.copier.copy([(d, v[a:b]) for d, v in zip(dsts, self.views)])

    def release(self) -> None:
        """Unpin. Sent without waiting (the daemon handles requests in order, so any later request of this
        client sees the pins gone); a refusal surfaces at the client's next call or `flush`."""
        if not self.released and self.gids:
            self.ns.client.send("release", slots=self.gids)
        self.released = True

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class StreamLease(Lease):
    """A lease that grows as a streaming acquire's replies arrive; `complete` once the last one is in."""

    def __init__(self, ns: Namespace, first: tuple[dict[str, Any], list[int]] | None = None) -> None:
        """`first`: the stream's first reply, read already (with the fds it passed) by the request's round trip."""
        super().__init__(ns, [], [])
        self.complete = False
        self._first = first
        self.on_landing: Callable[[int, int, int, int | None], None] | None = None  # (position, gid, verified
                                             # bytes, the writer's CRC-32C once they are the whole block)
        self.landings = 0                    # verified pieces reported ahead of their block
        self.until: Callable[[], bool] | None = None     # `arrivals` stops (the stream left open) once it is true

    def arrivals(self) -> Iterator[int]:
        """Read the daemon's replies as they come; after each, yield how many leading blocks are ready."""
        last = -1
        while not self.complete:
            if self.until is not None and self.until():
                return
            try:
                if self._first is not None:
                    (reply, fds), self._first = self._first, None
                else:
                    reply, fds = self.ns.client._reply(*self.ns.client._recv_frame(True))
            except BaseException:
                self.complete = True         # a refusal ends the stream: what arrived is still pinned, release it
                raise
            self.ns.client._adopt(reply.get("segments", []), fds)
            self.complete = not reply.get("more")
            if reply.get("landing"):
                self.landings += 1
                if self.on_landing is not None:
                    pos, gid, nbytes = reply["landing"]
                    self.on_landing(pos, gid, nbytes, reply.get("crc"))
            gids = reply["slots"]
            self.gids += gids
            self.crcs += reply.get("crcs") or [None] * len(gids)
            client = self.ns.client
            if not self.complete and {g >> 32 for g in self.gids[len(self.views):] if g} - client._segments.keys():
                continue            # a segment this client let go of (its handle not sent again): nothing may be
                                    # asked mid-stream, so these blocks are mapped once the stream has ended
            self.views += client._views(self.gids[len(self.views):])
            ready = len(self.views)
            if ready > last and (ready or self.complete):
                last = ready
                yield ready

    def read_streamed(self, dsts: Sequence[np.ndarray], verify: bool = True, early: bool = False) -> int:
        """Copy the blocks into `dsts` (flat uint8, one per key asked) as the stream brings them (module doc) and
        read it to its end; how many leading copies are the bytes committed: with `verify`, checked against each
        writer's CRC-32C as `read_verified` does (a copy that fails, or a block without a CRC, ends the prefix),
        else every block pinned. `early` (with `verify`): return as soon as every block asked is copied and
        checked — the last one, say, from its verified pieces and the writer's CRC-32C that came with them —
        leaving the rest of the stream unread (`complete` false): the caller reads it and releases the lease
        before its client's next request (`Client._open_stream`)."""
        copy = _StreamedCopy(self, dsts, verify)
        self.on_landing = copy.landed
        if early and verify:
            self.until = lambda: copy.good == len(dsts)
        try:
            for n in self.arrivals():
                copy.arrived(n)
        finally:
            self.on_landing = None
            self.until = None
        return copy.good

    def wait(self) -> int:
        """Read the stream to its end; the number of blocks pinned."""
        for _ in self.arrivals():
            pass
        return len(self.gids)

    def release(self) -> None:
        self.wait()                      # the replies must be read before this client's next request
        super().release()


class _StreamedCopy:
    """One `read_streamed`: what has been copied of each block, and the verified prefix."""

    def __init__(self, lease: StreamLease, dsts: Sequence[np.ndarray], verify: bool) -> None:
        self.lease, self.dsts, self.verify = lease, dsts, verify
        self.started: dict[int, tuple[int, int, int]] = {}   # position → (gid, bytes copied, their CRC-32C)
        self.copied = 0                                      # blocks copied whole
        self.good = 0                                        # ... of which the leading ones are the bytes committed
        self.failed = False

    def landed(self, pos: int, gid: int, nbytes: int, crc: int | None = None) -> None:
        """The verified start of the next block: copy what is new of it (a block already in, or a segment not
        mapped yet, is left to its whole reply: nothing is asked of the daemon mid-stream). With the writer's
        CRC-32C (`crc`: the bytes are the whole block), the copy is checked against it and the block done."""
        client = self.lease.ns.client
        if self.failed or pos != len(self.lease.gids) or pos >= len(self.dsts) or \
                (gid >> 32) not in client._segments:
            return
        at, have, got_so_far = self.started.get(pos, (gid, 0, 0))
        if at != gid:                                       # read again into another slot: start over
            have, got_so_far = 0, 0
        dst = self.dsts[pos]
        if not have < nbytes <= dst.nbytes:
            return
        src = client.slot(gid)[have:nbytes]
        if self.verify:
            got = copy_crc32c(dst[have:nbytes], src, crc=got_so_far)
        else:
            np.copyto(dst[have:nbytes], src)
            got = 0
        self.started[pos] = (gid, nbytes, got)
        if crc is not None and self.verify and nbytes == dst.nbytes and pos == self.copied:
            del self.started[pos]             # done without its block reply: checked against the writer's CRC
            if got != crc:
                self.failed = True
                return
            self.copied += 1
            self.good += 1

    def arrived(self, n: int) -> None:
        """The first `n` blocks are pinned: copy the ones not copied yet (the rest of a started one), check them."""
        n = min(n, len(self.dsts))
        if self.failed or n <= self.copied:
            return
        lease, first = self.lease, self.copied
        crcs: dict[int, int] = {}
        whole = [i for i in range(first, n) if self.started.get(i, (None,))[0] != lease.gids[i]]
        pairs = [(self.dsts[i], lease.views[i]) for i in whole]
        if self.verify:
            crcs.update(zip(whole, lease.ns.client.copier.copy_checked(pairs)))
        else:
            lease.ns.client.copier.copy(pairs)
        for i in sorted(set(range(first, n)) - set(whole)):      # the started ones: their rest
            _, have, crc = self.started.pop(i)
            dst, src = self.dsts[i], lease.views[i]
            if self.verify:
                crcs[i] = copy_crc32c(dst[have:], src[have:], crc=crc)
            else:
                np.copyto(dst[have:], src[have:])
        self.copied = n
        for i in range(first, n):
            if self.verify and (lease.crcs[i] is None or crcs[i] != lease.crcs[i]):
                self.failed = True
                return
            self.good += 1
