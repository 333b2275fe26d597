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
  without activity for hints.idle_s is retired by `sweep` (the server loop's tick), and beyond
  hints.max_workflows the least recently active one is retired at once. Both walk `recent`, ordered by activity,
  from its old end: a sweep costs O(workflows retired), never O(workflows).
- What the policy does not need (the step, the agents expected next, the priority) is kept here for
  `kvstore workflows`, per workflow; each call of an active workflow is told to `on_call` (the predictive prefetch:
  a call re-arms its prefetch, and one naming the agents expected `next` asks for it at once).
"""
from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvstore.daemon.config import HintsConfig
from kvstore.protocol import Code, ProtocolError
from kvstore.workflows import Touch, Workflows
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
        self.on_call = on_call                  # (books' id, whether the call names agents expected next)
        self.prefetch_stats = prefetch_stats    # the predictive prefetch's figures, shown with the hints
        self.idle_s = cfg.idle_s
        self.max_workflows = cfg.max_workflows
        self.clock = clock
        self.recent: OrderedDict[str, Info] = OrderedDict()    # active workflows, least recently active first
        self.ended: OrderedDict[str, float] = OrderedDict()    # ended ids → when; forgotten after idle_s
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
            return self._end(name, wid)
        if kind == "call" and wid in self.ended:
            return self._ignored(name, wid, "ended")
        self.ended.pop(wid, None)
        if kind == "call":
            self.flows.call(wid, m.get("agent", ""), wtype)
        else:
            self.flows.begin(wid, wtype)
        info = self._active(wid)
        if kind == "call":
            info.step, info.next = m.get("step"), list(m.get("next", ()))
        if prio is not None:
            info.priority = prio
        self._cap()
        if kind == "call" and self.on_call is not None and wid in self.flows.active:
            self.on_call(wid, bool(info.next))
        return self._reply(name, wid, why)

    def _end(self, name: str, wid: str) -> dict[str, Any]:
        if wid not in self.flows.active:
            return self._ignored(name, wid, "ended" if wid in self.ended else "unknown_workflow")
        self.recent.pop(wid, None)
        self.flows.end(wid)
        self.retired["ended"] += 1
        self._remember_end(wid)
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

    def _active(self, wid: str) -> Info:
        """The workflow's info, marked active now (the most recent)."""
        info = self.recent.pop(wid, None) or Info(self.clock())
        info.seen = self.clock()
        self.recent[wid] = info
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
        info = self.recent.get(wid)
        if info is None:
            self.ignored["ended_context" if wid in self.ended else "unknown_context"] += 1
            return None
        info.seen = self.clock()
        self.recent.move_to_end(wid)
        return Touch(wid, m.get("agent", ""))

    # ----- retirement -----
    def sweep(self) -> int:
        """(Under the state lock, from the server's tick.) Retire workflows idle past hints.idle_s and forget
        ends older than it; the number retired."""
        now = self.clock()
        n = 0
        while self.recent:
            wid, info = next(iter(self.recent.items()))
            if now - info.seen <= self.idle_s:
                break
            self._retire(wid, "idle")
            n += 1
        while self.ended and now - next(iter(self.ended.values())) > self.idle_s:
            self.ended.popitem(last=False)
        return n

    def _cap(self) -> None:
        while len(self.recent) > self.max_workflows:
            self._retire(next(iter(self.recent)), "over_max")

    def _retire(self, wid: str, why: str) -> None:
        """Retire a workflow whose end never came: its blocks become retired blocks, the predictor learns no end."""
        self.recent.pop(wid, None)
        self.flows.retire(wid)
        self.retired[why] += 1

    def _remember_end(self, wid: str) -> None:
        self.ended[wid] = self.clock()
        self.ended.move_to_end(wid)
        while len(self.ended) > self.max_workflows:
            self.ended.popitem(last=False)

    # ----- inspection -----
    def rows(self, tenant: str | None, limit: int) -> list[dict[str, Any]]:
        """Active workflows, the most recently active first: all tenants' (tenant None) or one tenant's."""
        now = self.clock()
        out = []
        for wid in reversed(self.recent):
            owner, name = unscoped(wid)
            if tenant is not None and owner != tenant:
                continue
            w, info = self.flows.active.get(wid), self.recent[wid]
            if w is None:
                continue
            out.append({"workflow": name, "tenant": owner, "type": w.wtype,
                        "agent": "" if w.agent == START else w.agent, "steps": w.steps, "step": info.step,
                        "next": info.next, "priority": info.priority, "idle_s": round(now - info.seen, 3)})
            if len(out) >= limit:
                break
        return out

    def stats(self) -> dict[str, Any]:
        acc = self.flows.predictor.accuracy
        return {"active": len(self.flows.active), "retired": sum(self.retired.values()),
                "retired_by": {r: self.retired[r] for r in ("ended", "idle", "over_max")},
                "ignored": dict(self.ignored), "hints": dict(self.kinds),
                "accuracy": {"top1_1": acc.rate(1), "top1_3": acc.rate(3)},
                "predictions": {"top1_1": acc.total[1], "top1_3": acc.total[3]},
                "prefetch": self.prefetch_stats() if self.prefetch_stats is not None else None}


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
