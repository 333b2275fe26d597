"""The record maps (kvstore/tiers/ssd/recmap.py): after a restart every block on disk is a hit from the first
request, the map is trusted only where it can be, and a header it does not name is never adopted."""
from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest

from kvstore.tiers.ssd.recmap import ENTRY_BYTES, FILE_HEADER
from kvstore.tiers.ssd.record import HEADER_BYTES
from kvstore.tiers.ssd.store import SsdStore
from tests.tiers.ssd_blocks import NS, PAYLOAD, RECORD, gate_restart, h, payload, read

N = 40


@pytest.fixture
def ssd_dir(tmp_path: Path) -> str:
    return str(tmp_path / "ssd")


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """The restart's header reads (full scan and validation) wait until the test sets this."""
    return gate_restart(monkeypatch)


def stored(ssd_dir: str, n: int = N) -> list[int]:
    """A store with blocks 0..n-1 written and closed; the records they landed in, by block."""
    s = SsdStore(ssd_dir, 256 * RECORD, sync="always").open()
    assert s.put_many([(NS, h(i), payload(i)) for i in range(n)]) == n
    recs = [s.index[NS + h(i)][1] for i in range(n)]
    s.close()
    return recs


def files(ssd_dir: str) -> tuple[str, str]:
    return os.path.join(ssd_dir, f"blocks-{PAYLOAD}.kvs"), os.path.join(ssd_dir, f"blocks-{PAYLOAD}.map")


def patch(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_every_block_is_a_hit_before_any_header_is_read(ssd_dir: str, gate: threading.Event) -> None:
    stored(ssd_dir)
    s = SsdStore(ssd_dir, 256 * RECORD).open(wait=False)
    try:
        assert s.scan.state == "validating" and s.scan.from_maps == N and s.scan.done == 0
        assert all(s.has(NS + h(i)) for i in range(N))
        assert [read(s, i) for i in range(N)] == [payload(i) for i in range(N)]     # each read checks its header
        gate.set()
        s.scanner.wait()
        assert s.scan.state == "ready" and not any(k.startswith("bad.") for k in s.counters)
        assert not s.files[PAYLOAD].unverified
    finally:
        gate.set()
        s.close()


def test_a_stale_entry_is_a_miss_and_the_validation_drops_it(ssd_dir: str, gate: threading.Event) -> None:
    """Entries whose headers are gone (as after a crash between a header's zeroing and its entry's): a read is a
    miss, never wrong bytes; the validation pass finds the others and frees their records."""
    recs = stored(ssd_dir)
    kvs, _ = files(ssd_dir)
    for i in (3, 7):
        patch(kvs, recs[i] * RECORD, bytes(HEADER_BYTES))
    s = SsdStore(ssd_dir, 256 * RECORD).open(wait=False)
    try:
        assert s.has(NS + h(3)) and s.has(NS + h(7))            # named by the map, not read yet
        assert read(s, 3) is None and s.counters["bad.key_mismatch"] == 1 and not s.has(NS + h(3))
        gate.set()
        s.scanner.wait()
        assert s.counters["bad.stale_map"] == 1 and not s.has(NS + h(7))
        assert [read(s, i) for i in range(N)] == [None if i in (3, 7) else payload(i) for i in range(N)]
        assert len(s.index) == N - 2
    finally:
        gate.set()
        s.close()


def test_a_header_the_map_does_not_name_is_never_adopted(ssd_dir: str) -> None:
    """A record whose entry was cleared holds nothing, whatever its header says (the map is authoritative): its
    block is a miss and its record is reused, so a deleted block cannot come back through it."""
    recs = stored(ssd_dir)
    _, rmap = files(ssd_dir)
    patch(rmap, FILE_HEADER + recs[5] * ENTRY_BYTES, bytes(ENTRY_BYTES))
    s = SsdStore(ssd_dir, 256 * RECORD).open()
    try:
        assert read(s, 5) is None and len(s.index) == N - 1
        assert recs[5] in s.files[PAYLOAD].free
        assert not any(k.startswith("bad.") for k in s.counters)
    finally:
        s.close()


@pytest.mark.parametrize("damage", ["missing", "corrupt", "building", "another-size"])
def test_a_map_that_cannot_be_trusted_is_rebuilt_by_a_full_scan(ssd_dir: str, damage: str,
                                                                gate: threading.Event) -> None:
    recs = stored(ssd_dir)
    kvs, rmap = files(ssd_dir)
    if damage == "missing":
        os.unlink(rmap)
    elif damage == "corrupt":
        patch(rmap, 20, b"\xff\xff")                          # the file header's fields fail their CRC
    elif damage == "building":
        patch(rmap, 12, (0).to_bytes(4, "little"))            # state: a rebuild cut short (and a bad CRC)
    else:
        patch(rmap, 16, (4096).to_bytes(8, "little"))         # a map of another block size's file
    s = SsdStore(ssd_dir, 256 * RECORD).open(wait=False)
    try:
        assert s.scan.state == "scanning" and s.scan.from_maps == 0 and not s.has(NS + h(0))
        gate.set()
        s.scanner.wait()
        assert [read(s, i) for i in range(N)] == [payload(i) for i in range(N)]
    finally:
        gate.set()
        s.close()
    gate.clear()                                              # the validation waits again: its state is seen
    s = SsdStore(ssd_dir, 256 * RECORD).open(wait=False)      # the rebuilt map is complete: no scan needed
    try:
        assert s.scan.from_maps == N and s.scan.state == "validating"
        assert [s.index[NS + h(i)][1] for i in range(N)] == recs
    finally:
        gate.set()
        s.close()


def test_a_directory_copied_whole_keeps_its_maps(ssd_dir: str, tmp_path: Path) -> None:
    """Maps are not tied to inodes: a directory copied or restored whole (new files) restarts from its maps."""
    stored(ssd_dir)
    copy = str(tmp_path / "copy")
    shutil.copytree(ssd_dir, copy)
    s = SsdStore(copy, 256 * RECORD).open(wait=False)
    try:
        assert s.scan.from_maps == N and [read(s, i) for i in range(N)] == [payload(i) for i in range(N)]
    finally:
        s.close()


def test_an_older_copy_left_by_a_crash_loses_to_the_newer(ssd_dir: str) -> None:
    """Two entries for one key (a crash before the older copy's zeroing): the newest wins, the other is wiped."""
    s = SsdStore(ssd_dir, 256 * RECORD, sync="always").open()
    assert s.put_many([(NS, h(1), payload(1, 0))]) == 1
    old_rec = s.index[NS + h(1)][1]
    kvs, rmap = files(ssd_dir)
    with open(kvs, "rb") as f:
        f.seek(old_rec * RECORD)
        old_record = f.read(RECORD)
    with open(rmap, "rb") as f:
        f.seek(FILE_HEADER + old_rec * ENTRY_BYTES)
        old_entry = f.read(ENTRY_BYTES)
    assert s.put_many([(NS, h(1), payload(1, 1))]) == 1      # the newer copy; the older record is wiped
    s.close()
    patch(kvs, old_rec * RECORD, old_record)                  # as if the crash came before the wipe
    patch(rmap, FILE_HEADER + old_rec * ENTRY_BYTES, old_entry)
    s = SsdStore(ssd_dir, 256 * RECORD).open()
    try:
        assert read(s, 1) == payload(1, 1) and s.counters["bad.superseded"] == 1 and len(s.index) == 1
    finally:
        s.close()
    s = SsdStore(ssd_dir, 256 * RECORD).open()
    try:
        assert read(s, 1) == payload(1, 1) and not any(k.startswith("bad.") for k in s.counters)
    finally:
        s.close()


def test_deletes_and_rewrites_during_the_validation_keep_the_map_exact(ssd_dir: str, gate: threading.Event) -> None:
    stored(ssd_dir)
    s = SsdStore(ssd_dir, 256 * RECORD, sync="always").open(wait=False)
    try:
        assert [s.delete(NS, h(i)) for i in range(0, N, 4)] == [True] * (N // 4)    # no wait for the validation
        assert s.put_many([(NS, h(i), payload(i, 2)) for i in range(1, N, 4)]) == N // 4
        assert s.put_many([(NS, h(N + i), payload(N + i)) for i in range(8)]) == 8
        gate.set()
        s.scanner.wait()
        assert not any(k.startswith("bad.") for k in s.counters)
        cf = s.files[PAYLOAD]                 # the record → key books agree with the index
        assert {k: rec for rec, k in enumerate(cf.keys) if k} == {k: w[1] for k, w in s.index.items()}
    finally:
        gate.set()
        s.close()
    expect = {i: None if i % 4 == 0 else payload(i, 2) if i % 4 == 1 else payload(i) for i in range(N)}
    expect.update({N + i: payload(N + i) for i in range(8)})
    s = SsdStore(ssd_dir, 256 * RECORD).open()
    try:
        assert s.scan.from_maps == len(s.index) == N - N // 4 + 8
        assert {i: read(s, i) for i in expect} == expect
    finally:
        s.close()


def test_a_damaged_entry_never_loses_its_block_nor_brings_back_a_delete(ssd_dir: str, gate: threading.Event) -> None:
    """A rotten or torn entry (not zero, not whole): its record is neither free nor a hit until the validation reads
    the header, which then books the block (and rewrites the entry) unless it was deleted meanwhile; a delete
    waits for that, so it is durable against the copy under the damaged entry."""
    recs = stored(ssd_dir)
    _, rmap = files(ssd_dir)
    for i in (2, 9):
        patch(rmap, FILE_HEADER + recs[i] * ENTRY_BYTES + 20, b"\xee")       # inside the key: the CRC fails
    s = SsdStore(ssd_dir, 256 * RECORD, sync="always").open(wait=False)
    try:
        cf = s.files[PAYLOAD]
        assert not s.has(NS + h(2)) and recs[2] not in cf.free and len(s.index) == N - 2
        deleting = threading.Thread(target=s.delete, args=(NS, h(9)))
        deleting.start()
        deleting.join(0.3)
        assert deleting.is_alive(), "a delete must wait while a damaged entry may hide a copy of the key"
        gate.set()
        deleting.join(30)
        s.scanner.wait()
        assert read(s, 2) == payload(2) and s.counters["map_repaired"] == 1
        assert read(s, 9) is None and s.counters["bad.damaged_map"] == 1
    finally:
        gate.set()
        s.close()
    s = SsdStore(ssd_dir, 256 * RECORD).open()
    try:
        assert s.scan.from_maps == N - 1 and read(s, 2) == payload(2) and read(s, 9) is None
    finally:
        s.close()


def test_a_scan_that_could_not_read_every_header_leaves_the_map_incomplete(ssd_dir: str,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk of headers that fails to read leaves its records unused this time; the map must not be marked
    complete without them (the next start would trust it and lose those blocks): that start scans again."""
    from kvstore.tiers.ssd import scan

    stored(ssd_dir)
    _, rmap = files(ssd_dir)
    os.unlink(rmap)                                           # a directory from before the maps: a full scan
    real = scan._read_headers

    def failing(cf, recs):  # type: ignore[no-untyped-def]
        recs = list(recs)
        if recs and recs[0] == 0:
            raise OSError(5, "Input/output error")            # the first chunk's read fails
        return real(cf, recs)

    monkeypatch.setattr(scan, "_read_headers", failing)
    s = SsdStore(ssd_dir, 256 * RECORD).open()
    try:
        assert s.scan.state == "ready" and len(s.index) == 0   # every block was in that chunk
    finally:
        s.close()
    monkeypatch.setattr(scan, "_read_headers", real)
    s = SsdStore(ssd_dir, 256 * RECORD).open(wait=False)
    try:
        assert s.scan.state == "scanning" and s.scan.from_maps == 0     # not trusted: scanned again
        s.scanner.wait()
        assert [read(s, i) for i in range(N)] == [payload(i) for i in range(N)]
    finally:
        s.close()
