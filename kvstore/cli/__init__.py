"""`kvstore serve | stats | top | ls | resize | tenants | evict | flush | ping | verify | hint | workflows`: human
tables by default, `--json` for scripts. One module per family of commands; this one parses and dispatches."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from kvstore.cli.books import cmd_evict, cmd_flush, cmd_ls, cmd_resize, cmd_tenants, cmd_verify
from kvstore.cli.hints import cmd_hint, cmd_workflows
from kvstore.cli.rates import SORTS
from kvstore.cli.serve import cmd_serve
from kvstore.cli.stats import cmd_ping, cmd_stats
from kvstore.cli.top import cmd_top


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConnectionError as e:
        print(f"kvstore: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        from kvstore.client import KVStoreError
        from kvstore.daemon.config import ConfigError

        if isinstance(e, KVStoreError) and e.code == "forbidden":
            print(f"kvstore: refused by the daemon: {e.message}", file=sys.stderr)
            return 1
        if isinstance(e, (KVStoreError, ConfigError, ValueError)):
            print(f"kvstore: {e}", file=sys.stderr)
            return 1
        raise


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvstore", description="Per-node KV-cache daemon for LLM inference engines.")
    p.add_argument("--socket", help="daemon socket (default: the configured one)")
    p.add_argument("--tenant", help="speak for this tenant (default: KVSTORE_TENANT, else your user's); its secret, "
                                    "if it has one, from KVSTORE_TENANT_SECRET")
    p.add_argument("--admin-secret-file", help="the daemon's admin secret (server.admin_secret_file), for admin "
                                               "commands where tenants have secrets (default: KVSTORE_ADMIN_SECRET, "
                                               "else the file KVSTORE_ADMIN_SECRET_FILE names)")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run the daemon in the foreground")
    s.add_argument("--config", help="YAML file over the embedded default (configs/default.yaml)")
    s.add_argument("--capacity", help="host pool size, e.g. 8GiB (overrides the configuration)")
    s.set_defaults(func=cmd_serve)
    _top_parser(sub)
    for name, func, text in (("stats", cmd_stats, "capacity, use and counters per tier"),
                             ("ping", cmd_ping, "check that the daemon answers")):
        c = sub.add_parser(name, help=text)
        c.add_argument("--json", action="store_true")
        c.set_defaults(func=func)
    c = sub.add_parser("ls", help="namespaces and their blocks")
    c.add_argument("--ns", type=int, help="also list this namespace's block hashes")
    c.add_argument("--tier", choices=["host", "ssd"], default="host", help="ssd: blocks on SSD per namespace")
    c.add_argument("--limit", type=int, default=20)
    c.add_argument("--tags", action="store_true", help="with --ns: each block's standing and the workflows (agents) "
                   "that touched it (pool.eviction: workflow)")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_ls)
    c = sub.add_parser("resize", help="grow or shrink a tier online: `resize 16GiB` (host), `resize ssd 1TiB`")
    c.add_argument("what", nargs="+", metavar="[TIER] SIZE", help="tier (host or ssd, default host) and capacity")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_resize)
    c = sub.add_parser("tenants", help="quota, use, borrowing and lending per tenant; "
                       "`tenants set NAME --host 8GiB --ssd 100GiB`")
    c.add_argument("action", nargs="*", metavar="set NAME", help="set NAME: change a tenant's quota online (admin)")
    c.add_argument("--host", help="with set: the tenant's guaranteed host-pool bytes, e.g. 8GiB (0: none)")
    c.add_argument("--ssd", help="with set: the tenant's guaranteed SSD bytes, e.g. 100GiB (0: none)")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_tenants)
    c = sub.add_parser("evict", help="evict unpinned blocks")
    g = c.add_mutually_exclusive_group(required=True)
    g.add_argument("--all", action="store_true")
    g.add_argument("--bytes", help="free at least this much, e.g. 1GiB")
    c.add_argument("--ns", type=int, help="only this namespace")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_evict)
    c = sub.add_parser("flush", help="wait until every block your tenant stored is on disk (SSD tier, synced)")
    c.add_argument("--timeout", type=float, help="seconds to wait at most (default: the daemon's "
                                                 "ssd.durable_timeout_s)")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_flush)
    _hint_parsers(sub)
    c = sub.add_parser("verify", help="check every record of an SSD directory offline (the daemon stopped)")
    c.add_argument("--dir", required=True, help="the SSD tier's directory")
    c.add_argument("--fix", action="store_true", help="quarantine the bad records")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_verify)
    return p


def _top_parser(sub: Any) -> None:
    c = sub.add_parser("top", help="live: ops, hit rates per tier, tenants and namespaces, movement between tiers, "
                                   "traffic lanes; q quits, s cycles the sort")
    c.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    c.add_argument("--count", type=int, default=0, help="stop after this many refreshes (0: until q or Ctrl-C)")
    c.add_argument("--sort", choices=SORTS, default="activity", help="order of the tenant and namespace rows "
                   "(activity: blocks looked up per second, for a namespace the change in its blocks)")
    c.add_argument("--tenant", dest="only_tenant", metavar="NAME", help="only this tenant's rows ('' for the default "
                   "tenant); `kvstore --tenant NAME top` instead speaks as that tenant")
    c.add_argument("--ns", help="only the namespaces with this id, model or share group (and their tenants' rows)")
    c.add_argument("--json", action="store_true", help="one JSON object per refresh, one per line")
    c.set_defaults(func=cmd_top)


def _hint_parsers(sub: Any) -> None:
    c = sub.add_parser("hint", help="tell the daemon a workflow begins, an agent of it runs, or it ends (advice for "
                                    "pool.eviction: workflow)")
    c.add_argument("kind", choices=["begin", "call", "end"])
    c.add_argument("workflow", help="the workflow's id (with --session: the chat session's id)")
    c.add_argument("--session", action="store_true", help="WORKFLOW is a chat session's id")
    c.add_argument("--type", help="the workflow's type or family (begin, call)")
    c.add_argument("--agent", help="the agent invoked (call)")
    c.add_argument("--step", type=int, help="the call's step in its workflow")
    c.add_argument("--next", nargs="+", metavar="AGENT", help="the agents expected next")
    c.add_argument("--priority", help="an integer, or low, normal, high")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_hint)
    c = sub.add_parser("workflows", help="active workflows and sessions: type, last agent, steps, idle time")
    c.add_argument("--limit", type=int, default=100)
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_workflows)
