"""The traffic manager's arbiter on its own: lane order, minimum shares, bounded queues, cancellation, escalation,
the path chooser and the figures it reports. Deterministic: one worker held by a gate while the queues fill, or
lanes kept backlogged by their own completions, so the order depends on the arbiter alone, not on timing."""
from __future__ import annotations

import random
import threading
from concurrent.futures import CancelledError, Future

import pytest

from kvstore.traffic import LANES, Busy, Lane, Path, choose, parse_lane
from kvstore.traffic.slow import SlowDevice

MiB = 1 << 20
SHARES = {Lane.CRITICAL: 0.96, Lane.STORE: 0.02, Lane.PREFETCH: 0.01, Lane.BACKGROUND: 0.01}


class Gate:
    """Holds the path's workers in a first transfer until opened: everything submitted meanwhile queues."""

    def __init__(self, path: Path, lane: Lane = Lane.BACKGROUND) -> None:
        self.opened = threading.Event()
        self.started = threading.Event()
        self.future = path.submit(lane, MiB, self._hold)
        assert self.started.wait(5)

    def _hold(self) -> None:
        self.started.set()
        self.opened.wait(10)

    def open(self) -> None:
        self.opened.set()


@pytest.fixture
def paths():
    made: list[Path] = []

    def make(**kw) -> Path:
        kw.setdefault("shares", SHARES)
        made.append(Path("test", **kw))
        return made[-1]
    yield make
    for p in made:
        p.close()


def expected_order(queued: list[tuple[Lane, int]], vtime: float, last: dict[Lane, float]) -> list[tuple[Lane, int]]:
    """The spec, written independently: tag = max(V, F_lane) + bytes / share, smallest tag first, ties to the
    higher lane."""
    tagged = []
    for i, (lane, nbytes) in enumerate(queued):
        last[lane] = max(vtime, last[lane]) + nbytes / SHARES[lane]
        tagged.append((last[lane], int(lane), i))
    return [queued[i] for _, _, i in sorted(tagged)]


def test_lanes_are_served_in_weighted_order_under_contention(paths):
    p = paths(workers=1)
    gate = Gate(p)                                   # background, 1 MiB: V becomes 1 MiB / 0.01
    order: list[tuple[Lane, int]] = []
    rng = random.Random(5)
    queued = [(rng.choice(LANES), rng.choice((MiB // 4, MiB, 2 * MiB))) for _ in range(80)]
    futures = [p.submit(lane, n, lambda lane=lane, n=n: order.append((lane, n))) for lane, n in queued]
    gate.open()
    for f in futures:
        f.result(5)
    last = {la: 0.0 for la in LANES}
    last[Lane.BACKGROUND] = MiB / SHARES[Lane.BACKGROUND]
    assert order == expected_order(queued, MiB / SHARES[Lane.BACKGROUND], last)
    crit = [i for i, (lane, _) in enumerate(order) if lane == Lane.CRITICAL]
    assert crit == list(range(len(crit)))            # with these sizes every critical transfer goes first


def test_fifo_policy_serves_in_arrival_order(paths):
    p = paths(workers=1, policy="fifo")
    gate = Gate(p)
    order: list[int] = []
    lanes = [Lane.BACKGROUND, Lane.CRITICAL, Lane.PREFETCH, Lane.CRITICAL, Lane.STORE]
    futures = [p.submit(lane, MiB, lambda i=i: order.append(i)) for i, lane in enumerate(lanes)]
    gate.open()
    for f in futures:
        f.result(5)
    assert order == [0, 1, 2, 3, 4]


def test_every_lane_keeps_its_minimum_share_over_a_long_contended_run(paths):
    """All four lanes stay backlogged (each completion queues the next transfer of its lane, with a seeded random
    size); over 6000 transfers each lane's share of the bytes is its configured share."""
    p = paths(workers=1)
    rng = random.Random(11)
    moved = {la: 0 for la in LANES}
    total = [0]
    done = threading.Event()

    def submit(lane: Lane) -> None:
        n = rng.randrange(64 << 10, 2 * MiB, 4096)
        p.submit(lane, n, lambda: None, on_done=lambda f, lane=lane, n=n: finished(lane, n))

    def finished(lane: Lane, n: int) -> None:
        moved[lane] += n
        total[0] += 1
        if total[0] >= 6000:
            done.set()
        else:
            submit(lane)

    gate = Gate(p)
    for lane in LANES:
        for _ in range(8):
            submit(lane)
    gate.open()
    assert done.wait(60)
    all_bytes = sum(moved.values())
    for lane in LANES:
        assert moved[lane] / all_bytes == pytest.approx(SHARES[lane], rel=0.15), (lane, moved)


def test_an_idle_lane_lends_its_share(paths):
    """Only background has work: it gets the whole path, not 1% of it."""
    p = paths(workers=2)
    futures = [p.submit(Lane.BACKGROUND, MiB, lambda: None) for _ in range(50)]
    for f in futures:
        f.result(5)
    assert p.stats()["lanes"]["background"]["transfers"] == 50


def test_a_critical_transfer_always_finds_a_worker(paths):
    """Lower lanes hold at most workers - 1 workers: with one held by background, a second background transfer
    waits while a critical one runs on the other worker at once."""
    p = paths(workers=2)
    g1 = Gate(p, Lane.BACKGROUND)
    second = p.submit(Lane.BACKGROUND, MiB, lambda: None)
    crit = p.submit(Lane.CRITICAL, MiB, lambda: "served")
    assert crit.result(5) == "served"                # while background still holds its one worker
    assert not second.done()                         # the second background transfer waits for a lower slot
    g1.open()
    second.result(5)


def test_a_full_lane_refuses_at_once_and_other_lanes_still_queue(paths):
    p = paths(workers=1, queue_limits={Lane.CRITICAL: 4, Lane.STORE: 4, Lane.PREFETCH: 2, Lane.BACKGROUND: 4})
    gate = Gate(p)
    p.submit(Lane.PREFETCH, MiB, lambda: None)
    p.submit(Lane.PREFETCH, MiB, lambda: None)
    assert p.room(Lane.PREFETCH) == 0
    with pytest.raises(Busy, match="prefetch lane's queue is full"):
        p.submit(Lane.PREFETCH, MiB, lambda: None)
    ok = p.submit(Lane.CRITICAL, MiB, lambda: 1)
    gate.open()
    assert ok.result(5) == 1
    s = p.stats()["lanes"]
    assert s["prefetch"]["rejected"] == 1 and s["critical"]["rejected"] == 0


def test_cancel_drops_queued_transfers_by_tag(paths):
    p = paths(workers=1)
    gate = Gate(p)
    ran: list[str] = []
    keep = p.submit(Lane.PREFETCH, MiB, lambda: ran.append("a"), tag=b"a")
    drop = p.submit(Lane.PREFETCH, MiB, lambda: ran.append("b"), tag=b"b")
    assert p.cancel(b"b") == 1
    assert p.cancel(b"nothing") == 0
    gate.open()
    keep.result(5)
    with pytest.raises(CancelledError):
        drop.result(5)
    assert ran == ["a"]
    s = p.stats()["lanes"]["prefetch"]
    assert (s["cancelled"], s["transfers"], s["queued"]) == (1, 1, 0)


def test_escalate_moves_a_queued_prefetch_ahead_of_background(paths):
    p = paths(workers=1)
    gate = Gate(p)
    order: list[str] = []
    futures = [p.submit(Lane.BACKGROUND, MiB, lambda i=i: order.append(f"bg{i}")) for i in range(3)]
    futures.append(p.submit(Lane.PREFETCH, MiB, lambda: order.append("wanted"), tag=b"k"))
    futures.append(p.submit(Lane.CRITICAL, MiB, lambda: order.append("crit")))
    assert p.escalate(b"k", Lane.CRITICAL) == 1
    gate.open()
    for f in futures:
        f.result(5)
    assert order[:2] == ["crit", "wanted"]
    assert p.stats()["lanes"]["prefetch"]["escalated"] == 1


def test_failures_reach_the_producer_and_are_counted(paths):
    p = paths(workers=1)

    def boom() -> None:
        raise OSError(5, "Input/output error")
    f = p.submit(Lane.CRITICAL, MiB, boom)
    with pytest.raises(OSError, match="Input/output"):
        f.result(5)
    p.submit(Lane.CRITICAL, MiB, lambda: None).result(5)
    s = p.stats()["lanes"]["critical"]
    assert (s["transfers"], s["failed"], s["bytes"]) == (2, 1, MiB)


def test_stats_count_every_transfer_and_its_bytes(paths):
    p = paths(workers=2)
    sizes = {Lane.CRITICAL: [MiB] * 5, Lane.STORE: [4096] * 3, Lane.BACKGROUND: [2 * MiB] * 2}
    futures = [p.submit(lane, n, lambda: None) for lane, ns in sizes.items() for n in ns]
    for f in futures:
        f.result(5)
    s = p.stats()
    for lane, ns in sizes.items():
        row = s["lanes"][lane.label]
        assert (row["transfers"], row["bytes"], row["queued"], row["in_flight"]) == (len(ns), sum(ns), 0, 0)
        assert row["latency"]["count"] == len(ns) and row["wait"]["count"] == len(ns)
    assert s["lanes"]["prefetch"]["transfers"] == 0


def test_expected_time_grows_with_the_queue_ahead_and_the_chooser_takes_the_shorter(paths):
    busy = paths(workers=1, nominal_bps=1e9)
    idle = paths(workers=1, nominal_bps=0.5e9)
    gate = Gate(busy)
    for _ in range(10):
        busy.submit(Lane.CRITICAL, 2 * MiB, lambda: None)
    # 20 MiB of critical work queued on the fast path: the idle path at half the speed finishes a 2 MiB read first
    assert busy.expected_s(2 * MiB, Lane.CRITICAL) > idle.expected_s(2 * MiB, Lane.CRITICAL)
    assert choose([(busy, 2 * MiB), (idle, 2 * MiB)], Lane.CRITICAL) == 1
    # background queued work barely delays a critical read: its share is 1%
    bg = paths(workers=1, nominal_bps=1e9)
    gate2 = Gate(bg)
    for _ in range(10):
        bg.submit(Lane.BACKGROUND, 2 * MiB, lambda: None)
    assert bg.expected_s(2 * MiB, Lane.CRITICAL) < busy.expected_s(2 * MiB, Lane.CRITICAL) / 2
    assert bg.expected_s(2 * MiB, Lane.BACKGROUND) > bg.expected_s(2 * MiB, Lane.CRITICAL)
    # equal paths: the first listed (the local one) wins the tie
    assert choose([(idle, MiB), (paths(workers=1, nominal_bps=0.5e9), MiB)], Lane.CRITICAL) == 0
    gate.open()
    gate2.open()


def test_slow_device_model_is_seeded():
    a, b = SlowDevice(1e12, seed=3), SlowDevice(1e12, seed=3)
    assert [a._rng.random() for _ in range(5)] == [b._rng.random() for _ in range(5)]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="policy"):
        Path("x", policy="lifo")
    with pytest.raises(ValueError, match="share above 0"):
        Path("x", shares={Lane.CRITICAL: 1.0, Lane.STORE: 0, Lane.PREFETCH: 0.1, Lane.BACKGROUND: 0.1})
    assert parse_lane("Prefetch") == Lane.PREFETCH
    with pytest.raises(ValueError, match="unknown lane"):
        parse_lane("urgent")


def test_closing_cancels_what_is_queued(paths):
    p = paths(workers=1)
    gate = Gate(p)
    queued: Future = p.submit(Lane.STORE, MiB, lambda: None)
    threading.Timer(0.05, gate.open).start()
    p.close()
    assert queued.cancelled()
    with pytest.raises(RuntimeError, match="closed"):
        p.submit(Lane.STORE, MiB, lambda: None)


def test_a_running_lower_transfer_yields_to_critical_at_its_checkpoints(paths):
    """A background transfer that reaches a checkpoint while a critical transfer runs waits until that transfer
    is done (counted as paused); a critical transfer's own checkpoint never waits, nor does one under fifo."""
    p = paths(workers=2)
    p.pause_max_s = 30.0                                 # longer than the test: only the critical's end resumes it
    events: list[str] = []
    started, go = threading.Event(), threading.Event()

    def background() -> None:
        events.append("bg piece 1")
        started.set()
        go.wait(10)
        p.checkpoint()
        events.append("bg piece 2")

    bg = p.submit(Lane.BACKGROUND, MiB, background)
    assert started.wait(5)
    crit = Gate(p, Lane.CRITICAL)                        # a critical read arrives and holds the device
    go.set()
    tick = threading.Event()
    while p.stats()["lanes"]["background"]["paused"] == 0:
        tick.wait(0.001)
    assert events == ["bg piece 1"]                      # paused at its checkpoint while the critical runs
    events.append("critical done")
    crit.open()
    bg.result(timeout=5)
    assert events == ["bg piece 1", "critical done", "bg piece 2"]
    assert p.stats()["lanes"]["background"]["paused"] == 1
    assert p.submit(Lane.CRITICAL, MiB, p.checkpoint).result(timeout=5) is None      # critical: no wait
    p.checkpoint()                                       # outside a worker: returns at once
    f = paths(workers=2, policy="fifo")
    g = Gate(f, Lane.CRITICAL)
    f.submit(Lane.BACKGROUND, MiB, f.checkpoint).result(timeout=5)                    # fifo: no lanes, no wait
    g.open()
    assert f.stats()["lanes"]["background"]["paused"] == 0
