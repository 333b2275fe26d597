"""The 16 bytes that travel after a block's bytes in the store: a magic, whether the writer gave a CRC-32C, the CRC,
and the block's length. A daemon of another node reads them with the block (the same get, into a small registered
pad) and serves the block only if its bytes match: a value written by something else, cut short, or changed in the
store is a miss, never served."""
from __future__ import annotations

import struct

MAGIC = b"KVS1"
SIZE = 16
_FMT = struct.Struct("<4sIII")
HAS_CRC = 1


def pack(nbytes: int, crc: int | None) -> bytes:
    return _FMT.pack(MAGIC, HAS_CRC if crc is not None else 0, crc or 0, nbytes)


def unpack(raw: bytes | memoryview, nbytes: int) -> tuple[bool, int | None]:
    """(whether the trailer is one of ours for a block of `nbytes`, the writer's CRC-32C or None)."""
    magic, flags, crc, length = _FMT.unpack(raw)
    if magic != MAGIC or length != nbytes or flags & ~HAS_CRC:
        return False, None
    return True, crc if flags & HAS_CRC else None
