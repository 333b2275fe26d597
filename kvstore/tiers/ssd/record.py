"""The SSD record format: one Full Block per fixed-size record in a preallocated file of one block size.

    record = header (4 KiB, of which the first 96 bytes are fields) + payload (the block, padded to 4 KiB)

Header fields (little endian): magic "KVSREC01", format version, header length, namespace digest (16), block hash
(16), payload length, payload CRC-32C, sequence number, flags, then a CRC-32C of all the fields before it. With flag
PIECE_MARKS, a marks block follows at MARKS_AT: "MRKS", the piece size, the count, the payload's CRC-32C continued
to the end of each piece (the last is the payload CRC), and a CRC-32C of the block. A reader that reads the payload
in those pieces checks each one as it lands, so the verified bytes can be handed on before the last piece is in
(reads.py); marks that do not check out are ignored (the payload is still checked whole). Daemons that predate the
flag ignore it and read the record as before. The
payload CRC is the one the block's writer committed it with (flag WRITER_CRC) — checked against the bytes before
they are written, and carried on when the block is promoted — or, for a block committed without one, the tier's own
(good against a torn write, never reported as the writer's). Version 1 records (zlib CRC-32, no flags) are still
read, as blocks without a writer's CRC. A record is
published by writing its payload, then its header (each synced according to the sync policy), so a torn write
leaves either the previous record (still whole and checked) or a header or payload whose checksum fails. Readers
check every field against the request and the checksum of the bytes they got (`check_record`, the one check that
reads and `verify` share); any mismatch is a miss.
"""
from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from crc32c import crc32c as crc32c_continue  # kvstore.checksum's CRC-32C, continued from a value

from kvstore.checksum import crc32c

MAGIC = b"KVSREC01"
VERSION = 2
ALIGN = 4096
HEADER_BYTES = ALIGN
WRITER_CRC = 1                                      # flags: the payload CRC is the block writer's
PIECE_MARKS = 2                                     # flags: a marks block follows the fields (module doc)
MARKS_AT = 128                                      # its offset in the header (past the map entry's bytes)
MARKS_MAGIC = b"MRKS"
MAX_MARKS = 64
PIECES = 4                                          # a payload's pieces, in flight at once on a critical read
PIECE_MIN = 256 << 10                               # ... none smaller than this: a small block is one piece
_MARKS = struct.Struct("<4sII")                     # magic, piece bytes, count; then the marks, then their CRC
_FIELDS = struct.Struct("<8sII16s16sQIQI")         # magic, version, header len, ns, hash, length, crc, seq, flags
_HEADER = struct.Struct("<8sII16s16sQIQII")        # ... + crc of the fields
_FIELDS_V1 = struct.Struct("<8sII16s16sQIQ")       # version 1: no flags, zlib CRC-32
_HEADER_V1 = struct.Struct("<8sII16s16sQIQI")
EMPTY = bytes(HEADER_BYTES)
_CRC: dict[int, Callable[[Any], int]] = {1: zlib.crc32, 2: crc32c}   # payload and header checksum per version


class BadRecord(Exception):
    """Why a record cannot be served; `reason` is the counter it raises."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Header:
    ns: bytes
    hash: bytes
    length: int
    crc: int
    seq: int
    writer: bool = False        # `crc` is the CRC-32C the block's writer committed it with
    version: int = VERSION
    marks: tuple[int, ...] = ()  # the payload's CRC-32C at the end of each piece of piece_bytes(length); written
    marked: bool = False         # (as parsed) the flag says a marks block follows: `parse_marks` reads it

    def pack(self) -> bytes:
        """The header as this daemon writes it (always the current version), with its marks block if any."""
        flags = (WRITER_CRC if self.writer else 0) | (PIECE_MARKS if self.marks else 0)
        fields = _FIELDS.pack(MAGIC, VERSION, HEADER_BYTES, self.ns, self.hash, self.length, self.crc, self.seq,
                              flags)
        head = (fields + struct.pack("<I", crc32c(fields))).ljust(MARKS_AT, b"\0")
        if self.marks:
            block = _MARKS.pack(MARKS_MAGIC, piece_bytes(self.length), len(self.marks)) + \
                struct.pack(f"<{len(self.marks)}I", *self.marks)
            head += block + struct.pack("<I", crc32c(block))
        return head.ljust(HEADER_BYTES, b"\0")

    @property
    def writer_crc(self) -> int | None:
        """The writer's CRC-32C, which the block carries on when it is promoted; None if the writer gave none."""
        return self.crc if self.writer else None


def record_bytes(payload: int) -> int:
    return HEADER_BYTES + padded(payload)


def padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def piece_bytes(length: int) -> int:
    """The piece size of a payload of `length` bytes: PIECES pieces of whole pages, none under PIECE_MIN. The
    writer's marks and a critical reader's requests share it."""
    return max(padded(-(-length // PIECES)), PIECE_MIN)


def running_crcs(payload: Any) -> tuple[int, ...]:
    """The payload's CRC-32C continued to the end of each piece of piece_bytes (one pass over the bytes, as the
    CRC of the whole would be): the marks of its header; the last is the payload's CRC."""
    piece = piece_bytes(len(payload))
    out, crc = [], 0
    with memoryview(payload).cast("B") as mv:
        for i in range(0, len(mv), piece):
            with mv[i:i + piece] as part:
                crc = crc32c_continue(part, crc)
            out.append(crc)
    return tuple(out) or (crc32c(b""),)


def parse_marks(raw: Any, header: Header) -> tuple[int, ...]:
    """The marks block of a header read whole (`raw`, HEADER_BYTES), () when the header has none or they do not
    check out (a block of another piece size or count, a torn or corrupt block, a last mark that is not the
    payload CRC): the payload is then checked whole."""
    if not header.marked or len(raw) < HEADER_BYTES:
        return ()
    magic, piece, count = _MARKS.unpack_from(raw, MARKS_AT)
    if magic != MARKS_MAGIC or not 2 <= count <= MAX_MARKS or piece != piece_bytes(header.length) or \
            count != -(-header.length // piece):
        return ()
    end = MARKS_AT + _MARKS.size + 4 * count
    marks = struct.unpack_from(f"<{count}I", raw, MARKS_AT + _MARKS.size)
    if crc32c(bytes(raw[MARKS_AT:end])) != struct.unpack_from("<I", raw, end)[0] or marks[-1] != header.crc:
        return ()
    return marks


def parse_header(raw: bytes) -> Header | None:
    """The header's fields, None for a never-written (all-zero) record; BadRecord if torn, foreign or corrupt."""
    if raw[:_HEADER.size] == EMPTY[:_HEADER.size]:
        return None
    if len(raw) < _HEADER.size:
        raise BadRecord("truncated", f"header is {len(raw)} bytes")
    if raw[:len(MAGIC)] != MAGIC:
        raise BadRecord("foreign", "not a kvstore record")
    version = struct.unpack_from("<I", raw, len(MAGIC))[0]
    if version == 1:
        magic, version, hlen, ns, h, length, crc, seq, hcrc = _HEADER_V1.unpack_from(raw)
        flags, fields = 0, _FIELDS_V1.size
    elif version == VERSION:
        magic, version, hlen, ns, h, length, crc, seq, flags, hcrc = _HEADER.unpack_from(raw)
        fields = _FIELDS.size
    else:
        raise BadRecord("version", f"format version {version}, this daemon reads 1 and {VERSION}")
    if hlen != HEADER_BYTES or _CRC[version](raw[:fields]) != hcrc:
        raise BadRecord("header_checksum", "header fields do not match their checksum")
    return Header(ns, h, length, crc, seq, bool(flags & WRITER_CRC), version, marked=bool(flags & PIECE_MARKS))


def check_payload(header: Header, payload: memoryview | bytes) -> None:
    if len(payload) < header.length:
        raise BadRecord("truncated", f"payload is {len(payload)} of {header.length} bytes")
    if _CRC[header.version](payload[:header.length]) != header.crc:
        raise BadRecord("payload_checksum", "payload bytes do not match their checksum")


def check_record(raw_header: bytes, payload: memoryview | bytes, key: bytes, length: int,
                 payload_crc: int | None = None) -> Header:
    """The one check of a record read back: its header is whole and ours, names `key` (namespace digest + block
    hash) and `length` payload bytes, and `payload` (the bytes read after the header, at least `length` of them)
    matches its checksum. Returns the header; raises BadRecord with the reason (an empty record is key_mismatch).
    `payload_crc`: the CRC-32C of those `length` bytes, computed by the reader as they landed (a version 1 record,
    whose checksum is zlib's, is checked on its bytes all the same)."""
    header = parse_header(raw_header)
    if header is None or header.ns + header.hash != key or header.length != length:
        raise BadRecord("key_mismatch", "the record holds another block")
    if payload_crc is None or header.version != VERSION or len(payload) < header.length:
        check_payload(header, payload)
    elif payload_crc != header.crc:
        raise BadRecord("payload_checksum", "payload bytes do not match their checksum")
    return header
