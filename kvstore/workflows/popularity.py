"""How often a held block is reused by a workflow that has not touched it yet — the reuse no active workflow's
lookahead can see (a shared document, a system prompt, a popular retrieved passage: the next workflow to use it has
not begun). Measured online per level (how many workflows touched the block so far: `level_of`), so
the eviction policies (kvstore.policy.workflow, .compact) can weigh a block's reuse by workflows to come against
the active workflows' lookahead values, retired blocks included (issue 34: on agent traces with shared documents
most of the LRU→Belady gap is in shared blocks).

    rate(level) = new-workflow touches of held blocks at that level / block-seconds held at that level

Both counts are integrated exactly (`held` changes at O(1) a change: each level keeps its count and when it last
changed) and halved together once `window` touches were counted since the last halving, so the rate follows the
traffic (a window of touches, not of seconds: it needs no time scale). A level whose blocks were never touched by a
second workflow has rate 0: with no sharing, or no hints, nothing changes the policy's order.

The policy turns a rate into its score's units with the mean gap between a workflow's calls (`value`): a workflow
due back in about one mean gap is worth its lookahead (kvstore.workflows.books.Workflows.value), and a block reused
by some new workflow at rate r is worth r · mean gap — both are expected reuses per mean gap.
"""
from __future__ import annotations

from collections.abc import Callable

DOUBLINGS = 2       # levels above the tag budget, each twice as many workflows as the one below


def levels(budget: int) -> int:
    """How many levels a policy with `budget` tags a block keeps: 0..budget, then `DOUBLINGS` more."""
    return budget + 1 + DOUBLINGS


def level_of(touched: int, budget: int) -> int:
    """A block's level from how many workflows touched it: the count itself up to the tag budget, then on a
    doubling scale (budget+1..2·budget, 2·budget+1..4·budget, ... the last level open-ended). Why past the budget:
    a block every workflow uses (a pipeline's stage prompt, a system prompt) and one that four used (a document
    of one task) are reused at very different rates by workflows to come, and one level for both priced them
    alike (bench_policies' families, six families × three seeds: mean gap closed 47.7% → 50.7%, with the pipeline
    and coding families' 10% pools gaining 14–23 points). Doubling, not counting, because a rate needs blocks at
    its level to be measured, and the counts of shared blocks spread out fast."""
    if touched <= budget:
        return touched
    level, top = budget + 1, 2 * budget
    while touched > top and level < budget + DOUBLINGS:
        level, top = level + 1, 2 * top
    return level


class Popularity:
    """Rates of reuse by new workflows, per level (module docstring)."""
    __slots__ = ("clock", "window", "held", "since", "exposure", "touches", "_counted")

    def __init__(self, levels: int, clock: Callable[[], float], window: int = 2048) -> None:
        self.clock = clock
        self.window = window
        self.held = [0] * levels                 # blocks held per level now
        self.since = [0.0] * levels              # when each level's count last changed
        self.exposure = [0.0] * levels           # block-seconds held, per level
        self.touches = [0.0] * levels            # touches by a new workflow, per level of the block before it
        self._counted = 0

    def _settle(self, level: int, now: float) -> None:
        self.exposure[level] += self.held[level] * (now - self.since[level])
        self.since[level] = now

    def enter(self, level: int) -> None:
        now = self.clock()
        self._settle(level, now)
        self.held[level] += 1

    def leave(self, level: int) -> None:
        now = self.clock()
        self._settle(level, now)
        self.held[level] -= 1

    def touched(self, level: int) -> None:
        """A workflow that had not touched it touched a held block of `level` (before its level rises)."""
        self.touches[level] += 1.0
        self._counted += 1
        if self._counted >= self.window:
            now = self.clock()
            for lv in range(len(self.held)):
                self._settle(lv, now)
                self.exposure[lv] *= 0.5
                self.touches[lv] *= 0.5
            self._counted = 0

    def counted(self) -> bool:
        """Whether any block was reused by a new workflow yet (before: every rate is 0)."""
        return any(self.touches)

    def rate(self, level: int) -> float:
        """New-workflow touches per held block and second at `level` (0 before any)."""
        t = self.touches[level]
        if not t:
            return 0.0
        exposure = self.exposure[level] + self.held[level] * (self.clock() - self.since[level])
        return t / exposure if exposure > 0 else 0.0
