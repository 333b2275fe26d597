"""The checks behind `uring.available()`, in the order uring._probe runs them: `load_binding` (the native
kvstore._kvuring is built), a Ring set up (the kernel may refuse: `refusal` turns its errno into a line for the log),
then `io_probe`, a test O_DIRECT read and write through that ring. A kernel or a build that fails any of them is not
used. This module holds no state: the verdict, REASON and the rings are uring.py's.

No child process: kvstore._kvuring is compiled on the build machine with plain -O2 (no -march), so it has no
instruction the CPU may lack (the liburing wheel it replaces held AVX-512 code and died of SIGILL without it).
"""
from __future__ import annotations

import errno
import mmap
import os
import tempfile
from collections.abc import Callable
from types import ModuleType

# Why the kernel refused io_uring_setup, by errno: what an operator should look at.
_REFUSALS = {
    errno.ENOSYS: "this kernel has no io_uring (or one older than 5.5)",
    errno.EPERM: "refused by kernel.io_uring_disabled or a seccomp filter (a container runtime's default)",
    errno.EACCES: "refused by a security module",
    errno.ENOMEM: "no memory for the rings (RLIMIT_MEMLOCK on kernels before 5.12)",
}


class Unusable(Exception):
    """Why io_uring is not used (the text after "io_uring unavailable: " in uring.REASON)."""


def load_binding() -> ModuleType:
    """kvstore._kvuring, or Unusable if it was not built (setup.py builds it as optional)."""
    try:
        import kvstore._kvuring as native
    except ImportError as e:
        raise Unusable(f"the native binding kvstore._kvuring is not built ({e})") from e
    return native


def refusal(e: OSError) -> str:
    """The kernel's refusal of a ring, with its errno, as a line for the log."""
    name = errno.errorcode.get(e.errno or 0, str(e.errno))
    why = _REFUSALS.get(e.errno or 0, e.strerror or "")
    return f"the kernel refused io_uring_setup ({name}: {why})"


def io_probe(run: Callable[[str, int, memoryview, int], int]) -> str:
    """A test O_DIRECT readv and writev, through `run` (one op on the ring under test), in a temporary file of
    $KVSTORE_URING_PROBE_DIR (else the temp directory; buffered where O_DIRECT is refused there). Returns how it
    ran, for the log; raises if a byte or a count is wrong, or if an export is left behind."""
    d = os.environ.get("KVSTORE_URING_PROBE_DIR") or tempfile.gettempdir()
    fd0, path = tempfile.mkstemp(prefix=".kvstore-uring-probe-", dir=d)
    try:
        os.close(fd0)
        pattern = bytes(range(256)) * 32                     # 8 KiB
        with open(path, "wb") as f:
            f.write(pattern)
            f.flush()
            os.fsync(f.fileno())
        try:
            fd = os.open(path, os.O_RDWR | os.O_DIRECT)
            how = f"O_DIRECT probe in {d}"
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            fd = os.open(path, os.O_RDWR)
            how = f"buffered probe: {d} refuses O_DIRECT"
        buf = mmap.mmap(-1, 8192)
        mv = memoryview(buf)
        try:
            first, second = mv[:4096], mv[4096:]
            n = run("r", fd, first, 4096)
            if n != 4096 or buf[:4096] != pattern[4096:]:
                raise OSError(errno.EIO, f"readv returned {n} and {'wrong' if n == 4096 else 'no'} bytes")
            buf[:4096] = pattern[::-1][:4096]
            n = run("w", fd, first, 0)
            m = run("r", fd, second, 0)
            if n != 4096 or m != 4096 or buf[4096:] != pattern[::-1][:4096]:
                raise OSError(errno.EIO, f"writev returned {n}, read back {m}, or the bytes differ")
            first.release()
            second.release()
        finally:
            os.close(fd)
        mv.release()
        buf.close()           # BufferError if an export were left behind: the probe fails then
        return how
    finally:
        os.unlink(path)
