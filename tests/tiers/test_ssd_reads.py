"""How the SSD store reads a block an engine waits for: a one-block critical get reads in the calling thread (no
hand-off to a path worker), in one request or, through io_uring, in pieces all in flight whose CRC-32C is
continued as they land; every byte is still checked; other reads go through the path's workers."""
from __future__ import annotations

import mmap
import os
import threading

import numpy as np
import pytest

from kvstore.checksum import crc32c
from kvstore.tiers.ssd.record import HEADER_BYTES, record_bytes
from kvstore.tiers.ssd.store import SsdStore
from kvstore.traffic import Lane, Path
from kvstore.traffic.path import Transfer

NS = bytes(range(16))
BLOCK = 2 << 20                       # a Full Block of the bench's geometry: several pieces of every size used
RECORD = record_bytes(BLOCK)


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def block(i: int) -> mmap.mmap:
    m = mmap.mmap(-1, BLOCK)          # page-aligned, as host slots are: read straight into, no bounce copy
    m[:] = np.random.default_rng(i).integers(0, 256, BLOCK, dtype=np.uint8).tobytes()
    return m


class Seen:
    """The path's device hook: which thread ran each transfer, in which lane."""

    def __init__(self) -> None:
        self.runs: list[tuple[Lane, str]] = []

    def __call__(self, t: Transfer) -> None:
        self.runs.append((t.lane, threading.current_thread().name))


@pytest.fixture(params=["threads", "auto"])
def store(request: pytest.FixtureRequest, tmp_path: str):  # type: ignore[no-untyped-def]
    seen = Seen()
    path = Path("ssd", workers=4, device=seen)
    s = SsdStore(os.path.join(str(tmp_path), "ssd"), 8 * RECORD, io=request.param, path=path).open()
    blocks = [block(i) for i in range(3)]
    assert s.put_many([(NS, h(i), blocks[i], crc32c(blocks[i])) for i in range(3)]) == 3
    seen.runs.clear()
    yield s, seen, blocks
    s.close()
    path.close()


def test_a_one_block_critical_get_reads_in_the_calling_thread(store) -> None:  # type: ignore[no-untyped-def]
    s, seen, blocks = store
    out = mmap.mmap(-1, BLOCK)
    crcs: list[int | None] = []
    before = s.path.lanes[Lane.CRITICAL].transfers
    assert s.get_many(NS, [h(1)], [memoryview(out)], Lane.CRITICAL, crcs=crcs) == 1
    assert out[:] == blocks[1][:] and crcs == [crc32c(blocks[1])]           # verified, the writer's CRC back
    critical = [name for lane, name in seen.runs if lane == Lane.CRITICAL]
    assert critical == [threading.current_thread().name]                    # this thread, not a worker
    assert s.path.lanes[Lane.CRITICAL].transfers == before + 1              # still a transfer on the path
    assert s.path.lanes[Lane.CRITICAL].in_flight == 0


def test_batches_and_lower_lanes_go_through_the_workers(store) -> None:  # type: ignore[no-untyped-def]
    s, seen, blocks = store
    outs = [mmap.mmap(-1, BLOCK) for _ in range(3)]
    assert s.get_many(NS, [h(i) for i in range(3)], [memoryview(o) for o in outs], Lane.CRITICAL) == 3
    assert s.get_many(NS, [h(2)], [memoryview(outs[0])], Lane.PREFETCH) == 1
    me = threading.current_thread().name
    reads = [(lane, name) for lane, name in seen.runs if lane in (Lane.CRITICAL, Lane.PREFETCH)]
    assert len(reads) == 4 and all(name != me for _, name in reads)          # on the path's workers
    assert [bytes(o) for o in outs] == [blocks[2][:], blocks[1][:], blocks[2][:]]


@pytest.mark.parametrize("where, reason", [
    (HEADER_BYTES + BLOCK - 1, "payload_checksum"),       # the last byte of the last piece
    (HEADER_BYTES + (BLOCK // 4), "payload_checksum"),    # the first byte of the second piece
    (40, "header_checksum"),                              # the header's key field
])
def test_a_bad_byte_in_any_piece_is_a_quarantined_miss(store, where: int, reason: str) -> None:  # type: ignore[no-untyped-def]
    s, seen, blocks = store
    _flip(s, 1, where)
    out = mmap.mmap(-1, BLOCK)
    assert s.get_many(NS, [h(1)], [memoryview(out)], Lane.CRITICAL) == 0      # never the wrong bytes
    assert s.counters[f"bad.{reason}"] == 1 and not s.has(NS + h(1))          # quarantined
    assert s.get_many(NS, [h(2)], [memoryview(out)], Lane.CRITICAL) == 1 and out[:] == blocks[2][:]


def _flip(s: SsdStore, i: int, where: int) -> None:
    """Flip one byte of block i's record, `where` bytes into it."""
    rec = s.index[NS + h(i)][1]
    with open(s.files[BLOCK].path, "r+b") as f:
        f.seek(rec * RECORD + where)
        byte = f.read(1)
        f.seek(rec * RECORD + where)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_critical_read_waits_its_turn_when_critical_reads_are_queued(tmp_path: str) -> None:
    """With a critical transfer already queued, a one-block get does not run ahead of it in its own thread."""
    gate = threading.Event()
    seen = Seen()

    def device(t: Transfer) -> None:
        seen(t)
        if t.tag == "hold":
            gate.wait(10)

    path = Path("ssd", workers=1, device=device)
    s = SsdStore(os.path.join(str(tmp_path), "ssd"), 4 * RECORD, path=path).open()
    try:
        b = block(7)
        assert s.put_many([(NS, h(7), b)]) == 1
        held = path.submit(Lane.CRITICAL, 0, lambda: None, tag="hold")       # the one worker, held
        queued = path.submit(Lane.CRITICAL, 0, lambda: None, tag="queued")   # and one critical transfer queued
        out = mmap.mmap(-1, BLOCK)
        done = []
        t = threading.Thread(target=lambda: done.append(s.get_many(NS, [h(7)], [memoryview(out)])))
        t.start()
        t.join(0.3)
        assert t.is_alive() and not done                   # it queued behind the others
        gate.set()
        t.join(10)
        assert done == [1] and out[:] == b[:] and held.done() and queued.done()
        assert seen.runs[-1] == (Lane.CRITICAL, "kvstore-ssd-0")     # read by the path's worker
    finally:
        gate.set()
        s.close()
        path.close()


# ----- verified pieces handed on while the read is in flight (record marks) -----
PIECE = BLOCK // 4                    # record.piece_bytes of a 2 MiB payload


def _pieces_of(s: SsdStore, i: int, out: mmap.mmap, want: bytes,
               crcs: list[int | None] | None = None) -> tuple[int, list[tuple[int, int, bool]]]:
    """A one-block critical get of block i, and each piece handed on: (block, bytes, whether `out` then held
    exactly the block's first bytes); the CRC handed with each goes to `crcs`."""
    seen: list[tuple[int, int, bool]] = []

    def on_piece(k: int, nbytes: int, crc: int | None) -> None:
        seen.append((k, nbytes, out[:nbytes] == want[:nbytes]))
        if crcs is not None:
            crcs.append(crc)
    n = s.get_many(NS, [h(i)], [memoryview(out)], Lane.CRITICAL, on_piece=on_piece)
    return n, seen


def test_a_critical_read_hands_on_each_verified_piece_before_the_block_is_whole(store) -> None:  # type: ignore[no-untyped-def]
    s, _, blocks = store
    out = mmap.mmap(-1, BLOCK)
    crcs: list[int | None] = []
    n, seen = _pieces_of(s, 1, out, blocks[1][:], crcs)
    assert n == 1 and out[:] == blocks[1][:]
    if s.io == "io_uring":            # every piece, each already the block's bytes when handed on
        assert seen == [(0, PIECE * k, True) for k in (1, 2, 3, 4)]
        assert crcs == [None, None, None, crc32c(blocks[1])]          # the writer's CRC once it is whole
    else:                             # the threads backend reads a critical block in one request: nothing early
        assert seen == []


@pytest.mark.parametrize("where, handed", [
    (HEADER_BYTES + 2 * PIECE, 2),      # the third piece fails its mark: the two before it were handed on
    (HEADER_BYTES, 0),                  # the first piece fails: nothing
    (40, 0),                            # the header fails its checksum: no marks are trusted
])
def test_a_piece_that_fails_its_mark_is_never_handed_on(store, where: int, handed: int) -> None:  # type: ignore[no-untyped-def]
    s, _, blocks = store
    _flip(s, 1, where)
    out = mmap.mmap(-1, BLOCK)
    n, seen = _pieces_of(s, 1, out, blocks[1][:])
    assert n == 0 and not s.has(NS + h(1))                         # a quarantined miss, as before
    assert seen == ([(0, PIECE * (k + 1), True) for k in range(handed)] if s.io == "io_uring" else [])


def test_a_record_holding_another_block_hands_on_nothing(store) -> None:  # type: ignore[no-untyped-def]
    """A record rewritten with another block under the read (here: the books pointing at block 1's record for
    block 2): its bytes pass its own marks, but the header names another key, so not one byte is handed on."""
    s, _, blocks = store
    with s.lock:
        s.index[NS + h(2)] = s.index[NS + h(1)]
    out = mmap.mmap(-1, BLOCK)
    n, seen = _pieces_of(s, 2, out, blocks[1][:])
    assert n == 0 and seen == [] and s.counters["bad.key_mismatch"] == 1


def test_a_record_without_marks_is_read_and_checked_whole(store) -> None:  # type: ignore[no-untyped-def]
    """A record written before marks existed (or whose marks block is damaged) is served as before, checked
    whole at the end, with nothing handed on early."""
    from dataclasses import replace

    from kvstore.tiers.ssd.record import MARKS_AT, parse_header, parse_marks

    s, _, blocks = store
    rec = s.index[NS + h(1)][1]
    path = s.files[BLOCK].path
    with open(path, "r+b") as f:
        f.seek(rec * RECORD)
        raw = f.read(HEADER_BYTES)
        header = parse_header(raw)
        assert header is not None and header.marked and len(parse_marks(raw, header)) == 4
        f.seek(rec * RECORD)
        f.write(replace(header, marks=()).pack())                      # as an older daemon wrote it
    _flip(s, 2, MARKS_AT + 20)                                         # block 2: a mark damaged
    for i in (1, 2):
        out = mmap.mmap(-1, BLOCK)
        n, seen = _pieces_of(s, i, out, blocks[i][:])
        assert n == 1 and out[:] == blocks[i][:] and seen == []
    assert not any(k.startswith("bad.") for k in s.counters)


@pytest.mark.parametrize("size", [256 << 10, 300 << 10, 768 << 10, 5 << 20])
def test_pieces_follow_the_blocks_size(tmp_path: str, size: int) -> None:
    """Another block size, another piece plan (record.piece_bytes): every piece is handed on in order, each a
    prefix of the block, the writer's CRC only with the last; a block of one piece (256 KiB) hands on nothing."""
    from kvstore.tiers.ssd.record import piece_bytes

    s = SsdStore(os.path.join(str(tmp_path), "ssd"), 4 * record_bytes(size), io="auto").open()
    try:
        b = mmap.mmap(-1, size)
        b[:] = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
        assert s.put_many([(NS, h(9), b, crc32c(b))]) == 1
        out = mmap.mmap(-1, size)
        seen: list[tuple[int, bool, int | None]] = []
        assert s.get_many(NS, [h(9)], [memoryview(out)], Lane.CRITICAL,
                          on_piece=lambda k, nbytes, crc: seen.append((nbytes, out[:nbytes] == b[:nbytes], crc))) == 1
        assert out[:] == b[:]
        piece = piece_bytes(size)
        want = [(min(end, size), True, None) for end in range(piece, size + piece, piece)]
        want[-1] = (size, True, crc32c(b))
        assert seen == (want if s.io == "io_uring" and size > piece else [])
    finally:
        s.close()
