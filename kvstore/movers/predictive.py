"""Predictive prefetch (PBKV §4.3, conservative; issue 14 part 4): the daemon promotes, on its own, the lower-tier
blocks of a workflow it expects to call again soon, so that the workflow's next request hits in the host pool
instead of waiting on the SSD.

- **A workflow's blocks** are the chain (namespace, block hashes) of its latest lookup, acquire or reserve naming it
  in the request's context (`saw`), the head of it only (prefetch.max_chain_blocks: prefixes matter, and a block is
  worth nothing without those before it). A request for a part of the chain kept does not shorten it, and the
  batches of one long request (head first, less than BURST_S apart) are put back together
  (`merge_chain`). The chain is forgotten when the workflow retires (ends, goes idle or is one too many):
  memory is bounded by hints.max_workflows × max_chain_blocks × 16 bytes. Measured: a tick with 1000 armed
  workflows whose 4096-block chains are all in the host pool holds the lock ~7 ms (256 of them looked at).
- **Triggers.** A `call` hint with `next` (the caller says who comes next: speculative prefill) prefetches the
  workflow's chain at once. On the server's tick, workflows whose next call is due (`Workflows.expect`: P(it calls
  again) >= prefetch.min_p and the expected wait, learned from the gaps between its type's calls, within
  prefetch.lead_s) are prefetched, most due first. Either way at most once per call: a call hint re-arms it. A
  workflow whose chain is all in the host pool stays armed (nothing was tried). Work per tick is bounded: at most
  SCAN_WORKFLOWS armed workflows looked at (in rotation) and prefetch.blocks_per_tick blocks queued; a run cut
  short by that or by the prefetch lane's bounded queue goes on at the next tick from where it stopped.
- **Where it lands** (never displacing an active block): the chain's blocks held below — the longest prefix
  present in some tier, host blocks and blocks in flight skipped — go into free host space first, then into space
  freed by evicting *retired* blocks (the host policy's `retired_victim`; under LRU, which has none, free space only).
  Blocks beyond that room are skipped (`skipped_no_room`). Reads go through the prefetcher (kvstore.movers.prefetch:
  the prefetch lane, escalated by a get that meets them, cancelled by a delete).
- **Failed predictions.** Blocks land tagged with the workflow's context (its group in the workflow policy), so
  when it ends they are retired blocks, evicted first. A landed block counts as `used` when a get/acquire pins it in
  the slot it landed in; as `wasted` when its workflow retires before that (or a get finds it gone). Reads still
  queued when their workflow retires are cancelled.

Everything here runs under the daemon's state lock. A run that evicted retired blocks lets go of the lock once, to
copy them down (`copy_evicted`) before their slots are reused; it checks the workflow is still there afterwards.
"""
from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from threading import Lock
from typing import Any

from kvstore.index import Index, NamespaceEntry
from kvstore.movers.config import PrefetchConfig
from kvstore.movers.prefetch import LaneFull, Prefetcher
from kvstore.policy import Retiring
from kvstore.protocol import HASH_BYTES
from kvstore.tiers import LowerTiers
from kvstore.tiers.host import HostPool
from kvstore.workflows import Touch, Workflow, Workflows

SCAN_WORKFLOWS = 256        # armed workflows whose timing one tick looks at (the others at the next ticks)
BURST_S = 1.0               # requests of a workflow this close together are batches of one request (`merge_chain`)
SCAN_BLOCKS = 4096          # blocks of a chain past its host prefix one run looks at (the rest at the next tick)
COUNTERS = ("predicted", "predicted_next", "predicted_timed", "queued", "landed", "used", "wasted", "wasted_bytes",
            "cancelled", "failed", "refused_lane_full", "skipped_host", "skipped_no_room", "evicted_retired")


@dataclass(eq=False)
class _Watch:
    """What the daemon keeps of one active workflow for its prefetch."""
    ns: NamespaceEntry
    chain: bytes                        # the block hashes of its latest request, HASH_BYTES each
    agent: str
    armed: bool = False                 # a call came since its last prefetch: the timed trigger may fire
    seen: float = 0.0                   # when a request last named it
    at: int | None = None               # a run in progress: the next block of the chain to look at
    trigger: str = ""                   # what started the run in progress ("next" or "timed")
    queued: set[bytes] = field(default_factory=set)       # index keys of its reads in flight
    landed: dict[bytes, int] = field(default_factory=dict)  # index key → slot it landed in, not used yet


class PredictivePrefetch:
    def __init__(self, cfg: PrefetchConfig, workflows: Workflows, index: Index, pool: HostPool, lower: LowerTiers,
                 prefetcher: Prefetcher, lock: Lock, copy_evicted: Callable[[], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.clock = clock
        self.flows = workflows
        self.index = index
        self.pool = pool
        self.lower = lower
        self.prefetcher = prefetcher
        self.lock = lock                        # the state lock: let go of once per run that evicted
        self.copy_evicted = copy_evicted        # (without the lock) the demotion copies this thread owes
        self.watches: dict[str, _Watch] = {}    # active workflows with a chain
        self.armed: OrderedDict[str, None] = OrderedDict()    # for the timed trigger, in rotation
        self.running: OrderedDict[str, None] = OrderedDict()  # runs to start or go on with at the next tick
        self.owner: dict[bytes, str] = {}       # index key in flight or landed, not used yet → its workflow
        self.counts: Counter[str] = Counter()
        workflows.retire_hooks.append(self._retired)

    # ----- what the daemon tells it -----
    def saw(self, ns: NamespaceEntry, touch: Touch, keys: bytes) -> None:
        """A request naming an active workflow: its keys (a blob of hashes) become the workflow's chain (see
        `merge_chain`: a request's batches are put back together)."""
        now = self.clock()
        w = self.watches.get(touch.workflow)
        if w is None:
            if touch.workflow in self.flows.active:     # armed: it was called (or begun) before this request
                head = keys[:self.cfg.max_chain_blocks * HASH_BYTES]
                self.watches[touch.workflow] = _Watch(ns, head, touch.agent, armed=True, seen=now)
                self.armed[touch.workflow] = None
            return
        burst = w.ns is ns and now - w.seen <= BURST_S
        chain = merge_chain(w.chain if w.ns is ns else b"", keys, burst)
        w.seen = now
        if chain is None:
            return
        w.ns, w.chain, w.agent = ns, chain[:self.cfg.max_chain_blocks * HASH_BYTES], touch.agent
        if w.at is not None:
            w.at = 0                            # a run in progress starts over on the new chain

    def called(self, wid: str, expects_next: bool) -> None:
        """A call hint of an active workflow: re-armed; with `next`, its prefetch runs at once (`run_now`)."""
        w = self.watches.get(wid)
        if w is None:
            return
        w.armed = True
        self.armed[wid] = None
        if expects_next:
            self._start(wid, w, "next")

    def acquired(self, ns: NamespaceEntry, hashes: list[bytes], gids: list[int]) -> None:
        """A get pinned these blocks: those a prefetch landed in the same slots were used."""
        if not self.owner:
            return
        for h, gid in zip(hashes, gids):
            key = ns.key(h)
            wid = self.owner.get(key)
            w = self.watches.get(wid) if wid is not None else None
            if w is None or key not in w.landed:
                continue
            del self.owner[key]
            landed_at = w.landed.pop(key)
            self.counts["used" if landed_at == gid else "wasted"] += 1
            if landed_at != gid:                     # evicted since, and read again on the critical path
                self.counts["wasted_bytes"] += ns.slot_bytes

    # ----- runs -----
    def run_now(self) -> None:
        """(In the op of a `call` hint with `next`.) Start the runs it asked for."""
        self._run_all(self.cfg.blocks_per_tick)

    def tick(self) -> None:
        """(The server's tick.) Go on with runs cut short, then start those of workflows now due."""
        budget = self._run_all(self.cfg.blocks_per_tick)
        if budget <= 0 or self.cfg.lead_s <= 0:
            return
        due: list[tuple[float, str]] = []
        for _ in range(min(len(self.armed), SCAN_WORKFLOWS)):
            wid = next(iter(self.armed))
            self.armed.move_to_end(wid)
            p, wait = self.flows.expect(wid)
            if wait is not None and p >= self.cfg.min_p and wait <= self.cfg.lead_s:
                due.append((wait, wid))
        for _, wid in sorted(due):
            w = self.watches.get(wid)
            if w is not None and w.armed and w.at is None:
                self._start(wid, w, "timed")
        self._run_all(budget)

    def _start(self, wid: str, w: _Watch, trigger: str) -> None:
        w.armed = False
        self.armed.pop(wid, None)
        w.at, w.trigger = 0, trigger
        self.running[wid] = None

    def _run_all(self, budget: int) -> int:
        """Runs in order of arrival until `budget` blocks are queued; the budget left."""
        for wid in list(self.running):
            if budget <= 0:
                break
            w = self.watches.get(wid)
            if w is None or w.at is None:
                self.running.pop(wid, None)
                continue
            budget -= self._run(wid, w, budget)
            if w.at is None:
                self.running.pop(wid, None)
        return budget

    def _run(self, wid: str, w: _Watch, budget: int) -> int:
        """Queue the next blocks of the workflow's chain that fit; the number queued. `w.at` is None once the
        chain is walked to its end (or the run gave up)."""
        assert w.at is not None
        if self.index.namespaces.get(w.ns.id) is not w.ns:
            w.at = None                              # the namespace is gone: nothing to promote into
            return 0
        room = self.prefetcher.room()
        if room <= 0:
            self.counts["refused_lane_full"] += 1    # the lane is full: the run goes on at the next tick
            return 0
        start = w.at
        want, w.at, skipped = self._candidates(w, min(room, budget))
        if not want:
            if w.at is None and w.trigger:
                w.armed = True                       # nothing was below: no prediction was tried
                self.armed[wid] = None
            return 0
        self.counts["skipped_host"] += skipped       # (counted for runs that found blocks below only)
        if w.trigger:
            self.counts["predicted"] += 1
            self.counts["predicted_" + w.trigger] += 1
            w.trigger = ""                           # counted once per run
        fits = self._room_for(w.ns, want)
        if len(fits) < len(want):
            w.at = None                              # no room for more: the run ends here
        if not fits or self.watches.get(wid) is not w:
            return 0
        return self._submit(wid, w, fits, start)

    def _candidates(self, w: _Watch, limit: int) -> tuple[list[bytes], int | None, int]:
        """Up to `limit` blocks of the chain from `w.at` held only below: (them, where to go on — None at the end —,
        blocks passed over as in the host pool or on their way there). The chain stops at a block no tier holds
        (what follows it is no use without it). The host pool's prefix is passed over at once (the common case: a
        workflow whose blocks are all up), then at most SCAN_BLOCKS blocks are looked at."""
        ns, chain, at = w.ns, w.chain, w.at or 0
        n = len(chain) // HASH_BYTES
        idx = self.index
        skipped = idx.host_prefix(ns, chain[at * HASH_BYTES:])
        at += skipped
        end = min(n, at + SCAN_BLOCKS)
        out: list[bytes] = []
        while at < end and len(out) < limit:
            h = chain[at * HASH_BYTES:(at + 1) * HASH_BYTES]
            key = ns.key(h)
            if key in idx.table or key in idx.pending or key in idx.promoting:
                skipped += 1
            elif key in idx.deleting or self.lower.holder(ns.block_id(h)) is None:
                return out, None, skipped
            else:
                out.append(h)
            at += 1
        return out, (at if at < n else None), skipped

    def _room_for(self, ns: NamespaceEntry, want: list[bytes]) -> list[bytes]:
        """The head of `want` that free host space, plus space of retired blocks evicted now, can take."""
        free = free_slots(self.pool, ns.slot_bytes, ns.tenant)
        evicted = 0
        policy = self.index.policy
        victim = policy.retired_victim if isinstance(policy, Retiring) else None     # LRU has no retired blocks
        while free + evicted < len(want) and victim is not None:
            key = victim(ns.cls)
            if key is None:
                break
            evict_block(self.index, key)
            evicted += 1
        self.counts["evicted_retired"] += evicted
        fits = min(len(want), free + evicted)
        self.counts["skipped_no_room"] += len(want) - fits
        if evicted:                                  # their slots are free once their copies are made
            self.lock.release()
            try:
                self.copy_evicted()
            finally:
                self.lock.acquire()
            if self.index.namespaces.get(ns.id) is not ns:
                return []
        return want[:fits]

    def _submit(self, wid: str, w: _Watch, want: list[bytes], start: int) -> int:
        touch = Touch(wid, w.agent)
        try:
            self.prefetcher.submit(w.ns, want, touch, lambda key, gid: self._outcome(wid, key, gid))
        except LaneFull:                             # (room was checked, but the lane is shared)
            self.counts["refused_lane_full"] += 1
            w.at = start                             # tried again at the next tick
            self.running[wid] = None
            return 0
        n = 0
        for h in want:
            key = w.ns.key(h)
            if key in self.prefetcher.flights and key not in self.owner:
                w.queued.add(key)
                self.owner[key] = wid
                n += 1
        self.counts["queued"] += n
        return n

    def _outcome(self, wid: str, key: bytes, gid: int | None) -> None:
        """(Under the state lock, from the prefetcher.) A queued read landed in slot `gid`, or did not (None)."""
        w = self.watches.get(wid)
        if w is None or key not in w.queued:
            if self.owner.get(key) != wid:
                return
            del self.owner[key]                      # its workflow retired while it was read
            if gid is not None:
                self.counts["landed"] += 1
                self._wasted(1, self.pool.segment_of(gid).slot_bytes)
            return
        w.queued.discard(key)
        if gid is None:
            self.owner.pop(key, None)
            self.counts["failed"] += 1
            return
        self.counts["landed"] += 1
        w.landed[key] = gid

    def _retired(self, flow: Workflow) -> None:
        """(A Workflows retire hook.) Its queued reads are cancelled, its landed blocks not used are wasted."""
        w = self.watches.pop(flow.wid, None)
        self.armed.pop(flow.wid, None)
        self.running.pop(flow.wid, None)
        if w is None:
            return
        queued, w.queued = set(w.queued), set()
        self.counts["cancelled"] += self.prefetcher.cancel_keys(queued)
        for key in queued:
            if key not in self.prefetcher.flights:  # cancelled: no outcome will count it
                self.owner.pop(key, None)
        for key in w.landed:
            self.owner.pop(key, None)
        self._wasted(len(w.landed), len(w.landed) * w.ns.slot_bytes)

    def _wasted(self, n: int, nbytes: int) -> None:
        self.counts["wasted"] += n
        self.counts["wasted_bytes"] += nbytes

    # ----- inspection -----
    def stats(self) -> dict[str, Any]:
        """Flat, numbers only (precision None before anything landed): `kvstore stats` workflows.prefetch."""
        out: dict[str, Any] = {k: self.counts[k] for k in COUNTERS}
        out["precision"] = self.counts["used"] / self.counts["landed"] if self.counts["landed"] else None
        out["watched"] = len(self.watches)
        out["in_flight"] = sum(len(w.queued) for w in self.watches.values())
        return out


def merge_chain(chain: bytes, keys: bytes, burst: bool) -> bytes | None:
    """A workflow's chain after a request for `keys`; None to keep it as it is. Clients split a long request into
    batches, head first, so: keys the chain holds already (a part of it, such as one batch or a shorter prefix)
    keep it; keys that begin inside it go on from there; within a burst (`burst`: requests of the workflow less
    than BURST_S apart) other keys are the next batch, after the chain; otherwise they are the workflow's new
    chain."""
    i = _find(chain, keys[:HASH_BYTES]) if keys else -1
    if i >= 0 and chain[i:i + len(keys)] == keys:
        return None
    if i > 0:
        return chain[:i] + keys
    if not burst or i == 0:
        return keys
    return chain + keys


def _find(chain: bytes, h: bytes) -> int:
    """The offset of hash `h` in the chain (on a hash boundary), or -1."""
    i = chain.find(h)
    while i >= 0 and i % HASH_BYTES:
        i = chain.find(h, i + 1)
    return i


def free_slots(pool: HostPool, slot_bytes: int, tenant: str) -> int:
    """Slots of this size the pool can hand out without evicting: free ones in the class's segments and those of
    the segments the cap still allows."""
    cls = pool.classes.get((tenant, slot_bytes))
    free = sum(len(s.free) for s in cls.with_free.values()) if cls is not None else 0
    held = pool.charged_bytes
    more = max(0, pool.capacity - held) // pool.segment_size(slot_bytes)
    return free + more * pool.slots_per_segment(slot_bytes)


def evict_block(index: Index, key: bytes) -> None:
    """Evict one unpinned block (a retired one, for a prefetch's room): handed to the eviction sink (demotion) like
    any eviction."""
    index.evict_block(key)
