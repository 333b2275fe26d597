"""A namespace's blocks as a client moves them: whole-block put and get, and the two-phase pieces under them —
`Reservation` (reserve → write, whole or layer by layer → commit) and `Lease` (acquire → read → release), with
`StreamLease` for a streaming acquire. Each copy is one numpy copy between the caller's buffer and a shared slot.

Blocks are named by their block hashes (`hashes`): 16 bytes each on the wire, where longer engine hashes are folded
by `kvstore.protocol.keys.block_key`; a batched request carries them packed in its `keys` field.

Checksums are on by default, end to end: a writer commits each block with the CRC-32C of its bytes
(kvstore.checksum), every tier keeps that CRC with the block, and `get` checks its own copy against it — a block
that fails, or was committed without one, ends the prefix there (a miss, never a wrong byte).

Durability: `put(..., durable=True)`, `Reservation.commit(durable=True)` and `Namespace.wait_durable` return once
the blocks are on disk and synced in the daemon's SSD tier, or at a deadline (`durable_timeout_s`; the daemon's
ssd.durable_timeout_s when not given, capped by its ssd.durable_timeout_max_s), with the daemon's answer
(`durability`): durable, unsynced (written; ssd.sync is never), timeout (stored, not all on disk yet), failed (some
could not be written) or no_ssd_tier. Without it a put returns before any disk write (write-through, where on, is
asynchronous).

Hint context: `lookup`, `get`, `put`, `acquire`, `acquire_stream` and `reserve` take `context=` (a
kvstore.client.hints.Context, or a (workflow, agent) pair): the workflow or chat session and agent the request is
for, sent as the request's `wf` and `agent` fields (a reservation's commits carry its context too), so that the
daemon's eviction policy knows which running workflows touched each block."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore.checksum import crc32c
from kvstore.client.copier import as_bytes
from kvstore.client.hints import ContextLike, context_fields
from kvstore.protocol import HASH_BYTES, VERSION, ReserveStatus, encode
from kvstore.protocol.geometry import Geometry
from kvstore.protocol.keys import NamespaceSpec, pack_keys

if TYPE_CHECKING:
    from kvstore.client.connection import Client


class Namespace:
    """Blocks of one namespace, by block hash: its geometry fixes every block's size."""

    def __init__(self, client: Client, nid: int, spec: NamespaceSpec) -> None:
        self.client = client
        self.id = nid
        self.spec = spec
        self.geometry: Geometry = spec.geometry
        self.block_bytes = spec.geometry.full_bytes

    def _batches(self, hashes: Sequence[bytes]) -> Iterable[bytes]:
        blob = pack_keys(hashes)
        step = self.client.max_keys * HASH_BYTES
        for i in range(0, len(blob), step):
            yield blob[i:i + step]

    def lookup(self, hashes: Sequence[bytes], context: ContextLike = None) -> int:
        """How many leading blocks of `hashes` the daemon holds (in any tier)."""
        ctx = context_fields(context)
        if len(hashes) <= self.client.max_keys:       # the common case: one message
            return int(self.client.call("lookup", ns=self.id, keys=pack_keys(hashes), **ctx)["n"])
        total = 0
        for blob in self._batches(hashes):
            n = self.client.call("lookup", ns=self.id, keys=blob, **ctx)["n"]
            total += n
            if n < len(blob) // HASH_BYTES:
                break
        return total

    def reserve(self, hashes: Sequence[bytes], context: ContextLike = None) -> Reservation:
        """Slots for these blocks (see Reservation); its commits carry `context`."""
        keys = pack_keys(hashes)
        if len(keys) > self.client.max_keys * HASH_BYTES:
            raise ValueError(f"reserve takes at most {self.client.max_keys} blocks at a time")
        ctx = context_fields(context)
        reply = self.client.call("reserve", ns=self.id, keys=keys, **ctx)
        return Reservation(self, keys, reply["slots"], reply["status"], ctx)

    def acquire(self, hashes: Sequence[bytes], lane: str = "critical", context: ContextLike = None) -> Lease:
        """Pin the longest stored prefix (promoting SSD blocks into host slots, in `lane`)."""
        reply = self.client.call("acquire", ns=self.id, keys=self._acquire_keys(hashes), lane=lane,
                                 **context_fields(context))
        return Lease(self, reply["slots"], reply.get("crcs"))

    def acquire_stream(self, hashes: Sequence[bytes], lane: str = "critical",
                       context: ContextLike = None) -> StreamLease:
        """Like `acquire`, but the blocks are reported as they land in the host pool, in the order of `hashes`:
        iterate `arrivals()` and copy the first blocks (a layer at a time, say) while later ones are still on the
        SSD. Read the stream to its end (or release the lease) before the next call on this client."""
        self.client.flush()
        self.client._sendall(encode({"v": VERSION, "op": "acquire", "id": next(self.client._ids), "ns": self.id,
                                         "keys": self._acquire_keys(hashes), "lane": lane, "stream": True,
                                         **context_fields(context)}))
        return StreamLease(self)

    def _acquire_keys(self, hashes: Sequence[bytes]) -> bytes:
        keys = pack_keys(hashes)
        if len(keys) > self.client.max_keys * HASH_BYTES:
            raise ValueError(f"acquire takes at most {self.client.max_keys} blocks at a time")
        return keys

    def put(self, hashes: Sequence[bytes], blocks: Sequence[Any], batch: int = 32, checksum: bool = True,
            durable: bool = False, durable_timeout_s: float | None = None, context: ContextLike = None) -> PutResult:
        """Store whole blocks: reserve → copy → commit, `batch` blocks per reserve; with `checksum`, each block's
        CRC-32C goes with its commit (a block committed without one is never served as verified). With `durable`,
        return once the blocks are on disk (or at the deadline): `result.durability` is the daemon's answer.

        Commits are pipelined: a batch is copied in parts and each part's commit is sent without waiting, so the
        daemon books part i while this process copies part i+1; the replies are read before the next reserve.
        A durable put's commits only queue their blocks for the disk, first in line; it waits once, at the end.
        """
        if len(hashes) != len(blocks):
            raise ValueError(f"{len(hashes)} hashes but {len(blocks)} blocks")
        deadline = self._durable_deadline(durable_timeout_s) if durable else None
        result = PutResult()
        for i in reversed(range(0, len(hashes), batch)):     # tail first: see Reservation.write_and_commit
            with self.reserve(hashes[i:i + batch], context) as r:
                r.write_and_commit(blocks[i:i + batch], checksum=checksum, durable=durable)
            result.add(r)
        self.client.flush()
        if durable:
            answer = self.wait_durable(hashes, deadline)
            result.durability, result.not_durable = answer["durability"], answer["pending"] + answer["failed"]
        return result

    def wait_durable(self, hashes: Sequence[bytes], timeout_s: float | None = None) -> dict[str, Any]:
        """Wait until these blocks (those stored: a block stored nowhere has nothing to persist) are on disk and
        synced in the daemon's SSD tier — those in the host pool only are written first in line — or until the
        deadline. The daemon's answer: {durability, blocks, pending, failed} (see the module docstring)."""
        answers = []
        timeout_s = self._durable_deadline(timeout_s)
        end = None if timeout_s is None else time.monotonic() + timeout_s
        for blob in self._batches(hashes):
            extra = {} if end is None else {"timeout_ms": max(0, int((end - time.monotonic()) * 1000))}
            answers.append(self.client.call("flush", ns=self.id, keys=blob, **extra))
        return merge_answers(answers)

    def _durable_deadline(self, timeout_s: float | None) -> float | None:
        """A durable wait's deadline, checked against the client's socket timeout (which would end it first)."""
        if timeout_s is None:
            return None
        if timeout_s < 0:
            raise ValueError(f"durable_timeout_s must not be negative, got {timeout_s}")
        if self.client.timeout is not None and timeout_s >= self.client.timeout:
            raise ValueError(f"durable_timeout_s ({timeout_s} s) must be below the client's socket timeout "
                             f"({self.client.timeout} s)")
        return timeout_s

    def get(self, hashes: Sequence[bytes], outs: Sequence[Any], batch: int = 32, lane: str = "critical",
            verify: bool = True, context: ContextLike = None) -> int:
        """Load the longest stored prefix into `outs`; returns how many blocks were loaded. With `verify`, each
        copy in `outs` is checked against its writer's CRC-32C: the prefix ends at a block that fails the check or
        has no CRC (its bytes and those after it in `outs` are not to be used)."""
        if len(hashes) != len(outs):
            raise ValueError(f"{len(hashes)} hashes but {len(outs)} output buffers")
        done = 0
        leases: list[Lease] = []
        try:
            for i in range(0, len(hashes), batch):
                lease = self.acquire(hashes[i:i + batch], lane, context)
                leases.append(lease)
                if verify:
                    n = lease.read_verified(outs[i:i + len(lease)])
                else:
                    lease.read_blocks(outs[i:i + len(lease)])
                    n = len(lease)
                done += n
                if n < len(hashes[i:i + batch]):
                    break
        finally:
            for lease in reversed(leases):       # released tail first: the head stays the most recent
                lease.release()
        return done

    def prefetch(self, hashes: Sequence[bytes], wait: bool = False) -> dict[str, int]:
        """Ask the daemon to promote these blocks from SSD into free host space ahead of a get. Returns
        {queued, done, skipped} (done and skipped are final with `wait`); KVStoreError `busy` when its queue is
        full."""
        total = {"queued": 0, "done": 0, "skipped": 0}
        for blob in self._batches(hashes):
            r = self.client.call("prefetch", ns=self.id, keys=blob, wait=wait)
            for k in total:
                total[k] += r[k]
        return total

    def delete(self, hashes: Sequence[bytes]) -> int:
        return sum(self.client.call("delete", ns=self.id, keys=b)["n"] for b in self._batches(hashes))

    def _check(self, bufs: Sequence[Any], nbytes: int, what: str, writable: bool) -> list[np.ndarray]:
        arrs = [as_bytes(b, writable) for b in bufs]
        for i, a in enumerate(arrs):
            if a.nbytes != nbytes:
                raise ValueError(f"wrong geometry: {what} {i} is {a.nbytes} bytes, namespace {self.id} "
                                 f"({self.spec.model}) expects {nbytes}")
        return arrs


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
    `status[i]`: the ReserveStatus of the i-th."""

    def __init__(self, ns: Namespace, keys: bytes, gids: list[int], status: list[int],
                 context: dict[str, str] | None = None) -> None:
        self.ns = ns
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

