"""The one-pass copy and CRC-32C (native/kvcopy.c, kvstore.checksum.copy_crc32c) and its two-pass fallback: every
byte copied, the CRC equal to the `crc32c` package's for any length and alignment, the same errors, and the CRC
always that of the destination as written, even while another thread rewrites the source (a hostile client
writing into a shared slot that a reader is copying)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import crc32c as crc32c_package
import numpy as np
import pytest

from kvstore import checksum
from kvstore.checksum import copy_then_crc32c, crc32c

try:
    from kvstore._kvcopy import HARDWARE
    from kvstore._kvcopy import copy_crc32c as native
except ImportError:              # built without a compiler: the fallback is what runs
    HARDWARE, native = False, None

needs_native = pytest.mark.skipif(not HARDWARE, reason="kvstore._kvcopy not built or no CRC-32C instruction")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _native(dst: Any, src: Any, stream: bool = False) -> int:
    assert native is not None
    return native(dst, src, stream=stream)


def _fallback(dst: Any, src: Any, stream: bool = False) -> int:
    return copy_then_crc32c(dst, src)


COPIES: dict[str, Callable[..., int]] = {"native": _native, "fallback": _fallback}
KINDS = [pytest.param("native", marks=needs_native), "fallback"]

# the loop's edges: 8-byte words, 3 x 256-byte short chunks, 3 x 8 KiB long chunks, the 64 KiB streaming floor
EDGES = [0, 1, 7, 8, 9, 15, 16, 17, 767, 768, 769, 24575, 24576, 24577, 65535, 65536, 65537, 2 << 20]


def _sizes() -> list[int]:
    rng = np.random.default_rng(13)
    return EDGES + [int(x) for x in rng.integers(0, 3 << 20, 12)]


def _pair(rng: np.random.Generator, n: int, src_off: int, dst_off: int) -> tuple[np.ndarray, np.ndarray]:
    src = rng.integers(0, 256, n + 64, dtype=np.uint8)[src_off:src_off + n]
    dst = np.zeros(n + 64, np.uint8)[dst_off:dst_off + n]
    return dst, src


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stream", [False, True])
def test_copy_and_crc_match_the_package_at_any_size_and_alignment(kind: str, stream: bool) -> None:
    rng = np.random.default_rng(7)
    for n in _sizes():
        src_off, dst_off = (int(x) for x in rng.integers(0, 64, 2))
        for so, do in ((src_off, dst_off), (0, 16), (16, 0), (0, 0)):   # what numpy and a slot give, and random
            dst, src = _pair(rng, n, so, do)
            got = COPIES[kind](dst, src, stream=stream)
            assert np.array_equal(dst, src), (n, so, do)
            assert got == crc32c_package.crc32c(src.tobytes()) == crc32c(dst), (n, so, do)


@needs_native
def test_native_continues_a_crc_and_takes_any_buffer() -> None:
    rng = np.random.default_rng(3)
    src = rng.integers(0, 256, (1 << 20) + 5, dtype=np.uint8)
    dst = np.zeros_like(src)
    whole = crc32c(src)
    head = _native(dst[:12345], src[:12345])
    assert native is not None and native(dst[12345:], src[12345:], head) == whole   # crc=: the package's `value`
    out = bytearray(100)
    assert native(out, b"k" * 100) == crc32c(b"k" * 100) and out == b"k" * 100      # bytes in, bytearray out
    assert native(memoryview(out)[:0], b"") == 0


# dst - src mod 4096 at each edge of the streamed copy's choice (native/kvcopy.c: the vector loop up to LEAD = 64 and
# from LEAD_GAP = 256, the scalar loop's STREAM_GAP = 512); 64 is what torch's tensors and the slots give a load
DELTAS = [0, 8, 16, 31, 32, 63, 64, 65, 96, 128, 255, 256, 257, 511, 512, 4032, 4088, 4095]
STREAMED = [65536, 65537, 65536 + 767, 24576 * 3 + 8 * 97 + 5, (2 << 20) + 3]


def _at_delta(n: int, delta: int, src_off: int) -> tuple[np.ndarray, np.ndarray]:
    """A source at src_off into a page and a destination `delta` bytes further on mod 4096, in one buffer (so that
    the distance is exact), not overlapping."""
    room = -(-(n + 4096) // 4096) * 4096
    buf = np.zeros(2 * room + 8192, np.uint8)
    base = (-buf.ctypes.data) % 4096
    src = buf[base + src_off:][:n]
    src[:] = np.random.default_rng(n + delta).integers(0, 256, n, dtype=np.uint8)
    d0 = base + room + src_off + delta
    return buf[d0:d0 + n], src


@needs_native
@pytest.mark.parametrize("vector", [True, False])
def test_streamed_copies_match_the_package_at_every_distance_between_dst_and_src(vector: bool) -> None:
    """Both loops of the streamed copy (the vector one where the CPU has AVX2; KVCOPY_NO_VECTOR for the scalar
    one), in a child so the switch is read at import: every byte and the CRC at each distance and length."""
    code = ("import sys, json, numpy as np, crc32c; sys.path.insert(0, sys.argv[1]); "
            "from tests.client.test_copy_crc import DELTAS, STREAMED, _at_delta; from kvstore import _kvcopy; "
            "bad = [(n, d, o) for n in STREAMED for d in DELTAS for o in (0, 8, 40) "
            "for dst, src in [_at_delta(n, d, o)] "
            "if _kvcopy.copy_crc32c(dst, src, stream=True) != crc32c.crc32c(src.tobytes()) "
            "or not np.array_equal(dst, src)]; "
            "print(json.dumps({'vector': _kvcopy.VECTOR, 'bad': bad}))")
    env = {k: v for k, v in os.environ.items() if k != "KVCOPY_NO_VECTOR"}
    if not vector:
        env["KVCOPY_NO_VECTOR"] = "1"
    out = subprocess.run([sys.executable, "-c", code, ROOT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    if vector and not got["vector"]:
        pytest.skip("this CPU has no AVX2: the scalar loop is the only one")
    assert got["vector"] == vector and got["bad"] == []


@pytest.mark.parametrize("kind", KINDS)
def test_bad_buffers_are_refused_with_the_argument_named(kind: str) -> None:
    copy = COPIES[kind]
    a = np.arange(100, dtype=np.uint8)
    square = np.zeros((10, 10), np.uint8)
    cases: list[tuple[Any, Any, type[Exception], str]] = [
        (b"x" * 3, b"abc", ValueError, "dst is read-only"),
        (np.zeros(100, np.uint8), a[:5], ValueError, "dst is 100 bytes, src 5"),
        (square[:, :5], np.zeros(50, np.uint8), ValueError, "dst is not C-contiguous"),
        (np.zeros(50, np.uint8), square[::2], ValueError, "src is not C-contiguous"),
        (a[10:], a[:90], ValueError, "overlap"),
        (3, a, TypeError, "dst must support the buffer protocol"),
        (np.zeros(3, np.uint8), "abc", TypeError, "src must support the buffer protocol"),
    ]
    for dst, src, exc, words in cases:
        with pytest.raises(exc, match=words):
            copy(dst, src)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stream", [False, True])
def test_the_crc_is_of_the_copy_even_while_the_source_changes(kind: str, stream: bool) -> None:
    """A writer flips bytes of the source all through the copies; each CRC returned is that of the destination
    (what the reader keeps), never of bytes it did not get."""
    src = np.random.default_rng(5).integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    stop = threading.Event()

    def scribble() -> None:
        i = 0
        while not stop.is_set():
            src[(i * 7919) % src.size:][:4096] += 1      # a page-sized write (numpy releases the GIL)
            i += 1

    writer = threading.Thread(target=scribble)
    writer.start()
    try:
        mismatched = [k for k in range(40) if COPIES[kind](dst, src, stream=stream) != crc32c(dst)]
    finally:
        stop.set()
        writer.join()
    assert mismatched == []


def test_fused_is_used_where_built_and_never_with_no_native() -> None:
    assert checksum.FUSED == (bool(HARDWARE) and os.environ.get("KVSTORE_NO_NATIVE", "") in ("", "0"))
    code = ("import numpy as np; from kvstore import checksum; s = np.arange(99999, dtype=np.uint8) * 3; "
            "d = np.zeros_like(s); print(checksum.FUSED, checksum.copy_crc32c(d, s) == checksum.crc32c(s), "
            "bool((d == s).all()))")
    env = {**os.environ, "KVSTORE_NO_NATIVE": "1", "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True", "True"]
