"""Types of the native one-pass copy and CRC-32C (native/kvcopy.c, whose header is the contract)."""
from typing import Any

HARDWARE: bool

def copy_crc32c(dst: Any, src: Any, crc: int = 0, *, stream: bool = False) -> int: ...
