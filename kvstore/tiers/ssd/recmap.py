"""The record map: beside each record file, a copy of every live record's header fields, so that a restarted daemon
knows what is on disk from the moment it serves, instead of after a scan of every header (one 4 KiB random read a
record: ~20 s for a tier of 500 k records).

    blocks-<payload>.map = file header (4 KiB) + one ENTRY_BYTES entry per record, at FILE_HEADER + rec * ENTRY_BYTES

An entry is the first HEADER_FIELDS bytes of the record's header (record.py: key, length, the writer's CRC, sequence
number, flags, and a CRC of those fields), or zeros for a record that holds nothing. The map is written buffered
(small writes; the page cache merges them), each file synced by the writer's batches.

**The map is authoritative; headers only confirm it.** A record is live only if its map entry names a key and its
header names the same key (the read checks the header and the payload; the validation pass after a start checks
every header in the background). A header that the map does not name is garbage, never adopted. The writes keep it
true across any crash:
- A record's map entry is written and synced *before* its header is written (writes.py): every header that can be
  on disk has its entry on disk, so every block that was durable before a crash is in the map after it.
- A delete zeroes the header durably first, then the entry (lazily durable): an entry left naming a key whose
  header is gone is a miss, never a resurrection; a stale header under an entry for another key is never adopted.
So a delete never waits for a scan, and nothing needs the scan to be found. One exception is read, not trusted: an
entry that is damaged (not zero, yet not a whole entry: torn by a power cut, or rotten) leaves its record neither
free nor booked until the validation reads its header; a whole header of this file is then booked (so no durable
block is lost to a damaged entry) and its entry rewritten, anything else wiped, and deletes wait for that.

The file header says whether the map is complete: written by a daemon that kept it through every change since the
record file was created or the map was rebuilt. A map that is missing, foreign, corrupt or incomplete (a rebuild cut
short) is not trusted: the restart scan reads every header as before (scan.py), the writes keep the entries of new
records meanwhile, and at the end of the scan the entries of what it found are written, synced, and the map marked
complete. The map is not tied to its record file's inode: a directory copied or restored whole (or rebuilt by the
power-cut model) keeps its fast restart, and a record file swapped under its map costs misses (its headers do not
confirm the entries), never a wrong byte or a resurrected block.
"""
from __future__ import annotations

import os
import struct
from collections.abc import Iterable

import numpy as np
from crc32c import crc32c as _crc32c

from kvstore.checksum import crc32c
from kvstore.tiers.ssd import diskio
from kvstore.tiers.ssd.record import ALIGN, HEADER_BYTES, Header
from kvstore.tiers.ssd.record import MAGIC as MAGIC_RECORD
from kvstore.tiers.ssd.record import VERSION as RECORD_VERSION

MAGIC = b"KVSMAP01"
VERSION = 1
FILE_HEADER = ALIGN
ENTRY_BYTES = 128
HEADER_FIELDS = 76                        # the header's fields and their CRC (record._HEADER.size)
BUILDING, COMPLETE = 0, 1
_FILE = struct.Struct("<8sIIQQI")        # magic, version, state, payload bytes, 0, 0 (reserved), ...
_FILE_CRC = struct.Struct("<I")          # ... then a CRC-32C of those fields
ZERO_ENTRY = bytes(ENTRY_BYTES)
# An entry as numpy reads it: record.py's version-2 header fields (the only version this daemon writes).
_ENTRY = np.dtype([("magic", "S8"), ("version", "<u4"), ("hlen", "<u4"), ("ns", "V16"), ("hash", "V16"),
                   ("length", "<u8"), ("crc", "<u4"), ("seq", "<u8"), ("flags", "<u4"), ("hcrc", "<u4"),
                   ("pad", "V52")])
FIELDS = HEADER_FIELDS - 4               # the fields the entry's CRC covers
KEY_AT = 16                              # namespace digest + block hash: 32 bytes from here
assert _ENTRY.itemsize == ENTRY_BYTES


def map_path(record_path: str) -> str:
    """`blocks-<payload>.map` beside `blocks-<payload>.kvs`."""
    return record_path[:-len(".kvs")] + ".map"


def entry_of(header: Header) -> bytes:
    """The map entry of a record with this header: its fields, as the record's own header starts."""
    return header.pack()[:HEADER_FIELDS].ljust(ENTRY_BYTES, b"\0")


class RecordMap:
    """The map of one record file (`payload`-byte blocks)."""

    def __init__(self, path: str, fd: int, payload: int) -> None:
        self.path = path
        self.fd = fd
        self.payload = payload

    @classmethod
    def open(cls, record_path: str, payload: int, fresh: bool) -> "RecordMap":
        """Open (or create) the map of a record file. `fresh`: the record file was just created, empty, so the
        map is made empty and complete at once. (The caller syncs the directory.)"""
        path = map_path(record_path)
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        created = not os.path.lexists(path)
        fd = os.open(path, flags, 0o600)
        diskio.opened(fd, path, created)
        m = cls(path, fd, payload)
        if fresh:
            m.reset(COMPLETE)
        return m

    # ----- the file header -----
    def complete(self) -> bool:
        """Whether this map can be trusted: ours, whole, complete, for this block size."""
        raw = os.pread(self.fd, _FILE.size + _FILE_CRC.size, 0)
        if len(raw) < _FILE.size + _FILE_CRC.size:
            return False
        fields = raw[:_FILE.size]
        magic, version, state, payload, _, _ = _FILE.unpack(fields)
        return (magic == MAGIC and version == VERSION and state == COMPLETE and payload == self.payload
                and _FILE_CRC.unpack_from(raw, _FILE.size)[0] == crc32c(fields))

    def reset(self, state: int) -> None:
        """Empty the map (every record holds nothing) and mark it `state`, durably. A disk call."""
        diskio.ftruncate(self.fd, 0)
        self.mark(state)

    def mark(self, state: int) -> None:
        """Write the file header with `state` and sync the map (its entries before it). A disk call."""
        fields = _FILE.pack(MAGIC, VERSION, state, self.payload, 0, 0)
        head = (fields + _FILE_CRC.pack(crc32c(fields))).ljust(FILE_HEADER, b"\0")
        diskio.fdatasync(self.fd)                 # the entries first: "complete" never precedes them
        diskio.pwritev(self.fd, [head], 0)
        diskio.fdatasync(self.fd)

    # ----- entries -----
    def put(self, entries: Iterable[tuple[int, bytes]]) -> None:
        """Write (record, entry) pairs (not synced: `sync`). A disk call (buffered)."""
        for rec, entry in entries:
            diskio.pwritev(self.fd, [entry], FILE_HEADER + rec * ENTRY_BYTES)

    def clear(self, recs: Iterable[int]) -> None:
        self.put((rec, ZERO_ENTRY) for rec in recs)

    def sync(self) -> None:
        diskio.fdatasync(self.fd)

    def cut(self, nrecords: int) -> None:
        """Drop the entries of records past `nrecords` (the record file was cut to that)."""
        diskio.ftruncate(self.fd, min(os.fstat(self.fd).st_size, FILE_HEADER + nrecords * ENTRY_BYTES))

    def load(self, nrecords: int) -> tuple[list[tuple[int, bytes, int]], list[int]]:
        """The entries of records 0 .. nrecords-1: those naming a block, as (record, key, sequence number), oldest
        first; and the records whose entry is damaged (not zero, yet not a whole entry of this file: torn, rotten).
        The records of zero entries hold nothing. Vectorised but for each entry's CRC (500 k: about a second)."""
        size = nrecords * ENTRY_BYTES
        raw = os.pread(self.fd, size, FILE_HEADER) if size else b""
        raw = raw.ljust(-(-len(raw) // ENTRY_BYTES) * ENTRY_BYTES, b"\0")    # a short last entry: zeros after it
        e = np.frombuffer(raw, _ENTRY)
        ok = ((e["magic"] == MAGIC_RECORD) & (e["version"] == RECORD_VERSION) & (e["hlen"] == HEADER_BYTES)
              & (e["length"] == self.payload))
        found = []
        view = memoryview(raw)
        for rec in np.flatnonzero(ok).tolist():
            at = rec * ENTRY_BYTES
            if _crc32c(view[at:at + FIELDS]) == int(e["hcrc"][rec]):
                found.append((rec, raw[at + KEY_AT:at + KEY_AT + 32], int(e["seq"][rec])))
        good = {rec for rec, _, _ in found}
        written = np.flatnonzero(np.frombuffer(raw, np.uint8).reshape(-1, ENTRY_BYTES).any(axis=1)).tolist()
        found.sort(key=lambda f: f[2])
        return found, [rec for rec in written if rec not in good]

    def file_bytes(self) -> int:
        return os.fstat(self.fd).st_size

    def close(self) -> None:
        os.close(self.fd)
