"""The donated tier with real donor processes (tests/tiers/donor_proc.py lends a memfd over the donors' socket) and
a real SSD tier below it: blocks read back byte-exact and checked, a block the donor wrote over is a miss, a full
region evicts down, a reclaim moves blocks down within its deadline or drops the rest and says so, reads racing a
reclaim never see a wrong byte, a killed donor's region is dropped at once, and bad requests are refused without
stopping the listener."""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path as FsPath
from typing import Any

import pytest

from kvstore.checksum import copy_crc32c, crc32c
from kvstore.client.connection import KVStoreError
from kvstore.client.donor import Donor
from kvstore.daemon.config import DonatedConfig, SsdConfig, TrafficConfig
from kvstore.protocol.frames import HEADER, FrameReader, decode, encode
from kvstore.tiers import TierContext
from kvstore.tiers.donated.memory import MemfdMemory
from kvstore.tiers.donated.tier import DonatedTier, open_tier
from kvstore.tiers.ssd.record import HEADER_BYTES, padded
from kvstore.tiers.ssd.tier import SsdTier
from kvstore.traffic import Lane, Path, Transfer
from kvstore.traffic.manager import TrafficManager

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NS = bytes(range(16))
BLOCK = 8192
RECORD = HEADER_BYTES + padded(BLOCK)


def bid(i: int) -> bytes:
    return NS + i.to_bytes(16, "big")


def payload(i: int) -> bytes:
    return random.Random(i).randbytes(BLOCK)


class DonorProc:
    """A donor in a process of its own, driven line by line (tests/tiers/donor_proc.py)."""

    def __init__(self, sock: str) -> None:
        self.p = subprocess.Popen([sys.executable, "-m", "tests.tiers.donor_proc", sock], cwd=ROOT, text=True,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.call_raw() == {"ready": True}

    def call_raw(self, line: str | None = None) -> dict[str, Any]:
        assert self.p.stdin is not None and self.p.stdout is not None
        if line is not None:
            self.p.stdin.write(line + "\n")
            self.p.stdin.flush()
        out = self.p.stdout.readline()
        assert out, f"the donor process ended (exit code {self.p.poll()})"
        return dict(json.loads(out))

    def call(self, cmd: str, **fields: Any) -> dict[str, Any]:
        return self.call_raw(json.dumps({"cmd": cmd, **fields}))

    def donate(self, nbytes: int) -> int:
        return int(self.call("donate", bytes=nbytes)["region"])

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()


@pytest.fixture
def sock_dir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="kvd-")         # short: a socket path has 108 bytes at most
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def ssd(tmp_path: FsPath) -> Iterator[SsdTier]:
    tier = SsdTier(SsdConfig(dir=str(tmp_path / "ssd"), capacity=256 * RECORD, io="threads")).open(wait=True)
    yield tier
    tier.close()


class Rig:
    """The tier under test (in this process), the SSD tier below it, and the donor processes started."""

    def __init__(self, sock_dir: str, ssd: SsdTier, slow_moves_s: float = 0.0, workers: int = 2) -> None:
        def device(t: Transfer) -> None:         # a slow link for the reclaim's copies (store lane) only
            if t.lane == Lane.STORE and slow_moves_s:
                time.sleep(slow_moves_s)

        self.sock = os.path.join(sock_dir, "donate.sock")
        self.path = Path("mem", workers=workers, device=device)
        self.ssd = ssd
        self.tier = DonatedTier(self.path, ssd).listen(self.sock)
        self.donors: list[DonorProc] = []

    def donor(self) -> DonorProc:
        d = DonorProc(self.sock)
        self.donors.append(d)
        return d

    def put(self, i: int, with_crc: bool = True) -> None:
        data = payload(i)
        buf = self.tier.stage(bid(i), BLOCK, crc32c(data) if with_crc else None)
        assert not isinstance(buf, bool)
        self.tier.fill(bid(i), buf, memoryview(data))

    def get(self, i: int, tier: Any = None) -> bytes | None:
        """The block's bytes from `tier` (this one by default), or None for a miss."""
        out = bytearray(BLOCK)
        return bytes(out) if (tier or self.tier).read([bid(i)], [memoryview(out)], Lane.CRITICAL) == 1 else None

    def close(self) -> None:
        for d in self.donors:
            d.stop()
        self.tier.close()
        self.path.close()


@pytest.fixture
def rig(sock_dir: str, ssd: SsdTier) -> Iterator[Rig]:
    r = Rig(sock_dir, ssd)
    yield r
    r.close()


def wait_for(cond: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_blocks_read_back_byte_exact_with_their_writers_crc(rig: Rig) -> None:
    """Blocks staged and filled live in the donor's memory (the donor sees their bytes there) and come back
    byte-exact, each with its writer's CRC (None for the one committed without), by `read` and by `read_async`."""
    d = rig.donor()
    region = d.donate(16 * BLOCK)
    assert stat.S_IMODE(os.stat(rig.sock).st_mode) == 0o600
    for i in range(10):
        rig.put(i, with_crc=i != 9)
    outs = [bytearray(BLOCK) for _ in range(10)]
    crcs: list[int | None] = []
    seen: list[int] = []
    n = rig.tier.read([bid(i) for i in range(10)], [memoryview(o) for o in outs], Lane.CRITICAL, seen.append, crcs)
    assert n == 10 and seen == list(range(1, 11))
    assert [bytes(o) for o in outs] == [payload(i) for i in range(10)]
    assert crcs == [crc32c(payload(i)) for i in range(9)] + [None]
    rid, offset = rig.tier.locate(bid(3)) or (0, 0)
    assert rid == region
    assert d.call("peek", region=region, offset=offset, nbytes=BLOCK)["crc"] == crc32c(payload(3))
    out = bytearray(BLOCK)
    done = threading.Event()
    f = rig.tier.read_async(bid(5), memoryview(out), Lane.PREFETCH, lambda _: done.set())
    assert f is not None and f.result(timeout=10) == crc32c(payload(5)) and bytes(out) == payload(5)
    assert rig.tier.read_async(bid(99), memoryview(out), Lane.PREFETCH, lambda _: None) is None
    s = rig.tier.stats()
    assert s["blocks"] == 10 and s["used_bytes"] == 10 * BLOCK and s["capacity_bytes"] == 16 * BLOCK
    assert [r["id"] for r in s["regions"]] == [region] and s["donors"] == 1


def test_a_block_the_donor_wrote_over_is_a_miss_never_served(rig: Rig) -> None:
    """The donor writes over two blocks' slots (one with a writer's CRC, one without: the tier checks that one
    against the CRC of what it stored): both are misses, dropped and counted; an untouched block still reads."""
    d = rig.donor()
    region = d.donate(8 * BLOCK)
    rig.put(1)
    rig.put(2, with_crc=False)
    rig.put(3)
    for i in (1, 2):
        _, offset = rig.tier.locate(bid(i)) or (0, 0)
        d.call("scribble", region=region, offset=offset + 100, nbytes=8)
    assert rig.get(1) is None and rig.get(2) is None
    assert not rig.tier.has(bid(1)) and not rig.tier.has(bid(2))
    assert rig.get(3) == payload(3)
    assert rig.tier.stats()["counters"]["crc_mismatch"] == 2


def test_a_block_the_donor_wrote_over_is_not_moved_down(rig: Rig) -> None:
    """Blocks written over by the donor before its reclaim (one with a writer's CRC, one without) are not moved
    down — the SSD tier could not tell the one without — and the reply counts them as dropped."""
    d = rig.donor()
    region = d.donate(8 * BLOCK)
    for i, with_crc in ((1, True), (2, False), (3, False)):
        rig.put(i, with_crc)
    for i in (1, 2):
        _, offset = rig.tier.locate(bid(i)) or (0, 0)
        d.call("scribble", region=region, offset=offset, nbytes=16)
    reply = d.call("reclaim", region=region, deadline_ms=20000)
    assert (reply["migrated"], reply["dropped"]) == (1, 2)
    assert [rig.ssd.has(bid(i)) for i in (1, 2, 3)] == [False, False, True] and rig.get(3, rig.ssd) == payload(3)


def test_a_full_region_evicts_its_least_recently_used_block_down(rig: Rig) -> None:
    """Four slots, six blocks: the two least recently used (block 0 was read, so 1 and 2) go down to the SSD tier,
    where they read back byte-exact; the slot's new block reads back too."""
    rig.donor().donate(4 * BLOCK)
    for i in range(4):
        rig.put(i)
    assert rig.get(0) == payload(0)
    rig.put(4)
    rig.put(5)
    assert [rig.tier.has(bid(i)) for i in range(6)] == [True, False, False, True, True, True]
    assert [rig.ssd.has(bid(i)) for i in range(6)] == [False, True, True, False, False, False]
    assert rig.get(1, rig.ssd) == payload(1) and rig.get(2, rig.ssd) == payload(2)
    assert [rig.get(i) for i in (0, 3, 4, 5)] == [payload(i) for i in (0, 3, 4, 5)]
    assert rig.tier.stats()["counters"]["evicted_down"] == 2


def test_a_block_being_read_is_not_evicted_under_its_reader(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two slots; block 0 is being read, its copy held up, and block 1 is used after it (so block 0 is the least
    recently used): a new block evicts block 1 instead, down to the SSD tier, and the reader gets block 0's
    bytes."""
    entered, release = threading.Event(), threading.Event()

    def gate() -> None:
        if threading.current_thread().name == "reader":
            entered.set()
            assert release.wait(20)

    rig.donor().donate(2 * BLOCK)
    rig.put(0)
    rig.put(1)
    slow_reads(monkeypatch, gate)
    got: list[bytes | None] = []
    reader = threading.Thread(target=lambda: got.append(rig.get(0)), name="reader")
    reader.start()
    assert entered.wait(20)
    assert rig.tier.stage(bid(1), BLOCK) is True                # used again: block 0 is the least recent
    rig.put(2)
    release.set()
    reader.join(20)
    assert got == [payload(0)]
    assert [rig.tier.has(bid(i)) for i in range(3)] == [True, False, True] and rig.ssd.has(bid(1))


def test_reclaim_moves_every_live_block_down_byte_exact(rig: Rig) -> None:
    """A reclaim with time enough: every live block (one deleted before is not) goes down to the SSD tier, byte-
    exact and with its writer's CRC; the region is unmapped and gone; the donor then uses its memory."""
    d = rig.donor()
    region = d.donate(16 * BLOCK)
    for i in range(12):
        rig.put(i, with_crc=i != 11)
    assert rig.tier.delete_many([bid(7)]) == [True]
    reply = d.call("reclaim", region=region, deadline_ms=20000, reuse=True)
    assert reply["migrated"] == 11 and reply["dropped"] == 0
    assert reply["unmapped"] is True and reply["deadline_passed"] is False and reply["region"] == region
    live = [i for i in range(12) if i != 7]
    assert not any(rig.tier.has(bid(i)) for i in range(12))
    outs = [bytearray(BLOCK) for _ in live]
    crcs: list[int | None] = []
    assert rig.ssd.read([bid(i) for i in live], [memoryview(o) for o in outs], Lane.CRITICAL, crcs=crcs) == 11
    assert [bytes(o) for o in outs] == [payload(i) for i in live]
    assert crcs == [crc32c(payload(i)) for i in live[:-1]] + [None]
    assert not rig.ssd.has(bid(7))
    s = rig.tier.stats()
    assert s["regions"] == [] and s["blocks"] == 0 and s["migrated"] == 11 and s["reclaim_seconds"]["count"] == 1


def test_a_reclaim_past_its_deadline_drops_the_rest_and_says_how_many(sock_dir: str, ssd: SsdTier) -> None:
    """Deadline 0: nothing is moved, all dropped. A deadline shorter than the copies take (each 30 ms on a slow
    link): some may move, the rest are dropped and counted, and the SSD tier holds exactly the ones moved."""
    rig = Rig(sock_dir, ssd, slow_moves_s=0.03)
    try:
        d = rig.donor()
        first = d.donate(8 * BLOCK)
        for i in range(6):
            rig.put(i)
        reply = d.call("reclaim", region=first, deadline_ms=0)
        assert (reply["migrated"], reply["dropped"], reply["deadline_passed"]) == (0, 6, True)
        assert not any(rig.tier.has(bid(i)) or ssd.has(bid(i)) for i in range(6))

        second = d.donate(32 * BLOCK)
        blocks = range(100, 120)
        for i in blocks:
            rig.put(i)
        reply = d.call("reclaim", region=second, deadline_ms=100)
        assert reply["migrated"] + reply["dropped"] == 20 and reply["dropped"] > 0 and reply["deadline_passed"]
        assert not any(rig.tier.has(bid(i)) for i in blocks)
        below = [i for i in blocks if ssd.has(bid(i))]
        assert len(below) == reply["migrated"]
        assert [rig.get(i, ssd) for i in below] == [payload(i) for i in below]
        assert rig.tier.stats()["regions"] == []
    finally:
        rig.close()


def slow_reads(monkeypatch: pytest.MonkeyPatch, gate: Any = None) -> None:
    """Region reads that take their time (or wait for `gate()`) while they hold the region's memory."""
    def read(self: MemfdMemory, offset: int, out: memoryview) -> int:
        with self._view[offset:offset + len(out)] as src:
            gate() if gate is not None else time.sleep(0.0005)
            return copy_crc32c(out, src)

    monkeypatch.setattr(MemfdMemory, "read", read)


def test_reads_racing_a_reclaim_get_the_right_bytes_or_miss(sock_dir: str, ssd: SsdTier,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Two readers read the region's blocks in a loop, each copy slow enough that one is nearly always under way,
    while its donor reclaims it (slowly: each copy down takes 5 ms) and then writes over the memory it got back:
    every read returns the block's bytes or misses — never a wrong byte, never an error, the region unmapped only
    once no copy touches it — and every block ends up on the SSD tier."""
    slow_reads(monkeypatch)
    rig = Rig(sock_dir, ssd, slow_moves_s=0.005)
    try:
        d = rig.donor()
        region = d.donate(32 * BLOCK)
        for i in range(32):
            rig.put(i)
        stats: dict[str, Any] = {"hits": 0, "misses": 0, "wrong": 0, "errors": []}
        reclaimed = threading.Event()
        lock = threading.Lock()

        def reader(seed: int) -> None:
            rnd, after = random.Random(seed), 0
            try:
                while after < 200:
                    i = rnd.randrange(32)
                    out = bytearray(BLOCK)
                    if seed % 2:
                        f = rig.tier.read_async(bid(i), memoryview(out), Lane.PREFETCH, lambda _: None)
                        got = f is not None and f.result(timeout=10) is not False
                    else:
                        got = rig.tier.read([bid(i)], [memoryview(out)], Lane.CRITICAL) == 1
                    with lock:
                        stats["hits" if got else "misses"] += 1
                        stats["wrong"] += got and bytes(out) != payload(i)
                    after += reclaimed.is_set()
            except Exception as e:  # reported below
                stats["errors"].append(repr(e))

        readers = [threading.Thread(target=reader, args=(s,)) for s in (1, 2)]
        for t in readers:
            t.start()
        wait_for(lambda: stats["hits"] >= 100)
        reply = d.call("reclaim", region=region, deadline_ms=30000, reuse=True)
        reclaimed.set()
        for t in readers:
            t.join(60)
        assert stats["errors"] == [] and stats["wrong"] == 0
        assert stats["hits"] >= 100 and stats["misses"] >= 400          # after the reclaim: all misses
        assert reply["migrated"] == 32 and reply["dropped"] == 0 and reply["unmapped"] is True
        assert "read_errors" not in rig.tier.stats()["counters"]
        assert [rig.get(i, ssd) for i in range(32)] == [payload(i) for i in range(32)]
    finally:
        rig.close()


def test_a_reclaim_answers_only_once_a_read_in_progress_is_done(sock_dir: str, ssd: SsdTier,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefetch read is inside its copy of a block (held there) when the donor reclaims the region: the block
    moves down (on another of the path's workers), but the region is not unmapped, nor the reclaim answered, until
    that copy is done; the read gets the block's bytes."""
    rig = Rig(sock_dir, ssd, workers=3)         # lower lanes may use 2 workers: the prefetch's and the move's
    entered, release = threading.Event(), threading.Event()

    def gate() -> None:
        if not entered.is_set():            # the first copy out of the region: the prefetch's
            entered.set()
            assert release.wait(20)

    try:
        d = rig.donor()
        region = d.donate(4 * BLOCK)
        rig.put(0)
        slow_reads(monkeypatch, gate)
        out = bytearray(BLOCK)
        f = rig.tier.read_async(bid(0), memoryview(out), Lane.PREFETCH, lambda _: None)
        assert f is not None and entered.wait(20)
        answered: list[tuple[dict[str, Any], bool]] = []
        reclaim = threading.Thread(target=lambda: answered.append(
            (d.call("reclaim", region=region, deadline_ms=20000, reuse=True), release.is_set())))
        reclaim.start()
        wait_for(lambda: rig.ssd.has(bid(0)) and not rig.tier.has(bid(0)))
        time.sleep(0.3)                     # room for a wrong answer to come early (none may)
        release.set()
        assert f.result(timeout=20) == crc32c(payload(0)) and bytes(out) == payload(0)
        reclaim.join(20)
        reply, after_release = answered[0]
        assert after_release and reply["unmapped"] is True and reply["migrated"] == 1
    finally:
        release.set()
        rig.close()


def test_a_memfd_reclaim_answers_before_its_unmap_and_nothing_touches_the_region_between(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unmapping a big region takes longer than a short deadline (18-40 ms for 256 MiB): the donor has its answer
    first, the unmap follows (held here until the answer came, or 5 s). Between the two the region is out of the
    books: reads of its blocks find them on the SSD tier, new evictions go elsewhere, and not one copy touches the
    region's memory."""
    unmapping, release, closed = threading.Event(), threading.Event(), threading.Event()
    touched: list[str] = []
    close, read, write = MemfdMemory.close, MemfdMemory.read, MemfdMemory.write

    def held_close(self: MemfdMemory) -> bool:
        unmapping.set()
        release.wait(5)
        try:
            return close(self)
        finally:
            closed.set()

    def watched(name: str, fn: Any) -> Any:
        def copy(self: MemfdMemory, offset: int, buf: memoryview) -> int:
            if unmapping.is_set():
                touched.append(name)
            return int(fn(self, offset, buf))
        return copy

    monkeypatch.setattr(MemfdMemory, "close", held_close)
    monkeypatch.setattr(MemfdMemory, "read", watched("read", read))
    monkeypatch.setattr(MemfdMemory, "write", watched("write", write))
    d = rig.donor()
    region = d.donate(16 * BLOCK)
    for i in range(8):
        rig.put(i)
    reply = d.call("reclaim", region=region, deadline_ms=20000)
    try:
        assert not closed.is_set(), "the reclaim answered only after its unmap"
        assert unmapping.wait(20) and reply["unmapped"] is True and reply["migrated"] == 8
        assert rig.tier.stats()["regions"] == []
        assert [rig.get(i) for i in range(8)] == [None] * 8                 # nothing read from the region ...
        assert [rig.get(i, rig.ssd) for i in range(8)] == [payload(i) for i in range(8)]     # ... it is all here
        rig.put(20)                                                          # an eviction: not into the region
        assert not rig.tier.has(bid(20)) and rig.ssd.has(bid(20))
    finally:
        release.set()
    wait_for(closed.is_set)
    assert touched == []


def mappings(name: str) -> int:
    """This process's mappings of the memfd called `name` (the donor's and, in these tests, the daemon's)."""
    with open("/proc/self/maps") as f:
        return sum(f"/memfd:{name} " in line for line in f)


def test_a_donor_releases_the_regions_it_got_back(rig: Rig) -> None:
    """A region given back stays mapped in the donor (its memory, to reuse) until `release`, or not at all with
    `keep=False`: a long-lived donor's mappings do not pile up. A region still lent cannot be released."""
    with Donor(rig.sock) as donor:
        kept, freed = donor.donate_memfd(4 * BLOCK, "kvs-kept"), donor.donate_memfd(4 * BLOCK, "kvs-freed")
        rig.put(1)
        with pytest.raises(ValueError):
            donor.release(kept)
        assert donor.reclaim(kept, 1.0)["migrated"] + donor.reclaim(freed, 1.0, keep=False)["migrated"] == 1
        wait_for(lambda: mappings("kvs-kept") == 1 and mappings("kvs-freed") == 0)     # the daemon's unmapped
        donor.memory(kept)[:4] = b"mine"                        # the donor's again, to use
        with pytest.raises(KeyError):
            donor.memory(freed)
        donor.release(kept)
        assert mappings("kvs-kept") == 0
        with pytest.raises(KeyError):
            donor.memory(kept)
        with pytest.raises(KeyError):
            donor.release(kept)
        assert donor.regions() == []


def test_a_killed_donor_is_reclaimed_at_once_and_its_blocks_miss(rig: Rig) -> None:
    """kill -9 of the donor: its connection ends, its region is given back with deadline 0 — nothing is read
    from it again, nothing is moved down (its memory may be gone) — and a donor beside it is untouched."""
    d, other = rig.donor(), rig.donor()
    d.donate(8 * BLOCK)
    kept = other.donate(8 * BLOCK)
    for i in range(12):
        rig.put(i)
    held = [i for i in range(12) if (rig.tier.locate(bid(i)) or (0, 0))[0] != kept]
    assert held and rig.get(held[0]) == payload(held[0])
    d.p.send_signal(signal.SIGKILL)
    d.p.wait()
    wait_for(lambda: [r["id"] for r in rig.tier.stats()["regions"]] == [kept])
    assert [rig.get(i) for i in held] == [None] * len(held)
    assert not any(rig.tier.has(bid(i)) or rig.ssd.has(bid(i)) for i in held)
    assert rig.tier.stats()["counters"]["reclaim_dropped"] == len(held)
    survivors = [i for i in range(12) if i not in held]
    assert [rig.get(i) for i in survivors] == [payload(i) for i in survivors]
    assert rig.tier.stats()["donors"] == 1


def _raw(sock: socket.socket, msg: dict[str, Any], fds: list[int] | None = None) -> dict[str, Any]:
    data = encode(msg)
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.sendall(data)
    frames = FrameReader()
    body = None
    while body is None:
        chunk = sock.recv(1 << 16)
        assert chunk, "the listener closed the connection"
        frames.feed(chunk)
        body = frames.next()
    return decode(body)


def _memfd(nbytes: int, seal: bool = True) -> int:
    import fcntl
    fd = os.memfd_create("t", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, nbytes)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_bad_requests_get_clear_errors_and_the_listener_serves_on(rig: Rig, tmp_path: FsPath) -> None:
    """Unknown op, no fd, two fds, a size that is not the memfd's, an unsealed memfd, a file that is not a memfd,
    another daemon's kind, another connection's region: each a clear error, no fd leaked, no region made, the
    connection still serving; an unparseable frame closes only its own connection."""
    other = Donor(rig.sock)
    theirs = other.donate_memfd(4 * BLOCK, "theirs")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(rig.sock)

    def refused(msg: dict[str, Any], fds: list[int] | None = None) -> tuple[str, str]:
        try:
            r = _raw(s, {"id": 7, **msg}, fds)
        finally:
            for fd in fds or ():
                os.close(fd)
        assert r["ok"] is False and r["id"] == 7
        return r["error"]["code"], r["error"]["message"]

    donate = {"op": "donate", "name": "x", "bytes": 4 * BLOCK, "kind": "memfd"}
    code, text = refused({"op": "lend"})
    assert code == "unknown_op" and "donate and reclaim" in text
    before = _open_fds()                                        # the listener has accepted `s` by now
    assert refused(donate)[0] == "bad_request" and "exactly one fd" in refused(donate)[1]
    code, text = refused(donate, [_memfd(4 * BLOCK), _memfd(4 * BLOCK)])
    assert code == "bad_request" and "carried 2" in text
    code, text = refused({**donate, "bytes": 8 * BLOCK}, [_memfd(4 * BLOCK)])
    assert code == "bad_request" and "must match" in text
    code, text = refused(donate, [_memfd(4 * BLOCK, seal=False)])
    assert code == "bad_request" and "F_SEAL_SHRINK" in text
    plain = tmp_path / "file"
    plain.write_bytes(bytes(4 * BLOCK))
    code, text = refused(donate, [os.open(plain, os.O_RDWR)])
    assert code == "bad_request" and "not a memfd" in text
    code, text = refused({**donate, "kind": "cuda", "handle": bytes(64)})
    assert code == "bad_request" and "kind 'memfd'" in text
    code, text = refused({"op": "reclaim", "region": theirs, "deadline_ms": 0})
    assert code == "not_found"
    code, text = refused({"op": "reclaim", "region": theirs, "deadline_ms": 0}, [_memfd(BLOCK)])
    assert code == "bad_request" and "carries no fd" in text
    assert _open_fds() == before                                # every fd passed was closed by the listener
    assert "kvstore.tiers.donated.cuda" not in sys.modules and "cupy" not in sys.modules
    assert [r["id"] for r in rig.tier.stats()["regions"]] == [theirs]

    ok = _raw(s, {"id": 8, **donate}, [fd := _memfd(4 * BLOCK)])   # the same connection serves on
    os.close(fd)
    assert ok["ok"] is True and ok["id"] == 8 and ok["region"] != theirs

    bad = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    bad.settimeout(10)
    bad.connect(rig.sock)
    bad.sendall(HEADER.pack(3) + b"\xc1\xc1\xc1")              # 0xc1: never valid msgpack
    reply = decode(bad.recv(1 << 16)[HEADER.size:])
    assert reply["error"]["code"] == "bad_frame" and bad.recv(1) == b""
    assert other.reclaim(theirs, 1.0)["dropped"] == 0           # the others are served on
    assert [r["id"] for r in rig.tier.stats()["regions"]] == [ok["region"]]
    with pytest.raises(KVStoreError) as e:
        other.reclaim(theirs, 1.0)
    assert e.value.code == "not_found"
    s.close()
    bad.close()
    other.close()


def test_the_tiers_odd_corners(rig: Rig, sock_dir: str) -> None:
    """No donor: a block goes straight to the tier below (staged and filled there). Write-through stores announced
    blocks, not ones deleted meanwhile nor ones failing their CRC. An emptied region is carved again for another
    block size; a block of a size no region serves goes below too. resize is refused. open_tier: off without the
    section, listening with it."""
    passed = rig.tier.stage(bid(40), BLOCK, None)
    assert not isinstance(passed, bool) and len(passed) == BLOCK   # the SSD tier's staging buffer
    rig.tier.fill(bid(40), passed, memoryview(payload(40)))
    assert not rig.tier.has(bid(40)) and rig.ssd.has(bid(40)) and rig.get(40, rig.ssd) == payload(40)
    assert rig.tier.stats()["counters"]["passed_down"] == 1
    region = rig.donor().donate(8 * BLOCK)
    rig.tier.announce([bid(1), bid(2), bid(3)])
    assert rig.tier.delete_many([bid(2)]) == [False]
    items = [(bid(1), payload(1), crc32c(payload(1))), (bid(2), payload(2), None), (bid(3), payload(3), 12345)]
    assert rig.tier.write(items, Lane.STORE) == 1
    assert [rig.tier.has(bid(i)) for i in (1, 2, 3)] == [True, False, False]
    assert rig.tier.namespaces() == {NS: 1} and rig.get(1) == payload(1)
    assert rig.tier.stage(bid(1), BLOCK, None) is True
    assert rig.tier.delete_many([bid(1), bid(9)]) == [True, False]
    big = bid(50)
    buf = rig.tier.stage(big, 4 * BLOCK, None)                  # the empty region, carved for 32 KiB
    assert not isinstance(buf, bool)
    rig.tier.fill(big, buf, memoryview(payload(50) * 4))
    out = bytearray(4 * BLOCK)
    assert rig.tier.read([big], [memoryview(out)]) == 1 and bytes(out) == payload(50) * 4
    assert rig.tier.stats()["regions"][0] == {"id": region, "name": "test", "kind": "memfd", "bytes": 8 * BLOCK,
                                              "slot_bytes": 4 * BLOCK, "slots": 2, "used": 1, "closing": False,
                                              "dead": False}
    passed = rig.tier.stage(bid(51), BLOCK, None)               # a region serves one size: below it goes
    assert not isinstance(passed, bool)
    rig.tier.fill(bid(51), passed, memoryview(payload(51)))
    assert rig.tier.stats()["counters"]["passed_down"] == 2 and not rig.tier.has(bid(51))
    assert rig.get(51, rig.ssd) == payload(51)
    with pytest.raises(ValueError):
        rig.tier.resize(1 << 30)

    traffic = TrafficManager(TrafficConfig())
    ctx = TierContext(traffic, socket=os.path.join(sock_dir, "kvstore.sock"))
    assert open_tier(DonatedConfig(), ctx) is None
    tier = open_tier(DonatedConfig(enabled=True, socket=os.path.join(sock_dir, "d2")), replace(ctx, below=rig.ssd))
    try:
        assert tier is not None and tier.path.name == "mem" and tier.below is rig.ssd
        with Donor(os.path.join(sock_dir, "d2")) as donor:
            assert donor.donate_memfd(4 * BLOCK) == 1
    finally:
        assert tier is not None
        tier.close()
        traffic.close()


CUDA_REFUSAL = """
import os, socket, sys, tempfile
from kvstore.protocol.frames import decode, encode
from kvstore.tiers.donated.tier import DonatedTier
from kvstore.traffic import Path
d = tempfile.mkdtemp(prefix="kvd-")
path = Path("gpu", workers=1)
tier = DonatedTier(path).listen(os.path.join(d, "donate.sock"), kind="cuda")
s = socket.socket(socket.AF_UNIX)
s.connect(os.path.join(d, "donate.sock"))
s.sendall(encode({"op": "donate", "id": 1, "bytes": 1 << 20, "kind": "cuda", "handle": b"short"}))
reply = decode(s.recv(1 << 16)[4:])
print(reply["error"]["code"], "handle" in reply["error"]["message"], "cupy" in sys.modules,
      "torch" in sys.modules)
s.close()
tier.close()
path.close()
"""


def test_a_cuda_daemon_checks_a_donation_before_it_touches_cuda() -> None:
    """(In a process of its own.) A daemon taking CUDA regions refuses a malformed handle with a clear error,
    without importing CuPy or torch for it."""
    out = subprocess.run([sys.executable, "-c", CUDA_REFUSAL], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["bad_request", "True", "False", "False"], out.stderr
