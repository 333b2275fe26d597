"""What an engine request says about its workflow, agent and session (issue 14's hints), read from the request's
own parameters, and sent to the daemon as advice. Engine-agnostic: the vLLM connector reads a request's
`kv_transfer_params`, the SGLang backend a storage call's `extra_info`; both hand the dict to `parse_hints`.

Accepted fields (flat, all optional; the common request has none and costs nothing):
    {"workflow": "w1", "workflow_type": "codegen", "agent": "coder", "step": 3, "next": ["tester"],
     "workflow_end": true, "session": "chat-9", "session_end": true, "priority": 2}
Vocabularies users already send, where they map cleanly (a flat field wins over them):
- Dynamo's `nvext.agent_hints.priority` (also `agent_hints` at the top): the request's priority;
- Dynamo's `nvext.agent_context` (`session_type_id`, `session_id`, `trajectory_id`): one agent run is our
  workflow (`session_id`, of type `session_type_id`), one trajectory of it our agent (`trajectory_id`, less a
  leading "<session_id>:" so that the same agent of two runs has one name, which the predictor learns from);
  Dynamo sends no end: such workflows retire after the daemon's `hints.idle_s`;
- SGLang's `session_id` (what its cache linker puts into `extra_info`): a chat session.

Hints are advice, never a reason for a request to fail: a field of the wrong type or size is dropped (logged at
debug, the rest applies), the daemon's refusals and "ignored" answers are logged at debug, and a lost connection is
the caller's to notice at its next lookup. Limits follow the daemon's (ids ≤ 256 bytes, ≤ 16 `next` names), so a
context sent with a lookup can never get that lookup refused.

Imports only the client: no engine.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvstore.client import Client

MAX_ID_BYTES = 256
MAX_NEXT = 16
PRIORITY_WORDS = ("low", "normal", "high")


@dataclass(frozen=True, slots=True)
class RequestHints:
    """One request's hints, checked: ids within the daemon's limits, or absent."""
    workflow: str | None = None
    wtype: str | None = None
    agent: str = ""
    step: int | None = None
    next: tuple[str, ...] = ()
    priority: int | str | None = None
    session: str | None = None
    workflow_end: bool = False
    session_end: bool = False

    @property
    def context(self) -> tuple[str, str] | None:
        """The (workflow, agent) context the request's lookups, loads and saves carry: its workflow (else its
        session's workflow, "session:<id>") and agent."""
        if self.workflow is not None:
            return (self.workflow, self.agent)
        if self.session is not None:
            return (f"session:{self.session}", self.agent)
        return None


def parse_hints(params: Any, log: logging.Logger) -> RequestHints | None:
    """The hints of a request's parameters, or None when they name no workflow and no session."""
    if not isinstance(params, Mapping):
        return None
    flat = {**_dynamo(params), **{k: v for k, v in params.items() if k in _FIELDS}}
    if "workflow" not in flat and "session" not in flat and "session_id" not in flat:
        return None
    bad: list[str] = []
    got: dict[str, Any] = {name: check(flat[key], bad, key) for key, (name, check) in _FIELDS.items() if key in flat}
    if bad:
        log.debug("kvstore: hint field(s) dropped: %s", "; ".join(bad))
    if got.get("session") is None and got.get("session_id") is not None:
        got["session"] = got["session_id"]
    got.pop("session_id", None)
    hints = RequestHints(**{k: v for k, v in got.items() if v is not None})
    return hints if hints.workflow is not None or hints.session is not None else None


def with_context(context: tuple[str, str] | None) -> dict[str, Any]:
    """`context=` for a client call, only where there is one: a request without hints calls exactly as before."""
    return {} if context is None else {"context": context}


def send_start(client: Client, hints: RequestHints, log: logging.Logger) -> None:
    """The request begins: a `call` of its agent in its workflow, a turn of its session. Never raises."""
    if hints.workflow is not None:
        w = client.workflow(hints.workflow, type=hints.wtype)
        _logged(w.call(hints.agent, step=hints.step, next=list(hints.next) or None, priority=hints.priority),
                "call", hints.workflow, log)
    if hints.session is not None:
        _logged(client.session(hints.session).turn(agent=hints.agent, priority=hints.priority), "turn",
                hints.session, log)


def send_end(client: Client, hints: RequestHints, log: logging.Logger) -> None:
    """The request finished: the ends it asked for. Never raises."""
    if hints.workflow is not None and hints.workflow_end:
        _logged(client.workflow(hints.workflow, type=hints.wtype).end(), "end", hints.workflow, log)
    if hints.session is not None and hints.session_end:
        _logged(client.session(hints.session).end(), "session end", hints.session, log)


def _logged(reply: Any, what: str, wid: str, log: logging.Logger) -> None:
    if isinstance(reply, dict) and reply.get("ignored"):
        log.debug("kvstore: hint %s of %r ignored: %s", what, wid, reply["ignored"])


def _dynamo(params: Mapping[str, Any]) -> dict[str, Any]:
    """Dynamo's `nvext.agent_hints` / `nvext.agent_context` (or the same at the top level) as flat fields."""
    nvext = params.get("nvext")
    where = nvext if isinstance(nvext, Mapping) else params
    out: dict[str, Any] = {}
    hints = where.get("agent_hints")
    if isinstance(hints, Mapping) and "priority" in hints:
        out["priority"] = hints["priority"]
    ctx = where.get("agent_context")
    if isinstance(ctx, Mapping) and isinstance(ctx.get("session_id"), str):
        run = ctx["session_id"]
        out["workflow"] = run
        if "session_type_id" in ctx:
            out["workflow_type"] = ctx["session_type_id"]
        trajectory = ctx.get("trajectory_id")
        if isinstance(trajectory, str):
            out["agent"] = trajectory.removeprefix(f"{run}:") or trajectory
    return out


def _name(value: Any, bad: list[str], key: str) -> str | None:
    if isinstance(value, str) and value and len(value.encode("utf-8", "surrogatepass")) <= MAX_ID_BYTES:
        return value
    bad.append(f"{key}: want a non-empty string of at most {MAX_ID_BYTES} bytes, got {_show(value)}")
    return None


def _flag(value: Any, bad: list[str], key: str) -> bool | None:
    if isinstance(value, bool):
        return value
    bad.append(f"{key}: want true or false, got {_show(value)}")
    return None


def _step(value: Any, bad: list[str], key: str) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    bad.append(f"{key}: want an integer >= 0, got {_show(value)}")
    return None


def _priority(value: Any, bad: list[str], key: str) -> int | str | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and value in PRIORITY_WORDS:
        return value
    bad.append(f"{key}: want an integer >= 0 or one of {', '.join(PRIORITY_WORDS)}, got {_show(value)}")
    return None


def _next(value: Any, bad: list[str], key: str) -> tuple[str, ...] | None:
    if isinstance(value, (list, tuple)) and len(value) <= MAX_NEXT:
        names = [_name(v, bad, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(n for n in names if n is not None)
    bad.append(f"{key}: want a list of at most {MAX_NEXT} names, got {_show(value)}")
    return None


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# request field -> (RequestHints field, check)
_FIELDS = {"workflow": ("workflow", _name), "workflow_type": ("wtype", _name), "agent": ("agent", _name),
           "step": ("step", _step), "next": ("next", _next), "priority": ("priority", _priority),
           "session": ("session", _name), "session_id": ("session_id", _name),
           "workflow_end": ("workflow_end", _flag), "session_end": ("session_end", _flag)}


