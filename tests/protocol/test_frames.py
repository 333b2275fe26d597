"""FrameReader, the one reader of a byte stream into frames (client and daemon): whole bodies in order, whatever the
chunking; None while a frame is incomplete; an oversize header refused before its body is buffered."""
from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.protocol import Code, FrameReader, ProtocolError, decode, encode


def frame(body: bytes) -> bytes:
    return struct.pack("<I", len(body)) + body


def drain(reader: FrameReader) -> list[bytes]:
    out = []
    while (body := reader.next()) is not None:
        out.append(body)
    return out


def test_empty_and_partial_input_needs_more_bytes():
    r = FrameReader()
    assert r.next() is None
    r.feed(b"\x05\x00")                     # half a header
    assert r.next() is None
    r.feed(b"\x00\x00abc")                  # header whole, body not
    assert r.next() is None
    r.feed(b"de")
    assert r.next() == b"abcde"
    assert r.next() is None                 # taken: gone from the buffer


def test_pipelined_frames_come_out_one_by_one_in_order():
    msgs = [{"v": 1, "id": i, "ok": True, "n": i * 7} for i in range(5)]
    r = FrameReader()
    r.feed(b"".join(encode(m) for m in msgs) + frame(b"xy")[:3])   # five whole frames and the start of a sixth
    assert [decode(b) for b in drain(r)] == msgs
    r.feed(frame(b"xy")[3:])
    assert r.next() == b"xy"


def test_an_empty_body_is_a_frame():
    r = FrameReader(limit=0)
    r.feed(frame(b"") * 2)
    assert drain(r) == [b"", b""]


@settings(max_examples=200, deadline=None)
@given(bodies=st.lists(st.binary(max_size=300), max_size=8), cuts=st.lists(st.integers(0, 3000), max_size=12))
def test_any_chunking_gives_the_same_frames(bodies, cuts):
    stream = b"".join(frame(b) for b in bodies)
    points = sorted({min(c, len(stream)) for c in cuts} | {0, len(stream)})
    r = FrameReader(limit=300)
    got: list[bytes] = []
    for a, b in zip(points, points[1:]):
        r.feed(stream[a:b])
        got += drain(r)
    assert got == bodies
    assert r.next() is None


@pytest.mark.parametrize("declared", [1025, 1 << 20, (1 << 32) - 1])
def test_oversize_header_is_refused_before_its_body(declared):
    r = FrameReader(limit=1024)
    r.feed(frame(b"ok") + struct.pack("<I", declared))   # a frame within the limit, then an oversize header alone
    assert r.next() == b"ok"
    with pytest.raises(ProtocolError) as e:
        r.next()
    assert e.value.code == Code.BAD_FRAME
    assert e.value.message == f"frame of {declared} bytes exceeds the limit of 1024 bytes"
    with pytest.raises(ProtocolError):      # the stream cannot be resynchronised: refused again
        r.next()


def test_a_frame_at_the_limit_passes_and_no_limit_means_any_size():
    r = FrameReader(limit=4)
    r.feed(frame(b"abcd"))
    assert r.next() == b"abcd"
    big = bytes(range(256)) * 4096
    r = FrameReader()
    r.feed(frame(big))
    assert r.next() == big


def test_feed_next_hands_back_a_whole_frame_without_buffering_it():
    r = FrameReader(limit=64)
    body = encode({"op": "ping"})[4:]
    got = r.feed_next(frame(body))
    assert isinstance(got, memoryview) and bytes(got) == body
    assert r.next() is None                                   # nothing was left in the buffer


def test_feed_next_buffers_partial_and_pipelined_frames_in_order():
    r = FrameReader()
    a, b = frame(b"first"), frame(b"second")
    assert r.feed_next(a[:3]) is None
    assert r.feed_next(a[3:] + b) == b"first"                 # two frames in one chunk: the first, then the next
    assert r.next() == b"second" and r.next() is None


def test_feed_next_refuses_an_oversize_whole_frame():
    r = FrameReader(limit=4)
    with pytest.raises(ProtocolError) as e:
        r.feed_next(frame(b"too long"))
    assert e.value.code == Code.BAD_FRAME
    with pytest.raises(ProtocolError):
        r.feed_next(frame(b"ok"))                             # the stream cannot be resynced
