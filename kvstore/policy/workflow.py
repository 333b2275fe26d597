"""Workflow-aware eviction (PBKV §4.2): retired blocks first, then active blocks by their lookahead reuse score.

The engine (or an agent framework) tells the daemon which workflow, agent and session each request belongs to
(hints, booked in kvstore.workflows: `Workflows.begin / call / end`); each block remembers which workflows touched
it (`tags`, at most `tag_budget` of them, the most recent, and how many ever did). Then, when a class is full:

1. **Retired blocks first** — every workflow that touched them has ended (or went idle past `idle_s`), or no hint
   ever named one — unless workflows to come are likely to reuse them (below). Fewest touching workflows first,
   least recently used first among equals. Without any hints every block is here, and the policy is LRU.
   **Workflows to come** (issue 34): a block many workflows used — a system prompt, a shared document, a popular
   retrieved passage — is reused by workflows that have not begun, which no lookahead sees. Each block's level, how
   many workflows touched it (the count up to `tag_budget`, then doublings: popularity.level_of), has a rate of reuse
   by a workflow new to the block, measured online (kvstore.workflows.popularity); a block is worth that rate in the
   units of the lookahead values (`shared_value`: rate × mean gap × the lookahead of a workflow that never ends),
   retired or active. Groups are per (signature, level); the victim is the lowest-worth group's head, retired
   before active among equals. With no block ever reused by a second workflow every rate is 0 and the order is
   PBKV's (retired strictly first).
   A block's count outlives its eviction (kvstore.policy.evicted): stored again, it comes back at its level.
2. **Then active blocks, lowest score first.** A block's score sums, over the active workflows that touched it,
   that workflow's K-step lookahead reuse value: Σ_k γ^(k-1) · s_w(k) · P(step k calls an agent that reuses the
   block), s_w(k) the probability w is still running at step k (kvstore.workflows.predictor). Under the prefix-sharing
   convention of agent frameworks (each agent's prompt carries the whole history so far), every later agent of a
   workflow reuses what an earlier one touched: the "later agents inherit" variant of PBKV §5, the default
   (`inherit=False` scores only the agents that touched the block themselves). A chat session is a workflow whose
   every turn reuses its whole history.
   **Timed** (the default): each value is scaled by how soon the workflow is expected back — the mean gap
   between calls over its expected residual wait, E[G − e | G > e], e the time since its last call and G the gaps
   learned per (type, agent) (`kvstore.workflows.predictor.Gaps`). Agents wait on decodes and tools, and those
   waits are not memoryless: the workflow that just called is the least likely to call next, so this is Belady's
   farthest next use, estimated (under memoryless gaps it falls back to the lookahead order).
   **Self-reuse** (kvstore.workflows.reuse): the convention is measured per workflow type — how often a later call
   rereads what the workflow touched before — and a type that never does (a static pipeline whose stages begin
   with their own role prompts) has its value scaled to nothing: its blocks are worth what they are to others.
   **Blocks a workflow is done with** (kvstore.workflows.rereads): the convention per block — a map-reduce worker's
   prompt, read by its check, is never read again; a coding agent's failed attempt is dropped for the next. Per
   (type, the agent that touched the block last, whether its call extended an earlier call's whole chain, how many
   of the workflow's calls touched it) the books learn how
   often a later call reads such a block again; a class measured dead keeps only that share of the workflow's
   value, and its blocks form a group of their own (the signature's `dead` group), so they go before the
   workflow's live ones however recent. Only dead classes: a graded share would rank a chain's head below its tail.
   Blocks are kept in groups of one signature (the set of active workflows that touched them), each an LRU list:
   a score is computed per group, not per block, and a workflow's step changes the value of its groups only.
3. Within a group, least recently used first: a read touches a prefix's head last, so tails go before heads.
Pinned blocks are never candidates.

**Admission** (`admits`, Belady's bypass): a block coming in with a request's context enters its workflow's group;
the index evicts a victim for it only if the victim's worth is at most the block's (the workflow's value and the
worth of the block's level: one more than the workflows remembered to have touched it, kvstore.policy.evicted),
else the put stops there (without a lower tier, where an eviction drops the block for good). The blocks a put
left out are remembered as touched by its workflow (`refused`): a block refused for one workflow and asked by the
next enters as shared — without that a pool full of blocks worth more never let it in. So a request never evicts
a prefix other live workflows share, nor a workflow due back sooner, to store blocks worth less (its own chain is
kept by the index: a put never evicts the chain it stores).

**Saves of the missed blocks only** (`Namespace.put`, the SGLang backend) must keep the order a whole-chain save
keeps (issue 34: within 5%): such a put does not name the prefix its request hit, so the index cannot protect it,
and it stores the new tail after the get touched the head. `CurrentCalls` remembers what each workflow's current
call read: the policy never evicts those blocks for the same call's deeper ones (`admits`), and refreshes that
prefix, tail first, before its next victim once the call stored blocks behind it — as a whole-chain save would.

**The seam for the no-hint default**: blocks no hint ever named are the retired level-0 group, an LRU list
(`groups[cls][0]` here, `_retired_of[cls][0]` in the compact form); the no-hint default's order
(kvstore.policy.history) belongs there, and nowhere else: hinted blocks keep the order above.

Cost: a touch is O(tags) (and O(1) of popularity books); an end re-groups the ended workflow's blocks (each block
pays once per tag it got); a victim costs O(groups of the class) — the active workflows, not the blocks (the compact
form keeps a timed pick for a few milliseconds: a put's evictions come in a burst).

Two forms with one order: `WorkflowPolicy` here keeps dicts per block (the reference model, and the SSD tier's
policy, whose books are dicts already); `kvstore.policy.compact.CompactWorkflowPolicy` keeps fixed rows per host
slot (the host pool's, within the 10-million-block memory budget). tests/policy checks they evict alike.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from kvstore.policy.current_calls import CurrentCalls
from kvstore.policy.evicted import EvictedTouches
from kvstore.policy.turnover import Turnover
from kvstore.workflows import Touch, Workflow, Workflows, agent_names
from kvstore.workflows.popularity import Popularity, level_of, levels

if TYPE_CHECKING:
    from kvstore.index.keytable import KeyTable
    from kvstore.policy.compact import CompactWorkflowPolicy

RETIRED = frozenset[str]()
Signature = frozenset[str]
Active = tuple[Signature, int, bool]   # an active group: its workflows, its blocks' level (popularity.level_of), and
                                       # whether its most recent workflow is done with them (workflows.rereads)


def host_policy(table: KeyTable, workflows: Workflows | None = None, key_at: Callable[[int], bytes | None] | None
                = None, slots_of: Callable[[int], int] | None = None) -> CompactWorkflowPolicy:
    """The registry's entry for the host pool (kvstore.policy): the compact form, rows per host slot."""
    from kvstore.policy.compact import CompactWorkflowPolicy

    if key_at is None:
        raise ValueError("the workflow policy needs key_at (gid -> key)")
    return CompactWorkflowPolicy(table, workflows or Workflows(), key_at, slots_of)


def tier_policy(workflows: Workflows | None = None) -> WorkflowPolicy:
    """The registry's entry for a lower tier with books of its own: this module's dict form."""
    return WorkflowPolicy(workflows or Workflows())


class WorkflowPolicy:
    """The hierarchical policy (module docstring), in the TierPolicy shape plus the touching context."""
    name = "workflow"

    def __init__(self, workflows: Workflows, tag_budget: int = 4, inherit: bool = True) -> None:
        self.flows = workflows
        self.flows.retire_hooks.append(self._retired)
        self.budget = tag_budget
        self.inherit = inherit
        self.tags: dict[bytes, dict[str, int]] = {}          # key → workflow → agent mask (most recent last)
        self.touched: dict[bytes, int] = {}                  # key → workflows that ever touched it (saturating)
        self.where: dict[bytes, tuple[int, Active | int]] = {}   # key → (class, group)
        self.groups: dict[int, dict[Active | int, OrderedDict[bytes, None]]] = {}
        self.pins: set[bytes] = set()
        self.pop = Popularity(levels(tag_budget), workflows.clock)
        self.calls = CurrentCalls(workflows)
        self.evicted = EvictedTouches(workflows)
        self.turnover = Turnover(workflows.clock)

    # ----- the TierPolicy hooks -----
    def added(self, key: bytes, cls: int, touch: Touch | None = None) -> None:
        if key in self.where:
            self.removed(key)
        self.where[key] = (cls, 0)
        kept = self.evicted.restore(key, touch)
        if kept:
            self.touched[key] = kept
        self._tag(key, touch)
        self.calls.stored(key, touch)
        self.pop.enter(self._level(key))
        self.turnover.stored(sum(self.pop.held))     # the blocks this policy holds (a tenant's, where per tenant)
        self._link(key)

    def accessed(self, key: bytes, touch: Touch | None = None) -> None:
        if key not in self.where:
            return
        before = self.touched.get(key, 0)
        self._tag(key, touch)
        self.calls.read(key, touch)
        if self.touched.get(key, 0) != before:          # a workflow new to it: reuse no lookahead saw coming
            self.pop.touched(level_of(before, self.budget))
            self.pop.leave(level_of(before, self.budget))
            self.pop.enter(self._level(key))
        if key not in self.pins:
            self._unlink(key)
            self._link(key)

    def removed(self, key: bytes) -> None:
        if key not in self.where:
            return
        if key not in self.pins:
            self._unlink(key)
        self.pins.discard(key)
        self.pop.leave(self._level(key))
        del self.where[key]
        tags = self.tags.pop(key, None)
        last = self.flows.active.get(next(reversed(tags))) if tags else None
        self.evicted.record(key, self.touched.pop(key, 0), last, len(self.where))

    def pinned(self, key: bytes) -> None:
        if key in self.where and key not in self.pins:
            self._unlink(key)
            self.pins.add(key)

    def unpinned(self, key: bytes) -> None:
        if key in self.pins:
            self.pins.discard(key)
            self._link(key)

    def victim(self, cls: int) -> bytes | None:
        """The head of the lowest-scored group: retired groups (by level, each worth its reuse by workflows to
        come) before active ones among equals, the fewest-touched retired first, the oldest active."""
        self._refresh()
        groups = self.groups.get(cls)
        if not groups:
            return None
        retired: tuple[float, int] | None = None
        for g in groups:
            if isinstance(g, int) and (retired is None or (self._shared(g), g) < retired):
                retired = (self._shared(g), g)
        best: tuple[float, bytes] | None = None
        for g, keys in groups.items():
            if isinstance(g, tuple):
                head = next(iter(keys))
                score = self._score(g, head)
                if best is None or score < best[0]:
                    best = (score, head)
        if retired is not None and (best is None or retired[0] <= best[0]):
            return next(iter(groups[retired[1]]))
        return None if best is None else best[1]

    def retired_victim(self, cls: int) -> bytes | None:
        """The next retired block of the class, or None: never an active one (room a prefetch may take)."""
        self._refresh()
        groups = self.groups.get(cls)
        retired = [g for g in groups if isinstance(g, int) and groups[g]] if groups else None
        return next(iter(groups[min(retired, key=lambda g: (self._shared(g), g))])) if groups and retired else None

    def admits(self, victim: bytes, touch: Touch | None, key: bytes | None = None) -> bool:
        """Whether to evict `victim` for the block `key` the request `touch` stores: unless the victim is worth more
        than the block coming, which enters the group of `touch`'s workflow alone at its level — one more than the
        workflows remembered to have touched it (kvstore.policy.evicted), 1 for a block never seen (Belady's bypass,
        estimated: the block whose next use is expected farthest is not stored). Equals are evicted, least recent
        first, as LRU would: workflows nothing tells apart (one-shot ones whose ends never come, say) must not
        freeze the pool with the first ones' blocks. Without an active workflow, always."""
        if touch is None or touch.workflow not in self.flows.active or victim not in self.where:
            return True
        if self.calls.mine(victim, touch):
            return False
        group = self.where[victim][1]
        worth = self._score(group, victim) if isinstance(group, tuple) else self._shared(group)
        level = self.evicted.coming_level(key, touch, self.budget)
        return worth <= self.flows.value(touch.workflow, self.turnover.horizon()) + self._shared(level)

    def refused(self, keys: list[bytes], cls: int, touch: Touch) -> None:
        """A put of `touch` left these blocks out (kvstore.policy's `Refusing`): remembered as touched by it."""
        for key in keys:
            self.flows.seen(touch, key)
            if key not in self.where:
                self.evicted.refused(key, touch, len(self.where))

    def describe(self, key: bytes) -> dict[str, Any] | None:
        """A block's standing and tags (`kvstore ls --tags`), or None if the policy does not hold it; `done`: the
        active workflows that are done with it (kvstore.workflows.rereads)."""
        if key not in self.where:
            return None
        tags = {w: m for w, m in self.tags.get(key, {}).items() if w in self.flows.active}
        standing = "pinned" if key in self.pins else "active" if tags else "retired"
        return {"standing": standing, "workflows": list(tags),
                "agents": {w: agent_names(self.flows.active[w], m) for w, m in tags.items()},
                "touched": self.touched.get(key, 0),
                "done": [w for w in tags if self.flows.block_worth(w, key) < 1.0]}

    # ----- inside -----
    def _score(self, group: Active, key: bytes) -> float:
        sig, level, dead = group
        if self.inherit:                 # fsum: exact, so the same in any order (the compact form sums by number)
            flows, horizon = self.flows, self.turnover.horizon()
            if dead:
                return (math.fsum(flows.value(w, horizon) * flows.block_worth(w, key) for w in sig)
                        + self._shared(level))
            return math.fsum(flows.value(w, horizon) for w in sig) + self._shared(level)
        masks = self.tags.get(key, {})
        return math.fsum(self.flows.agent_value(w, masks.get(w, 0)) for w in sig) + self._shared(level)

    def _refresh(self) -> None:
        """Prefixes read before their request stored the rest (CurrentCalls.stale): refreshed tail first."""
        for keys in self.calls.stale():
            for key in reversed(keys):
                if key in self.where and key not in self.pins:
                    self._unlink(key)
                    self._link(key)

    def _shared(self, level: int) -> float:
        """What a block of `level` is worth for the workflows to come (kvstore.workflows.popularity)."""
        return shared_value(self.pop, self.flows, level)

    def _level(self, key: bytes) -> int:
        return level_of(self.touched.get(key, 0), self.budget)

    def _tag(self, key: bytes, touch: Touch | None) -> None:
        if touch is None or not touch.workflow:
            return
        w = self.flows.active.get(touch.workflow)
        if w is None:
            return
        tags = self.tags.setdefault(key, {})
        mask = tags.pop(touch.workflow, None)
        if mask is None or not self.calls.mine(key, touch):
            self.flows.touched(w, mask is not None)
        if mask is None:
            self.touched[key] = min(255, self.touched.get(key, 0) + 1)
            if len(tags) >= self.budget:                       # the budget: the least recent tag goes
                del tags[next(iter(tags))]
        tags[touch.workflow] = (mask or 0) | (1 << min(w.agents.get(touch.agent, 0), 7))   # 8 bits a tag
        self.flows.seen(touch, key)

    def _group_of(self, key: bytes) -> Active | int:
        tags = self.tags.get(key, ())
        sig = frozenset(w for w in tags if w in self.flows.active)
        if sig:
            last = next(w for w in reversed(tags) if w in sig)
            return sig, self._level(key), self.flows.block_worth(last, key) < 1.0
        return self._level(key)                                     # retired: by how many workflows touched it

    def _link(self, key: bytes) -> None:
        cls, _ = self.where[key]
        group = self._group_of(key)
        self.where[key] = (cls, group)
        self.groups.setdefault(cls, {}).setdefault(group, OrderedDict())[key] = None

    def _unlink(self, key: bytes) -> None:
        cls, group = self.where[key]
        keys = self.groups[cls][group]
        keys.pop(key, None)
        if not keys:
            del self.groups[cls][group]

    def _retired(self, w: Workflow) -> None:
        """A workflow ended: its blocks move to the groups of the workflows still active on them (or retired),
        group by group in the order they were made, each from its least recent block (pinned ones at their unpin)."""
        for groups in self.groups.values():
            for sig in [g for g in groups if isinstance(g, tuple) and w.wid in g[0]]:
                for key in list(groups[sig]):
                    self._unlink(key)
                    self._link(key)

    # ----- inspection -----
    def counts(self) -> dict[str, int]:
        """Blocks retired and active (pinned ones aside)."""
        retired = active = 0
        for groups in self.groups.values():
            for g, keys in groups.items():
                if isinstance(g, int):
                    retired += len(keys)
                else:
                    active += len(keys)
        return {"retired": retired, "active": active, "workflows": len(self.flows.active)}

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.where)


def shared_value(pop: Popularity, flows: Workflows, level: int) -> float:
    """A block's worth for the workflows to come, in the units of `Workflows.value`: its level's rate of reuse by
    new workflows times the mean gap between calls, times the lookahead of a workflow that never ends (a stream of
    reuses: `Workflows.stream`; kvstore.workflows.popularity); 0 until both are known."""
    rate = pop.rate(level)
    if not rate:
        return 0.0
    mean = flows.mean_gap()
    return rate * mean * flows.stream() if mean else 0.0


__all__ = ["CurrentCalls", "WorkflowPolicy", "shared_value"]
