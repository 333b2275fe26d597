"""The checks behind `uring.available()`, in the order uring._probe runs them: `check_binding` (a ring set up in a
child process, since a binding built for CPU instructions this machine lacks dies of SIGILL; then the import, the
functions uring.py calls, and what the binding does with buffer exports), then `io_probe`, a test O_DIRECT read and
write through a ring of uring.py. A binding or a kernel that fails any of them is not used. This module holds no
state: the verdict, REASON and the rings are uring.py's.

`give_back_export` undoes the one buffer export per memoryview that liburing 2026.3.30's `Iovec` takes and never
releases (measured by `iovec_semantics`), so that an mmap is not pinned for good by every op.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any


class _PyBuffer(ctypes.Structure):
    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.py_object), ("len", ctypes.c_ssize_t),
                ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p)]


_PyBuffer_Release = ctypes.pythonapi.PyBuffer_Release
_PyBuffer_Release.argtypes = [ctypes.POINTER(_PyBuffer)]
_PyBuffer_Release.restype = None


def give_back_export(mv: memoryview) -> None:
    """Undo one PyObject_GetBuffer(mv) that was never released: a memoryview's releasebuffer only counts its
    exports down, and PyBuffer_Release then drops the reference the buffer held."""
    pb = _PyBuffer()
    pb.obj = mv
    _PyBuffer_Release(ctypes.byref(pb))



def iovec_semantics(L: Any) -> bool:
    """True if Iovec leaks exactly one export per memoryview, False if it keeps none after it is gone; else
    raise (a binding this module does not understand is not used)."""
    mv = memoryview(bytearray(64))
    base = sys.getrefcount(mv)
    iov = L.Iovec([mv, mv])
    del iov
    left = sys.getrefcount(mv) - base
    if left == 0:
        mv.release()
        return False
    if left == 2:
        give_back_export(mv)
        give_back_export(mv)
        if sys.getrefcount(mv) - base == 0:
            mv.release()             # BufferError here would mean the count is not what we think
            return True
    raise RuntimeError(f"Iovec keeps {left} references to 2 buffers; not a behaviour this module knows")


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


class Unusable(Exception):
    """Why liburing is not used (the text after "io_uring unavailable: " in uring.REASON)."""


_CHILD_PROBE = "import liburing as L; r = L.Ring(); L.io_uring_queue_init(8, r); L.io_uring_queue_exit(r)"

NEED = ("Ring", "Cqe", "Iovec", "io_uring_queue_init", "io_uring_queue_exit", "io_uring_get_sqe",
        "io_uring_prep_readv", "io_uring_prep_writev", "io_uring_submit", "io_uring_peek_cqe", "io_uring_cqe_seen")


def child_probe() -> str | None:
    """None if a child process can load liburing and set up a ring; else why not. Why a child first: a binding
    built for CPU instructions this machine lacks dies of SIGILL, which no except clause catches (liburing
    2026.3.30's wheel holds AVX-512 code: on an AMD EPYC without it, `Ring()` killed the daemon at start)."""
    try:
        p = subprocess.run([sys.executable, "-c", _CHILD_PROBE], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"the child probe could not run ({type(e).__name__}: {e})"
    if p.returncode < 0:
        try:
            name = signal.Signals(-p.returncode).name
        except ValueError:
            name = str(-p.returncode)
        return (f"liburing killed a child process with {name} (its binary uses CPU instructions this machine "
                f"lacks, or the kernel refused the ring)")
    if p.returncode != 0:
        tail = p.stderr.decode(errors="replace").strip().splitlines()
        return f"liburing failed in a child process ({tail[-1] if tail else f'exit {p.returncode}'})"
    return None


def check_binding() -> tuple[Any, bool, str]:
    """(liburing, whether its Iovec leaks one export per memoryview, its version) once the child probe passed, it
    imports and has every function in NEED; else Unusable saying which check failed."""
    crashed = child_probe()
    if crashed is not None:
        raise Unusable(crashed)
    try:
        import liburing as L
    except Exception as e:                       # ImportError, or a broken wheel
        raise Unusable(f"cannot import liburing ({type(e).__name__}: {e})") from e
    version = getattr(L, "__version__", "?")
    missing = [x for x in NEED if not hasattr(L, x)]
    if missing:
        raise Unusable(f"liburing {version} lacks {', '.join(missing)}")
    try:
        leaks = iovec_semantics(L)
    except Exception as e:
        raise Unusable(f"liburing {version}: {e}") from e
    return L, leaks, version
