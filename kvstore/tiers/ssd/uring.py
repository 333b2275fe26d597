"""io_uring for the SSD tier's worker threads, with os.preadv/os.pwritev as the fallback.

Each thread that calls in gets an io_uring of its own (thread-local, created on first use, `DEPTH` entries), so
worker threads never share a submission queue and need no lock. The functions have the semantics of their `os`
namesakes and work the same whether io_uring is in use or not, so callers never branch:

    preadv(fd, bufs, offset) -> int       bytes read (short at end of file); OSError(errno) on failure
    pwritev(fd, bufs, offset) -> int      bytes written; OSError(errno) on failure
    run_many(ops, depth=None, on_done=None) -> list[int]
        ops: ("r" | "w", fd, bufs, offset) each; up to `depth` (default and at most DEPTH) of them in flight at
        once from this one thread (one io_uring_submit per refill). Results in op order: bytes moved (>= 0) or
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

io_uring is used when the PyPI package `liburing` passes the checks of uring_probe.py (a ring set up in a child
process first, then the import, the functions used here, and the binding's buffer handling, below) and a test
O_DIRECT readv and writev through a ring of this module move the right bytes in a temporary file (in
$KVSTORE_URING_PROBE_DIR, else the temp directory; where O_DIRECT is refused there, e.g. tmpfs, the probe runs
buffered and REASON says so). The result is cached for the process. KVSTORE_NO_URING=1 (checked on every call)
forces the fallback. This module owns the cached verdict (available, backend, REASON), the ring and the calls;
uring_probe.py owns the checks, and `child_probe` is re-exported from it.

Memory safety. The kernel reads and writes the callers' buffers by address until each op's completion is reaped.
This module wraps every buffer in a memoryview of its own and builds the `liburing.Iovec` over those; the
memoryview holds a buffer export on the caller's object, so an mmap cannot be closed (BufferError) or a bytearray
resized while an op on it is in flight. The views, the Iovec and the op stay referenced until the op's completion
has been reaped. liburing 2026.3.30's `Iovec(list)` takes a buffer from each memoryview (PyObject_GetBuffer) and
never releases it: left alone, every op would leak that export and a reference, and pin its mmap for good. The
probe measures this (references taken, references left after the Iovec is gone) and, when the binding leaks
exactly one per buffer, each op returns it after completion with PyBuffer_Release; the memoryview's own
release() then proves the count is back to zero. A binding that behaves in any other way is not used.
If waiting is interrupted (KeyboardInterrupt, an error from the binding) while ops are in flight, the ring and
every buffer of the batch are parked in `_ORPHANS` for the life of the process rather than freed under the
kernel, and the thread gets a fresh ring next time.

Waiting never holds the GIL: liburing's io_uring_wait_cqe blocks inside the extension with the GIL held (it would
stall every other thread of the daemon for the whole I/O), so completions are taken with io_uring_peek_cqe and
the wait is a poll() on the ring's file descriptor, which releases the GIL.
"""
from __future__ import annotations

import errno
import mmap
import os
import select
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Union

from kvstore.tiers.ssd.uring_probe import Unusable, check_binding, give_back_export, io_probe
from kvstore.tiers.ssd.uring_probe import child_probe as child_probe  # re-exported: importable from here

Buffer = Union[memoryview, mmap.mmap, bytearray, bytes]
Op = tuple[str, int, Sequence[Buffer], int]

DEPTH = 8            # entries per thread's ring, and the most ops run_many keeps in flight
IOV_MAX = 1024       # Linux UIO_MAXIOV: os.preadv gives EINVAL beyond it

REASON = "not probed yet"     # why io_uring is (not) used: for a log line

_L: Any = None                # the liburing module once the probe passed
_state: bool | None = None    # cached probe result
_probe_reason = REASON
_leaks_exports = False        # whether liburing.Iovec keeps one buffer export per memoryview (see above)
_probe_lock = threading.Lock()
_tls = threading.local()
_ORPHANS: list[Any] = []      # (ring, ops) whose completions were never reaped: kept alive on purpose


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
    """Release our views (fallback path, or on errors before any Iovec was built over them)."""
    for v in views:
        v.release()


def _release_after_iovec(views: list[memoryview]) -> None:
    """After the op's completion: give back what the Iovec took, then release our views."""
    for v in views:
        if _leaks_exports:
            give_back_export(v)
        try:
            v.release()
        except BufferError:       # still exported: leave it pinned (a leak, never a dangling pointer)
            pass


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

class _Ring:
    """One thread's io_uring. Not shared between threads; rebuilt after fork."""

    def __init__(self, depth: int) -> None:
        L = self.L = _L
        self.live = False
        self.ring = L.Ring()
        L.io_uring_queue_init(depth, self.ring)      # OSError on failure
        self.live = True
        self.depth = depth
        self.pid = os.getpid()
        self.cqe = L.Cqe()
        self.poll = select.poll()
        self.poll.register(self.ring.ring_fd, select.POLLIN)

    def reap(self) -> tuple[int, int]:
        """The next completion: (user_data, res), res < 0 being -errno. Waits in poll() (GIL released)."""
        L = self.L
        while True:
            try:
                L.io_uring_peek_cqe(self.ring, self.cqe)
            except BlockingIOError:
                self.poll.poll()
                continue
            c = self.cqe[0]
            ud = c.user_data
            try:
                res = c.res                    # the binding raises OSError for a negative res
            except OSError as e:
                res = -(e.errno or errno.EIO)
            L.io_uring_cqe_seen(self.ring, c)
            return ud, res

    def close(self) -> None:
        if self.live:
            self.live = False
            self.L.io_uring_queue_exit(self.ring)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _thread_ring() -> _Ring:
    r = getattr(_tls, "ring", None)
    if r is None or r.pid != os.getpid():
        r = _tls.ring = _Ring(DEPTH)
    return r


def _run_uring(ops: list[tuple[str, int, list[memoryview], int]], depth: int,
               on_done: Callable[[int, int], None] | None = None) -> list[int]:
    """Up to `depth` ops in flight on this thread's ring; every op completed (and its views released) on return.
    If anything raises once an SQE has been taken, the ring and the buffers of every op not yet reaped are parked
    in _ORPHANS (never reused, never freed) and the thread gets a new ring next time."""
    L = _L
    r = _thread_ring()
    n = len(ops)
    results = [0] * n
    keep: list[Any] = [None] * n          # (views, iovec) of each op until its completion is reaped
    nxt = inflight = queued = done = 0
    try:
        while done < n:
            while nxt < n and inflight + queued < depth:
                kind, fd, views, off = ops[nxt]
                if keep[nxt] is None:
                    keep[nxt] = (views, L.Iovec(views))
                iov = keep[nxt][1]
                sqe = L.io_uring_get_sqe(r.ring)
                if sqe is None:
                    break
                queued += 1                   # from here on the SQE belongs to this op
                if kind == "r":
                    L.io_uring_prep_readv(sqe, fd, iov, off)
                else:
                    L.io_uring_prep_writev(sqe, fd, iov, off)
                sqe.user_data = nxt
                nxt += 1
            while queued:
                try:
                    s = L.io_uring_submit(r.ring)
                except InterruptedError:
                    continue
                if not s:
                    break
                queued -= s
                inflight += s
            if not inflight:
                raise OSError(errno.EIO, "io_uring_submit submitted nothing")
            i, res = r.reap()
            views = keep[i][0]
            keep[i] = None
            inflight -= 1
            done += 1
            results[i] = res
            _release_after_iovec(views)
            if on_done is not None:
                on_done(i, res)
    except BaseException:
        if inflight or queued:
            _ORPHANS.append((r, keep))      # the kernel may still use these buffers: never free them
            _tls.ring = None
        else:
            for k in keep:
                if k is not None:
                    _release_after_iovec(k[0])
        raise
    return results


# ---------------------------------------------------------------------------------------------------- probe

def _probe() -> None:
    global _state, _probe_reason, _L, _leaks_exports
    _state = False
    try:
        L, leaks, version = check_binding()
    except Unusable as e:
        _probe_reason = f"io_uring unavailable: {e}"
        return
    _L, _leaks_exports = L, leaks
    try:
        ring = _Ring(DEPTH)
    except Exception as e:
        _L = None
        _probe_reason = f"io_uring unavailable: ring setup failed ({type(e).__name__}: {e})"
        return
    try:
        how = io_probe(partial(_run_one_on, ring))
    except Exception as e:
        _L = None
        _probe_reason = f"io_uring unavailable: test readv/writev failed ({type(e).__name__}: {e})"
        return
    finally:
        if not any(o[0] is ring for o in _ORPHANS):
            ring.close()
    _probe_reason = f"io_uring in use (liburing {version}, depth {DEPTH}, {how})"
    _state = True


def _run_one_on(ring: _Ring, kind: str, fd: int, buf: memoryview, offset: int) -> int:
    """One op through `ring` (not this thread's own): what the probe tests."""
    saved, _tls.ring = getattr(_tls, "ring", None), ring
    try:
        return _run_uring([(kind, fd, _check(kind, fd, [buf], offset), offset)], 1)[0]
    finally:
        _tls.ring = saved
