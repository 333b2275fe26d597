"""kvstore._kvuring (native/kvuring.c) on its own: the Ring's ops against real files under tmp_path (O_DIRECT where
the file system allows it, else buffered), per-op errors as results, cancel, linked fsync, buffers held exactly
while the kernel may touch them, one ring per thread, and waits that release the GIL."""
from __future__ import annotations

import errno
import mmap
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

K = pytest.importorskip("kvstore._kvuring", reason="kvstore._kvuring not built")
ROOT = Path(__file__).resolve().parents[2]
PAGE = 4096


def make_ring(depth: int = 8) -> K.Ring:
    try:
        return K.Ring(depth)
    except OSError as e:                       # ENOSYS, EPERM (io_uring_disabled, seccomp): nothing to test here
        pytest.skip(f"the kernel refuses io_uring: {e}")


@pytest.fixture
def ring() -> Iterator[K.Ring]:
    r = make_ring()
    yield r
    r.close()


@pytest.fixture
def dfile(tmp_path: Path) -> Iterator[tuple[int, bool]]:
    """(fd, direct): a 1 MiB file under tmp_path, O_DIRECT unless the file system refuses it (tmpfs)."""
    path = tmp_path / "data"
    try:
        fd, direct = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600), True
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        fd, direct = os.open(path, os.O_RDWR | os.O_CREAT, 0o600), False
    os.ftruncate(fd, 1 << 20)
    yield fd, direct
    os.close(fd)


def filled(n: int, seed: int) -> mmap.mmap:
    m = mmap.mmap(-1, n)
    m[:] = bytes([seed]) * n
    m[seed % n] = 0xFF
    return m


def test_batched_writes_then_reads_are_byte_exact(ring: K.Ring, dfile: tuple[int, bool]) -> None:
    fd, _ = dfile
    srcs = [[filled(PAGE, 2 * i + 1), filled(2 * PAGE, 2 * i + 2)] for i in range(4)]
    # four writes of two buffers each, all in flight at once
    for i, bufs in enumerate(srcs):
        ring.writev(fd, bufs, i * 3 * PAGE, 100 + i)
    assert sorted(ring.wait(4)) == [(100 + i, 3 * PAGE) for i in range(4)]
    outs = [[mmap.mmap(-1, PAGE), mmap.mmap(-1, 2 * PAGE)] for _ in range(4)]
    for i, bufs in enumerate(outs):
        ring.readv(fd, bufs, i * 3 * PAGE, i)
    assert sorted(ring.wait(4)) == [(i, 3 * PAGE) for i in range(4)]
    for i in range(4):
        assert [o[:] for o in outs[i]] == [s[:] for s in srcs[i]], f"op {i}"
    assert ring.inflight == 0 and ring.space == ring.depth


def test_a_read_past_the_end_returns_the_short_count(ring: K.Ring, dfile: tuple[int, bool]) -> None:
    fd, _ = dfile
    size = os.fstat(fd).st_size
    out = mmap.mmap(-1, 2 * PAGE)
    ring.readv(fd, [out], size - PAGE, 1)     # one page left in the file
    ring.readv(fd, [out], size, 2)            # nothing left
    assert sorted(ring.wait(2)) == [(1, PAGE), (2, 0)]


def test_a_failing_op_is_its_result_and_the_others_run(ring: K.Ring, dfile: tuple[int, bool]) -> None:
    fd, direct = dfile
    src, out, odd = filled(PAGE, 7), mmap.mmap(-1, PAGE), mmap.mmap(-1, 2 * PAGE)
    ring.writev(fd, [src], 0, 1)
    assert ring.wait() == [(1, PAGE)]                          # data, not a hole: ext4 reads holes unchecked
    ring.readv(987654, [odd], 0, 2)                            # a bad fd
    ring.readv(fd, [out], 0, 3)
    if direct:
        ring.readv(fd, [memoryview(odd)[1:PAGE + 1]], 0, 4)    # misaligned memory under O_DIRECT
    got = dict(ring.wait(3 if direct else 2))
    assert got[2] == -errno.EBADF and got[3] == PAGE and out[:] == src[:]
    assert got.get(4, -errno.EINVAL) == -errno.EINVAL
    odd.close()                                                # the failed ops released their exports


def test_efbig_past_the_file_size_limit_is_a_result(tmp_path: Path) -> None:
    """No small file system needs mounting (root only): RLIMIT_FSIZE in a child gives EFBIG, the same path as
    ENOSPC (a write the file system refuses, reported as the op's result)."""
    code = (
        "import errno, os, resource, signal\n"
        "from kvstore import _kvuring as K\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))\n"
        f"fd = os.open({str(tmp_path / 'big')!r}, os.O_RDWR | os.O_CREAT, 0o600)\n"
        "try:\n"
        "    r = K.Ring(4)\n"
        "except OSError as e:\n"
        "    raise SystemExit(f'SKIP {e}')\n"
        "r.writev(fd, [bytes(4096)], 0, 1)\n"
        "r.writev(fd, [bytes(4096)], 1 << 16, 2)\n"
        "print(sorted(r.wait(2)) == [(1, 4096), (2, -errno.EFBIG)], sorted(r.wait(0)))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    if p.stderr.startswith("SKIP "):
        pytest.skip(p.stderr.strip())
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("True"), p.stdout


def test_a_cancelled_read_from_an_empty_pipe_is_ecanceled(ring: K.Ring) -> None:
    r, w = os.pipe()
    try:
        buf = bytearray(16)
        ring.readv(r, [buf], 0, 1)
        assert ring.submit() == 1
        ring.cancel(1, 2)                      # the read waits for data that never comes
        ring.cancel(12345, 3)                  # names no op in flight
        got = dict(ring.wait(3))
        assert got == {1: -errno.ECANCELED, 2: 0, 3: -errno.ENOENT}
        buf.extend(b"x")                       # released: resizable again
    finally:
        os.close(r)
        os.close(w)


def test_linked_fsync_runs_after_the_write(ring: K.Ring, dfile: tuple[int, bool]) -> None:
    fd, _ = dfile
    src = filled(PAGE, 9)
    ring.writev(fd, [src], 0, 1, link=True)
    ring.fsync(fd, 2, datasync=True)
    assert ring.wait(2) == [(1, PAGE), (2, 0)]                 # in this order: the fsync waited for the write
    # a failed write cancels its linked fsync
    ring.writev(987654, [src], 0, 3, link=True)
    ring.fsync(fd, 4)
    assert sorted(ring.wait(2)) == [(3, -errno.EBADF), (4, -errno.ECANCELED)]


def test_buffers_stay_exported_while_in_flight_and_are_released_after(ring: K.Ring) -> None:
    r, w = os.pipe()
    try:
        m = mmap.mmap(-1, PAGE)
        before = sys.getrefcount(m)
        ring.readv(r, [m], 0, 1)
        ring.submit()
        assert sys.getrefcount(m) == before + 1                # the op's Py_buffer holds the mapping
        with pytest.raises(BufferError):
            m.close()                                          # the kernel may still write into it
        os.write(w, b"abc")
        assert ring.wait() == [(1, 3)] and m[:3] == b"abc"
        assert sys.getrefcount(m) == before                    # reaped: export and reference given back
        m.close()
    finally:
        os.close(r)
        os.close(w)


def test_close_with_ops_in_flight_cancels_and_waits_before_releasing(ring: K.Ring) -> None:
    r, w = os.pipe()
    try:
        bufs = [bytearray(8) for _ in range(3)]
        for i, b in enumerate(bufs):
            ring.readv(r, [b], 0, i)
        ring.submit()
        ring.close()                                           # pipe reads never complete: cancelled, waited for
        assert ring.closed and ring.inflight == 0
        for b in bufs:
            b.extend(b"x")                                     # every export released
        with pytest.raises(ValueError):
            ring.readv(r, [bufs[0]], 0, 9)
        ring.close()                                           # idempotent
    finally:
        os.close(r)
        os.close(w)


def test_the_wait_releases_the_gil(ring: K.Ring) -> None:
    """A wait for a read from an empty pipe: another Python thread keeps running, and writes the data."""
    r, w = os.pipe()
    spins = [0]
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            spins[0] += 1

    t = threading.Thread(target=spin)
    t.start()
    threading.Timer(0.3, lambda: os.write(w, b"hello")).start()
    try:
        buf = bytearray(5)
        ring.readv(r, [buf], 0, 1)
        t0 = time.monotonic()
        assert ring.wait() == [(1, 5)] and buf == b"hello"
        waited = time.monotonic() - t0
        during = spins[0]
    finally:
        stop.set()
        t.join()
        os.close(r)
        os.close(w)
    assert waited >= 0.25
    assert during > 1000, during                               # the spinner ran while the wait blocked


def test_a_signal_handler_interrupts_a_wait_and_the_op_stays_held(ring: K.Ring) -> None:
    """KeyboardInterrupt (here a handler's exception) comes out of wait(); the op stays in flight with its buffer
    held, and a later wait reaps it."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    r, w = os.pipe()

    class Interrupted(Exception):
        pass

    def handler(signum: int, frame: object) -> None:
        raise Interrupted

    old = signal.signal(signal.SIGUSR1, handler)
    main = threading.main_thread().ident
    assert main is not None
    try:
        buf = bytearray(3)
        ring.readv(r, [buf], 0, 1)
        threading.Timer(0.2, lambda: signal.pthread_kill(main, signal.SIGUSR1)).start()
        with pytest.raises(Interrupted):
            ring.wait()
        assert ring.inflight == 1
        with pytest.raises(BufferError):
            buf.extend(b"x")
        os.write(w, b"abc")
        assert ring.wait() == [(1, 3)] and buf == b"abc"
    finally:
        signal.signal(signal.SIGUSR1, old)
        os.close(r)
        os.close(w)


def test_one_ring_per_thread_no_corruption_and_no_sharing(dfile: tuple[int, bool]) -> None:
    fd, _ = dfile
    nthreads, per, size = 4, 6, 8 * PAGE
    errors: list[BaseException] = []
    shared = make_ring(2)

    def worker(t: int) -> None:
        try:
            with pytest.raises(RuntimeError, match="thread that made it"):
                shared.readv(fd, [bytearray(PAGE)], 0, 0)      # not this thread's ring
            r = K.Ring(per)
            base = t * per * size
            srcs = [filled(size, t * 16 + i + 1) for i in range(per)]
            for _ in range(10):
                for i, s in enumerate(srcs):
                    r.writev(fd, [s], base + i * size, i)
                assert sorted(r.wait(per)) == [(i, size) for i in range(per)]
                outs = [mmap.mmap(-1, size) for _ in range(per)]
                for i, o in enumerate(outs):
                    r.readv(fd, [o], base + i * size, i)
                assert sorted(r.wait(per)) == [(i, size) for i in range(per)]
                assert all(o[:] == s[:] for o, s in zip(outs, srcs))
            r.close()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(t,)) for t in range(nthreads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    shared.close()
    assert not errors, errors


def test_registered_buffers_and_files(ring: K.Ring, dfile: tuple[int, bool]) -> None:
    fd, _ = dfile
    pool = mmap.mmap(-1, 4 * PAGE)
    pool[:2 * PAGE] = bytes([5]) * PAGE + bytes([6]) * PAGE
    ring.register_buffers([pool])
    ring.register_files([fd])
    ring.write_fixed(0, 0, 0, 2 * PAGE, 8 * PAGE, 1, fixed_file=True)     # fd 0: the first registered file
    assert ring.wait() == [(1, 2 * PAGE)]
    ring.read_fixed(fd, 0, 2 * PAGE, 2 * PAGE, 8 * PAGE, 2)
    assert ring.wait() == [(2, 2 * PAGE)] and pool[2 * PAGE:] == pool[:2 * PAGE]
    with pytest.raises(ValueError):
        ring.read_fixed(fd, 0, 3 * PAGE, 2 * PAGE, 0, 3)                   # past the registered buffer
    with pytest.raises(BufferError):
        pool.close()                                                       # registered: held by the ring
    ring.unregister_files()
    ring.unregister_buffers()
    pool.close()


def test_a_full_ring_refuses_a_prep_and_takes_nothing(dfile: tuple[int, bool]) -> None:
    fd, _ = dfile
    r = make_ring(2)
    a, b, c = (mmap.mmap(-1, PAGE) for _ in range(3))
    r.readv(fd, [a], 0, 1)
    r.readv(fd, [b], 0, 2)
    assert r.space == 0
    with pytest.raises(RuntimeError, match="in flight"):
        r.readv(fd, [c], 0, 3)
    c.close()                                                  # the refused op took no export
    assert sorted(r.wait(2)) == [(1, PAGE), (2, PAGE)]
    with pytest.raises(ValueError):
        r.readv(fd, [a], -1, 4)                                # -1 would mean "the file position"
    with pytest.raises(BufferError):
        r.readv(fd, [bytes(PAGE)], 0, 5)                       # a read into read-only memory
    assert r.space == 2
    r.close()


def test_a_forked_child_cannot_use_the_parents_ring_and_frees_its_copy(tmp_path: Path) -> None:
    """A child inherits the ring with an op in flight: it may not use it (RuntimeError) and frees its copy without
    waiting; the parent's op is unaffected."""
    code = (
        "import os\n"
        "from kvstore import _kvuring as K\n"
        "try:\n"
        "    r = K.Ring(2)\n"
        "except OSError as e:\n"
        "    raise SystemExit(f'SKIP {e}')\n"
        "p, w = os.pipe()\n"
        "buf = bytearray(3)\n"
        "r.readv(p, [buf], 0, 1)\n"
        "r.submit()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    try:\n"
        "        r.wait()\n"
        "        os._exit(3)\n"
        "    except RuntimeError:\n"
        "        del r\n"
        "        os._exit(0)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "os.write(w, b'abc')\n"
        "print(os.waitstatus_to_exitcode(status), r.wait(), bytes(buf))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    if p.stderr.startswith("SKIP "):
        pytest.skip(p.stderr.strip())
    assert p.returncode == 0, p.stderr
    assert p.stdout.split(" ", 1) == ["0", "[(1, 3)] b'abc'\n"], p.stdout
