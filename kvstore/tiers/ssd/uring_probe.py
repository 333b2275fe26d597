"""The checks behind `uring.available()`: what the installed liburing binding does with buffer exports, and a test
O_DIRECT read and write through a ring. A binding or a kernel that fails any of them is not used (see uring.py).

`give_back_export` undoes the one buffer export per memoryview that liburing 2026.3.30's `Iovec` takes and never
releases (measured by `iovec_semantics`), so that an mmap is not pinned for good by every op.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
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
