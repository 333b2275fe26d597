"""The hints' books (PBKV §4.1): which workflows and chat sessions are active, which agent each called last, how
long each waits between calls, and — from the predictor — each one's lookahead reuse value. The daemon's hint ops
write them (kvstore.daemon.hints); the eviction policies (kvstore.policy.workflow, kvstore.policy.compact), the
predictive prefetch (kvstore.movers.predictive) and the tiers read them. No bytes and no eviction here.

The engine (or an agent framework) says which workflow, agent and session each request belongs to (`begin`,
`call`, `end`); a workflow whose end never comes is retired when idle past `idle_s` (`expire`) or when there are too
many (`retire`). `value(wid)` is the workflow's K-step lookahead Σ γ^(k-1)·P(running at step k), timed by how soon
its next call is expected (predictor.Gaps); `expect(wid)` the probability and due time of its next call. Policies
register `retire_hooks` and `change_hooks` to re-group their blocks when a workflow ends or is called.

Per tenant (issue 29): each tenant's workflows are learned by its own `Model` (a TransitionModel and its Gaps, made
at the tenant's first hint, bounded by `Bounds`), so one tenant's hints never change the lookahead — and so the
eviction order — of another's workflows, nor clear its cached lookaheads. `footprint` sums the books' sizes.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstore.workflows.predictor import START, Gaps, TransitionModel, survival
from kvstore.workflows.rereads import Rereads
from kvstore.workflows.reuse import SelfReuse


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
    tenant: str = ""                                         # whose model learns from it and scores it
    fresh: int = 0                                           # blocks new to it in its current call (reuse.py)
    offered: int = 0                                         # ... in its previous call (counted when this one ends)
    rereads: int = 0                                         # blocks it touched before, read by its current call
    extends: bool = False                                    # its current call's chain holds an earlier call's
                                                             # whole chain (`Workflows.chain`, rereads.py)
    chain_step: int = -1                                     # ... the call whose chain that is,
    chain_len: int = 0                                       # ... its length in keys and its last key,
    chain_tail: bytes = b""
    tails: list[bytes] = field(default_factory=list)        # ... the last keys of its earlier calls' chains


@dataclass(frozen=True, slots=True)
class Bounds:
    """What one tenant's model may keep (kvstore.workflows.predictor's docstring; hints.model_* in the config)."""
    max_keys: int = 4096                 # (type, agent) pairs counted, and gap statistics kept
    max_successors: int = 16             # named successors per pair; the lookahead's agents per step
    max_bytes: int = 4 << 20             # the estimate of the counts' bytes, and of the gaps' (each; an eighth
                                         # of it for the self-reuse books)


@dataclass(slots=True)
class Model:
    """One tenant's predictor, gaps between calls, and how much each type's workflows reread their own blocks."""
    predictor: TransitionModel
    gaps: Gaps
    reuse: SelfReuse = field(default_factory=SelfReuse)


class Workflows:
    """The hints' books: which workflows are active, what each called last, and its lookahead value."""

    def __init__(self, predictor: TransitionModel | None = None, horizon: int = 3, gamma: float = 0.7,
                 idle_s: float = 600.0, clock: Callable[[], float] = time.monotonic, timed: bool = True,
                 bounds: Bounds | None = None) -> None:
        self.bounds = bounds or Bounds()
        self.models: dict[str, Model] = {}      # tenant → its model; "" the default (a predictor given: its)
        if predictor is not None:
            self.models[""] = Model(predictor, Gaps(max_keys=self.bounds.max_keys, max_bytes=self.bounds.max_bytes),
                                    SelfReuse(self.bounds.max_keys, self.bounds.max_bytes // 8))
        self.horizon = horizon
        self.gamma = gamma
        self.idle_s = idle_s
        self.clock = clock
        self.active: dict[str, Workflow] = {}
        self.ignored = 0                        # hints about unknown workflows, counted and dropped
        self._value: dict[str, float] = {}
        self.timed = timed                      # weigh each value by how soon the workflow is expected back
        self.nums: dict[int, Workflow] = {}                   # the active workflows by number
        self.version = 0                                        # bumps with every hint that may change a value
        self.retire_hooks: list[Callable[[Workflow], None]] = []   # each policy's: a workflow ended (already out
        self._next_num = 0                                      # of `active` and `nums`)
        self.change_hooks: list[Callable[[Workflow], None]] = []   # each policy's: the workflow's value may change
        self._mean: tuple[int, float | None] = (-1, None)         # (version, mean gap): `mean_gap`, cached
        self.self_reuse = True                  # scale each value by its type's measured self-reuse (reuse.py)
        self.reread_classes = Rereads(self.bounds.max_keys)   # what each workflow is done with (rereads.py)
        self.dead_blocks = True                 # price those at what their class is read again (rereads.py)

    def model(self, tenant: str = "") -> Model:
        """The tenant's model, made at its first use."""
        m = self.models.get(tenant)
        if m is None:
            b = self.bounds
            m = self.models[tenant] = Model(TransitionModel(self.horizon, b.max_keys, b.max_successors, b.max_bytes),
                                            Gaps(max_keys=b.max_keys, max_bytes=b.max_bytes),
                                            SelfReuse(b.max_keys, b.max_bytes // 8))
        return m

    @property
    def predictor(self) -> TransitionModel:
        """The default tenant's predictor (a daemon's tenants each have their own: `model`)."""
        return self.model().predictor

    @property
    def gaps(self) -> Gaps:
        """The default tenant's gaps between calls."""
        return self.model().gaps

    def begin(self, wid: str, wtype: str = "", tenant: str = "") -> Workflow:
        w = self.active.get(wid)
        if w is None:
            self._next_num = self._next_num % 0xFFFFFFFF + 1      # 32-bit, never 0 (an empty tag)
            w = self.active[wid] = self.nums[self._next_num] = Workflow(wid, wtype, seen=self.clock(),
                                                                          num=self._next_num, tenant=tenant)
            self._value.pop(wid, None)
            self.version += 1
        return w

    def call(self, wid: str, agent: str, wtype: str = "", tenant: str = "") -> Workflow:
        """Agent `agent` of workflow `wid` is invoked (a workflow not begun yet begins here)."""
        w = self.begin(wid, wtype, tenant)
        m = self.model(w.tenant)
        m.predictor.called(wid, w.wtype, w.agent, agent)
        now = self.clock()
        if w.steps:
            m.gaps.observe(w.wtype, w.agent, now - w.seen)
            m.reuse.counted(w.wtype, w.offered, w.rereads)   # the call that ends: what it could reread, and did
            w.offered, w.fresh, w.rereads = w.fresh, 0, 0
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
        self.model(w.tenant).predictor.ended(wid, w.wtype, w.agent)
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
        if w.steps > 1:                                      # its last call: what it could reread, and did
            self.model(w.tenant).reuse.counted(w.wtype, w.offered, w.rereads)
        self.model(w.tenant).predictor.forget(w.wid)
        self.reread_classes.ended(w)
        self.nums.pop(w.num, None)
        self._value.pop(w.wid, None)
        self.version += 1
        for hook in self.retire_hooks:
            hook(w)

    def value(self, wid: str, horizon: float | None = None) -> float:
        """The workflow's reuse value for a block every later agent reuses (0 when not active): its K-step lookahead
        Σ γ^(k-1)·P(running at step k); timed (the default), scaled by how soon its next call is expected. With the
        cache's `horizon` (how long it keeps an unused block: kvstore.policy.turnover), by the workflow's hit
        density — P(next call within the horizon) / E[min(wait, horizon)] (`Gaps.density`), times the mean gap —
        so a workflow likely back soon outranks one surely back later than the cache would keep its blocks
        (bimodal waits: a user who replies at once or leaves for minutes); without it, by the mean gap over the
        expected residual wait (the density's limit for a horizon beyond every gap). A workflow whose type has
        no gaps learned yet counts as due within one mean gap."""
        got = self._value.get(wid)
        if got is None:
            w = self.active.get(wid)
            if w is None:
                return 0.0
            ahead = self.model(w.tenant).predictor.lookahead(w.wtype, w.agent, self.horizon)
            alive = survival(ahead)
            share = self.model(w.tenant).reuse.share(w.wtype) if self.self_reuse else 1.0
            got = self._value[wid] = share * sum(self.gamma ** k * alive[k] for k in range(len(alive)))
        if not self.timed:
            return got
        w = self.active[wid]
        gaps = self.model(w.tenant).gaps
        mean = gaps.mean
        if mean is None:
            return got
        waited = self.clock() - w.seen
        if horizon is not None:
            density = gaps.density(w.wtype, w.agent, waited, horizon)
            return got if density is None else got * mean * density
        due = gaps.residual(w.wtype, w.agent, waited)
        return got if due is None else got * mean / (due + 0.05 * mean)

    def touched(self, w: Workflow, again: bool) -> None:
        """A policy saw workflow `w` touch a block: for the first time, or `again` in a later call (reuse.py)."""
        if again:
            w.rereads += 1
        else:
            w.fresh += 1

    def seen(self, touch: Touch | None, key: bytes) -> None:
        """A policy saw `touch`'s call touch `key` (read, stored, or left out): the rereads' books (rereads.py)."""
        if touch is not None:
            w = self.active.get(touch.workflow)
            if w is not None:
                self.reread_classes.seen(w, touch, key)

    def chain(self, touch: Touch | None, keys: bytes, width: int = 16) -> None:
        """The request of `touch` asks for this chain (a lookup's or a get's keys, `width` bytes each, head first):
        whether its call extends the whole chain of an earlier call of its workflow — a tool loop's next turn, a
        map-reduce worker's check of its own read — or starts a branch of its own (rereads.py keeps the two
        apart). A call's chain is the longest it asked for; its last key is remembered, TAILS of them."""
        w = self.active.get(touch.workflow) if touch is not None else None
        if w is None or not isinstance(keys, bytes) or len(keys) < width:
            return                                          # (a malformed blob is the op's to refuse)
        if w.chain_step != w.steps:                         # the call's first chain
            if w.chain_tail:
                w.tails.append(w.chain_tail)
                del w.tails[:-TAILS]
            w.chain_step, w.chain_len, w.chain_tail, w.extends = w.steps, 0, b"", False
        n = len(keys) // width
        if n > w.chain_len:
            w.chain_len, w.chain_tail = n, bytes(keys[(n - 1) * width:n * width])
            w.extends = any(_holds(keys, t, width) for t in w.tails)

    def block_worth(self, wid: str, key: bytes) -> float:
        """The share of the workflow's value a block keeps: below 1 only where the block's class is measured
        dead for it (rereads.py), 1 with `dead_blocks` off or the workflow not active."""
        w = self.active.get(wid)
        return self.reread_classes.worth(w, key) if w is not None and self.dead_blocks else 1.0

    def mean_gap(self) -> float | None:
        """The mean gap between a workflow's calls over every tenant's model (None before any): the time scale of
        the policies' scores."""
        if self._mean[0] != self.version:
            n = sum(m.gaps.count for m in self.models.values())
            self._mean = (self.version, sum(m.gaps.total for m in self.models.values()) / n if n else None)
        return self._mean[1]

    def stream(self) -> float:
        """The lookahead value of a workflow that never ends, Σ γ^(k-1) over the horizon: what a stream of reuses
        due about one mean gap apart is worth (the popularity term of the policies' scores)."""
        return (1.0 - self.gamma ** self.horizon) / (1.0 - self.gamma) if self.gamma != 1.0 else float(self.horizon)

    def expect(self, wid: str) -> tuple[float, float | None]:
        """(p_next, due_s) of an active workflow: the probability that it calls again, and the expected seconds until
        it does given the time since its last call (None while no gaps are learned for its type); (0.0, None) if it
        is not active. For the predictive prefetch."""
        w = self.active.get(wid)
        if w is None:
            return 0.0, None
        m = self.model(w.tenant)
        p = survival(m.predictor.lookahead(w.wtype, w.agent, 1))[0]
        return p, m.gaps.residual(w.wtype, w.agent, self.clock() - w.seen)

    def alive(self, wid: str) -> list[float]:
        """P(the workflow still runs at each of the next `horizon` steps), from its tenant's model ([] if it is not
        active): what its lookahead says, for `kvstore workflows`."""
        w = self.active.get(wid)
        if w is None:
            return []
        return survival(self.model(w.tenant).predictor.lookahead(w.wtype, w.agent, self.horizon))

    def agent_value(self, wid: str, mask: int) -> float:
        """The value for a block only the agents in `mask` touched (the plain PBKV score, without inheritance)."""
        w = self.active.get(wid)
        if w is None:
            return 0.0
        names = [a for a, bit in w.agents.items() if mask >> bit & 1]
        ahead = self.model(w.tenant).predictor.lookahead(w.wtype, w.agent, self.horizon)
        return sum(self.gamma ** k * sum(d.get(a, 0.0) for a in names) for k, d in enumerate(ahead))


    def footprint(self) -> dict[str, int]:
        """The books' sizes over every tenant: models, their pairs, successors, bytes (estimated: the self-reuse
        books' too), pending predictions, gap keys, and the work counters of their lookaheads
        (kvstore.workflows.predictor)."""
        out = {"models": len(self.models), "active": len(self.active), "gap_keys": 0, "bytes": 0}
        for m in self.models.values():
            for k, v in m.predictor.stats().items():
                out[k] = max(out.get(k, 0), v) if k == "max_expansions" else out.get(k, 0) + v
            out["gap_keys"] += len(m.gaps)
            out["bytes"] += m.gaps.bytes() + m.reuse.bytes()
        out["bytes"] += self.reread_classes.bytes()
        out["reread_keys"] = len(self.reread_classes)
        return out


TAILS = 16              # earlier calls' chain ends a workflow remembers (`Workflows.chain`)


def _holds(keys: bytes, key: bytes, width: int) -> bool:
    """Whether `key` is one of the `width`-byte keys of `keys` (at a key's boundary, not across two)."""
    i = keys.find(key)
    while i >= 0:
        if i % width == 0:
            return True
        i = keys.find(key, i + 1)
    return False


def agent_names(w: Workflow, mask: int) -> list[str]:
    """The agents of `w` in a block's agent mask (bit min(agent index, 7): the eighth and later share a bit)."""
    return [a for a, bit in w.agents.items() if mask >> min(bit, 7) & 1]
