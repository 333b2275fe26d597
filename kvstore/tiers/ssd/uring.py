"""io_uring for the SSD tier's worker threads, with os.preadv/os.pwritev as the fallback.

Each thread that calls in gets an io_uring of its own (thread-local, created on first use, `DEPTH` entries), so
worker threads never share a submission queue and need no lock (the native Ring refuses a call from any thread but
its maker's). The functions have the semantics of their `os` namesakes and work the same whether io_uring is in use
or not, so callers never branch:

    preadv(fd, bufs, offset) -> int       bytes read (short at end of file); OSError(errno) on failure
    pwritev(fd, bufs, offset) -> int      bytes written; OSError(errno) on failure
    run_many(ops, depth=None, on_done=None) -> list[int]
        ops: ("r" | "w", fd, bufs, offset) each; up to `depth` (default and at most DEPTH) of them in flight at
        once from this one thread (one io_uring_enter per refill). Results in op order: bytes moved (>= 0) or
        -errno for an op that failed. A failing op never raises and never stops the others; every op has
        completed when run_many returns. `on_done(i, result)` (which must not raise) is called in this thread as
        each op completes, in completion order, while the others are still in flight: work on the bytes of one
        (a checksum) overlaps the transfer of the next. Arguments are all checked before anything is submitted:
        a bad op (unknown kind, read into a read-only buffer, negative offset, ...) raises
        TypeError/ValueError/OSError and nothing runs.
    available() -> bool                   whether io_uring is used; REASON says why (a line for the log)
    backend() -> str                      "io_uring" or "os"

`bufs` is a list of buffers (mmap, memoryview, bytearray; bytes for writes): contiguous, and for O_DIRECT aligned
in address, length and offset as the file system wants (4 KiB is always enough), exactly as for os.preadv.
Misalignment gives OSError(EINVAL) on both paths.

io_uring is used when the native binding kvstore._kvuring (native/kvuring.c: raw io_uring syscalls, no liburing)
is built, the kernel sets up a ring (ENOSYS, or EPERM from kernel.io_uring_disabled or seccomp, give the fallback
with the errno in REASON), and a test O_DIRECT readv and writev through a ring of this module move the right bytes in
a temporary file (in $KVSTORE_URING_PROBE_DIR, else the temp directory; where O_DIRECT is refused there, e.g. tmpfs,
the probe runs buffered and REASON says so). The result is cached for the process. KVSTORE_NO_URING=1 (checked on
every call) forces the fallback. This module owns the cached verdict (available, backend, REASON), the rings and
the calls; uring_probe.py owns the checks.

Memory safety lives in the native Ring: each op holds a buffer export (Py_buffer) on every buffer it names from its
prep until its completion is reaped, so an mmap cannot be closed (BufferError) nor a bytearray resized under the
kernel. If anything raises while ops are in flight (KeyboardInterrupt during a wait, an on_done that raises), the
thread's ring is closed: the Ring cancels what is in flight and waits for every completion before it releases a
buffer, and the thread gets a fresh ring next time.

Waiting never holds the GIL: the Ring releases it around every io_uring_enter, the waits for completions included.
"""
from __future__ import annotations

import errno
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Union

from kvstore.tiers.ssd.uring_probe import Unusable, io_probe, load_binding, refusal

if TYPE_CHECKING:
    from kvstore._kvuring import Ring

Buffer = Union[memoryview, mmap.mmap, bytearray, bytes]
Op = tuple[str, int, Sequence[Buffer], int]

DEPTH = 8            # entries per thread's ring, and the most ops run_many keeps in flight
IOV_MAX = 1024       # Linux UIO_MAXIOV: os.preadv gives EINVAL beyond it

REASON = "not probed yet"     # why io_uring is (not) used: for a log line

_native: Any = None           # kvstore._kvuring once the probe passed
_state: bool | None = None    # cached probe result
_probe_reason = REASON
_probe_lock = threading.Lock()
_tls = threading.local()      # .ring: this thread's Ring; .pid: the process that made it


def _disabled() -> bool:
    return os.environ.get("KVSTORE_NO_URING", "").strip().lower() not in ("", "0", "false", "no", "off")


def available() -> bool:
    """Whether preadv/pwritev/run_many go through io_uring (probed once per process; see the module doc)."""
    global REASON
    if _disabled():
        REASON = "io_uring disabled by KVSTORE_NO_URING"
        return False
    if _state is None:
        with _probe_lock:
            if _state is None:
                _probe()
    REASON = _probe_reason
    return bool(_state)


def backend() -> str:
    """"io_uring" or "os": what preadv/pwritev/run_many use now."""
    return "io_uring" if available() else "os"


# ---------------------------------------------------------------------------------------------------- arguments

def _views(kind: str, bufs: Sequence[Buffer]) -> list[memoryview]:
    """Memoryviews of our own over the caller's buffers: one byte per item, contiguous, writable for reads."""
    if isinstance(bufs, (bytes, bytearray, memoryview, mmap.mmap)) or not isinstance(bufs, Sequence):
        raise TypeError("bufs must be a sequence of bytes-like objects")
    if not bufs:
        raise ValueError("bufs must not be empty")
    if len(bufs) > IOV_MAX:
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
    out = []
    for b in bufs:
        mv = memoryview(b)
        if not mv.c_contiguous:
            raise TypeError("buffers must be C-contiguous")
        if mv.ndim != 1 or mv.format != "B":
            mv = mv.cast("B")
        if kind == "r" and mv.readonly:
            raise TypeError("preadv needs writable buffers")
        out.append(mv)
    return out


def _check(kind: str, fd: int, bufs: Sequence[Buffer], offset: int) -> list[memoryview]:
    if kind not in ("r", "w"):
        raise ValueError(f"op kind must be 'r' or 'w', not {kind!r}")
    if not isinstance(fd, int) or not isinstance(offset, int):
        raise TypeError("fd and offset must be int")
    if fd < 0 or fd > 0x7FFFFFFF:
        raise OSError(errno.EBADF, os.strerror(errno.EBADF))
    if offset < 0:       # io_uring reads offset -1 as "the file position": never pass it through
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
    return _views(kind, bufs)


def _drop(views: list[memoryview]) -> None:
    """Release our views once no op holds them (the ring releases its own export on each as the op is reaped)."""
    for v in views:
        v.release()


# ---------------------------------------------------------------------------------------------------- fallback

def _os_one(kind: str, fd: int, views: list[memoryview], offset: int) -> int:
    try:
        return os.preadv(fd, views, offset) if kind == "r" else os.pwritev(fd, views, offset)
    finally:
        _drop(views)


# ---------------------------------------------------------------------------------------------------- public

def preadv(fd: int, bufs: Sequence[Buffer], offset: int) -> int:
    """os.preadv: read into `bufs` in order from `offset`; bytes read; OSError on failure."""
    return _one("r", fd, bufs, offset)


def pwritev(fd: int, bufs: Sequence[Buffer], offset: int) -> int:
    """os.pwritev: write `bufs` in order at `offset`; bytes written; OSError on failure."""
    return _one("w", fd, bufs, offset)


def _one(kind: str, fd: int, bufs: Sequence[Buffer], offset: int) -> int:
    views = _check(kind, fd, bufs, offset)
    if not available():
        return _os_one(kind, fd, views, offset)
    res = _run_uring([(kind, fd, views, offset)], 1)[0]
    if res < 0:
        raise OSError(-res, os.strerror(-res))
    return res


def run_many(ops: Sequence[Op], depth: int | None = None,
             on_done: Callable[[int, int], None] | None = None) -> list[int]:
    """Run reads and writes with up to `depth` in flight from this thread; bytes or -errno per op, in op order;
    `on_done(i, result)` as each completes."""
    d = DEPTH if depth is None else max(1, min(int(depth), DEPTH))
    checked = []
    try:
        for kind, fd, bufs, off in ops:
            checked.append((kind, fd, _check(kind, fd, bufs, off), off))
    except BaseException:
        for c in checked:
            _drop(c[2])
        raise
    if not checked:
        return []
    if not available():
        out = []
        for i, (kind, fd, views, off) in enumerate(checked):
            try:
                out.append(_os_one(kind, fd, views, off))
            except OSError as e:
                out.append(-(e.errno or errno.EIO))
            if on_done is not None:
                on_done(i, out[-1])
        return out
    return _run_uring(checked, d, on_done)


# ---------------------------------------------------------------------------------------------------- io_uring

def _thread_ring() -> Ring:
    """This thread's ring, made on first use (and again in a forked child, or after one was closed)."""
    r = getattr(_tls, "ring", None)
    if r is None or r.closed or getattr(_tls, "pid", None) != os.getpid():
        r = _tls.ring = _native.Ring(DEPTH)
        _tls.pid = os.getpid()
    return r


def _run_uring(ops: list[tuple[str, int, list[memoryview], int]], depth: int,
               on_done: Callable[[int, int], None] | None = None) -> list[int]:
    """Up to `depth` ops in flight on this thread's ring; every op completed (and its views released) on return.
    If anything raises meanwhile, the ring is closed first (see _abandon)."""
    r = _thread_ring()
    n = len(ops)
    results = [0] * n
    nxt = done = 0
    try:
        while done < n:
            while nxt < n and r.inflight < depth:
                kind, fd, views, off = ops[nxt]
                (r.readv if kind == "r" else r.writev)(fd, views, off, nxt)
                nxt += 1
            for i, res in r.wait():          # submits the new ops; waits with the GIL released
                results[i] = res
                done += 1
                _drop(ops[i][2])
                if on_done is not None:
                    on_done(i, res)
    except BaseException:
        _abandon(r, ops)
        raise
    return results


def _abandon(r: Ring, ops: list[tuple[str, int, list[memoryview], int]]) -> None:
    """Something raised with ops perhaps in flight: close the ring, which cancels them and waits for every
    completion before releasing its buffer exports, then release our views. The thread gets a new ring next."""
    if getattr(_tls, "ring", None) is r:
        _tls.ring = None
    r.close()
    for op in ops:
        _drop(op[2])


# ---------------------------------------------------------------------------------------------------- probe

def _probe() -> None:
    global _state, _probe_reason, _native
    _state = False
    try:
        native = load_binding()
        ring = native.Ring(DEPTH)
    except Unusable as e:
        _probe_reason = f"io_uring unavailable: {e}"
        return
    except OSError as e:
        _probe_reason = f"io_uring unavailable: {refusal(e)}"
        return
    _native = native
    try:
        how = io_probe(partial(_run_one_on, ring))
    except Exception as e:
        _native = None
        _probe_reason = f"io_uring unavailable: test readv/writev failed ({type(e).__name__}: {e})"
        return
    finally:
        ring.close()
    _probe_reason = f"io_uring in use (native kvstore._kvuring, depth {DEPTH}, {how})"
    _state = True


def _run_one_on(ring: Ring, kind: str, fd: int, buf: memoryview, offset: int) -> int:
    """One op through `ring` (not this thread's own): what the probe tests."""
    saved = getattr(_tls, "ring", None), getattr(_tls, "pid", None)
    _tls.ring, _tls.pid = ring, os.getpid()
    try:
        return _run_uring([(kind, fd, _check(kind, fd, [buf], offset), offset)], 1)[0]
    finally:
        _tls.ring, _tls.pid = saved
