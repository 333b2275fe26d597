"""A toy lower tier, registered from outside kvstore (tests/test_extending.py): blocks in a dict, bounded by
`toy.capacity` (first in, first out), every read checked against its writer's CRC-32C. What the README's "Adding a
tier" asks for, and nothing more: a section dataclass with `check()`, a class implementing LowerTier, `open_tier`."""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, ClassVar

from kvstore.checksum import crc32c
from kvstore.tiers import StagingBuffer, TierContext, TierWrite
from kvstore.traffic import Lane


@dataclass(slots=True)
class ToyConfig:
    SIZES: ClassVar[tuple[str, ...]] = ("capacity",)
    enabled: bool = False
    capacity: int = 8 << 20

    def check(self) -> list[str]:
        return [] if self.capacity > 0 else [f"toy.capacity: must be above 0, got {self.capacity}"]


class ToyTier:
    name = "toy"

    def __init__(self, cfg: ToyConfig, ctx: TierContext) -> None:
        self.cfg = cfg
        self.path = ctx.traffic.path("toy", 1)
        self.lock = threading.Lock()
        self.blocks: OrderedDict[bytes, tuple[bytes, int | None]] = OrderedDict()
        self.announced: set[bytes] = set()
        self.staged: dict[bytes, int | None] = {}       # the writer's CRC-32C of each block between stage and fill
        self.used = 0
        self.counters = {"stored": 0, "read": 0, "dropped": 0}

    def _keep(self, bid: bytes, data: bytes, crc: int | None) -> bool:
        if crc is not None and crc32c(data) != crc:
            return False
        with self.lock:
            while self.blocks and self.used + len(data) > self.cfg.capacity:
                _, (old, _) = self.blocks.popitem(last=False)
                self.used -= len(old)
                self.counters["dropped"] += 1
            self.blocks[bid] = (data, crc)
            self.used += len(data)
            self.counters["stored"] += 1
        return True

    def has(self, bid: bytes) -> bool:
        with self.lock:
            return bid in self.blocks

    def stage(self, bid: bytes, nbytes: int, crc: int | None = None) -> StagingBuffer | bool:
        with self.lock:
            if bid in self.blocks:
                return True
            self.staged[bid] = crc
        return bytearray(nbytes)

    def fill(self, bid: bytes, buf: StagingBuffer, data: memoryview) -> None:
        buf[:] = data
        with self.lock:
            crc = self.staged.pop(bid, None)
        self._keep(bid, bytes(buf), crc)

    def announce(self, bids: list[bytes]) -> None:
        with self.lock:
            self.announced.update(bids)

    def write(self, items: Sequence[TierWrite], lane: Lane) -> int:
        stored = 0
        for bid, buf, crc in items:
            with self.lock:
                live = bid in self.announced
                self.announced.discard(bid)
            stored += live and self._keep(bid, bytes(buf), crc)
        return stored

    def read(self, bids: Sequence[bytes], outs: Sequence[memoryview], lane: Lane,
             on_ready: Callable[[int], None] | None = None, crcs: list[int | None] | None = None) -> int:
        n = 0
        for bid, out in zip(bids, outs):
            with self.lock:
                got = self.blocks.get(bid)
            if got is None or got[1] is not None and crc32c(got[0]) != got[1]:
                break
            out[:len(got[0])] = got[0]
            if crcs is not None:
                crcs.append(got[1])
            n += 1
        self.counters["read"] += n
        if n and on_ready is not None:
            on_ready(n)
        return n

    def read_async(self, bid: bytes, out: memoryview, lane: Lane,
                   on_done: Callable[[Future[Any]], None]) -> Future[Any] | None:
        if not self.has(bid):
            return None
        crcs: list[int | None] = []
        return self.path.submit(lane, out.nbytes, lambda: crcs[0] if self.read([bid], [out], lane, None, crcs)
                                else False, tag=bid, on_done=on_done)

    def delete(self, bid: bytes) -> bool:
        return self.delete_many([bid])[0]

    def delete_many(self, bids: Sequence[bytes]) -> list[bool]:
        out = []
        with self.lock:
            for bid in bids:
                self.announced.discard(bid)
                got = self.blocks.pop(bid, None)
                self.used -= len(got[0]) if got else 0
                out.append(got is not None)
        return out

    def resize(self, capacity: int) -> dict[str, Any]:
        raise RuntimeError("toy: not resizable")

    def namespaces(self) -> dict[bytes, int]:
        with self.lock:
            out: dict[bytes, int] = {}
            for bid in self.blocks:
                out[bid[:16]] = out.get(bid[:16], 0) + 1
            return out

    def stats(self) -> dict[str, Any]:
        with self.lock:
            return {"tier": self.name, "capacity_bytes": self.cfg.capacity, "mapped_bytes": self.used,
                    "used_bytes": self.used, "resident_bytes": self.used, "blocks": len(self.blocks),
                    "segments": 1, "counters": dict(self.counters)}

    def close(self) -> None:
        pass


def open_tier(cfg: ToyConfig, ctx: TierContext) -> ToyTier | None:
    return ToyTier(cfg, ctx) if cfg.enabled else None
