"""One tier contract, stated and checked: every registered lower tier (kvstore.tiers.registry: TIER_TYPES and STACKED)
is built in this process from its class and configuration, on a fake traffic path, and the same scenarios run
against each of them. The contract is kvstore.tiers' (LowerTier's docstrings and the module docstring):

- round trip: blocks demoted (stage, fill) or written through (announce, write) read back byte-exact with their
  writer's CRC-32C, while staged and once written; `read` is the longest verified prefix;
- CRC: a block whose bytes do not match the CRC it came with is never served;
- deletes: a block deleted after its announce or its stage is never stored, and a delete is a delete;
- busy: with the path refusing every transfer (traffic.Busy, a full lane) a tier answers "not now" as its
  docstrings say (a shorter read, a write that stores fewer, Busy from read_async) and loses nothing;
- resize: within the tier's bounds, else refused with a reason, never silently;
- restart: a durable tier (the SSD) keeps its blocks across a close and reopen.

What a tier may legitimately do differently is data in its `Case` (its capabilities), not branches in the tests.
A scenario that fails because a tier breaks the contract is marked xfail (strict) in its case's `known_bugs`,
with the bug named; fixing the tier turns it into an XPASS, which fails until the mark goes.

The fake path (`FakePath`) has the interface of kvstore.traffic.Path that the tiers use; it runs transfers one at
a time, in submission order, on one thread, and can hold a lane's transfers queued (a background write that has
not run yet) or refuse every transfer. The donated tier gets memory as a donor's region would (a sealed memfd,
no donor process) and no tier below it; the remote tier links to a real mooncake_master on loopback
(tests/mooncake_master.py), its blocks in host-pool segments (mmap-backed, registered on first use).
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path as FsPath
from typing import Any

import pytest

from kvstore.checksum import crc32c
from kvstore.daemon.config import RemoteConfig, SsdConfig
from kvstore.tiers import DurableTier, LowerTier
from kvstore.tiers.donated.memory import MemfdMemory
from kvstore.tiers.donated.tier import DonatedTier
from kvstore.tiers.host import HostPool
from kvstore.tiers.registry import STACKED, TIER_TYPES
from kvstore.tiers.ssd.tier import SsdTier
from kvstore.traffic import Busy, Lane
from tests.mooncake_master import MooncakeMaster, master_binary

log = logging.getLogger("kvstore")
BLOCK = 16 << 10                    # a whole number of pages: staged copies and host slots as the daemon has them
DEADLINE = 30.0                     # the longest any wait here lasts before it fails the test
DEMOTED, WRITTEN, ABSENT = (1, 2), (3, 4), 9
STORED = DEMOTED + WRITTEN


def payload(seed: int) -> bytes:
    return random.Random(seed).randbytes(BLOCK)


def crc(seed: int) -> int:
    return crc32c(payload(seed))


def corrupt(seed: int) -> bytes:
    """The block's bytes with one bit flipped: what a slot written after commit holds (its CRC is still seed's)."""
    bad = bytearray(payload(seed))
    bad[100] ^= 0x01
    return bytes(bad)


def wait_until(cond: Callable[[], Any], what: str, on: threading.Condition) -> None:
    """Until `cond()` holds (checked whenever `on` is notified, and every 50 ms), or fail at DEADLINE. `cond` runs
    outside `on`: it may take a tier's locks, which a tier may hold while it submits to the path."""
    deadline = time.monotonic() + DEADLINE
    while not cond():
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"timed out waiting until {what}")
        with on:
            on.wait(min(left, 0.05))


def in_thread(fn: Callable[..., Any], *args: Any) -> Future[Any]:
    """`fn(*args)` on a thread of its own; its result as a future (waited on with a deadline)."""
    fut: Future[Any] = Future()

    def run() -> None:
        try:
            fut.set_result(fn(*args))
        except BaseException as e:       # noqa: BLE001 - the test thread sees it through the future
            fut.set_exception(e)
    threading.Thread(target=run, daemon=True).start()
    return fut


# ----- the fake traffic path -----
@dataclass(eq=False)
class _Job:
    lane: Lane
    fn: Callable[[], Any]
    future: Future[Any]
    tag: Hashable | None
    on_done: Callable[[Future[Any]], None] | None


class FakePath:
    """kvstore.traffic.Path as the tiers use it (submit, run, cancel, escalate, room, checkpoint, running_lane):
    one worker runs the transfers in submission order, skipping the lanes held (`holding`); `refusing` makes every
    submit raise Busy, as a full lane does. `cond` is notified at every submit, refusal and completion."""

    workers = 1

    def __init__(self, name: str) -> None:
        self.name = name
        self.cond = threading.Condition()
        self.queue: deque[_Job] = deque()
        self.held: set[Lane] = set()
        self.refuse = False
        self.refused = 0
        self.closed = False
        self._local = threading.local()
        self._worker = threading.Thread(target=self._work, name=f"fake-path-{name}", daemon=True)
        self._worker.start()

    # ----- what the tiers call -----
    def submit(self, lane: Lane, nbytes: int, fn: Callable[[], Any], tag: Hashable | None = None,
               on_done: Callable[[Future[Any]], None] | None = None) -> Future[Any]:
        with self.cond:
            if self.closed:
                raise RuntimeError(f"{self.name}: the path is closed")
            self.cond.notify_all()
            if self.refuse:
                self.refused += 1
                raise Busy(self.name, lane, len(self.queue))
            job = _Job(lane, fn, Future(), tag, on_done)
            self.queue.append(job)
            return job.future

    def run(self, lane: Lane, nbytes: int, fn: Callable[[], Any], tag: Hashable | None = None) -> Future[Any]:
        return self.submit(lane, nbytes, fn, tag)

    def cancel(self, tag: Hashable) -> int:
        with self.cond:
            gone = [j for j in self.queue if j.tag == tag]
            for j in gone:
                self.queue.remove(j)
                j.future.cancel()
            return len(gone)

    def escalate(self, tag: Hashable, lane: Lane) -> int:
        with self.cond:
            moved = [j for j in self.queue if j.tag == tag and j.lane > lane]
            for j in moved:
                j.lane = lane
            self.cond.notify_all()
            return len(moved)

    def room(self, lane: Lane) -> int:
        with self.cond:
            return 0 if self.refuse else 1 << 20

    def checkpoint(self) -> None:
        """Nothing to yield to: one transfer runs at a time."""

    def running_lane(self) -> Lane:
        return getattr(self._local, "lane", Lane.CRITICAL)

    def expected_s(self, nbytes: int, lane: Lane) -> float:
        return nbytes / 1e9

    def bandwidth(self) -> float:
        return 1e9

    def stats(self) -> dict[str, Any]:
        with self.cond:
            return {"path": self.name, "queued": len(self.queue), "refused": self.refused}

    def close(self) -> None:
        with self.cond:
            self.closed = True
            for j in self.queue:
                j.future.cancel()
            self.queue.clear()
            self.cond.notify_all()
        if self._worker is not threading.current_thread():
            self._worker.join(timeout=DEADLINE)

    # ----- what the tests steer -----
    @contextmanager
    def holding(self, lane: Lane) -> Iterator[None]:
        """The lane's transfers wait in the queue until the block ends (the others run)."""
        with self.cond:
            self.held.add(lane)
        try:
            yield
        finally:
            with self.cond:
                self.held.discard(lane)
                self.cond.notify_all()

    @contextmanager
    def refusing(self) -> Iterator[None]:
        """Every submit raises Busy until the block ends."""
        with self.cond:
            self.refuse = True
        try:
            yield
        finally:
            with self.cond:
                self.refuse = False
                self.cond.notify_all()

    def queued(self, lane: Lane) -> int:
        with self.cond:
            return sum(j.lane == lane for j in self.queue)

    def _next(self) -> _Job | None:
        with self.cond:
            while True:
                job = next((j for j in self.queue if j.lane not in self.held), None)
                if job is not None:
                    self.queue.remove(job)
                    return job
                if self.closed:
                    return None
                self.cond.wait()

    def _work(self) -> None:
        while (job := self._next()) is not None:
            if not job.future.set_running_or_notify_cancel():
                continue
            self._local.lane = job.lane
            try:
                job.future.set_result(job.fn())
            except BaseException as e:     # noqa: BLE001 - the producer sees it through the future
                job.future.set_exception(e)
            if job.on_done is not None:
                try:
                    job.on_done(job.future)
                except Exception:
                    log.exception("fake path %s: a completion handler failed", self.name)
            with self.cond:
                self.cond.notify_all()


# ----- the tiers, as data -----
@dataclass(frozen=True)
class Expect:
    """An outcome: no error (`error` None), or `error` raised with a message matching `match`."""
    error: type[Exception] | None = None
    match: str = ""

    def context(self) -> AbstractContextManager[Any]:
        return nullcontext() if self.error is None else pytest.raises(self.error, match=self.match)


OK = Expect()
CAPACITIES = {"too_small": 1, "roomy": 64 << 20}


@dataclass
class Case:
    """A tier built for one test, and what it may legitimately do differently from the others."""
    tier: LowerTier
    path: FakePath
    resize: dict[str, Expect]                   # CAPACITIES label -> the outcome
    restart: str | None = None                  # None: durable, `reopen` builds it again; else why not checked
    reopen: Callable[[], tuple[LowerTier, FakePath]] | None = None
    delete_waits_for_write: bool = False        # a delete of an announced block returns once its write has ended
    known_bugs: dict[str, str] = field(default_factory=dict)    # test name -> the contract bug (xfail, strict)


def ssd_case(tmp_path: FsPath, request: pytest.FixtureRequest) -> Case:
    cfg = SsdConfig(dir=str(tmp_path / "ssd"), capacity=4 << 20, staging_bytes=1 << 20, io="threads")

    def open_ssd() -> tuple[LowerTier, FakePath]:
        path = FakePath("ssd")
        return SsdTier(cfg, path).open(wait=True), path
    tier, path = open_ssd()
    return Case(tier, path, reopen=open_ssd, delete_waits_for_write=True,
                resize={"too_small": Expect(ValueError, "needs at least 1 MiB"), "roomy": OK})


def donated_case(tmp_path: FsPath, request: pytest.FixtureRequest) -> Case:
    region = 32 * BLOCK
    fd = os.memfd_create("kvstore-conformance", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, region)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    path = FakePath("mem")
    tier = DonatedTier(path, below=None)          # nothing below: a block it has no room for is dropped
    tier.add_region("conformance", MemfdMemory(fd, region), owner=1)
    refused = Expect(ValueError, "what donors lend it")
    return Case(tier, path, resize={"too_small": refused, "roomy": refused},
                restart="the donated tier holds lent memory: its blocks do not outlive the daemon")


@pytest.fixture(scope="module")
def conformance_master() -> Iterator[MooncakeMaster]:
    m = MooncakeMaster().start()
    yield m
    m.close()


def remote_case(tmp_path: FsPath, request: pytest.FixtureRequest) -> Case:
    from kvstore.tiers.remote.client import MooncakeClient
    from kvstore.tiers.remote.tier import RemoteTier

    master: MooncakeMaster = request.getfixturevalue("conformance_master")
    request.getfixturevalue("monkeypatch").setenv("MC_LOG_LEVEL", "WARNING")    # Mooncake's own lines: problems only
    cfg = RemoteConfig(master=master.address, metadata=master.metadata, hostname="127.0.0.1",
                       segment_bytes=16 << 20, buffer_bytes=16 << 20, staging_bytes=1 << 20, retry_s=0.2,
                       known_s=60.0, timeout_s=10.0)
    path = FakePath("net")
    # both placements: evicted blocks are staged and put (write-back), committed ones put at once (write-through)
    client = MooncakeClient(cfg, "127.0.0.1", "127.0.0.1")     # its ports on loopback where the guard is loaded
    tier = RemoteTier(cfg, path, client, write_back=True, placement="both").start()
    case = Case(tier, path, resize={"too_small": Expect(RuntimeError, "not resized from here"),
                                    "roomy": Expect(RuntimeError, "not resized from here")},
                restart="the remote store is shared, not this node's to keep: a restart is the master's matter "
                        "(tests/tiers/test_remote_tier.py)")
    wait_until(lambda: tier.up, "the remote tier links to the master", path.cond)
    return case


BUILDERS: dict[str, Callable[[FsPath, pytest.FixtureRequest], Case]] = {
    "ssd": ssd_case, "donated": donated_case, "remote": remote_case}
NO_MOONCAKE = pytest.mark.skipif(master_binary() is None, reason="Mooncake Store is not installed: pip install "
                                 "'kvstore[mooncake]' (make test installs it)")


class Rig:
    """The tier under test, its fake path, a host pool whose slots hold the blocks, and this test's namespace."""

    def __init__(self, case: Case, ns: bytes) -> None:
        self.case = case
        self.tier = case.tier
        self.path = case.path
        self.ns = ns
        self.pool = HostPool(capacity=8 << 20, segment_bytes=1 << 20)
        self._views: list[memoryview] = []

    def bid(self, seed: int) -> bytes:
        return self.ns + seed.to_bytes(16, "big")

    def slot(self, data: bytes | None = None) -> memoryview:
        """A host slot (mmap-backed, as the remote tier needs), holding `data` (zeros: None)."""
        gid = self.pool.allocate(BLOCK)
        assert gid is not None
        view = self.pool.view(gid)
        view[:] = data if data is not None else bytes(BLOCK)
        self._views.append(view)
        return view

    def demote(self, seed: int, bad: bool = False) -> bool:
        """Evict the block into the tier: stage (with its writer's CRC), then fill; whether the tier took it."""
        buf = self.tier.stage(self.bid(seed), BLOCK, crc(seed))
        if not isinstance(buf, bool):
            self.tier.fill(self.bid(seed), buf, self.slot(corrupt(seed) if bad else payload(seed)))
        return buf is not False

    def write(self, seeds: Sequence[int], bad: Sequence[int] = (), announce: bool = True) -> int:
        """Write blocks through from host slots (announced first, unless the test did); how many were stored."""
        bids = [self.bid(s) for s in seeds]
        if announce:
            self.tier.announce(bids)
        items = [(b, self.slot(corrupt(s) if s in bad else payload(s)), crc(s)) for b, s in zip(bids, seeds)]
        return self.tier.write(items, Lane.STORE)

    def read(self, seeds: Sequence[int]) -> Got:
        outs = [self.slot() for _ in seeds]
        crcs: list[int | None] = []
        ready: list[int] = []
        n = self.tier.read([self.bid(s) for s in seeds], outs, Lane.CRITICAL, ready.append, crcs)
        return Got(n, [describe(bytes(o)) for o in outs[:n]], crcs, ready)

    def read_async(self, seed: int) -> Future[Any] | None:
        return self.tier.read_async(self.bid(seed), self.slot(), Lane.PREFETCH, lambda f: None)

    def has(self, seeds: Sequence[int]) -> list[bool]:
        return [self.tier.has(self.bid(s)) for s in seeds]

    def store(self) -> None:
        """DEMOTED demoted and WRITTEN written through, all of them on the tier's medium."""
        assert all(self.demote(s) for s in DEMOTED)
        assert self.write(WRITTEN) == len(WRITTEN)
        self.settle()

    def settle(self) -> None:
        """Until nothing waits in the tier's staging for its write."""
        wait_until(lambda: self.tier.stats().get("staged_blocks", 0) == 0, "the tier has written what it staged",
                   self.path.cond)

    def assert_holds(self, seeds: Sequence[int]) -> None:
        """Every block is present and reads back byte-exact, with its writer's CRC."""
        assert self.has(seeds) == [True] * len(seeds)
        assert self.read(seeds) == Got.exact(seeds)

    def reopen(self) -> None:
        assert self.case.reopen is not None
        self.close_tier()
        self.tier, self.path = self.case.reopen()

    def close_tier(self) -> None:
        self.tier.close()
        self.path.close()

    def close(self) -> None:
        self.close_tier()
        for v in self._views:
            v.release()
        self.pool.close()


@dataclass
class Got:
    """What a read returned: the prefix's length, its blocks (by the seed whose bytes they are), the CRCs handed
    back, and what on_ready reported."""
    n: int
    blocks: list[str]
    crcs: list[int | None]
    ready: list[int]

    @staticmethod
    def exact(seeds: Sequence[int]) -> Got:
        n = len(seeds)
        return Got(n, [f"seed {s}" for s in seeds], [crc(s) for s in seeds], list(range(1, n + 1)))

    def __eq__(self, other: object) -> bool:
        """Same prefix, bytes and CRCs; on_ready reported a growing prefix, never past the one returned (a tier may
        report several blocks at once, and the caller takes the rest from the return value)."""
        if not isinstance(other, Got):
            return NotImplemented
        grew = self.ready == sorted(set(self.ready)) and all(0 < k <= self.n for k in self.ready)
        return grew and (self.n, self.blocks, self.crcs) == (other.n, other.blocks, other.crcs)


@functools.cache
def seed_digests() -> dict[bytes, int]:
    return {hashlib.sha256(payload(s)).digest(): s for s in range(16)}


def describe(block: bytes) -> str:
    """Which seed's bytes a block holds (short, for a failure's message)."""
    seed = seed_digests().get(hashlib.sha256(block).digest())
    return f"seed {seed}" if seed is not None else f"bytes of no seed (CRC-32C {crc32c(block):#010x})"


@pytest.fixture(params=[pytest.param("ssd"), pytest.param("donated"),
                        pytest.param("remote", marks=[NO_MOONCAKE, pytest.mark.mooncake])])
def rig(request: pytest.FixtureRequest, tmp_path: FsPath) -> Iterator[Rig]:
    case = BUILDERS[request.param](tmp_path, request)
    bug = case.known_bugs.get(request.function.__name__)
    if bug is not None:
        request.applymarker(pytest.mark.xfail(reason=bug, strict=True))
    # a namespace of this test's own: the remote store is shared by every test of the module
    r = Rig(case, hashlib.blake2b(request.node.nodeid.encode(), digest_size=16).digest())
    yield r
    r.close()


def test_every_registered_tier_is_checked() -> None:
    assert set(BUILDERS) == set(TIER_TYPES) | set(STACKED)


# ----- 1. round trip -----
READS = [                         # (seeds read, the verified prefix)
    ((1, 2, 3, 4), 4),
    ((3, 1, ABSENT, 2), 2),       # a missing block in the middle ends the prefix
    ((ABSENT, 1), 0),
    ((4, 3, 2, 1, ABSENT), 4),
]


def assert_reads(rig: Rig) -> None:
    for seeds, n in READS:
        assert rig.read(seeds) == Got.exact(seeds[:n]), seeds


def test_blocks_read_back_byte_exact_once_written(rig: Rig) -> None:
    # demote 1 and 2 (stage, fill), write 3 and 4 through (announce, write): the tier stores all four
    assert [rig.demote(s) for s in DEMOTED] == [True, True]
    assert rig.write(WRITTEN) == 2
    # present at once
    assert rig.has(STORED) == [True] * 4
    # once on the tier's medium: each read is the longest verified prefix, byte-exact, with the writers' CRCs
    rig.settle()
    assert_reads(rig)
    assert rig.has(STORED + (ABSENT,)) == [True] * 4 + [False]


def test_blocks_read_back_byte_exact_while_staged(rig: Rig) -> None:
    # write 3 and 4 through
    assert rig.write(WRITTEN) == 2
    with rig.path.holding(Lane.BACKGROUND):
        # demote 1 and 2 while the tier's background writes wait: they stay staged
        assert [rig.demote(s) for s in DEMOTED] == [True, True]
        # staged blocks are present for has and reads at once
        assert rig.has(STORED) == [True] * 4
        assert_reads(rig)


def test_read_async_hands_back_the_writers_crc(rig: Rig) -> None:
    rig.store()
    # one block's read as a transfer: its writer's CRC
    futures = {s: rig.read_async(s) for s in (*STORED, ABSENT)}
    assert futures[ABSENT] is None
    assert {s: f.result(DEADLINE) for s, f in futures.items() if f is not None} == {s: crc(s) for s in STORED}


# ----- 2. CRC refusal -----
@pytest.mark.parametrize("how", ["demoted", "written"])
def test_a_block_that_fails_its_writers_crc_is_never_served(rig: Rig, how: str) -> None:
    good, bad = (5, 7), 6
    # 5 and 7 stored as they are, 6 with bytes that do not match its writer's CRC
    if how == "demoted":
        for s in (5, bad, 7):
            rig.demote(s, bad=s == bad)
    else:
        assert rig.write((5, bad, 7), bad=(bad,)) == 2
        assert rig.has((bad,)) == [False]             # not stored: not present
    # a read stops before 6, while staged and once written
    assert rig.read((5, bad, 7)) == Got.exact((5,))
    rig.settle()
    assert rig.read((5, bad, 7)) == Got.exact((5,))
    assert rig.read((bad,)) == Got.exact(())
    # read_async: not held (None), or failed its check (False)
    fut = rig.read_async(bad)
    assert fut is None or fut.result(DEADLINE) is False
    rig.assert_holds(good)


# ----- 3. deletes -----
def test_a_stored_block_deleted_is_gone(rig: Rig) -> None:
    rig.store()
    # delete 3: the tier held it
    assert rig.tier.delete_many([rig.bid(3)]) == [True]
    # gone for has and reads; the others stay
    assert rig.has((3,)) == [False]
    assert rig.read((3,)) == Got.exact(())
    assert rig.read((2, 3, 4)) == Got.exact((2,))
    # a second delete finds nothing
    assert rig.tier.delete_many([rig.bid(3)]) == [False]
    rig.assert_holds((1, 2, 4))


def test_a_block_deleted_between_announce_and_write_is_not_stored(rig: Rig) -> None:
    # announce 5: a delete from now on cancels its write
    rig.tier.announce([rig.bid(5)])
    # delete it (a tier may hold the delete until the announced write has ended)
    deleted = in_thread(rig.tier.delete_many, [rig.bid(5)])
    if not rig.case.delete_waits_for_write:
        deleted.result(DEADLINE)
    # its write comes, then the delete returns: nothing of 5 is left
    rig.write((5,), announce=False)
    deleted.result(DEADLINE)
    rig.settle()
    assert rig.has((5,)) == [False]
    assert rig.read((5,)) == Got.exact(())


def test_a_block_deleted_while_its_write_runs_is_not_stored(rig: Rig) -> None:
    rig.tier.announce([rig.bid(5)])
    with rig.path.holding(Lane.STORE):
        # 5's write starts, its transfers held in the queue (a tier that moves no bytes on the path is done)
        writing = in_thread(rig.write, (5,), (), False)
        wait_until(lambda: rig.path.queued(Lane.STORE) or writing.done(), "the write is under way", rig.path.cond)
        # the delete comes while it runs
        deleted = in_thread(rig.tier.delete_many, [rig.bid(5)])
    # the write ends, then the delete: nothing of 5 is left
    writing.result(DEADLINE)
    deleted.result(DEADLINE)
    rig.settle()
    assert rig.has((5,)) == [False]
    assert rig.read((5,)) == Got.exact(())


def test_a_block_deleted_between_stage_and_fill_is_not_stored(rig: Rig) -> None:
    # stage 5: present from now on
    buf = rig.tier.stage(rig.bid(5), BLOCK, crc(5))
    assert not isinstance(buf, bool)
    assert rig.has((5,)) == [True]
    # delete it before its fill: the tier held it
    assert rig.tier.delete_many([rig.bid(5)]) == [True]
    # the fill comes late: nothing of 5 is stored
    rig.tier.fill(rig.bid(5), buf, rig.slot(payload(5)))
    rig.settle()
    assert rig.has((5,)) == [False]
    assert rig.read((5,)) == Got.exact(())


def test_a_late_fill_never_touches_the_block_that_took_its_room(rig: Rig) -> None:
    # stage 5, and delete it before its fill
    buf = rig.tier.stage(rig.bid(5), BLOCK, crc(5))
    assert not isinstance(buf, bool)
    rig.tier.delete_many([rig.bid(5)])
    with rig.path.holding(Lane.BACKGROUND):
        # 6 is demoted (staged: its background write waits), then 5's fill comes late
        assert rig.demote(6)
        rig.tier.fill(rig.bid(5), buf, rig.slot(payload(5)))
        # 6 reads back byte-exact from staging
        assert rig.read((6,)) == Got.exact((6,))
    # and once written; 5 is nowhere
    rig.settle()
    rig.assert_holds((6,))
    assert rig.has((5,)) == [False]


# ----- 4. busy -----
def test_busy_read_async_raises_busy(rig: Rig) -> None:
    rig.store()
    with rig.path.refusing():
        # a prefetch of a block the tier holds: Busy at once (LowerTier.read_async)
        for s in STORED:
            with pytest.raises(Busy):
                rig.read_async(s)
    # nothing was lost
    rig.assert_holds(STORED)


def test_busy_a_read_is_a_miss_for_now(rig: Rig) -> None:
    rig.store()
    with rig.path.refusing():
        # the path moves nothing: the verified prefix is empty, and no error
        assert rig.read(STORED) == Got.exact(())
    rig.assert_holds(STORED)


def test_busy_a_write_says_what_it_stored(rig: Rig) -> None:
    rig.store()
    with rig.path.refusing():
        # 5 written through while the path refuses: the count it answers is what is present
        stored = rig.write((5,))
        assert rig.has((5,)) == [stored == 1]
    # once the path takes transfers again, what it stored reads back; nothing was lost
    rig.settle()
    assert rig.read((5,)) == Got.exact((5,)[:stored])
    rig.assert_holds(STORED)


def test_busy_a_block_staged_while_busy_is_kept(rig: Rig) -> None:
    rig.store()
    with rig.path.refusing():
        # 5 demoted while the path refuses: taken or not (stage's False: "not now")
        taken = rig.demote(5)
        # the tier tries its write (refused), or has nothing waiting to write
        wait_until(lambda: rig.path.refused or rig.tier.stats().get("staged_blocks", 0) == 0,
                   "the tier tries to write what it staged", rig.path.cond)
    # once the path takes transfers again: a block taken is kept, and so is every other
    rig.settle()
    assert rig.read((5,)) == Got.exact((5,)[:int(taken)])
    rig.assert_holds(STORED)


def test_busy_a_delete_still_deletes(rig: Rig) -> None:
    rig.store()
    with rig.path.refusing():
        # delete 3 while the path refuses
        rig.tier.delete_many([rig.bid(3)])
    # once the path takes transfers again, 3 is gone; the others stay
    rig.settle()
    assert rig.has((3,)) == [False]
    assert rig.read((3,)) == Got.exact(())
    rig.assert_holds((1, 2, 4))


# ----- 5. resize -----
@pytest.mark.parametrize("size", list(CAPACITIES))
def test_resize_within_bounds_or_refused_with_the_reason(rig: Rig, size: str) -> None:
    rig.store()
    # resize: the reply of the resize op, or refused with a reason (never silently)
    with rig.case.resize[size].context():
        reply = rig.tier.resize(CAPACITIES[size])
        assert reply["capacity"] == CAPACITIES[size] and reply["evicted"] == 0 and reply["mapped_bytes"] > 0
        assert rig.tier.stats()["capacity_bytes"] == CAPACITIES[size]
    # either way, the tier keeps its blocks
    rig.assert_holds(STORED)


# ----- 6. restart -----
def test_a_durable_tier_keeps_its_blocks_across_a_restart(rig: Rig) -> None:
    if rig.case.restart is not None:
        # a tier that keeps nothing across a restart must not claim to (a DurableTier gets the host pool at a stop);
        # not a skip: the run requires the remote tier's tests to run (tests/engine_guard.py)
        assert not isinstance(rig.tier, DurableTier), rig.case.restart
        return
    # 1 and 2 demoted (the close writes what is staged), 3 and 4 written through; 4 deleted
    assert [rig.demote(s) for s in DEMOTED] == [True, True]
    assert rig.write(WRITTEN) == 2
    assert rig.tier.delete_many([rig.bid(4)]) == [True]
    # close, and open again on the same directory
    rig.reopen()
    # every block reads back byte-exact with its writer's CRC; the deleted one stays deleted
    rig.assert_holds((1, 2, 3))
    assert rig.has((4,)) == [False]
    assert rig.read((4,)) == Got.exact(())
