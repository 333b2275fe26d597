"""A namespace's reads: `Lease`, the two-phase load under `Namespace.get` (acquire → copy, whole blocks or layer by
layer, checked against each writer's CRC-32C → release), and `StreamLease`, a lease that grows as a streaming
acquire's replies arrive (blocks promoted from the SSD one after another). A lease owns its pinned slots' views
(mapped through its client) and their release; `Namespace` (kvstore.client.blocks) makes one with an `acquire`
request. A streaming lease reads its replies off the client's wire itself, so it must be read to its end (or
released) before the client's next request.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from kvstore.checksum import crc32c

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

    def __init__(self, ns: Namespace) -> None:
        super().__init__(ns, [], [])
        self.complete = False

    def arrivals(self) -> Iterator[int]:
        """Read the daemon's replies as they come; after each, yield how many leading blocks are ready."""
        last = -1
        while not self.complete:
            try:
                reply, fds = self.ns.client._reply(*self.ns.client._recv_frame(True))
            except BaseException:
                self.complete = True         # a refusal ends the stream: what arrived is still pinned, release it
                raise
            self.ns.client._adopt(reply.get("segments", []), fds)
            self.complete = not reply.get("more")
            gids = reply["slots"]
            self.gids += gids
            self.crcs += reply.get("crcs") or [None] * len(gids)
            self.views += self.ns.client._views(gids)
            if len(self.gids) > last or (self.complete and last < 0):
                last = len(self.gids)
                yield last

    def wait(self) -> int:
        """Read the stream to its end; the number of blocks pinned."""
        for _ in self.arrivals():
            pass
        return len(self.gids)

    def release(self) -> None:
        self.wait()                      # the replies must be read before this client's next request
        super().release()

