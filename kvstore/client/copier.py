"""The client's copy engine: the one copy of each transfer, between a caller's buffer and a shared slot.

numpy's copy releases the GIL, so two threads really copy in parallel; below ~1 MiB per batch a second thread costs
more than it gives, so small batches stay on the calling thread.

`copy_checked` also returns the CRC-32C of each destination (kvstore.checksum). Where the one-pass copy is built
(`checksum.FUSED`), each block is copied and checksummed in the same pass, by the copy threads splitting the blocks
between them; a transfer of STREAM_BYTES or more asks it to write around the caches (it is bigger than they are).
Otherwise, with one copy thread, the checksum of a group of blocks runs on a checksum thread while the next group
is copied, reading bytes the copy has just left in the cache; with more, each copy thread checksums the whole blocks
it copies right after copying each (the copy threads then cover the checksums' CPU time, and two already saturate
the memory bus here). The CRC, like numpy's copy and the one-pass copy, releases the GIL.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from kvstore.checksum import FUSED, copy_crc32c, crc32c

PARALLEL_MIN_BYTES = 1 << 20
STREAM_BYTES = 8 << 20      # a checked copy this large streams its stores (non-temporal): a quarter of the L3 here
GROUP_BYTES = 1 << 20       # per copy thread: the bytes copied before their checksum is handed to the checksum thread


def as_bytes(buf: Any, writable: bool = False) -> np.ndarray:
    """A flat uint8 view of a contiguous buffer (bytes, bytearray, memoryview, numpy array, CPU tensor's numpy)."""
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError("buffers must be C-contiguous (the copy never reorders bytes)")
        arr = buf.reshape(-1).view(np.uint8)
    else:
        arr = np.frombuffer(buf, dtype=np.uint8)
    if writable and not arr.flags.writeable:
        raise ValueError("destination buffer is read-only")
    return arr


class Copier:
    def __init__(self, threads: int = 1, fused: bool = FUSED) -> None:
        """`fused`: checked copies in one pass (kvstore.checksum.copy_crc32c); the default where it is native."""
        if threads not in (1, 2, 3, 4):
            raise ValueError(f"copy_threads must be 1..4, got {threads}")
        self.threads = threads
        self.fused = fused
        self._pool = ThreadPoolExecutor(threads - 1, thread_name_prefix="kvstore-copy") if threads > 1 else None
        self._checker: ThreadPoolExecutor | None = None

    def copy(self, pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
        """Copy each (dst, src) pair; all of them have been copied when this returns."""
        total = sum(src.nbytes for _, src in pairs)
        if self._pool is None or total < PARALLEL_MIN_BYTES or len(pairs) < 2:
            _copy_all(pairs)
            return
        shares = _split(pairs, self.threads, total)
        futures = [self._pool.submit(_copy_all, s) for s in shares[1:]]
        _copy_all(shares[0])
        for f in futures:
            f.result()

    def copy_checked(self, pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[int]:
        """Copy each (dst, src) pair and return the CRC-32C of each destination as copied."""
        return self.start_checked(pairs)()

    def start_checked(self, pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> Callable[[], list[int]]:
        """Copy each pair; returns a function that waits for the checksums and returns them. The copies are done
        when this returns; the last group's checksum may still run, so a caller with more to copy starts it
        before it asks for these (no pipeline drain between parts)."""
        crcs = [0] * len(pairs)
        total = sum(src.nbytes for _, src in pairs)
        if self.fused:
            self._fused(pairs, crcs, total)
            return lambda: crcs
        if total < PARALLEL_MIN_BYTES or len(pairs) < 2:
            for i, (dst, src) in enumerate(pairs):
                np.copyto(dst, src)
                crcs[i] = crc32c(dst)
            return lambda: crcs
        if self._pool is not None:
            shares = [list(range(i, len(pairs), self.threads)) for i in range(self.threads)]
            jobs = [self._pool.submit(_copy_and_check, pairs, s, crcs) for s in shares[1:]]
            _copy_and_check(pairs, shares[0], crcs)
            for j in jobs:
                j.result()
            return lambda: crcs
        if self._checker is None:
            self._checker = ThreadPoolExecutor(1, thread_name_prefix="kvstore-crc")
        futures = []
        for group in _groups(pairs, GROUP_BYTES * self.threads):
            self.copy([pairs[i] for i in group])
            futures.append(self._checker.submit(_checksums, crcs, [(i, pairs[i][0]) for i in group]))

        def finish() -> list[int]:
            for f in futures:
                f.result()
            return crcs
        return finish

    def _fused(self, pairs: Sequence[tuple[np.ndarray, np.ndarray]], crcs: list[int], total: int) -> None:
        """One pass per block; blocks dealt round-robin to the copy threads (a block is never split: its CRC is
        one stream)."""
        stream = total >= STREAM_BYTES
        if self._pool is None or total < PARALLEL_MIN_BYTES or len(pairs) < 2:
            _copy_crc(pairs, range(len(pairs)), crcs, stream)
            return
        shares = [range(i, len(pairs), self.threads) for i in range(self.threads)]
        jobs = [self._pool.submit(_copy_crc, pairs, s, crcs, stream) for s in shares[1:]]
        _copy_crc(pairs, shares[0], crcs, stream)
        for j in jobs:
            j.result()

    def close(self) -> None:
        for pool in (self._pool, self._checker):
            if pool is not None:
                pool.shutdown(wait=True)


def _split(pairs: Sequence[tuple[np.ndarray, np.ndarray]], n: int, total: int
           ) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """n shares of equal bytes: whole pairs where they divide evenly, else slices of them."""
    shares: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(n)]
    target = -(-total // n)
    i, filled = 0, 0
    for dst, src in pairs:
        start = 0
        while start < src.nbytes:
            take = min(src.nbytes - start, target - filled) if i < n - 1 else src.nbytes - start
            shares[i].append((dst[start:start + take], src[start:start + take]))
            start += take
            filled += take
            if filled >= target and i < n - 1:
                i, filled = i + 1, 0
    return shares


def _groups(pairs: Sequence[tuple[np.ndarray, np.ndarray]], nbytes: int) -> list[range]:
    """Consecutive runs of pairs of about `nbytes` each (at least one pair)."""
    out, start, filled = [], 0, 0
    for i, (_, src) in enumerate(pairs):
        filled += src.nbytes
        if filled >= nbytes:
            out.append(range(start, i + 1))
            start, filled = i + 1, 0
    if start < len(pairs):
        out.append(range(start, len(pairs)))
    return out


def _copy_and_check(pairs: Sequence[tuple[np.ndarray, np.ndarray]], which: list[int], crcs: list[int]) -> None:
    for i in which:
        dst, src = pairs[i]
        np.copyto(dst, src)
        crcs[i] = crc32c(dst)


def _copy_crc(pairs: Sequence[tuple[np.ndarray, np.ndarray]], which: range, crcs: list[int], stream: bool) -> None:
    for i in which:
        dst, src = pairs[i]
        crcs[i] = copy_crc32c(dst, src, stream)


def _checksums(crcs: list[int], items: list[tuple[int, np.ndarray]]) -> None:
    for i, arr in items:
        crcs[i] = crc32c(arr)


def _copy_all(pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
    for dst, src in pairs:
        np.copyto(dst, src)
