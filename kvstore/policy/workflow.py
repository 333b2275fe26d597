"""Workflow-aware eviction (PBKV §4.2): retired blocks first, then active blocks by their lookahead reuse score.

The engine (or an agent framework) tells the daemon which workflow, agent and session each request belongs to
(hints: `Workflows.begin / call / end`); each block remembers which workflows touched it (`tags`, at most
`tag_budget` of them, the most recent, and how many ever did). Then, when a class is full:

1. **Retired blocks first** — every workflow that touched them has ended (or went idle past `idle_s`), or no hint
   ever named one. Fewest touching workflows first (a block many workflows used, such as a shared system prompt,
   is the likeliest to be used by the next one), least recently used first among equals. Without any hints every
   block is here, and the policy is LRU.
2. **Then active blocks, lowest score first.** A block's score sums, over the active workflows that touched it,
   that workflow's K-step lookahead reuse value: Σ_k γ^(k-1) · s_w(k) · P(step k calls an agent that reuses the
   block), s_w(k) the probability w is still running at step k (predictor.py). Under the prefix-sharing
   convention of agent frameworks (each agent's prompt carries the whole history so far), every later agent of a
   workflow reuses what an earlier one touched: the "later agents inherit" variant of PBKV §5, the default
   (`inherit=False` scores only the agents that touched the block themselves). A chat session is a workflow whose
   every turn reuses its whole history.
   **Timed** (the default): each value is scaled by how soon the workflow is expected back — the mean gap
   between calls over its expected residual wait, E[G − e | G > e], e the time since its last call and G the gaps
   learned per (type, agent) (`predictor.Gaps`). Agents wait on decodes and tools, and those waits are not
   memoryless: the workflow that just called is the least likely to call next, so this is Belady's farthest next
   use, estimated (under memoryless gaps it falls back to the lookahead order).
   Blocks are kept in groups of one signature (the set of active workflows that touched them), each an LRU list:
   a score is computed per group, not per block, and a workflow's step changes the value of its groups only.
3. Within a group, least recently used first: a read touches a prefix's head last, so tails go before heads.
Pinned blocks are never candidates.

**Admission** (`admits`, Belady's bypass): a block coming in with a request's context enters its workflow's group;
the index evicts a victim for it only if the victim's score is at most the workflow's value, else the put stops
there (without a lower tier, where an eviction drops the block for good). So a request never evicts a prefix other
live workflows share, nor a workflow due back sooner, to store blocks worth less (its own chain is kept by the
index: a put never evicts the chain it stores).

Cost: a touch is O(tags); an end re-groups the ended workflow's blocks (each block pays once per tag it got); a
victim costs O(groups of the class) — the active workflows, not the blocks (the compact form keeps a timed pick
for a few milliseconds: a put's evictions come in a burst).

Two forms with one order: `WorkflowPolicy` here keeps dicts per block (the reference model, and the SSD tier's
policy, whose books are dicts already); `kvstore.policy.compact.CompactWorkflowPolicy` keeps fixed rows per host
slot (the host pool's, within the 10-million-block memory budget). tests/policy checks they evict alike.
"""
from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvstore.policy.predictor import END, START, Gaps, TransitionModel, survival

RETIRED = frozenset[str]()
Signature = frozenset[str]


@dataclass(frozen=True, slots=True)
class Touch:
    """The hint context of a request: the workflow (or chat session) and agent it belongs to."""
    workflow: str
    agent: str = ""


@dataclass
class Workflow:
    wid: str
    wtype: str
    agent: str = START
    steps: int = 0
    seen: float = 0.0
    agents: dict[str, int] = field(default_factory=dict)    # agent → its bit in a block's agent mask
    num: int = 0                                             # its number (1..2**32-1) in the compact books' tags


class Workflows:
    """The hints' books: which workflows are active, what each called last, and its lookahead value."""

    def __init__(self, predictor: TransitionModel | None = None, horizon: int = 3, gamma: float = 0.7,
                 idle_s: float = 600.0, clock: Callable[[], float] = time.monotonic, timed: bool = True) -> None:
        self.predictor = predictor or TransitionModel(horizon)
        self.horizon = horizon
        self.gamma = gamma
        self.idle_s = idle_s
        self.clock = clock
        self.active: dict[str, Workflow] = {}
        self.ignored = 0                        # hints about unknown workflows, counted and dropped
        self._value: dict[str, float] = {}
        self.gaps = Gaps()                      # seconds between a workflow's calls, per (type, agent)
        self.timed = timed                      # weigh each value by how soon the workflow is expected back
        self.nums: dict[int, Workflow] = {}                   # the active workflows by number
        self.version = 0                                        # bumps with every hint that may change a value
        self.retire_hooks: list[Callable[[Workflow], None]] = []   # each policy's: a workflow ended (already out
        self._next_num = 0                                      # of `active` and `nums`)
        self.change_hooks: list[Callable[[Workflow], None]] = []   # each policy's: the workflow's value may change

    def begin(self, wid: str, wtype: str = "") -> Workflow:
        w = self.active.get(wid)
        if w is None:
            self._next_num = self._next_num % 0xFFFFFFFF + 1      # 32-bit, never 0 (an empty tag)
            w = self.active[wid] = self.nums[self._next_num] = Workflow(wid, wtype, seen=self.clock(),
                                                                          num=self._next_num)
            self._value.pop(wid, None)
            self.version += 1
        return w

    def call(self, wid: str, agent: str, wtype: str = "") -> Workflow:
        """Agent `agent` of workflow `wid` is invoked (a workflow not begun yet begins here)."""
        w = self.begin(wid, wtype)
        self.predictor.called(wid, w.wtype, w.agent, agent)
        now = self.clock()
        if w.steps:
            self.gaps.observe(w.wtype, w.agent, now - w.seen)
        w.agent = agent
        w.steps += 1
        w.seen = now
        w.agents.setdefault(agent, len(w.agents))
        self._value.pop(wid, None)
        self.version += 1
        for hook in self.change_hooks:
            hook(w)
        return w

    def end(self, wid: str) -> None:
        w = self.active.pop(wid, None)
        if w is None:
            self.ignored += 1
            return
        self.predictor.ended(wid, w.wtype, w.agent)
        self._retire(w)

    def retire(self, wid: str) -> bool:
        """Retire one workflow whose end never came (idle, or one too many): its blocks become retired blocks, and
        the predictor learns no end. False if it was not active."""
        w = self.active.pop(wid, None)
        if w is None:
            return False
        self._retire(w)
        return True

    def expire(self) -> list[str]:
        """Retire workflows idle for longer than idle_s (their end never came); their ids."""
        now = self.clock()
        idle = [wid for wid, w in self.active.items() if now - w.seen > self.idle_s]
        for wid in idle:
            self._retire(self.active.pop(wid))
        return idle

    def _retire(self, w: Workflow) -> None:
        self.nums.pop(w.num, None)
        self._value.pop(w.wid, None)
        self.version += 1
        for hook in self.retire_hooks:
            hook(w)

    def value(self, wid: str) -> float:
        """The workflow's reuse value for a block every later agent reuses (0 when not active): its K-step lookahead
        Σ γ^(k-1)·P(running at step k); timed (the default), scaled by how soon its next call is expected — the
        mean gap over the expected residual wait (`Gaps`), so Belady's farthest next use is what goes first. A
        workflow whose type has no gaps learned yet counts as due within one mean gap."""
        got = self._value.get(wid)
        if got is None:
            w = self.active.get(wid)
            if w is None:
                return 0.0
            ahead = self.predictor.lookahead(w.wtype, w.agent, self.horizon)
            alive = survival(ahead)
            got = self._value[wid] = sum(self.gamma ** k * alive[k] for k in range(len(alive)))
        if not self.timed:
            return got
        mean = self.gaps.mean
        if mean is None:
            return got
        w = self.active[wid]
        due = self.gaps.residual(w.wtype, w.agent, self.clock() - w.seen)
        return got if due is None else got * mean / (due + 0.05 * mean)

    def expect(self, wid: str) -> tuple[float, float | None]:
        """(p_next, due_s) of an active workflow: the probability that it calls again, and the expected seconds until
        it does given the time since its last call (None while no gaps are learned for its type); (0.0, None) if it
        is not active. For the predictive prefetch."""
        w = self.active.get(wid)
        if w is None:
            return 0.0, None
        p = survival(self.predictor.lookahead(w.wtype, w.agent, 1))[0]
        return p, self.gaps.residual(w.wtype, w.agent, self.clock() - w.seen)

    def agent_value(self, wid: str, mask: int) -> float:
        """The value for a block only the agents in `mask` touched (the plain PBKV score, without inheritance)."""
        w = self.active.get(wid)
        if w is None:
            return 0.0
        names = [a for a, bit in w.agents.items() if mask >> bit & 1]
        ahead = self.predictor.lookahead(w.wtype, w.agent, self.horizon)
        return sum(self.gamma ** k * sum(d.get(a, 0.0) for a in names) for k, d in enumerate(ahead))


def agent_names(w: Workflow, mask: int) -> list[str]:
    """The agents of `w` in a block's agent mask (bit min(agent index, 7): the eighth and later share a bit)."""
    return [a for a, bit in w.agents.items() if mask >> min(bit, 7) & 1]


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
        self.where: dict[bytes, tuple[int, Signature | int]] = {}   # key → (class, group)
        self.groups: dict[int, dict[Signature | int, OrderedDict[bytes, None]]] = {}
        self.pins: set[bytes] = set()

    # ----- the TierPolicy hooks -----
    def added(self, key: bytes, cls: int, touch: Touch | None = None) -> None:
        if key in self.where:
            self.removed(key)
        self.where[key] = (cls, RETIRED)
        self._tag(key, touch)
        self._link(key)

    def accessed(self, key: bytes, touch: Touch | None = None) -> None:
        if key not in self.where:
            return
        self._tag(key, touch)
        if key not in self.pins:
            self._unlink(key)
            self._link(key)

    def removed(self, key: bytes) -> None:
        if key not in self.where:
            return
        if key not in self.pins:
            self._unlink(key)
        self.pins.discard(key)
        del self.where[key]
        self.tags.pop(key, None)
        self.touched.pop(key, None)

    def pinned(self, key: bytes) -> None:
        if key in self.where and key not in self.pins:
            self._unlink(key)
            self.pins.add(key)

    def unpinned(self, key: bytes) -> None:
        if key in self.pins:
            self.pins.discard(key)
            self._link(key)

    def victim(self, cls: int) -> bytes | None:
        groups = self.groups.get(cls)
        if not groups:
            return None
        retired = self.retired_victim(cls)
        if retired is not None:
            return retired
        best: tuple[float, bytes] | None = None
        for sig, keys in groups.items():
            if keys and isinstance(sig, frozenset):
                head = next(iter(keys))
                score = self._score(sig, head)
                if best is None or score < best[0]:
                    best = (score, head)
        return None if best is None else best[1]

    def retired_victim(self, cls: int) -> bytes | None:
        """The next retired block of the class, or None: never an active one (room a prefetch may take)."""
        groups = self.groups.get(cls)
        retired = [g for g in groups if isinstance(g, int) and groups[g]] if groups else None
        return next(iter(groups[min(retired)])) if groups and retired else None

    def admits(self, victim: bytes, touch: Touch) -> bool:
        """Whether to evict `victim` for a block the request `touch` stores: unless the victim is worth more than
        the block coming, which enters the group of `touch`'s workflow alone (Belady's bypass, estimated: the
        block whose next use is expected farthest is not stored). Equals are evicted, least recent first, as LRU
        would: workflows nothing tells apart (one-shot ones whose ends never come, say) must not freeze the pool
        with the first ones' blocks. Without an active workflow, always."""
        if touch.workflow not in self.flows.active or victim not in self.where:
            return True
        group = self.where[victim][1]
        return not isinstance(group, frozenset) or self._score(group, victim) <= self.flows.value(touch.workflow)

    def describe(self, key: bytes) -> dict[str, Any] | None:
        """A block's standing and tags (`kvstore ls --tags`), or None if the policy does not hold it."""
        if key not in self.where:
            return None
        tags = {w: m for w, m in self.tags.get(key, {}).items() if w in self.flows.active}
        standing = "pinned" if key in self.pins else "active" if tags else "retired"
        return {"standing": standing, "workflows": list(tags),
                "agents": {w: agent_names(self.flows.active[w], m) for w, m in tags.items()},
                "touched": self.touched.get(key, 0)}

    # ----- inside -----
    def _score(self, sig: Signature, key: bytes) -> float:
        if self.inherit:                 # fsum: exact, so the same in any order (the compact form sums by number)
            return math.fsum(self.flows.value(w) for w in sig)
        masks = self.tags.get(key, {})
        return math.fsum(self.flows.agent_value(w, masks.get(w, 0)) for w in sig)

    def _tag(self, key: bytes, touch: Touch | None) -> None:
        if touch is None or not touch.workflow:
            return
        w = self.flows.active.get(touch.workflow)
        if w is None:
            return
        tags = self.tags.setdefault(key, {})
        mask = tags.pop(touch.workflow, None)
        if mask is None:
            self.touched[key] = min(255, self.touched.get(key, 0) + 1)
            if len(tags) >= self.budget:                       # the budget: the least recent tag goes
                del tags[next(iter(tags))]
        tags[touch.workflow] = (mask or 0) | (1 << min(w.agents.get(touch.agent, 0), 7))   # 8 bits a tag

    def _group_of(self, key: bytes) -> Signature | int:
        sig = frozenset(w for w in self.tags.get(key, ()) if w in self.flows.active)
        if sig:
            return sig
        return min(self.touched.get(key, 0), self.budget)        # retired: by how many workflows touched it

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
            for sig in [g for g in groups if isinstance(g, frozenset) and w.wid in g]:
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


__all__ = ["END", "Touch", "WorkflowPolicy", "Workflows"]
