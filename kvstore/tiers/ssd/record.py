"""The SSD record format: one Full Block per fixed-size record in a preallocated file of one block size.

    record = header (4 KiB, of which the first 96 bytes are fields) + payload (the block, padded to 4 KiB)

Header fields (little endian): magic "KVSREC01", format version, header length, namespace digest (16), block hash
(16), payload length, payload CRC-32, sequence number, then a CRC-32 of all the fields before it. A record is
published by writing its payload, then its header (each synced according to the sync policy), so a torn write
leaves either the previous record (still whole and checked) or a header or payload whose checksum fails. Readers
check every field against the request and the checksum of the bytes they got (`check_record`, the one check that
reads and `verify` share); any mismatch is a miss.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

MAGIC = b"KVSREC01"
VERSION = 1
ALIGN = 4096
HEADER_BYTES = ALIGN
_FIELDS = struct.Struct("<8sII16s16sQIQ")          # magic, version, header len, ns, hash, length, crc, seq
_HEADER = struct.Struct("<8sII16s16sQIQI")         # ... + crc of the fields
EMPTY = bytes(HEADER_BYTES)


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

    def pack(self) -> bytes:
        fields = _FIELDS.pack(MAGIC, VERSION, HEADER_BYTES, self.ns, self.hash, self.length, self.crc, self.seq)
        return (fields + struct.pack("<I", zlib.crc32(fields))).ljust(HEADER_BYTES, b"\0")


def record_bytes(payload: int) -> int:
    return HEADER_BYTES + padded(payload)


def padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def parse_header(raw: bytes) -> Header | None:
    """The header's fields, None for a never-written (all-zero) record; BadRecord if torn, foreign or corrupt."""
    if raw[:_HEADER.size] == EMPTY[:_HEADER.size]:
        return None
    if len(raw) < _HEADER.size:
        raise BadRecord("truncated", f"header is {len(raw)} bytes")
    magic, version, hlen, ns, h, length, crc, seq, hcrc = _HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise BadRecord("foreign", "not a kvstore record")
    if version != VERSION:
        raise BadRecord("version", f"format version {version}, this daemon reads {VERSION}")
    if hlen != HEADER_BYTES or zlib.crc32(raw[:_FIELDS.size]) != hcrc:
        raise BadRecord("header_checksum", "header fields do not match their checksum")
    return Header(ns, h, length, crc, seq)


def check_payload(header: Header, payload: memoryview | bytes) -> None:
    if len(payload) < header.length:
        raise BadRecord("truncated", f"payload is {len(payload)} of {header.length} bytes")
    if zlib.crc32(payload[:header.length]) != header.crc:
        raise BadRecord("payload_checksum", "payload bytes do not match their checksum")


def check_record(raw_header: bytes, payload: memoryview | bytes, key: bytes, length: int) -> Header:
    """The one check of a record read back: its header is whole and ours, names `key` (namespace digest + block
    hash) and `length` payload bytes, and `payload` (the bytes read after the header, at least `length` of them)
    matches its checksum. Returns the header; raises BadRecord with the reason (an empty record is key_mismatch)."""
    header = parse_header(raw_header)
    if header is None or header.ns + header.hash != key or header.length != length:
        raise BadRecord("key_mismatch", "the record holds another block")
    check_payload(header, payload)
    return header
