"""kvstore.tiers.ssd.uring: byte-exact O_DIRECT round trips, several ops in flight, errors as os gives them — through
io_uring and through the forced os.preadv/os.pwritev fallback (KVSTORE_NO_URING=1), the same tests on both."""
from __future__ import annotations

import errno
import mmap
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator

import pytest

from kvstore.tiers.ssd import uring, uring_probe

MiB = 1 << 20
REC = 2 * MiB


def _direct_ok(d: str) -> bool:
    try:
        fd = os.open(os.path.join(d, ".odirect-check"), os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    os.unlink(os.path.join(d, ".odirect-check"))
    return True


@pytest.fixture
def ddir(tmp_path: str) -> Iterator[str]:
    """A directory where O_DIRECT works: tmp_path, else one under /var/tmp or /work (tmpfs refuses O_DIRECT)."""
    if _direct_ok(str(tmp_path)):
        yield str(tmp_path)
        return
    for parent in ("/var/tmp", os.path.dirname(os.path.dirname(os.path.abspath(__file__)))):
        try:
            d = tempfile.mkdtemp(prefix="kvs-uring-", dir=parent)
        except OSError:
            continue
        if _direct_ok(d):
            try:
                yield d
            finally:
                shutil.rmtree(d, ignore_errors=True)
            return
        shutil.rmtree(d, ignore_errors=True)
    pytest.skip("no directory here supports O_DIRECT")


@pytest.fixture(params=["io_uring", "os"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Runs the test through io_uring (skipped where it is unavailable) or the forced fallback; counts the
    calls that reach io_uring so each test can assert which path it really took."""
    calls = {"uring": 0}
    real = uring._run_uring

    def spy(ops, depth, on_done=None):  # type: ignore[no-untyped-def]
        calls["uring"] += 1
        return real(ops, depth, on_done)

    if request.param == "os":
        monkeypatch.setenv("KVSTORE_NO_URING", "1")
    else:
        monkeypatch.delenv("KVSTORE_NO_URING", raising=False)
        if not uring.available():
            pytest.skip(uring.REASON)
    monkeypatch.setattr(uring, "_run_uring", spy)
    assert uring.backend() == request.param
    calls["want"] = 1 if request.param == "io_uring" else 0
    return calls


def used(calls: dict[str, int]) -> bool:
    """True when the path taken is the one the test asked for."""
    return (calls["uring"] > 0) == bool(calls["want"])


def dfile(d: str, size: int, name: str = "f") -> int:
    fd = os.open(os.path.join(d, name), os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    os.ftruncate(fd, size)
    return fd


def filled(n: int, seed: int) -> mmap.mmap:
    m = mmap.mmap(-1, n)
    m[:] = (bytes([seed & 0xFF]) + os.urandom(4095)) * (n // 4096)
    return m


def test_roundtrip_several_buffers(ddir: str, backend: dict[str, int]) -> None:
    fd = dfile(ddir, 8 * REC)
    try:
        head, body = filled(4096, 1), filled(REC - 4096, 2)
        assert uring.pwritev(fd, [head, body], 3 * REC) == REC
        h2, b2 = mmap.mmap(-1, 4096), mmap.mmap(-1, REC - 4096)
        assert uring.preadv(fd, [h2, b2], 3 * REC) == REC
        assert h2[:] == head[:] and b2[:] == body[:]
        # memoryview slices of one mapping, as the SSD tier reads a record into a host slot
        big = mmap.mmap(-1, 2 * REC)
        mv = memoryview(big)
        assert uring.preadv(fd, [mv[4096:8192], mv[REC:2 * REC - 4096]], 3 * REC) == REC
        assert big[4096:8192] == head[:] and big[REC:2 * REC - 4096] == body[:]
        assert big[:4096] == bytes(4096)               # nothing outside the iovecs was touched
        # nothing keeps a buffer exported afterwards: every mapping can be closed
        mv.release()
        for m in (head, body, h2, b2, big):
            m.close()
        assert used(backend)
    finally:
        os.close(fd)


def test_run_many_more_ops_than_depth(ddir: str, backend: dict[str, int]) -> None:
    n = uring.DEPTH + 5                                # the window slides: more ops than ring entries
    fd = dfile(ddir, n * REC)
    try:
        srcs = [filled(REC, i) for i in range(n)]
        assert uring.run_many([("w", fd, [s], i * REC) for i, s in enumerate(srcs)]) == [REC] * n
        outs = [mmap.mmap(-1, REC) for _ in range(n)]
        order = list(reversed(range(n)))                # results come back in op order, not offset order
        res = uring.run_many([("r", fd, [outs[i]], i * REC) for i in order], depth=4)
        assert res == [REC] * n
        for i in range(n):
            assert outs[i][:] == srcs[i][:], f"record {i}"
        assert used(backend)
    finally:
        os.close(fd)


def test_run_many_reports_each_op_as_it_completes(ddir: str, backend: dict[str, int]) -> None:
    """on_done(i, result) once per op, in this thread, each op's bytes in place when it is called (a reader
    checksums a piece while the next is still on the disk); a failed op is reported with its -errno."""
    fd = dfile(ddir, 4 * REC)
    try:
        srcs = [filled(REC, 20 + i) for i in range(4)]
        assert uring.run_many([("w", fd, [s], i * REC) for i, s in enumerate(srcs)]) == [REC] * 4
        outs = [mmap.mmap(-1, REC) for _ in range(4)]
        seen: list[tuple[int, int, bool, str]] = []

        def done(i: int, res: int) -> None:
            seen.append((i, res, res < 0 or outs[i][:] == srcs[i][:], threading.current_thread().name))

        ops: list[uring.Op] = [("r", fd, [outs[i]], i * REC) for i in range(4)]
        ops.append(("r", 987654, [outs[0]], 0))                  # a bad fd: reported, never raised
        res = uring.run_many(ops, depth=4, on_done=done)
        assert res == [REC] * 4 + [-errno.EBADF]
        assert sorted(seen) == [(i, r, True, threading.current_thread().name) for i, r in enumerate(res)]
        assert used(backend)
    finally:
        os.close(fd)


def test_run_many_mixed_reads_writes_and_per_op_errors(ddir: str, backend: dict[str, int]) -> None:
    fd = dfile(ddir, 4 * REC)
    try:
        a, b = filled(REC, 7), filled(REC, 8)
        assert uring.pwritev(fd, [a], 0) == REC
        out = mmap.mmap(-1, REC)
        odd = mmap.mmap(-1, 2 * 4096)
        res = uring.run_many([
            ("w", fd, [b], 2 * REC),
            ("r", 987654, [out], 0),                          # bad fd
            ("r", fd, [memoryview(odd)[1:4097]], 0),          # misaligned memory under O_DIRECT
            ("r", fd, [out], 0),
            ("r", fd, [odd], 4096 + 1),                       # misaligned offset
        ])
        assert res == [REC, -errno.EBADF, -errno.EINVAL, REC, -errno.EINVAL]
        assert out[:] == a[:]                                 # the ops around the failures did their work
        assert uring.preadv(fd, [out], 2 * REC) == REC and out[:] == b[:]
        odd.close()                                           # no export left behind by the failed ops
        assert used(backend)
    finally:
        os.close(fd)


def test_errors_raise_like_os(ddir: str, backend: dict[str, int]) -> None:
    buf = mmap.mmap(-1, 4096)
    two = mmap.mmap(-1, 2 * 4096)
    fd = dfile(ddir, 4 * 4096)
    try:
        assert uring.pwritev(fd, [two], 0) == 2 * 4096       # data, not a hole: ext4 reads holes unchecked
        with pytest.raises(OSError) as e:
            uring.preadv(987654, [buf], 0)
        assert e.value.errno == errno.EBADF
        with pytest.raises(OSError) as e:
            uring.pwritev(987654, [buf], 0)
        assert e.value.errno == errno.EBADF
        closed = os.dup(fd)
        os.close(closed)
        with pytest.raises(OSError) as e:
            uring.preadv(closed, [buf], 0)
        assert e.value.errno == errno.EBADF
        with pytest.raises(OSError) as e:                     # misaligned address
            uring.preadv(fd, [memoryview(two)[1:4097]], 0)
        assert e.value.errno == errno.EINVAL
        with pytest.raises(OSError) as e:                     # misaligned length
            uring.pwritev(fd, [memoryview(buf)[:4095]], 0)
        assert e.value.errno == errno.EINVAL
        with pytest.raises(OSError) as e:                     # misaligned offset
            uring.pwritev(fd, [buf], 100)
        assert e.value.errno == errno.EINVAL
        # a short read at the end of the file returns what is there, as os.preadv does
        assert uring.preadv(fd, [two], 3 * 4096) == 4096
        assert uring.preadv(fd, [two], 8 * 4096) == 0
        assert used(backend)
        buf.close()
        two.close()
    finally:
        os.close(fd)


def test_bad_arguments_run_nothing(ddir: str, backend: dict[str, int]) -> None:
    fd = dfile(ddir, 2 * REC)
    try:
        src, out = filled(REC, 3), mmap.mmap(-1, REC)
        with pytest.raises(TypeError):
            uring.preadv(fd, [bytes(4096)], 0)                # read into read-only memory
        with pytest.raises(OSError) as e:
            uring.preadv(fd, [out], -1)                       # io_uring would read -1 as "file position"
        assert e.value.errno == errno.EINVAL
        with pytest.raises(ValueError):
            uring.pwritev(fd, [], 0)
        with pytest.raises(TypeError):
            uring.pwritev(fd, src, 0)                         # a buffer, not a list of buffers
        # one bad op: the whole batch is refused before anything runs, so the good write never happens
        with pytest.raises(ValueError):
            uring.run_many([("w", fd, [src], 0), ("x", fd, [out], 0)])
        assert uring.preadv(fd, [out], 0) == REC and out[:] == bytes(REC)
        assert uring.run_many([]) == []
        src.close()                                           # the refused batch left no export behind
        # writes take read-only memory (an aligned read-only mapping here, for O_DIRECT)
        ro = mmap.mmap(-1, 4096, prot=mmap.PROT_READ)
        assert memoryview(ro).readonly
        assert uring.pwritev(fd, [ro], 0) == 4096
    finally:
        os.close(fd)


def test_threads_each_own_ring(ddir: str, backend: dict[str, int]) -> None:
    nthreads, per = 4, 6
    fd = dfile(ddir, nthreads * per * 256 * 1024)
    errors: list[BaseException] = []
    rings: set[int] = set()
    lock = threading.Lock()

    def worker(t: int) -> None:
        try:
            size = 256 * 1024
            base = t * per * size
            srcs = [filled(size, t * 16 + i) for i in range(per)]
            for _ in range(5):
                assert uring.run_many([("w", fd, [s], base + i * size) for i, s in enumerate(srcs)]) == [size] * per
                outs = [mmap.mmap(-1, size) for _ in range(per)]
                assert uring.run_many([("r", fd, [o], base + i * size) for i, o in enumerate(outs)]) == [size] * per
                assert all(o[:] == s[:] for o, s in zip(outs, srcs))
            r = getattr(uring._tls, "ring", None)
            with lock:
                rings.add(id(r) if r is not None else -1)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(t,)) for t in range(nthreads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    os.close(fd)
    assert not errors, errors
    assert used(backend)
    if backend["want"]:
        assert len(rings) == nthreads and -1 not in rings      # one ring per thread
    else:
        assert rings == {-1}                                   # the fallback never made a ring


def test_export_counts_restored(ddir: str, backend: dict[str, int]) -> None:
    """Each op's buffer export is given back when its completion is reaped: many ops later the caller's view has
    its old reference count and its mapping still closes."""
    fd = dfile(ddir, 64 * 4096)
    try:
        m = mmap.mmap(-1, 4096)
        mv = memoryview(m)
        before = sys.getrefcount(mv)
        for i in range(200):
            uring.run_many([("w", fd, [mv], (i % 64) * 4096), ("r", fd, [mv], ((i + 1) % 64) * 4096)])
        assert sys.getrefcount(mv) == before
        mv.release()
        m.close()
        assert used(backend)
    finally:
        os.close(fd)


def test_wait_releases_gil() -> None:
    """An op that waits (a read from an empty pipe) must not hold the GIL: another thread writes the data."""
    if not uring.available():
        pytest.skip(uring.REASON)
    code = (
        "import os, threading, time\n"
        "from kvstore.tiers.ssd import uring\n"
        "assert uring.available(), uring.REASON\n"
        "r, w = os.pipe()\n"
        "buf = bytearray(5)\n"
        "threading.Timer(0.3, lambda: os.write(w, b'hello')).start()\n"
        "t0 = time.monotonic()\n"
        "n = uring.preadv(r, [buf], 0)\n"
        "assert n == 5 and bytes(buf) == b'hello', (n, buf)\n"
        "print('waited', time.monotonic() - t0)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=30,
                       env={**os.environ, "KVSTORE_NO_URING": ""})
    assert p.returncode == 0, p.stderr
    assert float(p.stdout.split()[1]) >= 0.25


def test_an_interrupted_wait_closes_the_ring_before_releasing_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A signal handler's exception during a wait (KeyboardInterrupt) comes out of preadv; the thread's ring is
    closed first — the read in flight cancelled and waited for — so the mapping is released, never freed under the
    kernel, and the next op runs on a fresh ring."""
    monkeypatch.delenv("KVSTORE_NO_URING", raising=False)
    if not uring.available():
        pytest.skip(uring.REASON)
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    r, w = os.pipe()
    m = mmap.mmap(-1, 4096)
    os.write(w, b"hi")
    assert uring.preadv(r, [bytearray(2)], 0) == 2                # this thread has a ring now
    old_ring = uring._tls.ring
    main = threading.main_thread().ident
    assert main is not None

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGUSR1, handler)
    try:
        threading.Timer(0.2, lambda: signal.pthread_kill(main, signal.SIGUSR1)).start()
        with pytest.raises(KeyboardInterrupt):
            uring.preadv(r, [m], 0)                               # waits: nothing written to the pipe
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert old_ring.closed and getattr(uring._tls, "ring", None) is None
    m.close()                                                     # the cancelled read holds no export
    os.write(w, b"xy")
    buf = bytearray(2)
    assert uring.preadv(r, [buf], 0) == 2 and buf == b"xy"        # the next op works, on a new ring
    assert uring._tls.ring is not None and uring._tls.ring is not old_ring
    os.close(r)
    os.close(w)


def test_probe_agrees_with_a_raw_ring() -> None:
    """Where a Ring can be set up by hand, the probe must have chosen io_uring; where the kernel refuses it, the
    probe must say so with the errno and fall back."""
    try:
        import kvstore._kvuring as native
    except ImportError:
        pytest.skip("kvstore._kvuring not built")
    old = os.environ.pop("KVSTORE_NO_URING", None)
    try:
        try:
            native.Ring(4).close()
        except OSError as e:
            assert not uring.available()
            assert "refused io_uring_setup" in uring.REASON and errno.errorcode[e.errno] in uring.REASON
        else:
            assert uring.available(), uring.REASON
            assert "io_uring in use" in uring.REASON
    finally:
        if old is not None:
            os.environ["KVSTORE_NO_URING"] = old


@pytest.mark.parametrize("err, words", [(errno.EPERM, "io_uring_disabled"), (errno.ENOSYS, "no io_uring")])
def test_a_kernel_refusal_falls_back_with_the_errno(monkeypatch: pytest.MonkeyPatch, err: int, words: str) -> None:
    """io_uring_setup refused (EPERM from kernel.io_uring_disabled or seccomp, ENOSYS): the fallback, and REASON
    names the errno; a binding that is not built says so too."""
    class Refused:
        class Ring:
            def __init__(self, depth: int) -> None:
                raise OSError(err, os.strerror(err))

    monkeypatch.delenv("KVSTORE_NO_URING", raising=False)
    for name in ("_state", "_probe_reason", "_native"):            # the real verdict comes back after the test
        monkeypatch.setattr(uring, name, getattr(uring, name))
    monkeypatch.setattr(uring, "_state", None)
    monkeypatch.setattr(uring, "load_binding", lambda: Refused)
    assert not uring.available() and uring.backend() == "os"
    assert errno.errorcode[err] in uring.REASON and words in uring.REASON
    fd = os.open(os.devnull, os.O_RDONLY)
    try:
        assert uring.preadv(fd, [bytearray(8)], 0) == 0             # the fallback serves the call
    finally:
        os.close(fd)

    def unbuilt() -> None:
        raise uring_probe.Unusable("the native binding kvstore._kvuring is not built (no module)")

    monkeypatch.setattr(uring, "_state", None)
    monkeypatch.setattr(uring, "load_binding", unbuilt)
    assert not uring.available() and "not built" in uring.REASON


def test_env_switch_forces_fallback() -> None:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = ("from kvstore.tiers.ssd import uring\n"
            "print(uring.available(), uring.backend(), uring.REASON)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=30,
                       env={**os.environ, "KVSTORE_NO_URING": "1"})
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("False os ") and "KVSTORE_NO_URING" in p.stdout
