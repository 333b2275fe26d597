"""The SSD tier's files: the directory and its lock, and one record file per block size.

- `lock_directory` makes the directory private (kvstore.private_dir: 0700, ours, not shared, not a symlink) and
  takes its LOCK file (0600, flock): one daemon is its only owner. `StoreLocked` when another holds it; a refused
  directory raises NotPrivateDir (an OSError). Nothing else in the directory is touched.
- A `ClassFile` is `blocks-<payload bytes>.kvs`: fixed-size records (record.py), 0600, opened with O_NOFOLLOW and
  with O_DIRECT where the file system takes it (tmpfs does not: then buffered). A file created is followed by an
  fsync of the directory, so that it survives a power cut with the records later synced in it (growth needs none:
  the fdatasync of the records written there carries the new size). `record_file_payload` names the files found
  at start that are ours (a name that is not, or a symlink, is skipped); a torn tail (not a whole record) is cut.
- Beside each record file, its record map `blocks-<payload bytes>.map` (recmap.py): a copy of every live record's
  header fields, opened and created with it (a new record file gets an empty, complete map), so that a restart
  knows what is on disk before it serves. `is_map_name` tells the scan not to take it for a foreign file.
- `allocate` reserves records at the end of a file for real (posix_fallocate), so a full disk shows there as a
  refusal, never as a failed write later; a refusal leaves the file exactly as it was. `add_records` then books
  the new records as free: `free` lists the records of a file that hold nothing (the writer takes from its end).
- `punch` gives a record's disk space back (a hole: the record reads as zeros, its block gone) and `refill`
  allocates a hole again before it is reused: how a block size's file makes room for another size's under the
  tenants' SSD quotas (owners.py). `holes` lists a file's punched records (in memory: after a restart a hole is a
  free record like any other, counted in the file's size, so the tier's disk use stays within the cap).
- Every change to a record file goes through diskio.py (which a test can record; a punch is not recorded);
  `choose_io` picks how record bytes move: os.preadv/pwritev from the path's workers, or an io_uring per worker
  (uring.py) when asked for and its probe finds it sound (never while diskio records). Buffers for O_DIRECT come
  from `aligned` (page-aligned anonymous mappings) unless `aligned_for_io` says the caller's buffer can be used as
  it is.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import queue
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstore.private_dir import ensure_private_dir
from kvstore.tiers.ssd import diskio
from kvstore.tiers.ssd.recmap import RecordMap
from kvstore.tiers.ssd.record import ALIGN, HEADER_BYTES, record_bytes

log = logging.getLogger("kvstore")
FILE_RE = re.compile(r"^blocks-(\d+)\.kvs$")
MAP_RE = re.compile(r"^blocks-(\d+)\.map$")
LOCK_NAME = "LOCK"


class StoreLocked(RuntimeError):
    """Another daemon owns the directory (holds its LOCK file)."""


def aligned(n: int) -> mmap.mmap:
    """A zeroed, page-aligned buffer of at least one page, as O_DIRECT wants."""
    return mmap.mmap(-1, max(n, mmap.PAGESIZE))


ZERO_BUF = aligned(HEADER_BYTES)          # all zeros, aligned: the header of a deleted or bad record


def aligned_for_io(buf: Any) -> bool:
    """Whether O_DIRECT can move `buf` as it is: its address and length on 4 KiB boundaries."""
    if len(buf) % ALIGN:
        return False
    try:
        return int(np.frombuffer(buf, np.uint8).ctypes.data) % ALIGN == 0
    except (TypeError, ValueError):
        return False


def choose_io(io: str) -> tuple[str, Callable[..., int], Callable[..., int]]:
    """(name, preadv, pwritev) for `io` (auto | io_uring | threads): io_uring only where its probe passes."""
    if diskio.recording():
        log.warning("ssd: recording every write and sync (%s): io_uring not used", diskio.RECORD_ENV)
        return "threads", os.preadv, diskio.pwritev
    if io in ("auto", "io_uring"):
        from kvstore.tiers.ssd import uring

        ok = uring.available()
        (log.info if ok or io == "auto" else log.warning)("ssd: %s", uring.REASON)
        if ok:
            return "io_uring", uring.preadv, uring.pwritev
    return "threads", os.preadv, os.pwritev


# ----- the directory -----
def lock_directory(directory: str) -> int:
    """Make `directory` private and take its LOCK; returns the lock's descriptor (close it to let go)."""
    ensure_private_dir(directory, "ssd directory")
    fd = os.open(os.path.join(directory, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StoreLocked(f"another kvstore daemon owns {directory} (its LOCK file is held); give each daemon "
                          f"its own ssd directory") from None
    return fd


# ----- record files -----
@dataclass(eq=False)
class ClassFile:
    """The record file of one payload size. `nrecords` and `free` are the store's books (under its lock)."""
    payload: int
    path: str
    fd: int
    direct: bool
    nrecords: int = 0
    free: list[int] = field(default_factory=list)
    holes: list[int] = field(default_factory=list)    # punched records: neither free nor allocated (`punch`)
    map: RecordMap | None = None                      # its record map (recmap.py)
    unverified: dict[int, bytes] = field(default_factory=dict)   # record → key: booked from the map, header unread
    keys: list[bytes | None] = field(default_factory=list)        # record → the key booked there (the store's)
    spare: queue.SimpleQueue[mmap.mmap] = field(default_factory=queue.SimpleQueue)   # record buffers for I/O

    def take(self) -> mmap.mmap:
        """An aligned buffer of one record; give it back with `spare.put`."""
        try:
            return self.spare.get_nowait()
        except queue.Empty:
            return aligned(self.record)

    @property
    def record(self) -> int:
        return record_bytes(self.payload)

    def size(self) -> int:
        return self.nrecords * self.record

    def allocated(self) -> int:
        """The bytes of its records on the disk: its size less its holes."""
        return (self.nrecords - len(self.holes)) * self.record


def open_class_file(directory: str, payload: int, path: str | None = None) -> ClassFile:
    """Open the record file for `payload`-byte blocks, O_DIRECT where it is taken, and its record map; a record
    file that does not exist yet is created empty with an empty, complete map, and the directory synced."""
    path = path or os.path.join(directory, f"blocks-{payload}.kvs")
    try:
        fd, direct = _open(path, os.O_CREAT | os.O_EXCL)
        created = True
    except FileExistsError:
        fd, direct = _open(path, 0)
        created = False
    diskio.opened(fd, path, created)
    try:
        rmap = RecordMap.open(path, payload, fresh=created)
    except OSError:
        os.close(fd)
        raise
    if created:
        diskio.fsync_dir(directory)
    return ClassFile(payload, path, fd, direct, map=rmap)


def _open(path: str, create: int) -> tuple[int, bool]:
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags | create | os.O_DIRECT, 0o600), True
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
    # no O_DIRECT here (tmpfs and friends): buffered; the refused open may have created the file already
    return os.open(path, flags | (create & ~os.O_EXCL), 0o600), False


def is_map_name(name: str) -> bool:
    """A record map's name (recmap.py): opened with its record file, never on its own."""
    return MAP_RE.match(name) is not None


def record_file_payload(directory: str, name: str) -> int | None:
    """The payload size of a record file of ours named `name`; None for other names and anything not a plain file
    (a symlink, a directory)."""
    m = FILE_RE.match(name)
    if not m or not stat.S_ISREG(os.lstat(os.path.join(directory, name)).st_mode):
        return None
    return int(m.group(1))


def cut_torn_tail(cf: ClassFile) -> int:
    """Count the file's whole records into `nrecords`; a torn tail or appended garbage is cut off. Returns the
    bytes cut."""
    size = os.fstat(cf.fd).st_size
    cf.nrecords = size // cf.record
    if size % cf.record:
        diskio.ftruncate(cf.fd, cf.size())
    return size % cf.record


def allocate(cf: ClassFile, start: int, nbytes: int) -> OSError | None:
    """Allocate `nbytes` at `start` (the file's end), really (posix_fallocate, not a sparse ftruncate); where the
    file system has no fallocate a sparse file will do. Returns the refusal (ENOSPC, EDQUOT, EFBIG), with nothing
    allocated, or None; other errors raise. A disk call: never under the store's lock."""
    try:
        diskio.posix_fallocate(cf.fd, start, nbytes)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):     # no fallocate here: a sparse file will do
            diskio.ftruncate(cf.fd, start + nbytes)
        elif e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise
        else:
            try:
                diskio.ftruncate(cf.fd, start)                # nothing half-allocated stays past our records
            except OSError:
                pass
            return e
    return None


def add_records(cf: ClassFile, records: int) -> None:
    """(The books.) Book `records` allocated at the end of the file as free, lowest last."""
    cf.free.extend(range(cf.nrecords + records - 1, cf.nrecords - 1, -1))
    cf.nrecords += records


_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


def punch(cf: ClassFile, rec: int) -> OSError | None:
    """Give record `rec`'s disk space back (it reads as zeros from now on: its header too); the refusal (a file
    system without hole punching), with nothing changed, or None. A disk call: never under the store's lock."""
    if _libc.fallocate(cf.fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, rec * cf.record, cf.record) != 0:
        err = ctypes.get_errno()
        return OSError(err, f"fallocate(PUNCH_HOLE) on {cf.path}: {os.strerror(err)}")
    return None


def refill(cf: ClassFile, rec: int) -> OSError | None:
    """Allocate a punched record again (posix_fallocate inside the file: its size does not change); the refusal
    (ENOSPC, ...), with the record still a hole, or None. A disk call: never under the store's lock."""
    try:
        diskio.posix_fallocate(cf.fd, rec * cf.record, cf.record)
    except OSError as e:
        return e
    return None
