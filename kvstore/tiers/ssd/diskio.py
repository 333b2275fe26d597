"""Every change the SSD tier makes to its files goes through here: writes, syncs, size changes, file creation and
directory syncs. Normally these are the `os` calls themselves. With `KVSTORE_DISKIO_RECORD=<log path>` in the
daemon's environment (tests only) each call is also appended to a log, so that a test can rebuild the states a
power cut could have left on the disk (tests/power_cut.py) and restart the daemon on them. io_uring cannot be
recorded: in recording mode files.choose_io uses the threads path. (Not `KVSTORE_SSD_*`: that prefix is the ssd
section of the configuration.)

The log is a sequence of entries, each `ENTRY` followed by `datalen` bytes, appended under one lock in the order
the calls completed; `t` is time.monotonic() (system-wide, so a test process can compare it with the times of its
own requests). Only files registered by `opened` (the record files) are recorded.

    op        fid   a                  b        data
    CREATE    fid   0                  0        the file's name (it did not exist before)
    OPEN      fid   0                  0        the file's name (it existed)
    WRITE     fid   offset             bytes    the bytes written
    SIZE      fid   new size           0        (ftruncate)
    ALLOC     fid   offset             length   (posix_fallocate: the size grows to offset + length at least)
    SYNC      fid   entries at start   0        (fdatasync or fsync done: the entries before `a` are durable)
    DIRSYNC   0     entries at start   0        (the directory's fsync done: files created before `a` exist)
"""
from __future__ import annotations

import os
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

RECORD_ENV = "KVSTORE_DISKIO_RECORD"
CREATE, OPEN, WRITE, SIZE, ALLOC, SYNC, DIRSYNC = range(7)
ENTRY = struct.Struct("<BxxxIdQQQ")         # op, fid, t, a, b, datalen


@dataclass(frozen=True, slots=True)
class Entry:
    op: int
    fid: int
    t: float
    a: int
    b: int
    data: bytes


class _Recorder:
    """The log of one daemon process (append only, one lock: entries are in the order the calls completed)."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        self.lock = threading.Lock()
        self.entries = 0
        self.fids: dict[int, int] = {}      # fd → file id
        self.names: dict[str, int] = {}     # file name → file id

    def log(self, op: int, fid: int, a: int = 0, b: int = 0, data: bytes = b"") -> None:
        with self.lock:
            self._append(op, fid, a, b, data)

    def _append(self, op: int, fid: int, a: int, b: int, data: bytes) -> None:
        os.write(self.fd, ENTRY.pack(op, fid, time.monotonic(), a, b, len(data)) + data)
        self.entries += 1

    def opened(self, fd: int, path: str, created: bool) -> None:
        name = os.path.basename(path)
        with self.lock:
            fid = self.names.setdefault(name, len(self.names) + 1)
            self.fids[fd] = fid
            self._append(CREATE if created else OPEN, fid, 0, 0, name.encode())

    def start(self) -> int:
        with self.lock:
            return self.entries


_rec: _Recorder | None = _Recorder(os.environ[RECORD_ENV]) if os.environ.get(RECORD_ENV) else None


def recording() -> bool:
    """Whether this process records its SSD I/O (then io_uring is not used)."""
    return _rec is not None


def opened(fd: int, path: str, created: bool) -> None:
    """A record file was opened (created, if `created`): from now on its changes are recorded."""
    if _rec is not None:
        _rec.opened(fd, path, created)


def pwritev(fd: int, bufs: Sequence[Any], offset: int) -> int:
    n = os.pwritev(fd, bufs, offset)
    if _rec is not None and fd in _rec.fids:
        data = b"".join(bytes(b) for b in bufs)[:n]
        _rec.log(WRITE, _rec.fids[fd], offset, n, data)
    return n


def fdatasync(fd: int) -> None:
    _synced(fd, os.fdatasync)


def fsync(fd: int) -> None:
    _synced(fd, os.fsync)


def _synced(fd: int, call: Any) -> None:
    if _rec is None or fd not in _rec.fids:
        call(fd)
        return
    start = _rec.start()
    call(fd)
    _rec.log(SYNC, _rec.fids[fd], start)


def ftruncate(fd: int, size: int) -> None:
    os.ftruncate(fd, size)
    if _rec is not None and fd in _rec.fids:
        _rec.log(SIZE, _rec.fids[fd], size)


def posix_fallocate(fd: int, offset: int, length: int) -> None:
    os.posix_fallocate(fd, offset, length)
    if _rec is not None and fd in _rec.fids:
        _rec.log(ALLOC, _rec.fids[fd], offset, length)


def fsync_dir(directory: str) -> None:
    """fsync the directory, so that the files created in it so far survive a power cut."""
    start = _rec.start() if _rec is not None else 0
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    if _rec is not None:
        _rec.log(DIRSYNC, 0, start)


def read_log(path: str) -> Iterator[Entry]:
    """The entries of a log, in order (a torn last entry, from a process killed while appending, is left out)."""
    with open(path, "rb") as f:
        raw = f.read()
    at = 0
    while at + ENTRY.size <= len(raw):
        op, fid, t, a, b, n = ENTRY.unpack_from(raw, at)
        if at + ENTRY.size + n > len(raw):
            return
        yield Entry(op, fid, t, a, b, raw[at + ENTRY.size:at + ENTRY.size + n])
        at += ENTRY.size + n
