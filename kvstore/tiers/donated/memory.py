"""A donated region's memory, as the tier touches it: copies in and out, each returning the CRC-32C of the bytes it
moved, and an unmap. Nothing outside this module (and `cuda`) holds a pointer into donated memory: the tier hands
out no view of it, so an unmap can never leave a caller with a dangling one.

- `MemfdMemory` (every machine): a memfd the donor created and passed by SCM_RIGHTS, mapped shared. It must be
  sealed against shrinking (F_SEAL_SHRINK): a donor that truncated a memfd we map would make the next copy a
  SIGBUS in the daemon, not an error. It needs no unseal to be given back: unmapping is all.
- `kvstore.tiers.donated.cuda.CudaMemory`: GPU memory opened from a CUDA IPC handle; imported only when a region
  of kind "cuda" arrives, so the CPU build never imports CUDA.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import stat
from typing import Protocol

from kvstore.checksum import copy_crc32c

MIN_REGION_BYTES = 1 << 12


class Refused(Exception):
    """A donation this tier does not take (the reply's `bad_request`); the message says why."""


class RegionMemory(Protocol):
    kind: str
    size: int
    outlives_mapping: bool      # the memory stays the donor's after the unmap: a reclaim answers before unmapping

    def write(self, offset: int, data: memoryview) -> int:
        """Copy host bytes into the region at `offset`; the CRC-32C of the bytes copied."""
        ...

    def read(self, offset: int, out: memoryview) -> int:
        """Copy `len(out)` bytes of the region at `offset` into host memory; the CRC-32C of `out` as written."""
        ...

    def close(self) -> bool:
        """Unmap; False if it could not be (a view still exists: never, while only this module makes them)."""
        ...


class MemfdMemory:
    kind = "memfd"
    outlives_mapping = True     # the donor's mapping keeps the pages: the daemon's munmap may follow its answer

    def __init__(self, fd: int, size: int) -> None:
        """Map a donated memfd (the fd is closed here, whatever happens: the mapping keeps the memory)."""
        try:
            check_memfd(fd, size)
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.size = size
        self._view = memoryview(self._mm)

    def write(self, offset: int, data: memoryview) -> int:
        # stream: a donated block is not read again soon; the copy may write around the caches
        with self._view[offset:offset + len(data)] as dst:
            return copy_crc32c(dst, data, stream=True)

    def read(self, offset: int, out: memoryview) -> int:
        with self._view[offset:offset + len(out)] as src:
            return copy_crc32c(out, src)

    def close(self) -> bool:
        self._view.release()
        try:
            self._mm.close()
        except BufferError:         # a view outlived its `with`: the mapping stays (no byte is read from it again)
            return False
        return True


def check_memfd(fd: int, size: int) -> None:
    """Refused unless `fd` is a memfd of exactly `size` bytes that cannot shrink."""
    st = os.fstat(fd)
    try:
        link = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        link = ""
    if not stat.S_ISREG(st.st_mode) or not link.startswith("/memfd:"):
        raise Refused(f"the fd passed is not a memfd ({link or stat.filemode(st.st_mode)}): donate memory made "
                      f"with memfd_create")
    if st.st_size != size:
        raise Refused(f"bytes says {size} but the memfd holds {st.st_size} bytes: they must match")
    if size < MIN_REGION_BYTES:
        raise Refused(f"a region must hold at least {MIN_REGION_BYTES} bytes, got {size}")
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    if not seals & fcntl.F_SEAL_SHRINK:
        raise Refused("the memfd is not sealed against shrinking: add F_SEAL_SHRINK (memfd_create with "
                      "MFD_ALLOW_SEALING, then fcntl F_ADD_SEALS), or a truncation would crash the daemon")


def open_memory(kind: str, size: int, fds: list[int], fields: dict[str, object]) -> RegionMemory:
    """The memory a `donate` message describes (its fds are closed here, kept or not); Refused says why not."""
    if kind == "memfd":
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise Refused(f"a memfd donation carries exactly one fd (SCM_RIGHTS), this one carried {len(fds)}")
        return MemfdMemory(fds[0], size)
    for fd in fds:
        os.close(fd)
    if fds:
        raise Refused(f"a {kind} donation carries no fd, this one carried {len(fds)}")
    from kvstore.tiers.donated.cuda import CudaMemory  # only here: the CPU build never imports CUDA
    return CudaMemory.from_message(size, fields)
