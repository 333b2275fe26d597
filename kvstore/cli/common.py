"""What every command shares: the client it talks through, tables, `--json` output, units of time."""
from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from kvstore.histogram import BUCKETS


def client(args: argparse.Namespace) -> Any:
    from kvstore.client import Client

    secret = admin_secret(args)
    if args.socket:
        return Client(args.socket, tenant=args.tenant, admin_secret=secret)
    from kvstore.daemon.config import load_config

    return Client(load_config().server.socket, tenant=args.tenant, admin_secret=secret)


def admin_secret(args: argparse.Namespace) -> str | None:
    """The admin secret a command's hello carries: --admin-secret-file, else KVSTORE_ADMIN_SECRET(_FILE) (the
    client reads those), else the daemon's configuration as this user can load it (server.admin_secret, or the
    file server.admin_secret_file names, where readable)."""
    import os

    if getattr(args, "admin_secret_file", None):
        with open(args.admin_secret_file) as f:
            return f.read().strip() or None
    if os.environ.get("KVSTORE_ADMIN_SECRET") or os.environ.get("KVSTORE_ADMIN_SECRET_FILE"):
        return None
    from kvstore.daemon.config import ConfigError, load_config

    try:
        return load_config(os.environ.get("KVSTORE_CONFIG")).server.admin_secret or None
    except (ConfigError, OSError):
        return None


def table_of(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def out(args: argparse.Namespace, data: Any, human: str) -> None:
    print(json.dumps(data, indent=2, default=str) if args.json else human)


def us(seconds: float | None) -> str:
    return f">{BUCKETS[-1]:g} s" if seconds is None else f"≤{seconds * 1e6:.0f} µs"


def ms(seconds: float | None) -> str:
    return "over 10 s" if seconds is None else f"{seconds * 1e3:.2f} ms"


def pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.1f}%"
