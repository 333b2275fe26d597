"""The daemon's side of the hints (issue 14): which workflows and chat sessions are running, per tenant, kept for
the eviction policy (kvstore.workflows: its `Workflows` are the books this module feeds).

Hints are advice. A malformed hint (a field of the wrong type or too long) is refused like any request
(`bad_request`, by the schema); a well-formed one that means nothing — the end of a workflow nobody began, a call
after its end, a kind this daemon does not know, a priority word it does not know — is answered ok with `ignored`
(the reason) and counted, never an error to the engine.

- Ids are scoped by the connection's tenant (`scoped`): two tenants' "w1" are two workflows, and one tenant cannot
  end another's. A chat session `sid` is the workflow "session:<sid>" of type "session"; its turns are calls.
- A `call` of a workflow not begun begins it; a `begin` after an `end` opens it again; a `call` after an `end`
  (without a new begin, within hints.idle_s) is ignored: an engine's late call must not revive a finished
  workflow. A workflow retired for idleness, whose end never came, begins again at its next call (a long tool
  call is not an end).
- Activity — a hint, or a request naming the workflow in its context (`touch`) — keeps a workflow active; one
  without activity for hints.idle_s is retired by `sweep` (the server loop's tick). Each tenant has its own
  `recent`, ordered by activity: beyond hints.tenant_workflows a tenant's least recently active workflow is
  retired at once, and beyond hints.max_workflows (every tenant's) the least recently active of the tenant holding
  the most — so one tenant's flood of hints retires its own workflows, never a quieter tenant's. Both walk from
  the old end: a sweep costs O(tenants + workflows retired), never O(workflows). Ended ids are kept per tenant
  alike (bounded by the same two caps).
- Each tenant's hints teach its own model (kvstore.workflows: `Workflows.model`, bounded by hints.model_keys,
  model_successors and model_bytes), so what one tenant's workflows do never changes another's lookahead.
- What the policy does not need (the step, the agents expected next, the priority) is kept here for
  `kvstore workflows`, per workflow; each call of an active workflow is told to `on_call` (the predictive prefetch:
  a call re-arms its prefetch, and one naming the agents expected `next` asks for it at once).
"""
from __future__ import annotations

import heapq
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvstore.daemon.config import HintsConfig
from kvstore.protocol import Code, ProtocolError
from kvstore.workflows import Touch, Workflows
from kvstore.workflows.books import Bounds
from kvstore.workflows.predictor import START

SESSION = "session:"                 # a chat session's workflow id: SESSION + its id
KINDS = ("begin", "call", "end", "session_begin", "session_end")
PRIORITIES = {"low": 0, "normal": 1, "high": 2}   # the words a priority may be (Dynamo sends an int)


def scoped(tenant: str, name: str) -> str:
    """The books' id of a tenant's workflow (tenant names hold no NUL: config.py refuses them)."""
    return f"{tenant}\x00{name}"


def unscoped(wid: str) -> tuple[str, str]:
    """(tenant, the workflow's own id) of a books' id."""
    tenant, _, name = wid.partition("\x00")
    return tenant, name


@dataclass(slots=True)
class Info:
    """What the daemon keeps of an active workflow beside the policy's Workflow."""
    seen: float
    step: int | None = None
    next: list[str] = field(default_factory=list)
    priority: int | None = None


class Hints:
    """The hint ops and request contexts of every tenant, applied to the one `Workflows` the policy reads."""

    def __init__(self, workflows: Workflows, cfg: HintsConfig, clock: Callable[[], float] = time.monotonic,
                 on_call: Callable[[str, bool], None] | None = None,
                 prefetch_stats: Callable[[], dict[str, Any]] | None = None) -> None:
        self.flows = workflows
        workflows.bounds = Bounds(cfg.model_keys, cfg.model_successors, cfg.model_bytes)   # before any model
        self.on_call = on_call                  # (books' id, whether the call names agents expected next)
        self.prefetch_stats = prefetch_stats    # the predictive prefetch's figures, shown with the hints
        self.idle_s = cfg.idle_s
        self.max_workflows = cfg.max_workflows
        self.tenant_workflows = cfg.tenant_workflows
        self.clock = clock
        self.recent: dict[str, OrderedDict[str, Info]] = {}    # tenant → active workflows, least recently active
        self.ended: dict[str, OrderedDict[str, float]] = {}    # tenant → ended ids → when; forgotten after idle_s
        self.kinds: Counter[str] = Counter()                   # hints received, by kind
        self.ignored: Counter[str] = Counter()                 # hints (and contexts) ignored, by reason
        self.retired: Counter[str] = Counter()                 # workflows retired: ended, idle, over_max

    # ----- a hint -----
    def apply(self, tenant: str, m: dict[str, Any]) -> dict[str, Any]:
        """One hint op's reply (see the module docstring); ProtocolError for a malformed one."""
        kind = m["kind"]
        name, wid, wtype = _target(kind, m, tenant)
        self.kinds[kind if kind in KINDS else "unknown"] += 1
        if kind not in KINDS:
            return self._ignored(name, wid, "unknown_kind")
        why = ""
        prio = m.get("priority")
        if isinstance(prio, str):
            if prio not in PRIORITIES:
                self.ignored["priority"] += 1
                why = "priority"              # the rest of the hint applies
            prio = PRIORITIES.get(prio)
        if kind in ("end", "session_end"):
            return self._end(tenant, name, wid)
        if kind == "call" and wid in self.ended.get(tenant, ()):
            return self._ignored(name, wid, "ended")
        self._forget(self.ended, tenant, wid)
        if kind == "call":
            self.flows.call(wid, m.get("agent", ""), wtype, tenant)
        else:
            self.flows.begin(wid, wtype, tenant)
        info = self._active(tenant, wid)
        if kind == "call":
            info.step, info.next = m.get("step"), list(m.get("next", ()))
        if prio is not None:
            info.priority = prio
        self._cap(tenant)
        if kind == "call" and self.on_call is not None and wid in self.flows.active:
            self.on_call(wid, bool(info.next))
        return self._reply(name, wid, why)

    def _end(self, tenant: str, name: str, wid: str) -> dict[str, Any]:
        if wid not in self.flows.active:
            return self._ignored(name, wid, "ended" if wid in self.ended.get(tenant, ()) else "unknown_workflow")
        self._forget(self.recent, tenant, wid)
        self.flows.end(wid)
        self.retired["ended"] += 1
        self._remember_end(tenant, wid)
        return self._reply(name, wid, "")

    def _ignored(self, name: str, wid: str, why: str) -> dict[str, Any]:
        self.ignored[why] += 1
        return self._reply(name, wid, why)

    def _reply(self, name: str, wid: str, why: str) -> dict[str, Any]:
        w = self.flows.active.get(wid)
        reply: dict[str, Any] = {"workflow": name, "active": w is not None, "steps": w.steps if w else 0}
        if why:
            reply["ignored"] = why
        return reply

    def _active(self, tenant: str, wid: str) -> Info:
        """The workflow's info, marked active now (its tenant's most recent)."""
        mine = self.recent.setdefault(tenant, OrderedDict())
        info = mine.pop(wid, None) or Info(self.clock())
        info.seen = self.clock()
        mine[wid] = info
        return info

    # ----- a request's context -----
    def touch(self, tenant: str, m: dict[str, Any]) -> Touch | None:
        """The hint context of a request (its `wf` and `agent` fields), or None; a request naming a workflow that
        is not active is counted (`ended_context`: it ended, as a save finishing after its request's end does;
        else `unknown_context`) and served without one."""
        name = m.get("wf")
        if not name:
            return None
        wid = scoped(tenant, name)
        mine = self.recent.get(tenant)
        info = mine.get(wid) if mine is not None else None
        if mine is None or info is None:
            self.ignored["ended_context" if wid in self.ended.get(tenant, ()) else "unknown_context"] += 1
            return None
        info.seen = self.clock()
        mine.move_to_end(wid)
        return Touch(wid, m.get("agent", ""))

    # ----- retirement -----
    def sweep(self) -> int:
        """(Under the state lock, from the server's tick.) Retire workflows idle past hints.idle_s and forget
        ends older than it; the number retired."""
        now = self.clock()
        n = 0
        for tenant, mine in list(self.recent.items()):
            while mine:
                wid, info = next(iter(mine.items()))
                if now - info.seen <= self.idle_s:
                    break
                self._retire(tenant, wid, "idle")
                n += 1
        for tenant, ended in list(self.ended.items()):
            while ended and now - next(iter(ended.values())) > self.idle_s:
                ended.popitem(last=False)
            if not ended:
                del self.ended[tenant]
        return n

    def _cap(self, tenant: str) -> None:
        """Retire beyond the caps: the tenant's own least recently active, then the busiest tenant's."""
        mine: OrderedDict[str, Info] = self.recent.get(tenant, OrderedDict())
        while len(mine) > self.tenant_workflows:
            self._retire(tenant, next(iter(mine)), "over_max")
        while _total(self.recent) > self.max_workflows:
            busiest = max(self.recent, key=lambda t: len(self.recent[t]))
            self._retire(busiest, next(iter(self.recent[busiest])), "over_max")

    def _retire(self, tenant: str, wid: str, why: str) -> None:
        """Retire a workflow whose end never came: its blocks become retired blocks, the predictor learns no end."""
        self._forget(self.recent, tenant, wid)
        self.flows.retire(wid)
        self.retired[why] += 1

    def _remember_end(self, tenant: str, wid: str) -> None:
        ended = self.ended.setdefault(tenant, OrderedDict())
        ended[wid] = self.clock()
        ended.move_to_end(wid)
        while len(ended) > self.tenant_workflows:
            ended.popitem(last=False)
        while _total(self.ended) > self.max_workflows:
            busiest = max(self.ended, key=lambda t: len(self.ended[t]))
            self._forget(self.ended, busiest, next(iter(self.ended[busiest])))

    @staticmethod
    def _forget(books: dict[str, OrderedDict[str, Any]], tenant: str, wid: str) -> None:
        mine = books.get(tenant)
        if mine is not None:
            mine.pop(wid, None)
            if not mine:
                del books[tenant]

    # ----- inspection -----
    def rows(self, tenant: str | None, limit: int) -> list[dict[str, Any]]:
        """Active workflows, the most recently active first: all tenants' (tenant None) or one tenant's. `alive`:
        the probability that each of the next steps comes, from the tenant's own model."""
        now = self.clock()
        books = self.recent if tenant is None else {tenant: self.recent.get(tenant, OrderedDict())}
        ordered = heapq.merge(*(reversed(mine.items()) for mine in books.values()),
                              key=lambda item: item[1].seen, reverse=True)
        out = []
        for wid, info in ordered:
            w = self.flows.active.get(wid)
            if w is None:
                continue
            out.append({"workflow": unscoped(wid)[1], "tenant": w.tenant, "type": w.wtype,
                        "agent": "" if w.agent == START else w.agent, "steps": w.steps, "step": info.step,
                        "next": info.next, "priority": info.priority, "idle_s": round(now - info.seen, 3),
                        "alive": [round(p, 4) for p in self.flows.alive(wid)]})
            if len(out) >= limit:
                break
        return out

    def stats(self) -> dict[str, Any]:
        """The books over every tenant (no tenant named): workflows, hints, the predictors' accuracy, and the size
        of the hint state (`state`: entries, the bytes estimate, the lookahead work counters)."""
        hits: Counter[int] = Counter()
        total: Counter[int] = Counter()
        for m in self.flows.models.values():
            hits.update(m.predictor.accuracy.hits)
            total.update(m.predictor.accuracy.total)
        state = {**self.flows.footprint(), "tenants": len(self.recent), "ended": _total(self.ended)}
        return {"active": len(self.flows.active), "retired": sum(self.retired.values()),
                "retired_by": {r: self.retired[r] for r in ("ended", "idle", "over_max")},
                "ignored": dict(self.ignored), "hints": dict(self.kinds),
                "accuracy": {"top1_1": hits[1] / total[1] if total[1] else None,
                             "top1_3": hits[3] / total[3] if total[3] else None},
                "predictions": {"top1_1": total[1], "top1_3": total[3]}, "state": state,
                "prefetch": self.prefetch_stats() if self.prefetch_stats is not None else None}


def _total(books: dict[str, OrderedDict[str, Any]]) -> int:
    return sum(len(mine) for mine in books.values())


def _target(kind: str, m: dict[str, Any], tenant: str) -> tuple[str, str, str]:
    """(the id as sent, its scoped id, the workflow's type) of a hint: exactly one of workflow and session."""
    wf: str | None = m.get("workflow")
    sid: str | None = m.get("session")
    if (wf is None) == (sid is None):
        raise ProtocolError(Code.BAD_REQUEST, f"hint: give exactly one of 'workflow' and 'session' "
                                              f"({'both' if wf is not None else 'neither'} given)")
    if kind.startswith("session_") and sid is None:
        raise ProtocolError(Code.BAD_REQUEST, f"hint: kind {kind!r} needs field 'session'")
    if not (wf or sid):
        raise ProtocolError(Code.BAD_REQUEST, "hint: the workflow or session id must not be empty")
    if sid is not None:
        return sid, scoped(tenant, SESSION + sid), m.get("type", "session")
    assert wf is not None
    return wf, scoped(tenant, wf), m.get("type", "")
