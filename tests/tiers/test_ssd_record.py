"""The SSD record format (kvstore.tiers.ssd.record) on its own: the one check every read and `verify` apply, and the
marks block that lets a read hand on each piece it has checked."""
from __future__ import annotations

import pytest

from kvstore.tiers.ssd.record import HEADER_BYTES

NS = bytes(range(16))
PAYLOAD = 10_000                                    # not a multiple of 4 KiB on purpose


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def payload(i: int) -> bytes:
    return (i.to_bytes(4, "big") * (PAYLOAD // 4 + 1))[:PAYLOAD]


def test_check_record_is_the_one_check() -> None:
    from kvstore.checksum import crc32c
    from kvstore.tiers.ssd.record import BadRecord, Header, check_record

    body = payload(7)
    raw = Header(NS, h(7), PAYLOAD, crc32c(body), 5).pack()
    assert check_record(raw, body, NS + h(7), PAYLOAD).seq == 5
    for raw_header, data, key, length, reason in [
        (raw, body, NS + h(8), PAYLOAD, "key_mismatch"),              # another block
        (raw, body, NS + h(7), PAYLOAD - 1, "key_mismatch"),          # another length
        (bytes(HEADER_BYTES), body, NS + h(7), PAYLOAD, "key_mismatch"),   # never written
        (raw[:50], body, NS + h(7), PAYLOAD, "truncated"),            # a torn header
        (raw, body[:-1], NS + h(7), PAYLOAD, "truncated"),            # a short payload
        (raw, b"\xff" + body[1:], NS + h(7), PAYLOAD, "payload_checksum"),
    ]:
        with pytest.raises(BadRecord) as e:
            check_record(raw_header, data, key, length)
        assert e.value.reason == reason


def test_a_header_carries_its_payloads_piece_marks_and_refuses_marks_that_do_not_check_out() -> None:
    """The marks block: the payload's CRC-32C at the end of each piece, the last its CRC; marks of another piece
    size or count, or damaged, are ignored (the payload is then checked whole), never trusted."""
    import struct
    from dataclasses import replace

    import numpy as np

    from kvstore.checksum import crc32c
    from kvstore.tiers.ssd.record import (
        MARKS_AT,
        PIECE_MIN,
        Header,
        parse_header,
        parse_marks,
        piece_bytes,
        running_crcs,
    )

    body = np.random.default_rng(3).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    marks = running_crcs(body)
    piece = piece_bytes(len(body))
    assert piece == 256 << 10 and len(marks) == 4 and marks[-1] == crc32c(body)
    assert [crc32c(body[:piece * (k + 1)]) for k in range(4)] == list(marks)
    header = Header(NS, h(7), len(body), marks[-1], 5, writer=True, marks=marks)
    raw = header.pack()
    parsed = parse_header(raw)
    assert parsed is not None and parsed.marked and parsed.writer_crc == marks[-1]
    assert parse_marks(raw, parsed) == marks
    assert parse_marks(replace(header, marks=()).pack(), parsed) == ()             # no block
    for at, value in [(MARKS_AT + 4, struct.pack("<I", piece // 2)),                 # another piece size
                      (MARKS_AT + 8, struct.pack("<I", 3)),                          # another count
                      (MARKS_AT + 12, b"\0\0\0\0")]:                                 # a mark, damaged
        bad = raw[:at] + value + raw[at + len(value):]
        assert parse_marks(bad, parsed) == ()
    assert running_crcs(body[:PIECE_MIN]) == (crc32c(body[:PIECE_MIN]),)      # one piece: its CRC, no marks
