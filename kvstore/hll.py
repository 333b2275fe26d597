"""A HyperLogLog over block keys: how many distinct blocks the engines looked up, in 16 KiB whatever their number.

With it the daemon reports the hit-rate ceiling of any cache, however large (as PegaFlow exports): a block's first
lookup can only miss, every later one could hit, so ceiling = 1 − distinct / looked up. p = 14 (16384 registers,
one byte each) gives a standard error of 1.04 / √16384 ≈ 0.8 % on the distinct count (Flajolet et al., 2007, with
linear counting below 5/2 · m; 64-bit hashes need no large-range correction).

Adding is cheap where it happens: `add_keys` (under the daemon's state lock, per lookup) only queues the blob — a
numpy pass costs ~50 µs whether it hashes 16 keys or 1000, measured here, which would double a small lookup's time
in the daemon. `take` and `fold` hash the queued keys in one pass, without the state lock (the server's tick), under
a lock of the sketch's own; `distinct` folds what is still queued first. Past FOLD_KEYS queued keys, `add_keys`
folds at once, so the queue stays bounded whatever the tick does.
"""
from __future__ import annotations

import threading

import numpy as np

P = 14
M = 1 << P
FOLD_KEYS = 1 << 18                    # queued keys (4 MiB of blobs) beyond which add_keys folds them itself
_ALPHA = 0.7213 / (1 + 1.079 / M)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_GOLDEN, _MASK = 0x9E3779B97F4A7C15, (1 << 64) - 1

Batch = list[tuple[bytes, int]]       # queued (blob of 16-byte keys, salt)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: spreads keys that are not uniform themselves (counters, test hashes) over 64 bits."""
    x = x ^ (x >> np.uint64(30))
    x = x * _MIX1
    x = x ^ (x >> np.uint64(27))
    x = x * _MIX2
    return x ^ (x >> np.uint64(31))


class HyperLogLog:
    def __init__(self) -> None:
        self.registers = np.zeros(M, dtype=np.uint8)
        self.added = 0                   # keys added, duplicates included
        self._queued: Batch = []
        self._queued_keys = 0
        self._lock = threading.Lock()    # the registers (folds may run outside the caller's lock)

    def add_keys(self, blob: bytes, salt: int = 0) -> None:
        """Add the 16-byte keys packed in `blob`; `salt` (a namespace's) makes one hash in two namespaces two
        keys. Queued: hashed at the next fold."""
        n = len(blob) // 16
        if not n:
            return
        self._queued.append((blob, salt))
        self.added += n
        self._queued_keys += n
        if self._queued_keys >= FOLD_KEYS:
            self.fold(self.take())

    def take(self) -> Batch:
        """The queued keys, handed over for a `fold` (under the lock the adders hold)."""
        batch, self._queued, self._queued_keys = self._queued, [], 0
        return batch

    def fold(self, batch: Batch) -> None:
        """Hash a batch into the registers: one numpy pass, under the sketch's own lock only."""
        if not batch:
            return
        words = np.frombuffer(b"".join(blob for blob, _ in batch), dtype=np.uint64).reshape(-1, 2)
        salts = np.repeat(np.array([s * _GOLDEN & _MASK for _, s in batch], dtype=np.uint64),
                          [len(blob) // 16 for blob, _ in batch])
        with np.errstate(over="ignore"):
            x = mix64(words[:, 0] ^ words[:, 1] * _MIX1 ^ salts)
        index = (x >> np.uint64(64 - P)).astype(np.intp)
        rest = (x << np.uint64(P)) | np.uint64(1 << (P - 1))      # the sentinel bounds the rank at 64 - P + 1
        rank = (64 - np.floor(np.log2(rest.astype(np.float64)))).astype(np.uint8)
        with self._lock:
            np.maximum.at(self.registers, index, rank)

    def distinct(self) -> float:
        """The estimated number of distinct keys added (folding the queued ones first)."""
        self.fold(self.take())
        with self._lock:
            regs = self.registers.copy()
        est = _ALPHA * M * M / float(np.sum(np.ldexp(1.0, -regs.astype(np.int32))))
        zeros = int(np.count_nonzero(regs == 0))
        if est <= 2.5 * M and zeros:
            return M * float(np.log(M / zeros))
        return est

    def ceiling(self) -> float | None:
        """The hit rate an unbounded cache would have had on the keys added (None before any)."""
        if not self.added:
            return None
        return max(0.0, 1.0 - min(self.distinct(), self.added) / self.added)
