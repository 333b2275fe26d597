"""What every part of the remote tier shares (kvstore.tiers.remote.tier composes the parts over one `Wire`).

- One lock for the whole tier, `lock` (and `cond`, a condition on it): the books (books.py), the write-back's
  staging and its queue (writeback.py), the link's up/down state (link.py) and both arenas are guarded together, so
  that a lookup, a demotion, a delete and the writer see one state. It is held for dict updates and arena
  bookkeeping (and the copy out of staging), never across a call to the store.
- Registered memory: the write-back's staging arena (None under write-through only) and the pad, a small arena
  for the trailers of the transfers in flight (`trailers`, `give_pad`: taken and given back under the lock); a host
  slot's segment is registered with the transfer engine the first time one of its slots moves (`addr`), so blocks
  move from and to host slots with no bounce copy.
- `wait`: a transfer's result within remote.timeout_s (the network path's transfers: kvstore.traffic), and
  `pieces`, which cuts a batch into transfers of a bounded size.
- `counters` and `seconds`: the tier's events and the wall time of its puts and reads, in its stats row.

`TierPart` is the base of the parts: it gives each the wire's fields under the names the tier's code has always used.
"""
from __future__ import annotations

import mmap
import threading
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np

from kvstore.tiers.remote import trailer
from kvstore.tiers.remote.arena import Arena
from kvstore.tiers.remote.client import MooncakeClient
from kvstore.tiers.remote.config import RemoteConfig
from kvstore.traffic import Path

PAD_BYTES = 1 << 20             # registered memory for the trailers of transfers in flight


class Wire:
    def __init__(self, name: str, cfg: RemoteConfig, path: Path, client: MooncakeClient,
                 staging: Arena | None) -> None:
        self.name = name
        self.cfg = cfg
        self.path = path
        self.client = client
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.staging = staging
        self.pad = Arena(PAD_BYTES)
        self.counters: Counter[str] = Counter()
        self.seconds: dict[str, float] = {"put_s": 0.0, "get_s": 0.0}   # wall time of puts and of reads

    def addr(self, view: memoryview) -> int:
        """The address of a host slot's bytes, its segment registered with the transfer engine on first use."""
        base = view.obj
        if not isinstance(base, mmap.mmap):
            raise TypeError("remote: blocks move from and to the host pool's segments (mmap-backed views) only")
        addr = int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
        if not self.client.registered(addr, view.nbytes):
            whole = np.frombuffer(base, dtype=np.uint8)
            start, size = int(whole.ctypes.data), whole.nbytes
            del whole
            self.client.register(start, size)
        return addr

    def trailers(self, n: int) -> int | None:
        with self.lock:
            return self.pad.take(trailer.SIZE * n)

    def give_pad(self, off: int) -> None:
        with self.lock:
            self.pad.give(off)

    def wait(self, fut: Future[Any], cancel_late: bool) -> Any:
        """A transfer's result within remote.timeout_s; past it, one still queued is cancelled (FutureTimeout),
        one running is waited for unless `cancel_late` (it moves no bytes into host slots)."""
        try:
            return fut.result(timeout=self.cfg.timeout_s)
        except FutureTimeout:
            self.counters["timeouts"] += 1
            if fut.cancel() or cancel_late:
                raise
            return fut.result()


class TierPart:
    """A part of the tier, over the wire it shares with the others."""

    def __init__(self, wire: Wire) -> None:
        self.wire = wire
        self.name = wire.name
        self.cfg = wire.cfg
        self.path = wire.path
        self.client = wire.client
        self.lock = wire.lock
        self.cond = wire.cond
        self.staging = wire.staging
        self.pad = wire.pad
        self.counters = wire.counters
        self.seconds = wire.seconds


def pieces(sizes: Sequence[int], limit: int, most: int = 1 << 30) -> list[tuple[int, int]]:
    """[a, b) ranges of consecutive items, each at most `limit` bytes and `most` items (at least one item)."""
    out: list[tuple[int, int]] = []
    a, total = 0, 0
    for i, n in enumerate(sizes):
        if i > a and (total + n > limit or i - a >= most):
            out.append((a, i))
            a, total = i, 0
        total += n
    out.append((a, len(sizes)))
    return out
