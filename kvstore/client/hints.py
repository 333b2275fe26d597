"""Hints from the client (issue 14): tell the daemon which workflow, agent and chat session a request belongs to, so
its eviction policy keeps what the next agent will reuse and drops what no running workflow will.

    w = client.workflow("w1", type="codegen")     # a handle: nothing is sent yet
    w.call("coder", step=1, next=["tester"])      # agent `coder` runs now (a workflow not begun begins here)
    ns.get(hashes, outs, context=w.context("coder"))
    w.end()                                       # its blocks are the first to go
    with client.session("chat-9") as s:           # a chat: every turn reuses the whole history
        ns.put(hashes, blocks, context=s.context())

Hints are advice: the handles' methods never raise for a hint the daemon refuses or a daemon that is away — they
return `{"ignored": "<why>"}` (and log at debug), so an engine never fails for one. `Client.hint` is the raw op,
which raises like any other call. A `Context` rides on lookup, acquire, reserve and commit as `wf` and `agent`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

if TYPE_CHECKING:
    from kvstore.client.connection import Client

log = logging.getLogger("kvstore.client")
SESSION = "session:"          # a chat session's workflow id on the wire: SESSION + its id


@dataclass(frozen=True, slots=True)
class Context:
    """The workflow (or chat session, as "session:<id>") and agent a request belongs to."""
    workflow: str
    agent: str = ""

    @classmethod
    def of_session(cls, sid: str, agent: str = "") -> Context:
        return cls(SESSION + sid, agent)


ContextLike = Union[Context, "tuple[str, str]", None]


def context_fields(context: ContextLike) -> dict[str, str]:
    """The request fields of a context (none for None)."""
    if context is None:
        return {}
    wf, agent = (context.workflow, context.agent) if isinstance(context, Context) else context
    if not isinstance(wf, str) or not isinstance(agent, str):
        raise TypeError(f"context: expected Context(workflow, agent) or a (workflow, agent) pair of strings, got "
                        f"{context!r}")
    return {"wf": wf, "agent": agent} if agent else {"wf": wf}


def _advice(client: Client, kind: str, fields: dict[str, Any]) -> dict[str, Any]:
    """Send one hint; a refusal or a lost daemon becomes {"ignored": ...}, never an exception."""
    from kvstore.client.connection import KVStoreError

    try:
        return client.hint(kind, **fields)
    except (KVStoreError, ConnectionError, OSError) as e:
        log.debug("hint %s %s not taken: %s", kind, fields, e)
        return {"ignored": str(e)}


class WorkflowHandle:
    """One workflow's hints (Client.workflow)."""

    def __init__(self, client: Client, wid: str, wtype: str | None = None) -> None:
        self.client = client
        self.id = wid
        self.type = wtype

    def _fields(self) -> dict[str, Any]:
        return {"workflow": self.id, **({"type": self.type} if self.type else {})}

    def begin(self) -> dict[str, Any]:
        return _advice(self.client, "begin", self._fields())

    def call(self, agent: str, step: int | None = None, next: list[str] | None = None,
             priority: int | str | None = None) -> dict[str, Any]:
        """Agent `agent` is invoked now (optionally: its step, the agents expected next, a priority)."""
        return _advice(self.client, "call", {**self._fields(), "agent": agent, **_optional(step, next, priority)})

    def end(self) -> dict[str, Any]:
        return _advice(self.client, "end", {"workflow": self.id})

    def context(self, agent: str = "") -> Context:
        return Context(self.id, agent)

    def __enter__(self) -> WorkflowHandle:
        self.begin()
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()


class SessionHandle:
    """One chat session's hints (Client.session): a workflow of type "session" whose turns are its calls."""

    def __init__(self, client: Client, sid: str) -> None:
        self.client = client
        self.id = sid

    def begin(self) -> dict[str, Any]:
        return _advice(self.client, "session_begin", {"session": self.id})

    def turn(self, agent: str = "", priority: int | str | None = None) -> dict[str, Any]:
        return _advice(self.client, "call", {"session": self.id, "agent": agent, **_optional(None, None, priority)})

    def end(self) -> dict[str, Any]:
        return _advice(self.client, "session_end", {"session": self.id})

    def context(self, agent: str = "") -> Context:
        return Context.of_session(self.id, agent)

    def __enter__(self) -> SessionHandle:
        self.begin()
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()


def _optional(step: int | None, next: list[str] | None, priority: int | str | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if step is not None:
        out["step"] = step
    if next is not None:
        out["next"] = list(next)
    if priority is not None:
        out["priority"] = priority
    return out
