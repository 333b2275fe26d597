"""Types of the native one-pass copy and CRC-32C (native/kvcopy.c, whose header is the contract)."""
from typing import Any

HARDWARE: bool
VECTOR: bool        # AVX2: streamed copies take the vector loop that loads ahead of its stores

def copy_crc32c(dst: Any, src: Any, crc: int = 0, *, stream: bool = False) -> int: ...

def copy_pages(pages: Any, offsets: Any, slots: Any, slot_offset: int, run_bytes: int, crcs: Any = None, *,
               to_slots: bool, stream: bool = False) -> None: ...
