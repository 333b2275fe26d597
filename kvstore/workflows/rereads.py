"""Which of an active workflow's blocks its own later calls will not read again, learned per (type, agent, touches).

Why (issue 34): the workflow policy prices an active workflow's blocks by its lookahead under the prefix-sharing
convention (every later call rereads what an earlier one touched), and most of what still separates it from
Belady on agent traces is blocks the convention keeps for a workflow that is done with them. A map-reduce worker's
prompt is read twice (its read, then its check) and never again; a coding agent's failed attempt is dropped when the
next attempt starts from the plan. Measured offline (bench/agent_families, the workflow policy told by an oracle
which active blocks their workflows never touch again): the map-reduce 50% pool goes from 27% to 79% of the
LRU→Belady gap, the held-out debate family's 25% pool from 33% to 67%, coding's 50% pool from 38% to 57%.

What a framework's hints carry at call time says it too, learned online: a block's class is its workflow's type,
the agent whose call touched it last, whether that call extends the whole chain of an earlier call of the workflow
(`Workflows.chain`, from the keys a lookup or get asks for with its context: a tool loop's next turn and a worker's
check of its own read do; a fresh branch from a shared head does not), and how many of the workflow's calls touched
it (`k`, up to K_MAX). Without the third, a worker's check (whose new blocks nothing reads again) and its read (whose
new blocks the check reads) were one class, alive on average (offline, mapreduce at 50%: 34/61/52% of the gap over
seeds 1–3 without it, 79/85/69% with it). Each
block a workflow touched resolves once per class it passes through — read again by a later call of the same
workflow (a success, and the block moves to class k+1), or never (a failure, counted when the workflow ends) — so
the estimate does not depend on what the pool kept: the books follow keys, not residency (an evicted block read
again is a success). P(class) = (successes + PRIOR) / (resolved + PRIOR): the convention (1) until counts say
otherwise; counts halve once HALF_AT were resolved since the last halving, so they follow the traffic.

Only a class measured *dead* changes anything (`worth`: P below DEAD_BELOW, else 1): a graded P orders a chain's
blocks against their own prefix — a debate agent's early transcript, touched by more of its rounds, looks less
likely to be read again than its last turn, though every later round reads both — and evicting a prefix's head
before its tail loses the tail with it (tried: the held-out debate family's 25% pool fell from 33% to 18%). Dead
classes are ones no later call reads (the worker's checked prompt, k = 2), where order does not matter.

Bounded: MAX_PER_WORKFLOW keys a workflow, MAX_PER_TENANT a tenant (so one tenant's workflows cannot use up the
books for another's) and MAX_KEYS over all; beyond them a block is untracked (the convention's 1). Classes are at
most `max_classes` (the oldest-made goes), keyed by tenant: one tenant's traffic never makes another's class dead.
KEY_BYTES is the estimate of one tracked key.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstore.workflows.books import Touch, Workflow

K_MAX = 8                   # touches counted per block (a class for 8 and more)
PRIOR = 4.0                 # pseudo-successes: a class is the convention's until measured
DEAD_BELOW = 0.2            # a class read again less often than this is dead for its workflow
HALF_AT = 4096.0            # resolved blocks between halvings of a class's counts
MAX_PER_WORKFLOW = 1 << 14
MAX_KEYS = 1 << 18
MAX_PER_TENANT = 1 << 16
KEY_BYTES = 120             # a tracked key: its dict slot, the packed int, the key's share (tracemalloc: ~110)
CLASS_BYTES = 400           # a class: its tuple key (type and agent strings shared with the books) and counts


class Rereads:
    """The books above: per active workflow, its keys' classes; per class, successes and resolved blocks."""
    __slots__ = ("max_classes", "_keys", "_classes", "_tracked", "_by_tenant")

    def __init__(self, max_classes: int = 4096) -> None:
        self.max_classes = max_classes
        self._keys: dict[str, dict[bytes, tuple[int, str, bool, int]]] = {}   # wid → key → (k, last agent, its
                                                                               # call extends, its step)
        self._classes: dict[tuple[str, str, str, bool, int], list[float]] = {}   # (tenant, type, agent,
                                                                                  # extends, k) → [s, n]
        self._tracked = 0
        self._by_tenant: dict[str, int] = {}                       # tenant → keys tracked

    def seen(self, w: Workflow, touch: Touch, key: bytes) -> None:
        """A call of `w` (`touch`) touched `key` — read, stored, or left out by a full pool."""
        keys = self._keys.get(w.wid)
        if keys is None:
            keys = self._keys[w.wid] = {}
        got = keys.get(key)
        if got is None:
            mine = self._by_tenant.get(w.tenant, 0)
            if len(keys) < MAX_PER_WORKFLOW and mine < MAX_PER_TENANT and self._tracked < MAX_KEYS:
                keys[key] = (1, touch.agent, w.extends, w.steps)
                self._tracked += 1
                self._by_tenant[w.tenant] = mine + 1
            return
        k, agent, extends, step = got
        if step == w.steps:                         # the same call again (a get, then the put of its chain)
            keys[key] = (k, touch.agent, w.extends, step)
            return
        self._count(w, agent, extends, k, 1.0)
        keys[key] = (min(k + 1, K_MAX), touch.agent, w.extends, w.steps)

    def ended(self, w: Workflow) -> None:
        """`w` ended (or was retired): every class its keys are in resolves as never read again."""
        keys = self._keys.pop(w.wid, None)
        if not keys:
            return
        self._tracked -= len(keys)
        left = self._by_tenant.get(w.tenant, 0) - len(keys)
        if left > 0:
            self._by_tenant[w.tenant] = left
        else:
            self._by_tenant.pop(w.tenant, None)
        for k, agent, extends, _ in keys.values():
            self._count(w, agent, extends, k, 0.0)

    def worth(self, w: Workflow, key: bytes) -> float:
        """The share of `w`'s lookahead value `key` keeps: its class's P if the class is dead, else 1."""
        keys = self._keys.get(w.wid)
        got = keys.get(key) if keys is not None else None
        if got is None:
            return 1.0
        c = self._classes.get((w.tenant, w.wtype, got[1], got[2], got[0]))
        if c is None:
            return 1.0
        p = (c[0] + PRIOR) / (c[1] + PRIOR)
        return p if p < DEAD_BELOW else 1.0

    def _count(self, w: Workflow, agent: str, extends: bool, k: int, success: float) -> None:
        ck = (w.tenant, w.wtype, agent, extends, k)
        c = self._classes.get(ck)
        if c is None:
            if len(self._classes) >= self.max_classes:
                del self._classes[next(iter(self._classes))]
            c = self._classes[ck] = [0.0, 0.0]
        c[0] += success
        c[1] += 1.0
        if c[1] >= 2 * HALF_AT:
            c[0] /= 2
            c[1] /= 2

    def bytes(self) -> int:
        """The estimate of the books' bytes."""
        return self._tracked * KEY_BYTES + len(self._classes) * CLASS_BYTES

    def __len__(self) -> int:
        return self._tracked


__all__ = ["DEAD_BELOW", "Rereads"]
