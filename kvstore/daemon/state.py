"""The daemon's state, built whole from the configuration at start: the host pool and its index, the lower tiers,
the traffic manager, and the movers — each mover given only the parts it uses. Nothing is filled in later; a part
that the configuration leaves out (no lower tier: no demotion, promotion reads, prefetch or write-through) is None
from the start. The write-through mover exists wherever the first lower tier can say when a block is on disk: it
writes every committed block with ssd.write_through, and the blocks of durable commits and flushes always.

The hints' books are one `Workflows` (st.workflows, kvstore.workflows), read by the index's eviction policy and
fed by `hints` (kvstore.daemon.hints: per tenant, idle retirement); `looked_up` counts distinct keys looked up, for
the hit-rate ceiling (kvstore.hll). `predictive` (kvstore.movers.predictive) prefetches the lower-tier blocks of
workflows expected back soon; None without a lower tier or with prefetch.enabled false.

`lock` guards the books (index, pool, connection count, hints); `changed` (on it) is notified when a promotion or a
prefetch finishes or a mover has work. Ops run under `lock`; block copies never do (see movers.demotion), nor
does a question to the remote store (`remote.probe`).

`remote` is the remote tier where one is configured (also in `lower`); `publisher` (kvstore.movers.publish) puts
committed blocks in it at once where its placement says write-through.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from threading import Condition, Lock

from kvstore.daemon.access import Access
from kvstore.daemon.config import Config
from kvstore.daemon.hints import Hints
from kvstore.daemon.metrics import OpMetrics
from kvstore.hll import HyperLogLog
from kvstore.index import Index
from kvstore.index.quotas import Quotas
from kvstore.movers.demotion import Demotion
from kvstore.movers.predictive import PredictivePrefetch
from kvstore.movers.prefetch import Prefetcher
from kvstore.movers.promotion import Promotion
from kvstore.movers.publish import Publisher
from kvstore.movers.reserve import Reserve
from kvstore.movers.writethrough import WriteThrough
from kvstore.tiers import DurableTier, LowerTiers, SharedTier, TenantBooks, TierContext
from kvstore.tiers.host import HostPool
from kvstore.tiers.registry import STACKED, TIER_TYPES, open_lower_tiers
from kvstore.traffic.manager import TrafficManager
from kvstore.workflows import Workflows


@dataclass(eq=False)
class State:
    config: Config
    lock: Lock
    changed: Condition
    counters: Counter[str]
    pool: HostPool
    index: Index
    traffic: TrafficManager
    lower: LowerTiers
    promotion: Promotion
    demotion: Demotion | None
    prefetcher: Prefetcher | None
    write_through: WriteThrough | None
    workflows: Workflows
    hints: Hints
    predictive: PredictivePrefetch | None
    remote: SharedTier | None = None
    publisher: Publisher | None = None
    looked_up: HyperLogLog = field(default_factory=HyperLogLog)
    metrics: OpMetrics = field(default_factory=OpMetrics)
    connections: int = 0
    started: float = field(default_factory=time.time)
    access: Access = field(init=False)

    def __post_init__(self) -> None:
        self.access = Access(self.config.server)

    def defer_copies(self) -> None:
        """Demotion copies of blocks this thread evicts wait until `copy_deferred` (after the lock)."""
        if self.demotion is not None:
            self.demotion.deferring()

    def copy_deferred(self, done: bool = True) -> None:
        """(Without the lock.) Make this thread's deferred demotion copies, then let go of their slots."""
        copy_deferred(self.demotion, self.index, self.lock, done)


def copy_deferred(demotion: Demotion | None, index: Index, lock: Lock, done: bool = True) -> None:
    """(Without the lock.) The demotion copies this thread owes, then the slots they held are let go (under it);
    also handed to the promotion mover, which must copy before it reads into slots taken by eviction."""
    if demotion is None:
        return
    held = demotion.copy_deferred(done)
    if held:
        with lock:
            index.let_go(held)


def build_state(config: Config) -> State:
    """Open the tiers and wire the movers. A lower tier that cannot start raises (tiers.TierUnavailable)."""
    lock = Lock()
    changed = Condition(lock)
    counters: Counter[str] = Counter()
    traffic = TrafficManager(config.traffic)
    workflows = Workflows(idle_s=config.hints.idle_s)
    ssd_quotas = ({t.name: t.ssd for t in config.tenants if t.ssd}, config.tenancy.default_ssd)
    context = TierContext(traffic, workflows, socket=config.server.socket, quotas={"ssd": ssd_quotas})
    lower = open_lower_tiers({name: config.section(name) for name in (*TIER_TYPES, *STACKED)}, context)
    pool = HostPool(config.pool.capacity, config.pool.segment_bytes, config.pool.small_segment_slots)
    demotion = Demotion(lower.first, pool, counters) if lower else None
    t = config.tenancy
    quotas = Quotas(pool, {x.name: x.host for x in config.tenants}, t.default_host, t.lending, t.window_s,
                    compact_bytes=t.compact_bytes)
    index = Index(pool, config.pool.eviction, demotion, counters, workflows=workflows, quotas=quotas,
                  tenant_policies={t.name: t.policy for t in config.tenants})
    index.coupled = config.pool.pair_eviction == "coupled"
    for tier in lower:                                   # a tier with tenants' books (the SSD's quotas)
        if isinstance(tier, TenantBooks):
            tier.know_tenants(index.namespaces.tenant_of_digest)
    prefetcher = Prefetcher(index, pool, lower, changed, counters) if lower else None
    copy_evicted = partial(copy_deferred, demotion, index, lock, False)
    reserve = Reserve(index, pool, lock, counters, config.ssd.promote_reserve if demotion is not None else 0,
                      demotion.deferring if demotion is not None else _nothing, copy_evicted)
    remote = lower.shared
    promotion = Promotion(index, pool, lower, lock, changed, copy_evicted,
                          prefetcher.escalate if prefetcher is not None else _no_flight, reserve.kick,
                          remote, counters)
    publisher = None
    if remote is not None and remote.write_through:
        publisher = Publisher(index, pool, remote, changed, counters, config.remote.staging_bytes)
    predictive = None
    if prefetcher is not None and config.prefetch.enabled:
        predictive = PredictivePrefetch(config.prefetch, workflows, index, pool, lower, prefetcher, lock,
                                        copy_evicted)
    write_through = None
    durable = next((t for t in lower if isinstance(t, DurableTier)), None) if lower else None
    if durable is not None:                              # durable commits and flushes, even without write_through
        write_through = WriteThrough(index, pool, durable, changed, counters, config.ssd.staging_bytes,
                                     enabled=config.ssd.write_through, synced=config.ssd.sync != "never",
                                     pin_cap=int(config.pool.capacity * config.server.max_reserved_fraction))
    hints = Hints(workflows, config.hints, on_call=predictive.called if predictive is not None else None,
                  prefetch_stats=predictive.stats if predictive is not None else None)
    return State(config, lock, changed, counters, pool, index, traffic, lower, promotion, demotion, prefetcher,
                 write_through, workflows, hints, predictive, remote, publisher)


def _no_flight(key: bytes) -> bool:
    return False


def _nothing() -> None:
    return None
