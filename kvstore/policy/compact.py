"""Workflow-aware eviction for the host pool, in compact books: the order of kvstore.policy.workflow's
`WorkflowPolicy` (the reference model, dicts per block), at 41 bytes per host slot instead of ~700 per block
(tracemalloc, 100 k blocks, keys aside).

Why a second form: the host pool is where the 10-million-block budget applies (issue 14: ≤ 150 B a block with the
key table's ~74). Per block the reference keeps a dict of tags, an OrderedDict node and a tuple in dicts; here
every host slot has a fixed row in per-segment arrays: kvstore.policy.rows owns them (their layout, a segment's
rows made and dropped, tags written, a row's signature read, a row copied on a move). This module owns the order
over them: the groups, the lists threaded through the rows' prev/next, the victims and the hooks on a workflow's
end or hint; kvstore.policy.compact_scores ranks the groups (the scores, the heap, the timed pick).

A group is one (class, signature, level, dead): the set of active workflows among the tags, or, for retired blocks,
how many workflows touched them (its level), and whether the most recent of those workflows is done with its
blocks (kvstore.workflows.rereads: found from the key at a link, `key_at`, for active rows only); the level
(popularity.level_of: the count up to the budget, then doublings) prices its reuse by workflows to come
(kvstore.workflows.popularity; workflow.py's docstring); its record holds the list's head (least recent), tail and
size.

A block moved to another slot (compaction: kvstore.index.capacity) takes its row along (`moved`, O(budget)): the
new slot's row replaces the old one in its group's list, where it stood.

Cost: added / accessed / removed / pinned / unpinned are O(budget) plus a key-table lookup; a workflow's end moves
the blocks of its groups (each block once per tag it got). `victim`: the active groups of a class are kept in a
heap by (score, age); a group's score changes only when one of its workflows gets a hint (its value is cached by
`Workflows` until then), so a victim costs O(log groups) plus, once per hint, re-scoring the hinted workflow's
groups. (The variants whose scores move with every hint, `inherit=False` and `Workflows.timed`, and any once a
block was reused by a second workflow (its level's worth moves with every such reuse), take the minimum over the
class's active groups, as the reference does, kept for `pick_s` while nothing changes: `_pick`.) A victim also
looks at the class's retired groups, one per level (O(budget)).

Speed (this runs under the daemon's lock on every put and get): the hot paths call the rows' methods as
`self.rows.m(...)` — as cheap as a method of this class on CPython 3.11 (a bound method kept in the instance dict
is ~10 ns a call dearer: its call site stays unspecialized) — and read and write the arrays of `chunks`, the rows'
own dict, directly (the lists' links, the group field).
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvstore.policy.compact_scores import Group, GroupScores
from kvstore.policy.current_calls import CurrentCalls
from kvstore.policy.evicted import EvictedTouches
from kvstore.policy.rows import ABSENT, MAX_BUDGET, NIL, PINNED, SLOT_MASK, Chunk, Rows
from kvstore.policy.turnover import Turnover
from kvstore.policy.workflow import shared_value
from kvstore.workflows import Touch, Workflow, Workflows
from kvstore.workflows.popularity import Popularity, level_of, levels

if TYPE_CHECKING:
    from kvstore.index.keytable import KeyTable

__all__ = ["ABSENT", "NIL", "PINNED", "CompactWorkflowPolicy"]


class CompactWorkflowPolicy(GroupScores):
    """The host pool's workflow-aware policy (module docstring), in the EvictionPolicy shape: over the index's key
    table (key → gid), with `key_at(gid)` for the way back; `slots_of(segment id)` sizes a segment's rows at once
    (else they grow as its slots are used)."""
    name = "workflow"

    def __init__(self, table: KeyTable, workflows: Workflows, key_at: Callable[[int], bytes | None],
                 slots_of: Callable[[int], int] | None = None, tag_budget: int = 4, inherit: bool = True,
                 pick_s: float = 0.005) -> None:
        if not 1 <= tag_budget <= MAX_BUDGET:
            raise ValueError(f"tag_budget must be in 1..{MAX_BUDGET}, got {tag_budget}")
        self.table = table
        self.flows = workflows
        self.flows.retire_hooks.append(self._retired)
        self.flows.change_hooks.append(self._changed)
        self.key_at = key_at
        self.slots_of = slots_of
        self.budget = tag_budget
        self.inherit = inherit
        self.rows = rows = Rows(workflows, tag_budget, slots_of)
        self.chunks: dict[int, Chunk] = rows.chunks                # the rows' own dict (module docstring)
        self.groups: dict[int, Group] = {}
        self._by_sig: dict[tuple[int, frozenset[int] | int, int, bool], Group] = {}   # (class, signature, level,
                                                                 # done with: workflow.py's Active)
        self._active: dict[int, dict[int, Group]] = {}          # class → its active groups, in creation order
        self._retired_of: dict[int, list[Group | None]] = {}    # class → retired group per touch count
        self._with: dict[int, set[int]] = {}                     # workflow number → group ids with it
        self._free_ids: list[int] = []
        self._seq = 0
        self.init_scores(pick_s)
        self.pop = Popularity(levels(tag_budget), workflows.clock)
        self.calls = CurrentCalls(workflows)
        self.turnover = Turnover(workflows.clock)
        self.evicted = EvictedTouches(workflows)

    # ----- the EvictionPolicy hooks -----
    def added(self, key: bytes, cls: int, touch: Touch | None = None) -> None:
        gid = self.table.get(key)
        if gid is None:
            return
        ch, i = self.rows.occupy(gid)
        if ch.group[i] != ABSENT:                # a row left behind (a missed `removed`): it goes first ...
            self._drop(ch, i, gid)
            ch, i = self.rows.occupy(gid)       # ... and may have taken the segment's chunk with it
        kept = self.evicted.restore(key, touch)
        if kept:
            ch.touched[i] = kept
        if self.rows.tag(ch, i, touch) and touch is not None:
            self.flows.touched(self.flows.active[touch.workflow], False)
        self.flows.seen(touch, key)
        self.calls.stored(key, touch)
        self.pop.enter(level_of(ch.touched[i], self.budget))
        self.turnover.stored(sum(self.pop.held))     # the blocks this policy holds (its tenants', where per tenant)
        self._link(ch, i, gid, cls)

    def accessed(self, key: bytes, touch: Touch | None = None) -> None:
        gid = self.table.get(key)
        if gid is None:
            return
        ch, i = self.rows.row(gid)
        if ch is None or ch.group[i] == ABSENT:
            return
        before = ch.touched[i]
        new = self.rows.tag(ch, i, touch)
        if new is not None and touch is not None and (new or not self.calls.mine(key, touch)):
            self.flows.touched(self.flows.active[touch.workflow], not new)
        self.flows.seen(touch, key)
        self.calls.read(key, touch)
        if ch.touched[i] != before:              # a workflow new to it: reuse no lookahead saw coming
            b = self.budget
            self.pop.touched(level_of(before, b))
            self.pop.leave(level_of(before, b))
            self.pop.enter(level_of(ch.touched[i], b))
        g = ch.group[i]
        if g >= 0:
            cls = self.groups[g].cls
            self._unlink(ch, i, gid)
            self._link(ch, i, gid, cls)

    def removed(self, key: bytes) -> None:
        """(Before the key table lets go of the key.)"""
        gid = self.table.get(key)
        if gid is None:
            return
        ch, i = self.rows.row(gid)
        if ch is not None and ch.group[i] != ABSENT:
            self._drop(ch, i, gid)
            if ch.touched[i]:
                held = sum(self.pop.held)
                self.evicted.record(key, ch.touched[i], self.flows.nums.get(self.rows.last_tag(ch, i)), held)

    def pinned(self, key: bytes) -> None:
        gid = self.table.get(key)
        if gid is None:
            return
        ch, i = self.rows.row(gid)
        if ch is not None and ch.group[i] >= 0:
            self._unlink(ch, i, gid)
            ch.group[i] = PINNED

    def unpinned(self, key: bytes) -> None:
        gid = self.table.get(key)
        if gid is None:
            return
        ch, i = self.rows.row(gid)
        if ch is not None and ch.group[i] == PINNED:
            self._link(ch, i, gid, self.table.cls_of(key))

    def moved(self, key: bytes, src: int, dst: int) -> None:
        """A block moved from slot `src` to the free slot `dst` (compaction, kvstore.index.capacity): its row goes
        with it — group (or pinned), tags, masks, touch count — and takes src's place in its group's list, so that
        its order is kept. O(budget)."""
        sch, s = self.rows.row(src)
        if sch is None or sch.group[s] == ABSENT:
            return
        dch, d = self.rows.occupy(dst)
        if dch.group[d] != ABSENT:
            self._drop(dch, d, dst)              # (a free slot has no row; one left behind goes first)
            dch, d = self.rows.occupy(dst)
        self.rows.copy(sch, s, dch, d)
        if sch.group[s] >= 0:
            self._splice(sch, s, dch, d, dst)
        self.rows.vacate(sch, s, src)                # last: it may drop src's chunk

    def victim(self, cls: int) -> bytes | None:
        """As WorkflowPolicy.victim: the lowest-scored group's head, retired before active among equals."""
        self._refresh()
        retired = self._best_retired(cls)
        if retired is not None and retired[0] <= 0.0:
            return self.key_at(retired[1].head)          # worth nothing to anyone: no score is lower (PBKV's case)
        best = self._best_active(cls)
        if retired is not None and (best is None or retired[0] <= self._score(best)):
            return self.key_at(retired[1].head)
        return None if best is None else self.key_at(best.head)

    def retired_victim(self, cls: int) -> bytes | None:
        """The next retired block of the class, or None: never an active one (room a prefetch may take)."""
        self._refresh()
        got = self._best_retired(cls)
        return None if got is None else self.key_at(got[1].head)

    def _refresh(self) -> None:
        """Prefixes read before their request stored the rest (workflow.CurrentCalls.stale): tail first."""
        for keys in self.calls.stale():
            for key in reversed(keys):
                gid = self.table.get(key)
                if gid is None:
                    continue
                ch, i = self.rows.row(gid)
                if ch is not None and ch.group[i] >= 0:
                    cls = self.groups[ch.group[i]].cls
                    self._unlink(ch, i, gid)
                    self._link(ch, i, gid, cls)

    def admits(self, victim: bytes, touch: Touch | None, key: bytes | None = None) -> bool:
        """As WorkflowPolicy.admits: evict `victim` for the block `key` of `touch` unless it is worth more."""
        gid = self.table.get(victim)
        if touch is None or touch.workflow not in self.flows.active or gid is None:
            return True
        if self.calls.mine(victim, touch):
            return False
        ch, i = self.rows.row(gid)
        if ch is None or ch.group[i] < 0:
            return True
        g = self.groups[ch.group[i]]
        worth = shared_value(self.pop, self.flows, g.level) if isinstance(g.sig, int) else self._score(g)
        level = self.evicted.coming_level(key, touch, self.budget)
        coming = self.flows.value(touch.workflow, self.turnover.horizon()) + shared_value(self.pop, self.flows, level)
        return worth <= coming

    def refused(self, keys: list[bytes], cls: int, touch: Touch) -> None:
        """As WorkflowPolicy.refused: blocks a put of `touch` left out are remembered as touched by it."""
        held = sum(self.pop.held)
        for key in keys:
            self.flows.seen(touch, key)
            gid = self.table.get(key)
            ch, i = self.rows.row(gid) if gid is not None else (None, 0)
            if ch is None or ch.group[i] == ABSENT:
                self.evicted.refused(key, touch, held)

    def describe(self, key: bytes) -> dict[str, Any] | None:
        """A block's standing and tags (`kvstore ls --tags`), or None if the policy has no row for it."""
        gid = self.table.get(key)
        ch, i = self.rows.row(gid) if gid is not None else (None, 0)
        if ch is None or ch.group[i] == ABSENT:
            return None
        got = self.rows.describe(ch, i)
        got["done"] = [w for w in got["workflows"] if self.flows.block_worth(w, key) < 1.0]
        return got

    # ----- groups -----
    def _drop(self, ch: Chunk, i: int, gid: int) -> None:
        if ch.group[i] >= 0:
            self._unlink(ch, i, gid)
        self.pop.leave(level_of(ch.touched[i], self.budget))
        self.rows.vacate(ch, i, gid)

    def _group(self, cls: int, sig: frozenset[int] | int, level: int, dead: bool = False) -> Group:
        g = self._by_sig.get((cls, sig, level, dead))
        if g is not None:
            return g
        gid = self._free_ids.pop() if self._free_ids else len(self.groups)
        self._seq += 1
        g = self._by_sig[(cls, sig, level, dead)] = self.groups[gid] = Group(gid, cls, sig, level, self._seq, dead)
        if isinstance(sig, int):
            slots = self._retired_of.setdefault(cls, [None] * levels(self.budget))
            slots[sig] = g
        else:
            self._active.setdefault(cls, {})[gid] = g
            self._unscored.setdefault(cls, set()).add(g)
            for n in sig:
                self._with.setdefault(n, set()).add(gid)
        return g

    def _forget(self, g: Group) -> None:
        del self.groups[g.id]
        del self._by_sig[(g.cls, g.sig, g.level, g.dead)]
        self._free_ids.append(g.id)
        if isinstance(g.sig, int):
            self._retired_of[g.cls][g.sig] = None
            return
        del self._active[g.cls][g.id]
        self._unscored.get(g.cls, set()).discard(g)
        for n in g.sig:
            ids = self._with.get(n)
            if ids is not None:
                ids.discard(g.id)
                if not ids:
                    del self._with[n]

    def _link(self, ch: Chunk, i: int, gid: int, cls: int) -> None:
        """At the most recent end of the slot's group (from its tags now)."""
        sig = self.rows.sig(ch, i)
        dead = False
        if not isinstance(sig, int) and self.flows.dead_blocks:      # done with by its most recent workflow?
            key = self.key_at(gid)
            last = self.flows.nums[self.rows.last_active(ch, i)]
            dead = key is not None and self.flows.block_worth(last.wid, key) < 1.0
        g = self._group(cls, sig, level_of(ch.touched[i], self.budget), dead)
        ch.prev[i] = g.tail
        ch.next[i] = NIL
        if g.tail != NIL:
            t = g.tail
            self.chunks[t >> 32].next[t & SLOT_MASK] = gid
        else:
            g.head = gid
        g.tail = gid
        g.size += 1
        ch.group[i] = g.id

    def _unlink(self, ch: Chunk, i: int, gid: int) -> None:
        g = self.groups[ch.group[i]]
        p, n = ch.prev[i], ch.next[i]
        if p != NIL:
            self.chunks[p >> 32].next[p & SLOT_MASK] = n
        else:
            g.head = n
        if n != NIL:
            self.chunks[n >> 32].prev[n & SLOT_MASK] = p
        else:
            g.tail = p
        ch.prev[i] = ch.next[i] = NIL
        g.size -= 1
        if g.size == 0:
            self._forget(g)

    def _splice(self, sch: Chunk, s: int, dch: Chunk, d: int, dst: int) -> None:
        """Row `d` (slot `dst`) takes linked row `s`'s place in its group's list: same neighbours, same position."""
        g = self.groups[sch.group[s]]
        p, n = sch.prev[s], sch.next[s]
        dch.prev[d], dch.next[d] = p, n
        if p != NIL:
            self.chunks[p >> 32].next[p & SLOT_MASK] = dst
        else:
            g.head = dst
        if n != NIL:
            self.chunks[n >> 32].prev[n & SLOT_MASK] = dst
        else:
            g.tail = dst

    def _retired(self, w: Workflow) -> None:
        """A workflow ended: the blocks of its groups move to the groups of the workflows still active on them (or
        retired), group by group in the order they were made, each from its least recent block."""
        self.rows.ended(w.num)
        ids = self._with.pop(w.num, set())
        for g in sorted((self.groups[x] for x in ids if x in self.groups), key=lambda g: g.seq):
            while self.groups.get(g.id) is g:
                gid = g.head
                ch, i = self.rows.linked_row(gid)
                self._unlink(ch, i, gid)
                self._link(ch, i, gid, g.cls)

    # ----- inspection -----
    def counts(self) -> dict[str, int]:
        """Blocks retired and active (pinned ones aside)."""
        retired = sum(g.size for g in self.groups.values() if isinstance(g.sig, int))
        active = sum(g.size for g in self.groups.values() if not isinstance(g.sig, int))
        return {"retired": retired, "active": active, "workflows": len(self.flows.active)}

    def nbytes(self) -> int:
        """Bytes of the books: the rows, (roughly) the groups, and the records of evicted blocks."""
        return (self.rows.nbytes() + sys.getsizeof(self.groups) + len(self.groups) * 200 + sys.getsizeof(self.chunks)
                + self.evicted.nbytes)
