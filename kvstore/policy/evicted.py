"""What the workflow policy remembers of the hinted blocks it evicted: how many workflows had touched each, so that a
block stored again comes back at its level (issue 34).

Why: a block's level — how many workflows touched it — prices its reuse by workflows to come (kvstore.policy.workflow,
kvstore.workflows.popularity). Without this memory an evicted block lost its count with its bytes: a shared
document or a planner's prompt evicted once under pressure came back as a block one workflow had touched, among the
first to go again, and its level never grew past what one stay in the pool saw. Offline (bench/family_offline, the
four agent families, seeds 1–3, whole-chain saves), the share of the LRU→Belady gap closed: map-reduce at a tenth and
a quarter of its peak 37% and 29% → 41% and 35% (mean of seeds; the no-hint history policy 35% and 31%), retrieval
at a tenth 44% → 49%, the other cells within a point.

The count comes back, less one if the block's last toucher is the workflow storing it again: that workflow's touch
adds it back (its tag is not remembered), and a workflow reloading its own evicted context is not a new reuse.
Neither the tags nor the agents come back: a block stored again is tagged by who stores it. A block a put left out
(`refused`: the admission kept blocks worth more, kvstore.policy.workflow) is recorded as touched by that workflow
too, and a block coming is admitted at the level the records give it (`coming_level`): a block every workflow asks
for and none gets into a full pool is known as shared by the third request, not refused for ever as new (the
`pipeline` family at a tenth of its peak, seed 1: the last stage's role prompt was never held).

A record is one byte in a kvstore.policy.levels.History (the native ring, 21–32 bytes a record): the count
(saturating at 15, above MAX_BUDGET) in the low nibble, and in the high one 1 + the last toucher's number mod 15
(0: none active), so two workflows alias once in 15 — which only counts a reload as a new reuse. FACTOR records per
block held; made at the first hinted eviction (a daemon without hints keeps none).
"""
from __future__ import annotations

from kvstore.policy.levels import History
from kvstore.workflows import Touch, Workflow, Workflows
from kvstore.workflows.popularity import level_of

FACTOR = 3                  # records per block held (the families' figures move by <1 point from 3 to 50)


def _mark(w: Workflow | None) -> int:
    return 0 if w is None else w.num % 15 + 1


class EvictedTouches:
    """The touch counts of evicted hinted blocks (module docstring), for one policy (all its classes)."""

    def __init__(self, workflows: Workflows) -> None:
        self.flows = workflows
        self.history: History | None = None

    def record(self, key: bytes, touched: int, last: Workflow | None, held: int) -> None:
        """A block leaves: `touched` workflows touched it, `last` (if still active) most recently; `held` blocks
        stay with the policy (the memory follows that size)."""
        if touched <= 0:
            return
        h = self.history
        if h is None:
            h = self.history = History(factor=FACTOR)
        if held > h.grow_at or held < h.shrink_at:
            h.size_for(held)
        h.records.record(key, min(touched, 15) | (0 if last is None else last.num % 15 + 1) << 4)

    def refused(self, key: bytes, touch: Touch, held: int) -> None:
        """A put of `touch`'s workflow left the block out: it touched the block all the same (kvstore.policy's
        `Refusing`), counted once per workflow as a store would."""
        w = self.flows.active.get(touch.workflow) if touch.workflow else None
        if w is not None:
            self.record(key, self.restore(key, touch) + 1, w, held)

    def coming_level(self, key: bytes | None, touch: Touch, budget: int) -> int:
        """The level a block not held would enter at when `touch` stores it: the workflows remembered to have
        touched it, and this one (1 for a block never seen, or no key given)."""
        return 1 if key is None else level_of(self.restore(key, touch) + 1, budget)

    def restore(self, key: bytes, touch: Touch | None) -> int:
        """The count a block stored again with `touch` starts from, before the touch tags it (0: none kept)."""
        if self.history is None:
            return 0
        code = self.history.records.level(key)
        if not code:
            return 0
        touched = code & 15
        w = self.flows.active.get(touch.workflow) if touch is not None and touch.workflow else None
        if w is not None and code >> 4 == _mark(w):
            touched -= 1                         # its own block back: its touch adds it again
        return touched

    @property
    def remembered(self) -> int:
        return 0 if self.history is None else self.history.remembered

    @property
    def nbytes(self) -> int:
        return 0 if self.history is None else self.history.nbytes


__all__ = ["FACTOR", "EvictedTouches"]
