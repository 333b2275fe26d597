"""The books the index's parts share: one `Books`, made by `open_books` and handed to each part at construction
(kvstore.index.books composes them). Plain state: it decides nothing, and each part binds the containers it uses
once, so that its hot loops read them as before.

- `pool` (kvstore.tiers.host) and `table` (kvstore.index.keytable): which key lives in which slot, both ways.
- `pins` (gid → pins across connections, and the eviction sink's holds) and `zombies` (deleted or evicted while
  pinned: freed at the last unpin), which the capacity parts honour and the request parts take and drop.
- `pending` (reserved keys → gid), `promoting`/`cancelled` (promotions in flight, and those a delete overtook),
  `deleting` (keys a delete is taking out of the lower tiers): the request parts' books, read by the movers too.
- `moving` (lent segments still being emptied by drain steps) and `compacting` (the segment a compaction empties).
- `policy` (kvstore.policy, the host pool's; per tenant where tenants chose their own), `quotas`
  (kvstore.index.quotas), `namespaces` (kvstore.index.namespaces), `workflows` (the hints' books), `counters`,
  `on_evict` (the eviction sink: the demotion mover), `coupled` (pool.pair_eviction), and the recency `clock`.
"""
from __future__ import annotations

import bisect
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstore.index.keytable import KeyTable
from kvstore.index.namespaces import Namespaces
from kvstore.index.quotas import Quotas
from kvstore.policy import EvictionPolicy, make_policy
from kvstore.policy.tenants import PerTenantPolicy
from kvstore.tiers.host import HostPool, Segment, split_gid
from kvstore.workflows import Workflows

if TYPE_CHECKING:
    from kvstore.index.capacity import EvictionSink

CLOCK_SAMPLE_S = 0.05      # how finely the recency clock is mapped to time


class RecencyClock:
    """Recency across sizes: advances per commit and acquire; a slot's `used` is the clock at its last use. When the
    clock moved is noted every CLOCK_SAMPLE_S, so that a block's last use can be told in time (`used_at`: the
    lending window of kvstore.index.quotas)."""
    __slots__ = ("now", "_times", "_quotas")

    def __init__(self, quotas: Quotas) -> None:
        self.now = 1
        self._times: deque[tuple[int, float]] = deque([(1, time.monotonic())])   # when the clock was where
        self._quotas = quotas

    def advance(self) -> None:
        """The clock moves on (a commit or an acquire); samples older than twice the lending window are dropped."""
        self.now += 1
        now = time.monotonic()
        times = self._times
        if now - times[-1][1] >= CLOCK_SAMPLE_S:
            times.append((self.now, now))
            horizon = now - 2 * self._quotas.window_s
            while len(times) > 2 and times[1][1] < horizon:
                times.popleft()

    def used_at(self, clock: int) -> float:
        """About when (time.monotonic(), within CLOCK_SAMPLE_S) the clock stood at `clock`; a clock older than the
        samples kept (twice the lending window) is answered with the oldest sample's time."""
        times = self._times
        i = bisect.bisect_right(times, clock, key=lambda t: t[0])
        return times[max(0, i - 1)][1]


@dataclass(slots=True, eq=False)
class Books:
    """The shared books (see the module docstring). Containers are never replaced, only changed in place."""
    pool: HostPool
    quotas: Quotas                      # tenants' guarantees and lending
    on_evict: EvictionSink | None       # where evicted blocks are handed (the demotion mover)
    table: KeyTable
    workflows: Workflows                # the hints' books (the daemon's)
    namespaces: Namespaces
    policy: EvictionPolicy
    counters: Counter[str]
    clock: RecencyClock
    promoting: set[bytes] = field(default_factory=set)          # keys being read from a lower tier into a slot
    cancelled: set[bytes] = field(default_factory=set)          # ... and deleted meanwhile: never published
    pending: dict[bytes, int] = field(default_factory=dict)     # reserved keys (any connection) → gid
    deleting: Counter[bytes] = field(default_factory=Counter)   # keys a delete is taking out of the lower tiers
    pins: Counter[int] = field(default_factory=Counter)         # gid → pins across connections (and the sink's)
    zombies: dict[int, bytes] = field(default_factory=dict)     # deleted or evicted while pinned: gid → key
    moving: deque[Segment] = field(default_factory=deque)       # lent segments still being emptied, oldest first
    coupled: bool = False                                       # pool.pair_eviction coupled: residuals go along
    compacting: Segment | None = None   # a segment whose blocks a compaction moves out (released by its retire)


def open_books(pool: HostPool, policy: str, on_evict: EvictionSink | None, counters: Counter[str] | None,
               workflows: Workflows | None, quotas: Quotas | None, tenant_policies: dict[str, str]) -> Books:
    """Empty books over `pool`, with the host pool's policy: `policy` for all, or — where tenants chose others
    (`tenants[].policy`) — one instance per policy named, each tenant's classes routed to its own
    (kvstore.policy.tenants)."""
    table = KeyTable()
    workflows = workflows if workflows is not None else Workflows()
    namespaces = Namespaces()
    quotas = quotas if quotas is not None else Quotas(pool)

    def key_at(gid: int) -> bytes | None:
        """The key of the block in a slot (the policy's way back from a gid)."""
        return pool.segments[gid >> 32].keys[gid & 0xFFFFFFFF]

    def make(name: str) -> EvictionPolicy:
        return make_policy(name, table, workflows, key_at, lambda seg: pool.segments[seg].nslots)

    chosen = {t: p for t, p in tenant_policies.items() if p and p != policy}
    if chosen:
        policies = {name: make(name) for name in {policy, *chosen.values()}}
        host_policy: EvictionPolicy = PerTenantPolicy(table, policies, chosen, policy,
                                                      namespaces.class_tenants.__getitem__)
    else:
        host_policy = make(policy)
    return Books(pool, quotas, on_evict, table, workflows, namespaces, host_policy,
                 Counter() if counters is None else counters, RecencyClock(quotas))


def seg_slot(pool: HostPool, gid: int) -> tuple[Segment, int]:
    """The segment and slot index of a gid."""
    seg_id, slot = split_gid(gid)
    return pool.segments[seg_id], slot
