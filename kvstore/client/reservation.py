"""A namespace's writes: `Reservation`, the two-phase store under `Namespace.put` (reserve → copy, whole blocks or
layer by layer → commit, or abort), and what a put reports — `PutResult`, and the daemon's durability answers
merged over several requests (`merge_answers`). A reservation owns its reserved slots' views (mapped through its
client) and the commits of its blocks, with their CRC-32C and hint context; `Namespace` (kvstore.client.blocks)
makes one with a `reserve` request and nothing else of it lives there. Its hot path is `write_and_commit`: one
numpy copy per block (the client's Copier), the CRC computed beside the copy, commits pipelined a part at a time.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstore.checksum import crc32c
from kvstore.protocol import HASH_BYTES, ReserveStatus

if TYPE_CHECKING:
    from kvstore.client.blocks import Namespace


ANSWER_ORDER = ("no_ssd_tier", "failed", "timeout", "unsynced", "durable")     # the worst first


def merge_answers(answers: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One answer for several durable requests: the worst of their answers, their counts added."""
    if not answers:
        return {"durability": "durable", "blocks": 0, "pending": 0, "failed": 0}
    worst = min((a["durability"] for a in answers), key=ANSWER_ORDER.index)
    return {"durability": worst, **{k: sum(a.get(k, 0) for a in answers) for k in ("blocks", "pending", "failed")}}


@dataclass
class PutResult:
    """What a put did, in blocks: stored now, stored already, being stored by another writer (`busy`), or refused
    for want of space; for a durable put, the daemon's answer (`durability`) and the blocks not durable by then."""
    stored: int = 0
    existed: int = 0
    busy: int = 0
    no_space: int = 0
    durability: str | None = None
    not_durable: int = 0

    def add(self, r: Reservation) -> None:
        for s in r.status:
            if s == ReserveStatus.RESERVED:
                self.stored += 1
            elif s == ReserveStatus.EXISTS:
                self.existed += 1
            elif s == ReserveStatus.IN_PROGRESS:
                self.busy += 1
            elif s == ReserveStatus.NO_SPACE:
                self.no_space += 1


class Reservation:
    """Slots reserved for blocks being stored. Invisible to everyone until `commit()`; `abort()` (or leaving the
    `with` block on an exception, or the connection ending) frees them. `keys`: the block hashes asked, packed;
    `status[i]`: the ReserveStatus of the i-th; `stopped`: why the blocks from the first NO_SPACE on got no slot
    ("share": this connection or tenant is at server.max_reserved_fraction or max_held_fraction, and committing
    frees room; "room": no slot without evicting the chain's earlier blocks or blocks worth more), None if none was
    refused."""

    def __init__(self, ns: Namespace, keys: bytes, gids: list[int], status: list[int],
                 context: dict[str, str] | None = None, stopped: str | None = None) -> None:
        self.ns = ns
        self.stopped = stopped
        self.context = context or {}                     # the request fields of its hint context, for its commits
        self.keys = keys
        self.gids = gids
        self.status: list[ReserveStatus] = [ReserveStatus(s) for s in status]
        self.views = ns.client._views([g for g in gids if g])
        self.done = False
        self._uncommitted = len(self.reserved)   # write_and_commit commits from the end: positions before this
        self.durability: dict[str, Any] | None = None   # a durable commit's answer
        self._durable = False                            # write_and_commit's commits queue their blocks for disk

    @property
    def reserved(self) -> list[int]:
        """Positions (in the hashes asked) that got a slot and must be written."""
        return [i for i, s in enumerate(self.status) if s == ReserveStatus.RESERVED]

    def _keys_at(self, positions: list[int]) -> bytes:
        return b"".join(self.keys[i * HASH_BYTES:(i + 1) * HASH_BYTES] for i in positions)

    def write_blocks(self, blocks: Sequence[Any]) -> None:
        """Copy whole blocks, one per hash asked (blocks for positions not reserved are skipped)."""
        srcs = self.ns._check([blocks[i] for i in self.reserved], self.ns.block_bytes, "block", False)
        self.ns.client.copier.copy(list(zip(self.views, srcs)))

    def write_and_commit(self, blocks: Sequence[Any], part: int = 8, checksum: bool = True,
                         durable: bool = False) -> None:
        """Copy whole blocks and commit them `part` at a time without waiting for the replies (read by the
        client's next call or `flush`). A block is visible once its part's commit is booked. With `checksum`,
        each block's CRC-32C (of the slot as copied, computed beside the copy) goes with its commit, so that
        readers and lower tiers can verify it. With `durable`, each commit queues its blocks for the disk first in
        line, without waiting for it (Namespace.wait_durable waits)."""
        self._durable = durable
        pos = self.reserved
        srcs = self.ns._check([blocks[i] for i in pos], self.ns.block_bytes, "block", False)
        # The last part first: the daemon links each commit's blocks as the most recent, so the head of a prefix
        # ends up most recent and eviction takes its tail first (a block is useless without those before it).
        # With checksums, a part's commit goes once the next part is copied: its last CRC runs beside that copy.
        copier = self.ns.client.copier
        waiting: tuple[int, Callable[[], list[int]]] | None = None
        for start in reversed(range(0, len(pos), part)):
            pairs = list(zip(self.views[start:start + part], srcs[start:start + part]))
            if not checksum:
                copier.copy(pairs)
                self._commit_part(pos, start, part, None)
                continue
            finish = copier.start_checked(pairs)
            if waiting is not None:
                self._commit_part(pos, waiting[0], part, waiting[1]())
            waiting = (start, finish)
        if waiting is not None:
            self._commit_part(pos, waiting[0], part, waiting[1]())
        self.done = True

    def _commit_part(self, pos: list[int], start: int, part: int, crcs: list[int] | None) -> None:
        """Send the commit of the reserved positions pos[start:start + part] without waiting for its reply."""
        extra: dict[str, Any] = {"crcs": crcs, **self.context} if crcs is not None else dict(self.context)
        if self._durable:
            extra.update(durable=True, timeout_ms=0)      # queued for the disk; the put waits once, at its end
        self.ns.client.send("commit", ns=self.ns.id, keys=self._keys_at(pos[start:start + part]), **extra)
        self._uncommitted = start

    def write_layer(self, layer: int, srcs: Sequence[Any]) -> None:
        """Copy Layer Block `layer` of every reserved block (one source per hash asked)."""
        a, b = self.ns.geometry.layer_range(layer)
        arrs = self.ns._check([srcs[i] for i in self.reserved], b - a, "layer block", False)
        self.ns.client.copier.copy([(v[a:b], s) for v, s in zip(self.views, arrs)])

    def checksums(self) -> list[int]:
        """CRC-32C of each reserved slot as it is now (all layers written): what `commit(crcs=...)` takes."""
        return [crc32c(v) for v in self.views]

    def commit(self, crcs: Sequence[int] | None = None, checksum: bool = True, durable: bool = False,
               durable_timeout_s: float | None = None) -> int:
        """Publish the reserved blocks with their CRC-32C (one per reserved block): `crcs` as given, else, with
        `checksum`, computed from the slots now. Without either, readers can never verify them. With `durable`,
        the reply comes once they are on disk and synced, or at the deadline (`durable_timeout_s`, 0: queue them
        for the disk first in line and reply at once): the daemon's answer is in `self.durability`."""
        self.done = True
        pos = self.reserved
        if not pos:
            if durable:
                self.durability = merge_answers([])
            return 0
        if crcs is None and checksum:
            crcs = self.checksums()
        extra: dict[str, Any] = {"crcs": list(crcs), **self.context} if crcs is not None else dict(self.context)
        if durable:
            extra["durable"] = True
            timeout = self.ns._durable_deadline(durable_timeout_s)
            if timeout is not None:
                extra["timeout_ms"] = int(timeout * 1000)
        reply = self.ns.client.call("commit", ns=self.ns.id, keys=self._keys_at(pos), **extra)
        if durable:
            self.durability = {k: reply[k] for k in ("durability", "blocks", "pending", "failed")}
        return int(reply["n"])

    def abort(self) -> None:
        self.done = True
        pos = self.reserved[:self._uncommitted]
        if pos:
            self.ns.client.call("abort", ns=self.ns.id, keys=self._keys_at(pos))

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if not self.done:
            self.abort()


