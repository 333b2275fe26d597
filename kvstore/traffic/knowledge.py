"""What a path knows of itself, and the choice between paths made from it (DualPath §6.1).

This module owns the per-lane statistics (`LaneStats`: counts, bytes queued and in flight, wait and latency
histograms), the bandwidth estimate measured over the path's busy time (`DECAY_BUSY_S`: it forgets the past by
halves), the expected completion time of a new transfer (`expected_s`), the path's `stats()` report, and
`choose`/`rank`, which send a read by the path expected to finish first. It decides nothing about the order of
transfers on a path: that is the arbiter's, in `path`, which also books the figures read here (under its lock).
`PathKnowledge` is the part of `Path` that reads them; `Path` is its only subclass.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstore.histogram import Histogram
from kvstore.traffic.lanes import LANES, Lane

if TYPE_CHECKING:
    from kvstore.traffic.path import Path, Transfer

DECAY_BUSY_S = 10.0          # the bandwidth estimate forgets the past by halves, every 10 s of busy time


@dataclass(slots=True)
class LaneStats:
    transfers: int = 0          # completed (ok or failed)
    bytes: int = 0
    failed: int = 0
    cancelled: int = 0
    rejected: int = 0
    escalated: int = 0
    paused: int = 0             # checkpoints at which a running transfer waited for critical traffic
    queued_bytes: int = 0
    in_flight: int = 0
    wait: Histogram = field(default_factory=Histogram)       # queued → started
    latency: Histogram = field(default_factory=Histogram)    # queued → done


class PathKnowledge:
    """The reading side of `Path`: its bandwidth, a new transfer's expected time, its statistics. The state it
    reads is set and booked by `Path` (declared here for the type checker only)."""

    name: str
    policy: str
    workers: int
    shares: dict[Lane, float]
    limits: dict[Lane, int]
    nominal_bps: float
    queues: dict[Lane, deque[Transfer]]
    lanes: dict[Lane, LaneStats]
    _cond: threading.Condition
    _in_flight: int
    _busy_since: float
    _busy_s: float
    _done_bytes: float

    def bandwidth(self) -> float:
        """Bytes per second over the path's busy time (the nominal figure until it has moved enough to know)."""
        with self._cond:
            busy = self._busy_s + (time.perf_counter() - self._busy_since if self._in_flight else 0.0)
            if busy < 0.01 or self._done_bytes < 1 << 20:
                return self.nominal_bps
            return self._done_bytes / busy

    def expected_s(self, nbytes: int, lane: Lane) -> float:
        """When a transfer of `nbytes` submitted now in `lane` would be done: the bytes the arbiter will serve
        before it (its lane's queue; of each other lane, what its share lets through meanwhile), plus what is in
        flight, over the measured bandwidth."""
        bw = self.bandwidth()
        with self._cond:
            mine = self.lanes[lane].queued_bytes + nbytes
            ahead = float(mine)
            for other in LANES:
                if other == lane:
                    continue
                queued = self.lanes[other].queued_bytes
                let_through = mine * self.shares[other] / self.shares[lane]
                ahead += queued if self.policy == "fifo" else min(queued, let_through)
            ahead += sum(s.in_flight for s in self.lanes.values()) * nbytes / max(self.workers, 1)
        return ahead / bw

    def stats(self) -> dict[str, Any]:
        bw = self.bandwidth()
        with self._cond:
            lanes = {la.label: {"queued": len(self.queues[la]), "queued_bytes": s.queued_bytes,
                                "in_flight": s.in_flight, "transfers": s.transfers, "bytes": s.bytes,
                                "failed": s.failed, "cancelled": s.cancelled, "rejected": s.rejected,
                                "escalated": s.escalated, "paused": s.paused, "queue_limit": self.limits[la],
                                "share": self.shares[la],
                                "wait": s.wait.to_dict(), "latency": s.latency.to_dict()}
                     for la, s in self.lanes.items()}
            return {"path": self.name, "policy": self.policy, "workers": self.workers, "in_flight": self._in_flight,
                    "bandwidth_bps": bw, "lanes": lanes}


def choose(options: list[tuple[Path, int]], lane: Lane) -> int:
    """Of several ways to fetch the same bytes — (path, bytes it would move) each — the index of the one expected
    to finish first (DualPath §6.1); ties go to the earlier option, so list the local path first."""
    return rank(options, lane)[0]


def rank(options: list[tuple[Path, int]], lane: Lane) -> list[int]:
    """The options' indices, the one expected to finish first first (ties keep their order)."""
    est = [path.expected_s(nbytes, lane) for path, nbytes in options]
    return sorted(range(len(options)), key=est.__getitem__)
