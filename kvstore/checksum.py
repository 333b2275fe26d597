"""The block checksum: CRC-32C, computed by the writer and carried with the block through every tier.

CRC-32C (Castagnoli) runs in hardware (SSE 4.2 `crc32`, ARMv8 `crc32c`) at ~20 GB/s here, against ~3 GB/s for
zlib's CRC-32, and it is what LevelDB, RocksDB and ext4 use for the same job. The `crc32c` package (ICRAR) is used
rather than `google-crc32c`: it takes any buffer (numpy arrays, mmaps, memoryviews of shared slots) without a copy
and releases the GIL, so a checksum runs beside a copy on another thread.

A block's CRC is that of its writer (the client that committed it): a tier checks it before it writes the block
and a reader checks its own copy against it; none recomputes it from bytes that a client could have altered since.
A block committed without one is never reported as verified.

`copy_crc32c` copies a buffer and returns the CRC-32C of the bytes copied. Where the native `kvstore._kvcopy` loads
and the CPU has the instruction (`FUSED`), it is one pass: each word is loaded once, stored and checksummed, so the
CRC costs no second read of the bytes (a copy then a CRC read them twice: put/get with checksums ran at 0.52-0.86x
memcpy). Otherwise (no compiler at install, another CPU, or `KVSTORE_NO_NATIVE=1`) it is numpy's copy and then the
CRC of the destination; both give the same value, and both are the CRC of the destination as written.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
from crc32c import crc32c as _crc32c

CRC_BITS = 32


def crc32c(buf: Any) -> int:
    """CRC-32C of a contiguous buffer (bytes, bytearray, memoryview, mmap, numpy array)."""
    return int(_crc32c(buf))


def _module() -> Any:
    """The native module where it is built and enabled; else None."""
    if os.environ.get("KVSTORE_NO_NATIVE", "") not in ("", "0"):
        return None
    try:
        import kvstore._kvcopy as _kvcopy
    except ImportError:
        return None
    return _kvcopy


_kvcopy = _module()
_fused = _kvcopy.copy_crc32c if _kvcopy is not None and _kvcopy.HARDWARE else None
FUSED = _fused is not None


def copy_crc32c(dst: Any, src: Any, stream: bool = False, crc: int = 0) -> int:
    """Copy `src` into `dst` (contiguous buffers of the same length, `dst` writable, not overlapping) and return the
    CRC-32C of the bytes copied, continuing `crc` (the CRC of the bytes before them). `stream`: the copy is large and
    not read again soon, so the one-pass copy may write around the caches (non-temporal stores); it changes no
    result. Releases the GIL for large buffers."""
    if _fused is not None:
        return int(_fused(dst, src, crc, stream=stream))
    return copy_then_crc32c(dst, src, crc)


def copy_then_crc32c(dst: Any, src: Any, crc: int = 0) -> int:
    """The two-pass `copy_crc32c`: numpy's copy, then the CRC of the destination (the fallback, and a baseline)."""
    d, s = _flat(dst, "dst"), _flat(src, "src")
    if not d.flags.writeable:
        raise ValueError("copy_crc32c: dst is read-only")
    if d.nbytes != s.nbytes:
        raise ValueError(f"copy_crc32c: dst is {d.nbytes} bytes, src {s.nbytes}: they must be the same length")
    if d.nbytes and np.shares_memory(d, s):
        raise ValueError("copy_crc32c: dst and src overlap")
    np.copyto(d, s)
    return int(_crc32c(d.data, crc))


def _flat(buf: Any, name: str) -> np.ndarray:
    """A flat uint8 view of a C-contiguous buffer; the same errors as the native copy."""
    try:
        arr = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
    except TypeError:
        raise TypeError(f"copy_crc32c: {name} must support the buffer protocol, got {type(buf).__name__}") from None
    if not arr.flags.c_contiguous:
        raise ValueError(f"copy_crc32c: {name} is not C-contiguous (the copy never reorders bytes)")
    return arr.reshape(-1).view(np.uint8)


def copy_pages(pages: np.ndarray, offsets: np.ndarray, slots: Sequence[Any], slot_offset: int, run_bytes: int,
               crcs: np.ndarray | None = None, *, to_slots: bool, stream: bool = False) -> None:
    """Move one layer of several blocks between an engine's flat KV storage and the blocks' slots in one call.

    Block i's runs lie back to back in `slots[i]` from `slot_offset`; its run k is `pages[offsets[i*R + k]:]
    [:run_bytes]` (R runs per block). `to_slots`: pages -> slots (a save), else slots -> pages (a load). With `crcs`
    (uint32, one per block) each block's CRC-32C is continued over its runs in slot order while they are copied, so
    moving a block's layers in order leaves the CRC of its whole slot with no second read of a byte. Natively one
    call per layer (bounds checked, GIL released); otherwise a numpy copy per run and the `crc32c` package."""
    need_hw = crcs is not None
    if _kvcopy is not None and (_kvcopy.HARDWARE or not need_hw):
        _kvcopy.copy_pages(pages, offsets, slots, slot_offset, run_bytes, crcs, to_slots=to_slots, stream=stream)
        return
    runs = len(offsets) // max(len(slots), 1)
    if len(offsets) != runs * len(slots):
        raise ValueError(f"copy_pages: {len(offsets)} run offsets for {len(slots)} slots")
    starts = offsets.tolist()
    for i, slot in enumerate(slots):
        flat = _flat(slot, "slot")
        for k in range(runs):
            o, at = starts[i * runs + k], slot_offset + k * run_bytes
            if o < 0 or o + run_bytes > pages.nbytes or at + run_bytes > flat.nbytes:
                raise ValueError(f"copy_pages: run {i * runs + k} is out of bounds")
            page, run = pages[o:o + run_bytes], flat[at:at + run_bytes]
            np.copyto(*((run, page) if to_slots else (page, run)))
            if crcs is not None:
                crcs[i] = _crc32c(run.data, int(crcs[i]))
