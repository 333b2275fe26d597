"""The machine's own limits for the comparisons against LMCache, measured in the same run as what they bound.

- memcpy of whole 2 MiB blocks between private, already touched buffers (one thread): what a store or a retrieve
  through a DRAM tier can at best reach with one copy;
- the same bytes gathered from a paged KV layout (per block: K and V of each of 4 layers, 256 KiB runs): the copy
  LMCache's daemon makes from a registered engine KV cache;
- O_DIRECT write (then fdatasync) and read of the same 2 MiB blocks on the file system of the disk tiers, one
  request at a time and 4 in flight;
- a round trip of a 32-key lookup's sizes over a Unix stream socket to a server in another process (the floor of any
  request; bench_pool.EchoServer).
"""
from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

BLOCK = 2 << 20


class Memcpy:
    """One-thread copies of `n` blocks: contiguous (2 MiB each) and gathered from a paged layout."""

    def __init__(self, n: int) -> None:
        rng = np.random.default_rng(1)
        self.src = [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(n)]
        self.dst = [np.ones(BLOCK, np.uint8) for _ in range(n)]
        # paged: 4 layers × (K, V) × n blocks × 256 KiB: block i's bytes are 8 runs of 256 KiB, one per (layer, K|V)
        self.paged = rng.integers(0, 256, (4, 2, n, BLOCK // 8), dtype=np.uint8)

    def contiguous(self) -> float:
        """Seconds to copy every block once."""
        t0 = time.perf_counter()
        for d, s in zip(self.dst, self.src):
            np.copyto(d, s)
        return time.perf_counter() - t0

    def gather(self) -> float:
        t0 = time.perf_counter()
        for i, d in enumerate(self.dst):
            v = d.reshape(4, 2, BLOCK // 8)
            np.copyto(v, self.paged[:, :, i])
        return time.perf_counter() - t0


class ODirect:
    """A file of `n` blocks opened with O_DIRECT in `directory`: batch writes (pwritev, then fdatasync) and batch
    reads (preadv), as a disk tier without any book-keeping would do them, `depth` requests in flight (one thread
    each: pwritev/preadv release the GIL). Depth 1 is one block after the other; the disk tiers keep several in
    flight (kvstore reads 4 at a time, LMCache's fs tier up to 8 prefetches), so the limit is drawn at depth 4."""

    def __init__(self, directory: str, n: int, depth: int = 4) -> None:
        self.path = os.path.join(directory, "odirect-limit")
        self.n = n
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        self.bufs = [mmap.mmap(-1, BLOCK) for _ in range(depth)]    # page-aligned, as O_DIRECT needs
        for b in self.bufs:
            b.write(os.urandom(BLOCK))
        self.pool = ThreadPoolExecutor(depth)
        os.ftruncate(self.fd, n * BLOCK)

    def _run(self, fn: Callable[[int, list[mmap.mmap], int], int], first: int, count: int, depth: int) -> None:
        def lane(k: int) -> None:
            for i in range(first + k, first + count, depth):
                fn(self.fd, [self.bufs[k]], (i % self.n) * BLOCK)
        for f in [self.pool.submit(lane, k) for k in range(depth)]:
            f.result()

    def write(self, first: int, count: int, depth: int = 1) -> float:
        t0 = time.perf_counter()
        self._run(os.pwritev, first, count, depth)
        os.fdatasync(self.fd)
        return time.perf_counter() - t0

    def read(self, first: int, count: int, depth: int = 1) -> float:
        t0 = time.perf_counter()
        self._run(os.preadv, first, count, depth)
        return time.perf_counter() - t0

    def close(self) -> None:
        os.close(self.fd)
        self.pool.shutdown()
        for b in self.bufs:
            b.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
