"""The crash oracle shared by the kill -9 and power-loss tests: what each key may, must or must not hold after a
crash, from the history of the requests that clients sent and the replies they got.

Every block's bytes are a function of its key (tests.workers.content), so a block served with other bytes is
always a failure. Each key has one owner (one client thread), which sends its puts and deletes one after the
other, so a key's history is a sequence; the crash happens at `cut` (time.monotonic(), comparable across the
processes of this machine). Of the requests sent before the cut, the last one decides:
- an acknowledged delete (reply received before the cut): the block must be a miss, never served again;
- a put acknowledged as stored, followed (same daemon life) by a moment the daemon's stats showed the SSD tier
  settled with write-through and sync=always (`settled`): the block is durable and must be served;
- a put acknowledged `durable` (put(..., durable=True): the daemon answered once its record was synced): the block
  must be served;
- a put acknowledged as stored before a write-through watermark (`watermark`: a stats poll, answered before the
  cut, whose oldest pending write-through was younger than the put, with nothing skipped, lost or failed on the
  durable path so far): its write-through had settled, so it must be served — the write-through blocks older than
  the lag the daemon itself measured, checked without pausing the clients;
- anything else (a request in flight at the cut, a put refused, a put not settled yet): either is fine;
- no request at all: a miss.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

ABSENT, DELETED, PRESENT, EITHER = "absent", "deleted", "present", "either"   # DELETED: absent, by a delete

# A restarted daemon is checked right after it answers, not once its SSD scan is done: the record maps
# (kvstore/tiers/ssd/recmap.py) put every block on disk in the books before it serves, so a promise that fails then
# is a lost block. False waits for the scan (a block not scanned yet is a miss), to compare.
CHECK_BEFORE_SCAN = True


@dataclass
class Op:
    kind: str                     # "put" | "delete"
    life: int                     # which daemon process it was sent to
    start: float
    ack: float | None = None      # when its reply arrived; None: in flight when the daemon died, or failed
    stored: bool = False          # a put: the daemon holds the block (stored now or already)
    durable: bool = False         # a put answered `durable` (on disk and synced when acknowledged)


@dataclass
class Oracle:
    ops: dict[bytes, list[Op]] = field(default_factory=dict)
    settles: list[tuple[int, float, float]] = field(default_factory=list)    # (life, start, end)
    watermarks: list[tuple[int, float, float]] = field(default_factory=list)  # (life, settled before, seen at)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def begin(self, key: bytes, kind: str, life: int) -> Op:
        op = Op(kind, life, time.monotonic())
        with self.lock:
            self.ops.setdefault(key, []).append(op)
        return op

    @staticmethod
    def acked(op: Op, stored: bool = False, durable: bool = False) -> None:
        op.stored = stored
        op.durable = durable
        op.ack = time.monotonic()

    def watermark(self, life: int, before: float, seen: float) -> None:
        """Every put of `life` acknowledged before `before` had its write-through settled on disk (a stats poll
        whose reply came at `seen`)."""
        with self.lock:
            self.watermarks.append((life, before, seen))

    def settled(self, life: int, start: float, end: float) -> None:
        """The SSD tier was seen settled between `start` and `end` (stats polled from `start` on)."""
        with self.lock:
            self.settles.append((life, start, end))

    def expect(self, key: bytes, cut: float) -> str:
        sent = [op for op in self.ops.get(key, []) if op.start < cut]
        if not sent:
            return ABSENT
        last = sent[-1]
        done = last.ack is not None and last.ack < cut
        if last.kind == "delete":
            return DELETED if done else EITHER
        if not done or not last.stored:
            return EITHER
        assert last.ack is not None
        durable = last.durable or \
            any(life == last.life and start > last.ack and end < cut for life, start, end in self.settles) or \
            any(life == last.life and last.ack < before and seen < cut for life, before, seen in self.watermarks)
        return PRESENT if durable else EITHER

    def check(self, key: bytes, served: bytes | None, want: bytes, cut: float) -> str | None:
        """Why serving `served` (None: a miss) for `key` after a crash at `cut` breaks a promise; None if fine."""
        if served is not None and served != want:
            return f"{key.hex()}: served bytes that were never written for it"
        expect = self.expect(key, cut)
        if served is not None and expect == DELETED:
            return f"{key.hex()}: served after a delete acknowledged before the crash ({self.history(key, cut)})"
        if served is not None and expect == ABSENT:
            return f"{key.hex()}: served, but never written before the crash"
        if served is None and expect == PRESENT:
            return f"{key.hex()}: durable before the crash, missing after it ({self.history(key, cut)})"
        return None

    def history(self, key: bytes, cut: float) -> str:
        """The key's last requests sent before the cut: kind@life, `?` without a reply before it, `+` stored, `!`
        answered durable, and when it was sent and answered (ms before the cut); then the settles of the last
        one's life."""
        sent = [op for op in self.ops.get(key, []) if op.start < cut][-4:]
        ops = ", ".join(f"{op.kind}@{op.life}{'' if op.ack is not None and op.ack < cut else '?'}"
                        f"{'+' if op.stored else ''}{'!' if op.durable else ''} "
                        f"({_ms(cut - op.start)}..{_ms(cut - (op.ack or cut))})"
                        for op in sent)
        settles = [f"{_ms(cut - a)}..{_ms(cut - b)}" for life, a, b in self.settles
                   if sent and life == sent[-1].life and a < cut]
        return f"{ops}; settles {settles}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"
