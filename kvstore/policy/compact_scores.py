"""The compact workflow policy's ranking of its groups (kvstore.policy.compact): which group's head goes next.

Why apart: compact.py keeps the books — rows, groups and the lists threaded through them, the hooks; this module
only reads them to rank. An active group's score is its workflows' lookahead values plus what its level is worth to
workflows to come (kvstore.policy.workflow's docstring); a retired group is worth its level alone. Active groups are
kept in a heap per class by (score, age) and re-scored only when one of their workflows gets a hint (`_changed`);
the variants whose scores move with the clock (`inherit=False`, `Workflows.timed`, or once popularity was
counted) take a minimum over the class's active groups instead, kept for `pick_s` while nothing changes (`_pick`:
a put's evictions come in a burst). `GroupScores` is mixed into `CompactWorkflowPolicy`, whose state it names
below; it owns the heap, the groups waiting for a score, the hinted workflows and the kept pick.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvstore.policy.rows import NIL, Rows
from kvstore.policy.workflow import shared_value

if TYPE_CHECKING:
    from kvstore.policy.turnover import Turnover
    from kvstore.workflows import Workflow, Workflows
    from kvstore.workflows.popularity import Popularity

__all__ = ["Group", "GroupScores"]


class Group:
    __slots__ = ("id", "cls", "sig", "level", "head", "tail", "size", "seq", "ver", "dead")

    def __init__(self, gid: int, cls: int, sig: frozenset[int] | int, level: int, seq: int,
                 dead: bool = False) -> None:
        self.id, self.cls, self.sig, self.level, self.seq = gid, cls, sig, level, seq
        self.dead = dead            # its blocks' most recent workflow is done with them (workflows.rereads)
        self.head = self.tail = NIL
        self.size = 0
        self.ver = 0                # its entry in the class's heap is the one of this version


class GroupScores:
    """The ranking half of CompactWorkflowPolicy (module docstring)."""
    flows: Workflows
    pop: Popularity
    turnover: Turnover
    rows: Rows
    inherit: bool
    groups: dict[int, Group]
    _active: dict[int, dict[int, Group]]
    _retired_of: dict[int, list[Group | None]]
    _with: dict[int, set[int]]
    _seq: int
    key_at: Callable[[int], bytes | None]

    def init_scores(self, pick_s: float) -> None:
        self._heap: dict[int, list[tuple[float, int, int, Group]]] = {}   # class → (score, seq, ver, group)
        self._unscored: dict[int, set[Group]] = {}                # class → groups made or hinted since
        self._hinted: set[int] = set()                             # workflows hinted since the last re-scoring
        self._picked: dict[int, tuple[Group, int, int, float]] = {}   # class → (group, version, seq, when)
        self.pick_s = pick_s

    def _best_retired(self, cls: int) -> tuple[float, Group] | None:
        """The retired group worth least to workflows to come (the fewest-touched among equals), its worth."""
        best: tuple[float, Group] | None = None
        for g in self._retired_of.get(cls) or ():
            if g is not None:
                worth = shared_value(self.pop, self.flows, g.level)
                if best is None or worth < best[0]:
                    best = (worth, g)
        return best

    def _score(self, g: Group) -> float:
        flows, horizon = self.flows, self.turnover.horizon()
        assert isinstance(g.sig, frozenset)
        if self.inherit:
            key = self.key_at(g.head) if g.dead else None
            if key is not None:
                return (math.fsum(flows.value(flows.nums[n].wid, horizon) * flows.block_worth(flows.nums[n].wid, key)
                                  for n in g.sig) + shared_value(self.pop, flows, g.level))
            return (math.fsum(flows.value(flows.nums[n].wid, horizon) for n in g.sig)
                    + shared_value(self.pop, flows, g.level))
        ch, i = self.rows.linked_row(g.head)
        masks = self.rows.masks_of(ch, i)
        return (math.fsum(flows.agent_value(flows.nums[n].wid, masks.get(n, 0)) for n in g.sig)
                + shared_value(self.pop, flows, g.level))

    def _changed(self, w: Workflow) -> None:
        """A hint about `w`: its value is recomputed, so its groups are re-scored at the next victim of their
        class (then, not now: the value is computed when the reference model would compute it)."""
        self._hinted.add(w.num)

    def _best_active(self, cls: int) -> Group | None:
        """The active group of the class with the lowest score (the oldest such group among equals)."""
        groups = self._active.get(cls)
        if not groups:
            return None
        if not self.inherit or self.flows.timed or self.pop.counted():
            return self._pick(cls, groups)
        if self._hinted:
            for n in self._hinted:
                for x in self._with.get(n, ()):
                    g = self.groups[x]
                    self._unscored.setdefault(g.cls, set()).add(g)
            self._hinted.clear()
        heap = self._heap.setdefault(cls, [])
        fresh = self._unscored.pop(cls, None)
        if fresh:
            if len(heap) > 2 * len(groups) + 64:       # stale entries: start over
                heap.clear()
                fresh = set(groups.values())
            for g in fresh:
                g.ver += 1
                heapq.heappush(heap, (self._score(g), g.seq, g.ver, g))
        while heap:
            _, _, ver, g = heap[0]
            if ver == g.ver and self.groups.get(g.id) is g:
                return g
            heapq.heappop(heap)
        return None

    def _pick(self, cls: int, groups: dict[int, Group]) -> Group:
        """The lowest-scored group when scores move with the clock: a minimum over the class's active groups, kept
        for `pick_s` while no hint came and no group was made (a put's evictions come in a burst: one scan, not
        one per block)."""
        now = self.flows.clock()
        got = self._picked.get(cls)
        if got is not None:
            g, version, seq, at = got
            if (version == self.flows.version and seq == self._seq and now - at < self.pick_s
                    and self.groups.get(g.id) is g):
                return g
        g = min(groups.values(), key=lambda g: (self._score(g), g.seq))
        self._picked[cls] = (g, self.flows.version, self._seq, now)
        return g
