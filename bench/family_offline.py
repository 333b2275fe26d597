"""Offline replays of an agent-family trace (bench/agent_families.py) at a pool of `cap` blocks, under the two ways
a client saves (SAVES): the yardsticks of bench_policies' `--families` mode, and the fast design loop of the
workflow policy.

- `whole`: as kvstore's vLLM connector — read the longest held prefix, then reserve the request's whole chain
  (held blocks refreshed, the rest stored; the put never evicts its own chain's blocks).
- `missed`: as `Namespace.put` without `after` and the SGLang backend — read the longest held prefix, then put
  only the blocks after it, reserved head first as one chain (it protects only itself: the prefix it hit is not
  named).
- `named`: `Namespace.put` of the blocks after the prefix, naming the prefix (`after`): the daemon protects and
  refreshes the prefix as a whole-chain reserve does, so offline it is `whole`.

`lru(events, cap, save)` is the daemon's LRU replayed in Python (a check of the daemon replay); `belady(events,
cap)` evicts the block used farthest in the future, the deepest in its chain among equals (a prefix's tail before
its head: every request that uses a block uses its parent), and bypasses a block used no sooner than every held
one (the ceiling; per block, save-agnostic). `policy(events, cap, save, name)` replays a kvstore policy in-process
(the dict form, kvstore.policy.workflow's `WorkflowPolicy` for "workflow", with hints; "history", "lru" without)
with the index's reserve / commit / pin semantics emulated (kvstore.index.stores, .reads, .allocation) on the
trace's clock.
"""
from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from typing import Any

from agent_families import Event, calls

SAVES = ("whole", "missed", "named")
WHOLE = ("whole", "named")              # the saves that name the whole chain to the daemon


def prefix_held(chain: list[int], held: Any) -> int:
    return next((i for i, b in enumerate(chain) if b not in held), len(chain))


def lru(events: list[Event], cap: int, save: str) -> tuple[int, int]:
    """(blocks hit, blocks looked up) under LRU with the save mode's order of touches."""
    held: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    for e in calls(events):
        chain = e.blocks
        n = prefix_held(chain, held)
        hit, total = hit + n, total + len(chain)
        for b in reversed(chain[:n]):                   # the get: unpinned tail first, the head most recent
            held.move_to_end(b)
        batch = chain if save in WHOLE else chain[n:]
        protect: set[int] = set()                       # the chain up to the block being stored
        stored = []
        end = len(batch)
        for i, b in enumerate(batch):
            protect.add(b)
            if b in held:
                continue
            if len(held) + len(stored) >= cap:
                v = next(iter(held), None)
                if v is None or v in protect:
                    end = i                             # stopped: what follows would follow a hole
                    break
                del held[v]
            stored.append(b)
        for b in reversed(batch[:end]):                 # published / refreshed tail first
            if b in held or b in stored:
                held[b] = None
                held.move_to_end(b)
    return hit, total


def belady(events: list[Event], cap: int) -> tuple[int, int]:
    reqs = calls(events)
    nxt: dict[int, int] = {}
    uses: list[list[float]] = [[] for _ in reqs]
    for i in range(len(reqs) - 1, -1, -1):
        uses[i] = [nxt.get(b, math.inf) for b in reqs[i].blocks]
        for b in reqs[i].blocks:
            nxt[b] = i
    held: dict[int, tuple[float, int]] = {}             # block → (next use, depth in its chain)
    heap: list[tuple[float, int, int]] = []             # (-next use, -depth, block), lazily cleaned
    hit = total = 0
    for e, nexts in zip(reqs, uses):
        n = prefix_held(e.blocks, held)
        hit, total = hit + n, total + len(e.blocks)
        for depth, (b, nu) in enumerate(zip(e.blocks, nexts)):
            if b not in held and len(held) >= cap:
                while heap and held.get(heap[0][2]) != (-heap[0][0], -heap[0][1]):
                    heapq.heappop(heap)
                if not heap or (-heap[0][0], -heap[0][1]) <= (nu, depth):
                    continue                            # bypass: every held block is used sooner
                del held[heapq.heappop(heap)[2]]
            held[b] = (nu, depth)
            heapq.heappush(heap, (-nu, -depth, b))
    return hit, total


def _key(b: int) -> bytes:
    return b.to_bytes(8, "little")


def policy(events: list[Event], cap: int, save: str, name: str = "workflow", **kw: Any) -> tuple[int, int]:
    """A kvstore policy in-process (module docstring), hints for "workflow"."""
    from kvstore.policy import make_tier_policy
    from kvstore.workflows import Touch, Workflows

    clock = [0.0]
    flows = Workflows(idle_s=math.inf, clock=lambda: clock[0], **kw)
    pol: Any = make_tier_policy(name, flows)
    hints = name == "workflow"
    held: set[bytes] = set()
    hit = total = 0
    for e in events:
        clock[0] = e.at
        if e.kind != "call":
            if hints and e.kind == "end":
                flows.end(e.workflow)
            elif hints:
                flows.begin(e.workflow, e.family)
            continue
        touch = None
        if hints:
            flows.call(e.workflow, e.agent, e.family)
            touch = Touch(e.workflow, e.agent)
        chain = [_key(b) for b in e.blocks]
        if touch is not None:                            # the lookup's chain, with its context (read_ops.touch_of)
            flows.chain(touch, b"".join(chain), 8)
        n = prefix_held(chain, held)
        hit, total = hit + n, total + len(chain)
        if hasattr(pol, "asked"):                        # the lookup (kvstore.policy.Asking)
            pol.asked(chain, 0)
        pins = hasattr(pol, "pinned")                    # (a tier's LRU has no pins: a read is a use)
        for k in chain[:n]:                              # acquire: pinned, tagged
            if pins:
                pol.pinned(k)
            if touch is not None or not pins:
                pol.accessed(k, touch)
        for k in reversed(chain[:n]):                    # release: tail first
            if pins:
                pol.unpinned(k)
            else:
                pol.accessed(k, touch)
        _reserve_commit(pol, held, chain if save in WHOLE else chain[n:], cap, touch)
    return hit, total


def _reserve_commit(pol: Any, held: set[bytes], batch: list[bytes], cap: int, touch: Any) -> None:
    """kvstore.index.stores' reserve then commit of one batch, without a lower tier."""
    protect: set[bytes] = set()                 # the chain up to the block being stored
    admits = getattr(pol, "admits", None)
    reserved: list[bytes] = []
    refresh: dict[bytes, list[bytes]] = {}
    waiting: list[bytes] = []
    stopped = False
    left: list[bytes] = []                      # left out by a stop (kvstore.index.stores: `refused`)
    for k in batch:
        if stopped:
            if k not in held:
                left.append(k)
            continue
        protect.add(k)
        if k in held:
            waiting.append(k)
            continue
        while len(held) + len(reserved) >= cap:
            v = pol.victim(0)
            if v is None or v in protect or (admits is not None and not admits(v, touch, k)):
                stopped = True
                break
            pol.removed(v)
            held.discard(v)
        if stopped:
            left.append(k)
            continue
        reserved.append(k)
        if waiting:
            refresh[k] = waiting
            waiting = []
    if left and touch is not None and hasattr(pol, "refused"):
        pol.refused(left, 0, touch)
    for k in reversed(waiting):
        pol.accessed(k, touch)
    for k in reversed(reserved):
        held.add(k)
        pol.added(k, 0, touch)
        for before in reversed(refresh.pop(k, ())):
            if before in held:
                pol.accessed(before, touch)
