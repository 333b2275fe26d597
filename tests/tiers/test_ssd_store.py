"""The SSD record store on real files: round trips, restart, torn and corrupted records, the lock, the cap."""
from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from kvstore.tiers.ssd.record import HEADER_BYTES, padded
from kvstore.tiers.ssd.store import SsdStore, StoreLocked

NS = bytes(range(16))
PAYLOAD = 10_000                                    # not a multiple of 4 KiB on purpose
RECORD = HEADER_BYTES + padded(PAYLOAD)


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def payload(i: int) -> bytes:
    return (i.to_bytes(4, "big") * (PAYLOAD // 4 + 1))[:PAYLOAD]


@pytest.fixture
def ssd_dir(tmp_path):
    return str(tmp_path / "ssd")


def open_store(d: str, capacity: int = 64 * RECORD) -> SsdStore:
    return SsdStore(d, capacity).open()


def read(s: SsdStore, i: int) -> bytes | None:
    out = bytearray(PAYLOAD)
    return bytes(out) if s.get(NS, h(i), out) else None


def test_roundtrip_and_restart_finds_every_durable_record(ssd_dir):
    s = open_store(ssd_dir)
    assert s.put_many([(NS, h(i), payload(i)) for i in range(10)]) == 10
    s.delete(NS, h(3))
    s.close()
    s = open_store(ssd_dir)                           # a restart: the index comes from the headers
    assert [read(s, i) == payload(i) for i in range(10)] == [i != 3 for i in range(10)]
    assert s.used_bytes() == 9 * RECORD and s.by_namespace() == {NS: 9}
    assert s.file_bytes() == os.stat(os.path.join(ssd_dir, f"blocks-{PAYLOAD}.kvs")).st_size
    assert stat.S_IMODE(os.stat(ssd_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(os.path.join(ssd_dir, f"blocks-{PAYLOAD}.kvs")).st_mode) == 0o600


def test_a_second_owner_is_refused(ssd_dir):
    s = open_store(ssd_dir)
    with pytest.raises(StoreLocked, match="another kvstore daemon owns"):
        open_store(ssd_dir)
    s.close()
    open_store(ssd_dir).close()                      # free again once the first is gone


def test_capacity_is_never_exceeded(ssd_dir):
    s = open_store(ssd_dir, capacity=5 * RECORD + 100)
    assert s.put_many([(NS, h(i), payload(i)) for i in range(8)]) == 5
    assert s.counters["full"] == 3
    assert s.file_bytes() <= 5 * RECORD + 100
    assert s.put_many([(NS, h(i), payload(i)) for i in range(8, 11)]) == 3     # room made by evicting 3
    assert s.counters["evictions"] == 3 and s.by_namespace() == {NS: 5} and s.used_bytes() == 5 * RECORD


def _corrupt(ssd_dir: str, record: int, offset: int, data: bytes) -> None:
    with open(os.path.join(ssd_dir, f"blocks-{PAYLOAD}.kvs"), "r+b") as f:
        f.seek(record * RECORD + offset)
        f.write(data)


def stored_then_corrupted(ssd_dir: str, n: int, record: int, offset: int, data: bytes) -> SsdStore:
    """Store blocks 0..n-1, stop, overwrite `data` at `offset` in `record`, and open the store again."""
    s = open_store(ssd_dir)
    s.put_many([(NS, h(i), payload(i)) for i in range(n)])
    s.close()
    _corrupt(ssd_dir, record, offset, data)
    return open_store(ssd_dir)


@pytest.mark.parametrize("where, data, reason", [
    (HEADER_BYTES + 5000, b"\xff", "payload_checksum"),     # a flipped byte in the payload
    (HEADER_BYTES, bytes(PAYLOAD), "payload_checksum"),    # the payload zero-filled
    (40, b"\x01", "header_checksum"),                       # a flipped byte in the header's key field
    (0, b"NOTOURS!", "foreign"),                            # another program's bytes
])
def test_corrupt_record_is_a_quarantined_miss(ssd_dir, where, data, reason):
    s = stored_then_corrupted(ssd_dir, 3, 1, where, data)
    assert read(s, 1) is None                        # never the wrong bytes
    assert s.counters[f"bad.{reason}"] == 1
    assert read(s, 0) == payload(0) and read(s, 2) == payload(2)
    s.close()
    s = open_store(ssd_dir)                          # quarantined: gone for good, its space reusable
    assert read(s, 1) is None and s.used_bytes() == 2 * RECORD


@pytest.mark.parametrize("cut", [1, HEADER_BYTES - 1, HEADER_BYTES + PAYLOAD - 1])
def test_torn_tail_and_appended_garbage(ssd_dir, cut):
    s = open_store(ssd_dir)
    s.put_many([(NS, h(i), payload(i)) for i in range(3)])
    s.close()
    path = os.path.join(ssd_dir, f"blocks-{PAYLOAD}.kvs")
    size = os.path.getsize(path)
    os.truncate(path, size - RECORD * (64 - 3) - RECORD + cut)   # the last written record torn after `cut` bytes
    with open(path, "ab") as f:
        f.write(b"garbage")
    s = open_store(ssd_dir)
    assert s.counters["bad.torn_tail"] == 1
    assert [read(s, i) == payload(i) for i in range(3)] == [True, True, False]
    assert os.path.getsize(path) % RECORD == 0


def test_foreign_temporary_and_symlinked_files_are_skipped(ssd_dir, tmp_path):
    s = open_store(ssd_dir)
    s.put_many([(NS, h(1), payload(1))])
    s.close()
    outside = tmp_path / "outside.kvs"
    outside.write_bytes(b"x" * RECORD)
    os.symlink(outside, os.path.join(ssd_dir, "blocks-20000.kvs"))
    for name in ("notes.txt", "blocks-123.kvs.tmp"):
        with open(os.path.join(ssd_dir, name), "w") as f:
            f.write("not a record")
    s = open_store(ssd_dir)
    assert s.counters["skipped_files"] == 3
    assert read(s, 1) == payload(1)
    assert outside.read_bytes() == b"x" * RECORD     # never written through the symlink


def test_wrong_geometry_is_a_miss(ssd_dir):
    s = open_store(ssd_dir)
    s.put_many([(NS, h(1), payload(1))])
    assert s.get(NS, h(1), bytearray(PAYLOAD - 1)) is False
    assert s.counters["wrong_geometry"] == 1
    assert read(s, 1) == payload(1)


def test_newest_copy_wins_after_restart(ssd_dir):
    s = open_store(ssd_dir)
    s.put_many([(NS, h(1), payload(1))])
    s.put_many([(NS, h(1), payload(2))])             # the same key stored again
    s.close()
    s = open_store(ssd_dir)
    assert read(s, 1) == payload(2) and s.used_bytes() == RECORD


def test_verify_reports_then_fixes(ssd_dir):
    s = stored_then_corrupted(ssd_dir, 4, 2, HEADER_BYTES + 7, b"\x00\x01")
    bad = s.verify()
    assert [(rec, reason) for _, rec, reason in bad] == [(2, "payload_checksum")]
    assert s.verify() == bad                         # reporting changes nothing
    assert len(s.verify(fix=True)) == 1
    assert s.verify() == [] and read(s, 2) is None and s.used_bytes() == 3 * RECORD


def test_cli_verify(ssd_dir):
    import json
    import subprocess
    import sys

    s = open_store(ssd_dir)
    s.put_many([(NS, h(i), payload(i)) for i in range(3)])
    s.close()
    _corrupt(ssd_dir, 0, HEADER_BYTES + 1, b"\xee")
    run = lambda *a: subprocess.run([sys.executable, "-m", "kvstore", "verify", "--dir", ssd_dir, *a],  # noqa: E731
                                    capture_output=True, text=True)
    r = run("--json")
    assert r.returncode == 1
    out = json.loads(r.stdout)
    assert out["records"] == 3 and [b["reason"] for b in out["bad"]] == ["payload_checksum"]
    assert run("--fix").returncode == 0
    r = run()
    assert r.returncode == 0 and "2 record(s) checked, 0 bad" in r.stdout
    held = open_store(ssd_dir)                       # a daemon owns the directory: verify refuses
    r = run()
    assert r.returncode == 1 and "stop the daemon" in r.stderr
    held.close()


def test_bad_record_in_a_batch_cuts_the_prefix_there(ssd_dir):
    s = stored_then_corrupted(ssd_dir, 6, 3, HEADER_BYTES + 100, b"\x99")
    outs = [bytearray(PAYLOAD) for _ in range(6)]
    assert s.get_many(NS, [h(i) for i in range(6)], outs) == 3
    assert [bytes(o) for o in outs[:3]] == [payload(i) for i in range(3)]
    assert s.counters["bad.payload_checksum"] == 1
    assert s.get_many(NS, [h(4), h(5)], outs[:2]) == 2           # the blocks after it are still good


@pytest.mark.parametrize("io", ["threads", "auto"])
@pytest.mark.parametrize("nbytes", [2 << 20, (1536 << 10) + 4096])
def test_records_larger_than_a_piece_round_trip_in_every_lane(ssd_dir, io: str, nbytes: int) -> None:
    """Payloads of several 512 KiB pieces (whole, and a last piece that is not) are written piece by piece with
    checkpoints between them (background lane) and read back into page-aligned buffers piece by piece (prefetch)
    or in one read (critical): byte-exact, and the store's CRC check passes, across a restart too."""
    import mmap

    import numpy as np

    from kvstore.checksum import crc32c
    from kvstore.traffic import Lane
    from kvstore.traffic.path import PIECE_BYTES

    assert nbytes > 2 * PIECE_BYTES
    rng = np.random.default_rng(nbytes)
    blocks = []
    for _ in range(3):
        m = mmap.mmap(-1, nbytes)                       # page-aligned: written straight from it, as host slots are
        m[:] = rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes()
        blocks.append(m)
    s = SsdStore(ssd_dir, 16 * (nbytes + HEADER_BYTES), io=io).open()
    writer = [crc32c(b) for b in blocks]                # the writers' CRCs travel with the blocks and come back
    assert s.put_many([(NS, h(i), blocks[i], writer[i]) for i in range(3)], Lane.BACKGROUND) == 3
    for reopen in (False, True):
        if reopen:
            s.close()
            s = SsdStore(ssd_dir, 16 * (nbytes + HEADER_BYTES), io=io).open(wait=True)
        for lane in (Lane.PREFETCH, Lane.CRITICAL):
            outs = [mmap.mmap(-1, nbytes) for _ in range(3)]
            crcs: list[int | None] = []
            assert s.get_many(NS, [h(i) for i in range(3)], [memoryview(o) for o in outs], lane, crcs=crcs) == 3
            assert [bytes(o) for o in outs] == [bytes(b) for b in blocks]
            assert crcs == writer
    s.close()


# ----- one record check, shared by reads and verify (the check itself: test_ssd_record.py) -----
def test_verify_and_reads_agree_on_a_record_of_another_length(ssd_dir: str) -> None:
    """A whole, checksummed header that names fewer bytes than the file's records hold: reads refuse it, and so
    does verify (it applies the same check)."""
    from kvstore.checksum import crc32c
    from kvstore.tiers.ssd.record import Header

    s = open_store(ssd_dir)
    s.put_many([(NS, h(i), payload(i)) for i in range(3)])
    _, rec, seq = s.index[NS + h(1)]
    short = payload(1)[:PAYLOAD - 16]
    _corrupt(ssd_dir, rec, 0, Header(NS, h(1), len(short), crc32c(short), seq).pack())
    assert [(r, reason) for _, r, reason in s.verify()] == [(rec, "key_mismatch")]
    assert read(s, 1) is None and s.counters["bad.key_mismatch"] == 1
    assert read(s, 0) == payload(0) and s.verify() == []
    s.close()


# ----- the restart scan -----
def _gated_scan(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Scan chunks (and a map's validation) wait for the returned event before they read anything."""
    from tests.tiers.ssd_blocks import gate_restart

    return gate_restart(monkeypatch)


def forget_maps(ssd_dir: str) -> None:
    """Remove the record maps, as a directory written before them has none: the next start scans every header."""
    for name in os.listdir(ssd_dir):
        if name.endswith(".map"):
            os.unlink(os.path.join(ssd_dir, name))


def test_a_write_during_the_scan_is_never_undone_by_it(ssd_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The file grows for a write made while the scan runs: the scan reads only the records the file held when it
    started, so it neither frees the grown records a second time nor quarantines the new record as a copy."""
    import time

    s = open_store(ssd_dir, capacity=1000 * RECORD)
    s.put_many([(NS, h(i), payload(i)) for i in range(3)])
    s.close()                                        # 64 records, 3 of them used
    forget_maps(ssd_dir)
    gate = _gated_scan(monkeypatch)
    s = SsdStore(ssd_dir, 1000 * RECORD).open(wait=False)
    assert s.put_many([(NS, h(100), payload(100))]) == 1     # no free record known yet: the file grows
    gate.set()
    deadline = time.monotonic() + 30
    while s.scan.state == "scanning" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert s.scan.state == "ready" and s.scan.total == 64
    cf = s.files[PAYLOAD]
    assert cf.nrecords == 128 and len(cf.free) == len(set(cf.free)) == 128 - 4
    assert not [k for k in s.counters if k.startswith("bad.")]
    assert [read(s, i) for i in (0, 1, 2, 100)] == [payload(i) for i in (0, 1, 2, 100)]
    s.close()
    s = open_store(ssd_dir)
    assert read(s, 100) == payload(100) and s.used_bytes() == 4 * RECORD
    s.close()


def test_close_during_the_scan_stops_it_at_once(ssd_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from kvstore.tiers.ssd import scan

    monkeypatch.setattr(scan, "SCAN_CHUNK", 1)       # a transfer per record: 64 chunks, 8 of them in flight
    s = open_store(ssd_dir)
    s.put_many([(NS, h(1), payload(1))])             # a file of 64 records
    s.close()
    gate = _gated_scan(monkeypatch)
    s = SsdStore(ssd_dir, 64 * RECORD).open(wait=False)
    s.scanner.closing = True                         # as close() sets it, with every slot taken
    gate.set()
    t0 = time.monotonic()
    s.close()
    assert time.monotonic() - t0 < 2.0
    assert s.scan.state == "stopped" and s.scan.done < s.scan.total == 64


def test_scan_progress_is_reported_as_it_goes(ssd_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstore.tiers.ssd import scan

    monkeypatch.setattr(scan, "SCAN_CHUNK", 1)
    s = open_store(ssd_dir)
    s.put_many([(NS, h(1), payload(1))])             # a file of 64 records
    s.close()
    calls: list[tuple[int, int]] = []
    s = SsdStore(ssd_dir, 64 * RECORD).open(lambda done, total: calls.append((done, total)))
    s.close()
    assert len(calls) >= 4 and calls[-1] == (64, 64)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)


# ----- the directory: kvstore.private_dir, as the store uses it -----
def test_an_open_directory_of_ours_is_tightened(ssd_dir: str) -> None:
    os.makedirs(ssd_dir, mode=0o755)
    os.chmod(ssd_dir, 0o755)
    open_store(ssd_dir).close()
    assert stat.S_IMODE(os.stat(ssd_dir).st_mode) == 0o700


@pytest.mark.parametrize("mode", [0o1777, 0o777, 0o1700])
def test_a_shared_directory_is_refused_never_tightened(ssd_dir: str, mode: int) -> None:
    """Like /tmp (ours by uid when running as root): refused, left as it is, nothing created in it."""
    from kvstore.private_dir import NotPrivateDir

    os.makedirs(ssd_dir)
    os.chmod(ssd_dir, mode)
    with pytest.raises(NotPrivateDir, match=f"ssd directory {ssd_dir} is shared .*private directory inside it"):
        open_store(ssd_dir)
    assert stat.S_IMODE(os.stat(ssd_dir).st_mode) == mode and os.listdir(ssd_dir) == []


def test_a_symlink_or_a_file_is_refused(ssd_dir: str, tmp_path: Path) -> None:
    from kvstore.private_dir import NotPrivateDir

    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    os.symlink(real, ssd_dir)
    with pytest.raises(NotPrivateDir, match="is a symlink or not a directory"):
        open_store(ssd_dir)
    assert os.listdir(real) == []                    # no LOCK made through the link
    os.unlink(ssd_dir)
    with open(ssd_dir, "w") as f:
        f.write("a file")
    with pytest.raises(NotPrivateDir, match="is a symlink or not a directory"):
        open_store(ssd_dir)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a directory to another user")
def test_a_directory_of_another_user_is_refused(ssd_dir: str) -> None:
    from kvstore.private_dir import NotPrivateDir

    os.makedirs(ssd_dir, mode=0o700)
    os.chown(ssd_dir, 65534, 65534)
    with pytest.raises(NotPrivateDir, match=f"ssd directory {ssd_dir} belongs to uid 65534"):
        open_store(ssd_dir)
    assert os.listdir(ssd_dir) == []


def test_private_dir_messages_and_error_type(tmp_path: Path) -> None:
    """One exception type, an OSError (callers that report OSErrors report it), whose message names the directory
    as the caller calls it; the socket's directory gets the same check."""
    from kvstore.private_dir import NotPrivateDir, ensure_private_dir

    d = str(tmp_path / "run")
    ensure_private_dir(d, "socket directory")        # created 0700, parents as makedirs makes them
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    ensure_private_dir(d, "socket directory")        # and again: nothing to do
    os.chmod(d, 0o1777)
    with pytest.raises(OSError) as e:
        ensure_private_dir(d, "socket directory")
    assert isinstance(e.value, NotPrivateDir) and e.value.strerror is None
    assert str(e.value).startswith(f"socket directory {d} is shared")


def test_cli_verify_refuses_a_shared_directory(ssd_dir: str) -> None:
    import subprocess
    import sys

    os.makedirs(ssd_dir)
    os.chmod(ssd_dir, 0o1777)
    r = subprocess.run([sys.executable, "-m", "kvstore", "verify", "--dir", ssd_dir], capture_output=True, text=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith(f"kvstore: cannot verify {ssd_dir}: ssd directory {ssd_dir} is shared")

