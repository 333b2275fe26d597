"""`kvstore hint` and `kvstore workflows`: workflow hints by hand, and the workflows the daemon tracks."""
from __future__ import annotations

import argparse
from typing import Any

from kvstore.cli.common import client, out, table_of


def cmd_hint(args: argparse.Namespace) -> int:
    """Exit status 0 whether the daemon took the hint or ignored it (it says which); 1 if it refused it."""
    kind = f"session_{args.kind}" if args.session and args.kind != "call" else args.kind
    fields: dict[str, Any] = {"session" if args.session else "workflow": args.workflow}
    for name in ("type", "agent", "step", "next"):
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    if args.priority is not None:
        fields["priority"] = int(args.priority) if args.priority.isdigit() else args.priority
    with client(args) as c:
        r = c.hint(kind, **fields)
    state = "active" if r["active"] else "not active"
    text = f"{r['workflow']}: {state}, {r['steps']} step(s)"
    out(args, r, f"{text} — ignored: {r['ignored']}" if "ignored" in r else text)
    return 0


def cmd_workflows(args: argparse.Namespace) -> int:
    with client(args) as c:
        rows = c.workflows(args.limit)
    headers = ["workflow", "type", "last agent", "steps", "idle", "priority", "next"]
    table = [[w["workflow"], w["type"] or "-", w["agent"] or "-", w["steps"], f"{w['idle_s']:.1f} s",
              "-" if w["priority"] is None else w["priority"], " ".join(w["next"]) or "-"] for w in rows]
    if any(w["tenant"] for w in rows):                   # tenants configured: say whose each one is
        headers.insert(1, "tenant")
        for row, w in zip(table, rows):
            row.insert(1, w["tenant"] or "-")
    out(args, rows, table_of(headers, table) if rows else "no active workflows")
    return 0
