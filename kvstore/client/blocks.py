"""A namespace's blocks as a client moves them: whole-block put and get, and the two-phase pieces under them —
`Reservation` (reserve → write, whole or layer by layer → commit) and `Lease` (acquire → read → release), with
`StreamLease` for a streaming acquire. Each copy is one numpy copy between the caller's buffer and a shared slot.
This module is `Namespace`: the requests that name blocks by hash (lookup, reserve, acquire, put, get, prefetch,
delete, durable waits) and the batching of them; the writes' two-phase piece is kvstore.client.reservation, the
reads' kvstore.client.lease (both named here too, as before).

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
from collections.abc import Iterable, Sequence
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore.client.copier import as_bytes
from kvstore.client.hints import ContextLike, context_fields
from kvstore.client.lease import Lease, StreamLease
from kvstore.client.reservation import ANSWER_ORDER, PutResult, Reservation, merge_answers
from kvstore.protocol import HASH_BYTES, ReserveStatus
from kvstore.protocol.geometry import Geometry
from kvstore.protocol.keys import NamespaceSpec, pack_keys

if TYPE_CHECKING:
    from kvstore.client.connection import Client

# what this module named before the reservation and the leases moved out: still importable from here
__all__ = ["ANSWER_ORDER", "Lease", "Namespace", "PutResult", "Reservation", "StreamLease", "merge_answers"]


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

    def held(self, hashes: Sequence[bytes], context: ContextLike = None) -> list[bool]:
        """Which of `hashes` the daemon holds (in any tier), each on its own: a hybrid model's sliding-window and
        state groups need a few blocks before a prefix end, not an unbroken chain (kvstore.connectors.groups).
        Pins nothing and counts no hit."""
        ctx = context_fields(context)
        out: list[bool] = []
        for blob in self._batches(hashes):
            out += [b == 1 for b in self.client.call("lookup", ns=self.id, keys=blob, mask=True, **ctx)["held"]]
        return out

    def reserve(self, hashes: Sequence[bytes], context: ContextLike = None,
                after: Sequence[bytes] = (), more: bool = False) -> Reservation:
        """Slots for these blocks, a chain head first (see Reservation: from the first block without a slot on,
        none gets one, and `stopped` says why); its commits carry `context`. `after`: blocks of the same chain
        stored just before these, which the daemon must not evict for them; `more`: this connection's next reserve
        goes on with the chain (the blocks stored already at the end of this one are refreshed with it)."""
        keys = pack_keys(hashes)
        if len(keys) > self.client.max_keys * HASH_BYTES or len(after) > self.client.max_keys:
            raise ValueError(f"reserve takes at most {self.client.max_keys} blocks at a time (and as many after)")
        ctx = context_fields(context)
        extra: dict[str, Any] = {"after": pack_keys(after)} if after else {}
        if more:
            extra["more"] = True
        reply = self.client.call("reserve", ns=self.id, keys=keys, **ctx, **extra)
        return Reservation(self, keys, reply["slots"], reply["status"], ctx, reply.get("stopped"))

    def acquire(self, hashes: Sequence[bytes], lane: str = "critical", context: ContextLike = None) -> Lease:
        """Pin the longest stored prefix (promoting SSD blocks into host slots, in `lane`)."""
        reply = self.client.call("acquire", ns=self.id, keys=self._acquire_keys(hashes), lane=lane,
                                 **context_fields(context))
        return Lease(self, reply["slots"], reply.get("crcs"))

    def acquire_stream(self, hashes: Sequence[bytes], lane: str = "critical",
                       context: ContextLike = None, pieces: bool = False) -> StreamLease:
        """Like `acquire`, but the blocks are reported as they land in the host pool, in the order of `hashes`:
        iterate `arrivals()` and copy the first blocks (a layer at a time, say) while later ones are still on the
        SSD. Read the stream to its end (or release the lease) before the next call on this client. `pieces`:
        the daemon also reports the next block's verified start while the rest is read (`StreamLease.on_landing`,
        `read_streamed`)."""
        fields = {"ns": self.id, "keys": self._acquire_keys(hashes), "lane": lane, "stream": True,
                  **context_fields(context)}
        if pieces:
            fields["pieces"] = True
        # the first reply read here, as any request's: a connection the daemon closed is opened again and the
        # acquire sent again (a broken connection's pins went with it), as `acquire` does
        return StreamLease(self, self.client._roundtrip("acquire", fields, want_fds=True))

    def _acquire_keys(self, hashes: Sequence[bytes]) -> bytes:
        keys = pack_keys(hashes)
        if len(keys) > self.client.max_keys * HASH_BYTES:
            raise ValueError(f"acquire takes at most {self.client.max_keys} blocks at a time")
        return keys

    def put(self, hashes: Sequence[bytes], blocks: Sequence[Any], batch: int = 32, checksum: bool = True,
            durable: bool = False, durable_timeout_s: float | None = None, context: ContextLike = None,
            after: Sequence[bytes] = ()) -> PutResult:
        """Store a chain of whole blocks (head first): reserve → copy → commit, `batch` blocks per reserve; with
        `checksum`, each block's CRC-32C goes with its commit (a block committed without one is never served as
        verified). With `durable`, return once the blocks are on disk (or at the deadline): `result.durability` is
        the daemon's answer. `after`: the blocks of the chain before these (a request that puts only the blocks it
        missed passes the prefix it hit), which the daemon does not evict to store these (the last
        client.max_keys of them).

        What the daemon keeps of the chain is always a prefix, its head the most recent (eviction takes the tail
        first): the chain is reserved head first — where a block gets no slot the put stops, for a block after a
        hole is never read — and committed tail first. A chain larger than this tenant's share of reservations
        (server.max_reserved_fraction) goes in windows of that size, the last window first, so that the head is
        still committed last; where a window gets no room, the windows after it, stored already, are deleted.
        Commits are pipelined (Reservation.write_and_commit). A durable put's commits only queue their blocks for
        the disk, first in line; it waits once, at the end.
        """
        if len(hashes) != len(blocks):
            raise ValueError(f"{len(hashes)} hashes but {len(blocks)} blocks")
        deadline = self._durable_deadline(durable_timeout_s) if durable else None
        store = _Store(self, hashes, blocks, batch, checksum, durable, context, after)
        run, hole, stopped = store.reserve(0, len(hashes))
        if stopped == "share" and hole:                  # larger than the share: in windows of what it let in
            for _, r in run:
                r.abort()
            result = store.in_windows(hole)
        else:
            store.commit(run)
            result = store.result([run])
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
        has no CRC (its bytes and those after it in `outs` are not to be used). Each batch is a streaming acquire
        with `pieces`: blocks promoted from the SSD are copied as they land, the first one's verified start while
        the rest of it is still on the disk (StreamLease.read_streamed)."""
        if len(hashes) != len(outs):
            raise ValueError(f"{len(hashes)} hashes but {len(outs)} output buffers")
        done = 0
        leases: list[StreamLease] = []
        one = len(hashes) <= batch          # one batch: the get may return before its stream's end (read_streamed)
        try:
            for i in range(0, len(hashes), batch):
                part = hashes[i:i + batch]
                dsts = self._check(outs[i:i + len(part)], self.block_bytes, "output block", True)
                streamed = self.acquire_stream(part, lane, context, pieces=True)
                leases.append(streamed)
                n = streamed.read_streamed(dsts, verify, early=one)
                done += n
                if n < len(part):
                    break
        finally:
            for lease in reversed(leases):       # released tail first: the head stays the most recent
                if lease.complete:
                    lease.release()
                else:                            # read to its end and released before the client's next request
                    self.client._open_stream = lease
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


Run = list[tuple[int, Reservation]]     # reservations of consecutive parts of a chain: (position of the first, it)


class _Store:
    """One `Namespace.put`: its chain reserved head first and committed tail first, in windows where it is larger
    than the tenant's share of reservations (see `Namespace.put`)."""

    def __init__(self, ns: Namespace, hashes: Sequence[bytes], blocks: Sequence[Any], batch: int, checksum: bool,
                 durable: bool, context: ContextLike, prefix: Sequence[bytes]) -> None:
        self.ns, self.hashes, self.blocks, self.batch = ns, hashes, blocks, batch
        self.checksum, self.durable, self.context = checksum, durable, context
        self.prefix = list(prefix[-ns.client.max_keys:])       # the chain's blocks before `hashes`

    def reserve(self, start: int, end: int) -> tuple[Run, int | None, str | None]:
        """Reserve hashes[start:end] `batch` at a time, head first, until a block gets no slot (the hole). Returns
        the reservations, the hole's position (None if none) and why the daemon stopped there. The blocks of the
        chain before `start` (those stored) are not evicted for these, and are refreshed with them (`after`, sent
        with the first reserve: the daemon keeps the run's chain while `more` says it goes on)."""
        run: Run = []
        keep = self.ns.client.max_keys
        after = self.hashes[max(0, start - keep):start] if start >= keep else \
            [*self.prefix, *self.hashes[:start]][-keep:]
        try:
            for i in range(start, end, self.batch):
                j = min(i + self.batch, end)
                r = self.ns.reserve(self.hashes[i:j], self.context, after if i == start else (), more=j < end)
                run.append((i, r))
                if ReserveStatus.NO_SPACE in r.status:
                    return run, i + r.status.index(ReserveStatus.NO_SPACE), r.stopped
        except BaseException:
            for _, r in run:
                r.abort()
            raise
        return run, None, None

    def commit(self, run: Run) -> None:
        """Write and commit a run's reservations, the last first (its head ends up the most recent)."""
        with ExitStack() as open_reservations:           # an error aborts those not committed yet
            for _, r in run:
                open_reservations.enter_context(r)
            for i, r in reversed(run):
                r.write_and_commit(self.blocks[i:i + len(r.status)], checksum=self.checksum, durable=self.durable)
                self.ns.client.flush()       # its commits' replies: unread, the socket's buffer fills (deadlock)

    def in_windows(self, size: int) -> PutResult:
        """Store the chain in windows of `size` blocks, the last window first; where one stops at a hole, the
        blocks the windows after it stored are deleted (they would follow the hole)."""
        kept: list[Run] = []
        dropped: list[Run] = []
        for start in reversed(range(0, len(self.hashes), size)):
            run, hole, _ = self.reserve(start, min(start + size, len(self.hashes)))
            self.commit(run)
            if hole is not None:
                dropped, kept = dropped + kept, []
            kept.append(run)
        orphans = [self.hashes[i + k] for run in dropped for i, r in run for k, st in enumerate(r.status)
                   if st == ReserveStatus.RESERVED]
        if orphans:
            self.ns.delete(orphans)
        return self.result(kept, dropped)

    def result(self, kept: Sequence[Run], dropped: Sequence[Run] = ()) -> PutResult:
        """What the put did: the blocks of the runs kept as the daemon answered, those stored by the runs dropped
        (deleted since) and those never asked as refused."""
        result = PutResult()
        asked = 0
        for run in kept:
            for _, r in run:
                result.add(r)
                asked += len(r.status)
        for run in dropped:
            for _, r in run:
                result.add(r)
                stored = r.status.count(ReserveStatus.RESERVED)
                result.stored -= stored
                result.no_space += stored
                asked += len(r.status)
        result.no_space += len(self.hashes) - asked
        return result
