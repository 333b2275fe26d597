"""One physical path (the SSD, later a NIC or a GPU link) and the arbiter in front of it.

Every transfer on the path is a function that moves `nbytes` (a record read, a payload write, a sync), submitted in
a lane. Each lane has a bounded FIFO queue: a full one refuses at once with `Busy`, so a producer learns of
overload instead of piling up work. A fixed set of worker threads is the path's in-flight limit; each free worker
takes the next transfer chosen by the arbiter:

- `weighted` (the default): self-clocked weighted fair queueing over bytes. A transfer of n bytes in lane l gets
  the finish tag max(V, F_l) + n / share_l, where F_l is lane l's last tag and V the tag of the transfer last
  started; the smallest tag goes next. Lanes with work split the path in proportion to their shares (critical
  0.96 against 0.01 for background: about 96 critical bytes for every background byte while both wait), an idle
  lane lends its share to the others, and no lane with a share above zero ever starves. Besides, lower lanes may
  hold at most `workers - 1` workers, so a critical read always finds a worker free; and while critical transfers
  are queued, running or less than 50 ms old, the lower lanes keep a single transfer in flight, so that a read an
  engine waits on shares the device with one other transfer at most; and while critical transfers are queued or
  running, a lower lane starts one only when it is owed its share (its tag at or below the last critical tag),
  not merely because a worker is free. Finally, a lower-lane transfer already on the device yields to critical
  ones between its pieces: a long transfer (a 2 MiB record write or prefetch read) moves in pieces of
  `PIECE_BYTES` and calls `checkpoint()` between them, which waits while a critical transfer is queued or running
  (at most `PAUSE_MAX_S` each time, so nothing stalls for good). A critical read then shares the device with at
  most one piece, not one whole record. bench/bench_traffic.py measures the effect against a plain FIFO.
- `fifo`: one queue in arrival order, the baseline the benchmark compares with.

The path also knows itself — bytes queued per lane, in flight, the bandwidth measured over its busy time — and from
that the expected completion time of a new transfer (`expected_s`), which the chooser uses to send a read by the
path that will finish first (DualPath §6.1).

This module owns the arbiter: the lanes' queues, the tags, the workers, the checkpoints, and the booking of each
transfer's start and end. What the path knows of itself — the per-lane statistics, the bandwidth estimate,
`expected_s`, `stats()` — and `choose`/`rank` live in `knowledge` (re-exported here).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from kvstore.traffic.knowledge import DECAY_BUSY_S, LaneStats, PathKnowledge, choose, rank
from kvstore.traffic.lanes import DEFAULT_QUEUE, DEFAULT_SHARES, LANES, Lane

__all__ = ["CRITICAL_QUIET_S", "DECAY_BUSY_S", "PAUSE_MAX_S", "PIECE_BYTES", "POLICIES", "Busy", "LaneStats", "Path",
           "Transfer", "choose", "rank"]

log = logging.getLogger("kvstore")
POLICIES = ("weighted", "fifo")
CRITICAL_QUIET_S = 0.05     # critical traffic counts as active this long after its last transfer
PIECE_BYTES = 512 << 10      # lower-lane transfers move in pieces this large and may yield to critical in between
PAUSE_MAX_S = 0.02           # the longest one checkpoint waits for critical traffic to pass


class Busy(Exception):
    """A lane's queue is full: the producer should retry later (or drop what it wanted to do)."""

    def __init__(self, path: str, lane: Lane, limit: int) -> None:
        super().__init__(f"{path}: the {lane.label} lane's queue is full ({limit} transfers); try again later")
        self.path = path
        self.lane = lane


@dataclass(eq=False, slots=True)
class Transfer:
    lane: Lane
    nbytes: int
    fn: Callable[[], Any]
    future: Future[Any]
    tag: Hashable | None
    on_done: Callable[[Future[Any]], None] | None
    queued_at: float
    finish: float = 0.0


class Path(PathKnowledge):
    def __init__(self, name: str, workers: int = 4, shares: Mapping[Lane, float] | None = None,
                 queue_limits: Mapping[Lane, int] | None = None, policy: str = "weighted",
                 nominal_bps: float = 1e9, device: Callable[[Transfer], None] | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"traffic policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.name = name
        self.policy = policy
        self.workers = workers
        self.shares = dict(DEFAULT_SHARES if shares is None else shares)
        if any(self.shares.get(la, 0) <= 0 for la in LANES):
            raise ValueError(f"{name}: every lane needs a share above 0, got {self.shares}")
        self.limits = dict(DEFAULT_QUEUE if queue_limits is None else queue_limits)
        # lower lanes leave one worker to critical reads (not in fifo, which is the no-lanes baseline)
        self.low_limit = max(1, workers - 1) if policy == "weighted" else workers
        self.nominal_bps = nominal_bps
        self.pause_max_s = PAUSE_MAX_S
        self.device = device                    # called before each transfer: a test's gate, a slow-device model
        self.queues: dict[Lane, deque[Transfer]] = {la: deque() for la in LANES}
        self.lanes: dict[Lane, LaneStats] = {la: LaneStats() for la in LANES}
        lock = threading.Lock()
        self._cond = threading.Condition(lock)
        self._quiet = threading.Condition(lock)     # notified when no critical transfer is queued or running
        self._current = threading.local()           # the transfer each worker runs (its lane, for checkpoint)
        self._vtime = 0.0
        self._last: dict[Lane, float] = {la: 0.0 for la in LANES}
        self._arrivals = 0
        self._low_in_flight = 0
        self._in_flight = 0
        self._critical_at = -1.0
        self._busy_since = 0.0
        self._busy_s = 0.0
        self._done_bytes = 0.0
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"kvstore-{name}-{i}", daemon=True)
                         for i in range(workers)]
        for t in self._threads:
            t.start()

    # ----- producers -----
    def submit(self, lane: Lane, nbytes: int, fn: Callable[[], Any], tag: Hashable | None = None,
               on_done: Callable[[Future[Any]], None] | None = None) -> Future[Any]:
        """Queue `fn` (moving `nbytes`) in `lane`; its future holds fn's result. `on_done(future)` runs on the
        worker thread once the future is set. Raises Busy at once when the lane's queue is full."""
        with self._cond:
            if self._closed:
                raise RuntimeError(f"{self.name}: the path is closed")
            q = self.queues[lane]
            if len(q) >= self.limits[lane]:
                self.lanes[lane].rejected += 1
                raise Busy(self.name, lane, self.limits[lane])
            t = Transfer(lane, nbytes, fn, Future(), tag, on_done, time.perf_counter())
            self._tag(t)
            q.append(t)
            self.lanes[lane].queued_bytes += nbytes
            self._cond.notify()
            return t.future

    def run(self, lane: Lane, nbytes: int, fn: Callable[[], Any], tag: Hashable | None = None) -> Future[Any]:
        """`submit`, for a transfer the caller waits for at once: a critical one runs in the calling thread (done
        when this returns) while no critical transfer is queued and fewer than `workers` are in flight, counted
        in flight like a worker's (the lower lanes yield to it); otherwise it is queued. Why: the two thread
        hand-offs through a worker cost ~0.3 ms of a 2 MiB SSD-hit get (bench_ssd_tier, 2-core VM)."""
        with self._cond:
            here = (lane == Lane.CRITICAL and self.policy == "weighted" and not self._closed
                    and not self.queues[lane] and self._in_flight < self.workers)
            if here:
                t = Transfer(lane, nbytes, fn, Future(), tag, None, time.perf_counter())
                self._tag(t)
                self._vtime = max(self._vtime, t.finish)
                self._start(t)
        if not here:
            return self.submit(lane, nbytes, fn, tag)
        saved = getattr(self._current, "lane", None)
        try:
            self._execute(t)
        finally:
            if saved is None:
                del self._current.lane
            else:
                self._current.lane = saved
        return t.future

    def room(self, lane: Lane) -> int:
        """How many more transfers the lane's queue takes now."""
        with self._cond:
            return self.limits[lane] - len(self.queues[lane])

    def cancel(self, tag: Hashable) -> int:
        """Drop the queued transfers carrying `tag` (their futures are cancelled); returns how many."""
        with self._cond:
            n = 0
            for lane, q in self.queues.items():
                for t in [t for t in q if t.tag == tag]:
                    q.remove(t)
                    t.future.cancel()
                    self.lanes[lane].cancelled += 1
                    self.lanes[lane].queued_bytes -= t.nbytes
                    n += 1
            return n

    def escalate(self, tag: Hashable, lane: Lane) -> int:
        """Move queued transfers carrying `tag` up to `lane` (a prefetch that a get now waits for becomes
        critical); returns how many moved."""
        with self._cond:
            n = 0
            for old, q in self.queues.items():
                if old <= lane:
                    continue
                for t in [t for t in q if t.tag == tag]:
                    q.remove(t)
                    self.lanes[old].queued_bytes -= t.nbytes
                    self.lanes[old].escalated += 1
                    t.lane = lane
                    self._tag(t)
                    self.queues[lane].append(t)
                    self.lanes[lane].queued_bytes += t.nbytes
                    n += 1
            if n:
                self._cond.notify(n)
            return n

    def _tag(self, t: Transfer) -> None:
        if self.policy == "fifo":
            self._arrivals += 1
            t.finish = float(self._arrivals)
            return
        start = max(self._vtime, self._last[t.lane])
        t.finish = self._last[t.lane] = start + max(t.nbytes, 1) / self.shares[t.lane]

    # ----- preemption points -----
    def _critical_busy(self) -> bool:
        return bool(self.queues[Lane.CRITICAL] or self.lanes[Lane.CRITICAL].in_flight)

    def checkpoint(self) -> None:
        """Called by a running transfer between its pieces: a lower-lane transfer waits here while a critical
        transfer is queued or running (at most `pause_max_s`), so a read an engine waits on has the device to itself.
        Returns at once for critical transfers, under fifo, and outside a worker."""
        lane = getattr(self._current, "lane", Lane.CRITICAL)
        if lane == Lane.CRITICAL or self.policy != "weighted":
            return
        deadline = time.perf_counter() + self.pause_max_s
        with self._cond:
            if not self._critical_busy():
                return
            self.lanes[lane].paused += 1
            while self._critical_busy() and not self._closed:
                left = deadline - time.perf_counter()
                if left <= 0 or not self._quiet.wait(left):
                    return

    def running_lane(self) -> Lane:
        """The lane of the transfer this worker thread runs (CRITICAL outside a worker): a transfer that moves in
        pieces only to yield to critical ones (PIECE_BYTES) moves whole when it is critical itself."""
        return getattr(self._current, "lane", Lane.CRITICAL)

    # ----- workers -----
    def _next(self) -> Transfer | None:
        with self._cond:
            while True:
                best: Transfer | None = None
                low_limit = self._low_limit_now()
                critical_busy = self.policy == "weighted" and bool(
                    self.queues[Lane.CRITICAL] or self.lanes[Lane.CRITICAL].in_flight)
                for lane in LANES:
                    q = self.queues[lane]
                    if not q or (lane != Lane.CRITICAL and self._low_in_flight >= low_limit):
                        continue
                    if lane != Lane.CRITICAL and critical_busy and q[0].finish > self._last[Lane.CRITICAL]:
                        continue        # not owed yet: it would only slow the critical reads on the device
                    if best is None or q[0].finish < best.finish:
                        best = q[0]
                if best is not None:
                    self.queues[best.lane].popleft()
                    self._vtime = max(self._vtime, best.finish) if self.policy == "weighted" else 0.0
                    self._start(best)
                    return best
                if self._closed:
                    return None
                self._cond.wait()

    def _low_limit_now(self) -> int:
        """(Under the condition.) While critical transfers are queued, running or just done, the lower lanes keep
        one transfer in flight, not workers - 1: a read an engine waits on shares the device with at most one
        other transfer, and the lower lanes still move (the arbiter's order gives each its share)."""
        if self.policy == "weighted" and (self.queues[Lane.CRITICAL] or self.lanes[Lane.CRITICAL].in_flight
                                          or time.perf_counter() - self._critical_at < CRITICAL_QUIET_S):
            return 1
        return self.low_limit

    def _start(self, t: Transfer) -> None:
        s = self.lanes[t.lane]
        s.queued_bytes -= t.nbytes
        s.in_flight += 1
        if t.lane != Lane.CRITICAL:
            self._low_in_flight += 1
        if self._in_flight == 0:
            self._busy_since = time.perf_counter()
        self._in_flight += 1
        s.wait.observe(time.perf_counter() - t.queued_at)

    def _work(self) -> None:
        while (t := self._next()) is not None:
            self._execute(t)

    def _execute(self, t: Transfer) -> None:
        """Run a started transfer in this thread, set its future, book its end, call its completion handler."""
        ok = t.future.set_running_or_notify_cancel()
        if ok:
            try:
                if self.device is not None:
                    self.device(t)
                self._current.lane = t.lane
                t.future.set_result(t.fn())
            except BaseException as e:  # the producer sees it through the future
                t.future.set_exception(e)
        self._finish(t, ok)
        if ok and t.on_done is not None:
            try:
                t.on_done(t.future)
            except Exception:
                log.exception("%s: a transfer's completion handler failed", self.name)

    def _finish(self, t: Transfer, ran: bool) -> None:
        now = time.perf_counter()
        with self._cond:
            s = self.lanes[t.lane]
            s.in_flight -= 1
            if t.lane != Lane.CRITICAL:
                self._low_in_flight -= 1
            self._in_flight -= 1
            if not ran:
                s.cancelled += 1
            else:
                s.transfers += 1
                failed = t.future.exception() is not None
                s.failed += failed
                if not failed:
                    s.bytes += t.nbytes
                    self._done_bytes += t.nbytes
                s.latency.observe(now - t.queued_at)
            if t.lane == Lane.CRITICAL:
                self._critical_at = now
                if not self._critical_busy():
                    self._quiet.notify_all()
            if self._in_flight == 0:
                self._busy_s += now - self._busy_since
                if self._busy_s > DECAY_BUSY_S:
                    self._busy_s /= 2
                    self._done_bytes /= 2
            if self._closed or (self._low_in_flight < self.low_limit and any(self.queues.values())):
                self._cond.notify()

    # ----- closing -----
    def close(self) -> None:
        """Cancel what is queued, let what runs finish, stop the workers."""
        with self._cond:
            self._closed = True
            for lane, q in self.queues.items():
                for t in q:
                    t.future.cancel()
                    self.lanes[lane].cancelled += 1
                q.clear()
                self.lanes[lane].queued_bytes = 0
            self._cond.notify_all()
            self._quiet.notify_all()
        for th in self._threads:
            if th is not threading.current_thread():
                th.join(timeout=30)
