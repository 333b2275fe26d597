"""The compact workflow policy's books per host slot (kvstore.policy.compact): storage, not order. Every host slot
has a fixed row in per-segment arrays (`array`, no Python object per block), found from the key through the key
table (key → gid = segment << 32 | slot) and back through `key_at(gid)` (the pool's reverse map):

    group    int32   the slot's group id (>= 0: linked), PINNED (-1: a candidate again at its unpin) or ABSENT (-2)
    prev/next int64  the gids of its neighbours in its group's LRU list (NIL = -1)
    tags     uint32 × budget   the workflow numbers (`Workflow.num`) that touched it, least recent first, 0 = none
    masks    uint8 × budget    per tag, the agents of that workflow that touched it (bit min(agent index, 7))
    touched  uint8             how many workflows ever touched it (saturating at 255)

This module owns the arrays and what a row says on its own: a segment's rows are made when its first block comes
(sized by `slots_of`, else grown as its slots are used) and dropped with its last block (`vacate`); a touch goes
into a row's tags (`tag`); a row's signature — its active workflows, or how many ever touched it — is read from
them (`sig`), and its standing for `kvstore ls --tags` (`describe`); a block moved to another slot (compaction:
kvstore.index.capacity) takes its row along (`copy`, O(budget)). Workflow numbers are 32-bit and wrap after 2**32
workflows: a stale tag may then alias a new workflow, which only makes one old block look touched by it (hints are
advice).

Why apart from the order: the rows are the memory (the 41 bytes a slot that the host pool's budget counts, in
`nbytes`) and their layout is the same whatever the order is; which list a row is in, and where, is the policy's
alone (compact.py writes the group field and threads its groups' lists through prev/next, reading the arrays of
`chunks` directly: no call per link on its hot paths).
"""
from __future__ import annotations

from array import array
from collections.abc import Callable
from typing import Any

from kvstore.workflows import Touch, Workflows, agent_names
from kvstore.workflows.popularity import level_of

ABSENT, PINNED, NIL = -2, -1, -1
SLOT_MASK = 0xFFFFFFFF
MAX_BUDGET = 8
ROW_BYTES_PER_TAG = 5          # a uint32 tag and a uint8 mask


class Chunk:
    """The rows of one segment's slots."""
    __slots__ = ("group", "prev", "next", "tags", "masks", "touched", "live")

    def __init__(self, n: int, budget: int) -> None:
        self.group = array("i", [ABSENT]) * n
        self.prev = array("q", [NIL]) * n
        self.next = array("q", [NIL]) * n
        self.tags = array("I", [0]) * (n * budget)
        self.masks = array("B", [0]) * (n * budget)
        self.touched = array("B", [0]) * n
        self.live = 0

    def grow(self, n: int, budget: int) -> None:
        more = n - len(self.group)
        self.group.extend(array("i", [ABSENT]) * more)
        self.prev.extend(array("q", [NIL]) * more)
        self.next.extend(array("q", [NIL]) * more)
        self.tags.extend(array("I", [0]) * (more * budget))
        self.masks.extend(array("B", [0]) * (more * budget))
        self.touched.extend(array("B", [0]) * more)

    def nbytes(self) -> int:
        return sum(a.buffer_info()[1] * a.itemsize
                   for a in (self.group, self.prev, self.next, self.tags, self.masks, self.touched))


class Rows:
    """The rows of the host slots, by segment (`chunks`: segment id → Chunk), `budget` tags each."""
    __slots__ = ("chunks", "budget", "flows", "slots_of", "_no_tags", "_no_masks", "_single")

    def __init__(self, workflows: Workflows, budget: int, slots_of: Callable[[int], int] | None) -> None:
        self.chunks: dict[int, Chunk] = {}
        self.budget = budget
        self.flows = workflows
        self.slots_of = slots_of
        self._no_tags, self._no_masks = array("I", [0]) * budget, array("B", [0]) * budget
        self._single: dict[int, frozenset[int]] = {}               # one workflow's signature, made once

    # ----- a segment's rows: made, found, given back -----
    def row(self, gid: int) -> tuple[Chunk | None, int]:
        """The chunk and row of a slot; no chunk when none was made for it (a slot never added)."""
        seg, i = gid >> 32, gid & SLOT_MASK
        ch = self.chunks.get(seg)
        return (ch, i) if ch is not None and i < len(ch.group) else (None, i)

    def occupy(self, gid: int) -> tuple[Chunk, int]:
        """The chunk and row of a slot being added, made (or grown) on first use: an empty row (no tags, ABSENT
        until the policy links it), counted live — unless a row was left behind there (a missed `removed`): that
        one comes back as it is (its group not ABSENT), for the policy to drop before it asks again."""
        seg, i = gid >> 32, gid & SLOT_MASK
        ch = self.chunks.get(seg)
        if ch is None:
            n = self.slots_of(seg) if self.slots_of is not None else 0
            ch = self.chunks[seg] = Chunk(max(n, i + 1), self.budget)
        elif i >= len(ch.group):
            ch.grow(max(i + 1, 2 * len(ch.group)), self.budget)
        elif ch.group[i] != ABSENT:
            return ch, i
        b = self.budget
        ch.tags[i * b:i * b + b] = self._no_tags
        ch.masks[i * b:i * b + b] = self._no_masks
        ch.touched[i] = 0
        ch.live += 1
        return ch, i

    def linked_row(self, gid: int) -> tuple[Chunk, int]:
        """The row of a slot in a group (a group's head: its row exists)."""
        ch, i = self.row(gid)
        assert ch is not None, f"slot {gid:#x} heads a group but has no row"
        return ch, i

    def vacate(self, ch: Chunk, i: int, gid: int) -> None:
        """The slot's row is no one's (unlinked already)."""
        ch.group[i] = ABSENT
        ch.prev[i] = ch.next[i] = NIL
        ch.live -= 1
        if ch.live == 0:
            del self.chunks[gid >> 32]           # the segment's rows go with its last block

    def copy(self, sch: Chunk, s: int, dch: Chunk, d: int) -> None:
        """Row `s` (a moved block's old slot) into the occupied row `d`: group (or pinned), tags, masks, touch
        count; its place in its group's list is the policy's (`_splice`). O(budget)."""
        b = self.budget
        dch.tags[d * b:d * b + b] = sch.tags[s * b:s * b + b]
        dch.masks[d * b:d * b + b] = sch.masks[s * b:s * b + b]
        dch.touched[d] = sch.touched[s]
        dch.group[d] = sch.group[s]

    # ----- what a row says -----
    def tag(self, ch: Chunk, i: int, touch: Touch | None) -> bool | None:
        """A touch of an active workflow: its number becomes the row's most recent tag, the agent's bit added to its
        mask (the least recent tag goes when the budget is full). Whether the workflow was new to the row (None: no
        active workflow touched it)."""
        if touch is None or not touch.workflow:
            return None
        w = self.flows.active.get(touch.workflow)
        if w is None:
            return None
        num, bit = w.num, 1 << min(w.agents.get(touch.agent, 0), 7)
        b = self.budget
        base = i * b
        tags, masks = ch.tags, ch.masks
        n, j = 0, -1                             # tags in the row; where `num` is among them
        while n < b and tags[base + n]:
            if tags[base + n] == num:
                j = n
            n += 1
        new = j < 0
        if new:
            ch.touched[i] = min(255, ch.touched[i] + 1)
            if n < b:
                tags[base + n] = num
                masks[base + n] = bit
                return True
            j, mask = 0, bit                     # the budget: the least recent tag goes
        else:
            mask = masks[base + j] | bit
        last = base + n - 1
        for x in range(base + j, last):          # the tags after it move up: it becomes the most recent
            tags[x] = tags[x + 1]
            masks[x] = masks[x + 1]
        tags[last] = num
        masks[last] = mask
        return new

    def sig(self, ch: Chunk, i: int) -> frozenset[int] | int:
        """The row's signature: the set of its active workflows' numbers, or, when none is, how many workflows ever
        touched it, as a level (popularity.level_of)."""
        b = self.budget
        live = self.flows.nums
        act = [t for t in ch.tags[i * b:i * b + b] if t and t in live]
        if not act:
            return level_of(ch.touched[i], b)
        if len(act) > 1:
            return frozenset(act)
        sig = self._single.get(act[0])
        if sig is None:
            sig = self._single[act[0]] = frozenset(act)
        return sig

    def last_tag(self, ch: Chunk, i: int) -> int:
        """The workflow number that touched the row most recently (0: none)."""
        tags, base = ch.tags, i * self.budget
        for j in range(base + self.budget - 1, base - 1, -1):
            if tags[j]:
                return tags[j]
        return 0

    def last_active(self, ch: Chunk, i: int) -> int:
        """The active workflow number that touched the row most recently (0: none is active)."""
        tags, base, live = ch.tags, i * self.budget, self.flows.nums
        for j in range(base + self.budget - 1, base - 1, -1):
            if tags[j] and tags[j] in live:
                return tags[j]
        return 0

    def ended(self, num: int) -> None:
        """Workflow `num` ended: its one-workflow signature is made anew if the number comes back."""
        self._single.pop(num, None)

    def masks_of(self, ch: Chunk, i: int) -> dict[int, int]:
        """The row's tags (workflow numbers, live or not) and their agents' masks."""
        b = self.budget
        return {t: ch.masks[i * b + j] for j, t in enumerate(ch.tags[i * b:i * b + b]) if t}

    def describe(self, ch: Chunk, i: int) -> dict[str, Any]:
        """A live row's standing and tags (`kvstore ls --tags`)."""
        live = self.flows.nums
        tags = [(live[t], m) for t, m in self.masks_of(ch, i).items() if t in live]
        standing = "pinned" if ch.group[i] == PINNED else "active" if tags else "retired"
        return {"standing": standing, "workflows": [w.wid for w, _ in tags],
                "agents": {w.wid: agent_names(w, m) for w, m in tags}, "touched": ch.touched[i]}

    def nbytes(self) -> int:
        return sum(ch.nbytes() for ch in self.chunks.values())
