"""`kvstore top`: the daemon's work, refreshed every interval from two samples of `stats` and `list` (the figures
and their definitions: kvstore.cli.rates). One screen, as htop or `redis-cli --stat`: a header (uptime, state,
connections, host pool and SSD use), the operations (blocks and bytes per second, hit rate per tier this interval
beside the ceiling), a row per tenant and per namespace sorted by activity, the blocks moving between tiers, and
the traffic lanes where the daemon has paths.

On a terminal it redraws in place with plain ANSI (no curses, no new dependency: a screen a second needs no
more), reads keys without Enter — `q` quits, `s` cycles the sort — and clips to the window. Anything else (a pipe,
a file) gets each interval as plain lines; `--json` one object an interval, one a line."""
from __future__ import annotations

import argparse
import json
import os
import select as selecting
import sys
import time
from types import TracebackType
from typing import Any

from kvstore.cli.common import client, pct, table_of, us
from kvstore.cli.rates import SORTS, interval, sample, select
from kvstore.cli.stats import hit_split
from kvstore.units import format_size

CLEAR = "\x1b[H\x1b[2J"


def cmd_top(args: argparse.Namespace) -> int:
    if not args.interval > 0:
        raise ValueError(f"--interval must be above 0 seconds, got {args.interval:g}")
    order = args.sort
    keyed = not args.json and sys.stdin.isatty() and sys.stdout.isatty()
    try:
        with client(args) as c, Keys(keyed) as keys:
            hello = c.call("hello")                     # whose rows the daemon shows us: all, or our tenant's
            viewer = {"tenant": hello.get("tenant"), "admin": hello.get("admin", True)}
            before, shown, n = sample(c), None, 0
            while args.count <= 0 or n < args.count:
                deadline = time.monotonic() + args.interval
                while (key := keys.next(deadline)) is not None:
                    if key == "q":
                        return 0
                    order = SORTS[(SORTS.index(order) + 1) % len(SORTS)]
                    if shown is not None:
                        show(select(shown, order, args.only_tenant, args.ns), args, keyed)
                after = sample(c)
                shown, before, n = {**interval(before, after), "viewer": viewer}, after, n + 1
                show(select(shown, order, args.only_tenant, args.ns), args, keyed)
    except KeyboardInterrupt:
        pass
    return 0


def show(frame: dict[str, Any], args: argparse.Namespace, keyed: bool) -> None:
    if args.json:
        print(json.dumps(frame), flush=True)
        return
    lines = render(frame, args.interval, keyed)
    if not sys.stdout.isatty():
        print("\n".join(lines) + "\n", flush=True)
        return
    try:
        width, height = os.get_terminal_size(sys.stdout.fileno())     # the window now (COLUMNS may be stale)
    except OSError:
        width, height = 80, 24
    if len(lines) > height - 1:
        lines = lines[:height - 2] + [f"… {len(lines) - height + 2} more line(s): a taller window, or --tenant/--ns"]
    sys.stdout.write(CLEAR + "\n".join(line[:width] for line in lines) + "\n")
    sys.stdout.flush()


class Keys:
    """Keys read one at a time without echo while a terminal is both stdin and stdout (cbreak mode, restored on
    exit); otherwise `next` just waits."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.saved: Any = None

    def __enter__(self) -> Keys:
        if self.enabled:
            import termios
            import tty

            self.saved = termios.tcgetattr(sys.stdin.fileno())
            tty.setcbreak(sys.stdin.fileno())
            sys.stdout.write("\x1b[?25l")               # no cursor blinking over the figures
        return self

    def __exit__(self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if self.saved is not None:
            import termios

            termios.tcsetattr(sys.stdin.fileno(), termios.TCSADRAIN, self.saved)
            sys.stdout.write("\x1b[?25h")
            sys.stdout.flush()

    def next(self, deadline: float) -> str | None:
        """`q` or `s` as soon as one is typed (other keys are ignored), None at the deadline."""
        while (left := deadline - time.monotonic()) > 0:
            if not self.enabled:
                time.sleep(left)
                break
            ready, _, _ = selecting.select([sys.stdin.fileno()], [], [], left)
            if not ready:
                break
            typed = os.read(sys.stdin.fileno(), 64).decode(errors="ignore").lower()
            if not typed:                              # end of input: the terminal is gone
                return "q"
            for ch in typed:
                if ch in "qs":
                    return ch
        return None


def render(f: dict[str, Any], every: float, keyed: bool) -> list[str]:
    keys = " (s: next sort, q: quit)" if keyed else ""
    lines = [*_head(f["daemon"], every), *_viewer(f["viewer"]), f"sort: {f['sort']}{keys}", ""]
    lines += _ops(f).splitlines() + [""]
    if f["tenants"]:
        lines += _tenants(f["tenants"]).splitlines() + [""]
    if f["namespaces"]:
        lines += _namespaces(f["namespaces"]).splitlines() + [""]
    lines += _movement(f["movement"])
    if f["paths"]:
        lines += [""] + _paths(f["paths"]).splitlines()
    return lines


def _head(d: dict[str, Any], every: float) -> list[str]:
    state = d["state"] if d["state"] == "ready" else f"{d['state']} ({d['scanned']} of {d['records']} records)"
    tiers = "; ".join(f"{name} {format_size(t['used_bytes'])} of {format_size(t['capacity_bytes'])}"
                      + (f" ({t['used_bytes'] / t['capacity_bytes']:.0%})" if t["capacity_bytes"] else "")
                      for name, t in d["tiers"].items())
    return [f"kvstore top — up {_duration(d['uptime_s'])}, {state}, every {every:g} s; {d['connections']} "
            f"connection(s), {d['namespaces']} namespace(s)", f"used: {tiers}"]


def _viewer(v: dict[str, Any]) -> list[str]:
    if v["admin"]:
        return []
    return [f"not the admin: tenant {v['tenant'] or '(default)'}'s rows only (all of them with the admin secret: "
            "--admin-secret-file, or KVSTORE_ADMIN_SECRET)"]


def _duration(s: float) -> str:
    s = int(s)
    return f"{s // 86400}d{s % 86400 // 3600:02d}h" if s >= 86400 else \
        f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def rate_of(bytes_per_s: float | None, exact: bool = True) -> str:
    return "-" if bytes_per_s is None else ("" if exact else "~") + format_size(bytes_per_s) + "/s"


def _ops(f: dict[str, Any]) -> str:
    o, hr, since = f["ops"], f["hit_rates"], f["since_start"]

    def hits(r: dict[str, float | None]) -> list[str]:
        return [pct(r["host"]), pct(r["lower"]), pct(r["miss"])]
    rows = [["lookup", f"{o['lookups_per_s']:.0f}", f"{o['lookup_blocks_per_s']:.0f}", "-", *hits(hr["lookup"])],
            ["get", "", f"{o['get_blocks_per_s']:.0f}", rate_of(o["get_bytes_per_s"], o["bytes_exact"]),
             *hits(hr["acquire"])],
            ["put", "", f"{o['put_blocks_per_s']:.0f}", rate_of(o["put_bytes_per_s"], o["bytes_exact"]), "", "", ""]]
    table = table_of(["op", "calls/s", "blocks/s", "bytes/s", "hit host", "lower", "miss"], rows)
    lookup = (since["hit_rates"] or {}).get("lookup") or {"host": None, "lower": None, "miss": None}
    return f"{table}\nsince start: lookup hit rate {hit_split(lookup)}; hit-rate ceiling {pct(since['ceiling'])}"


def _tenants(rows: list[dict[str, Any]]) -> str:
    ssd = any(r["ssd_held_bytes"] is not None for r in rows)
    heads = ["tenant", "lookup blk/s", "hit", "hit since start", "got+put/s", "held", "evict/s"] + (
        ["ssd held", "ssd evict/s"] if ssd else [])
    return table_of(heads, [[r["tenant"] or "(default)", f"{r['lookup_blocks_per_s']:.0f}", pct(r["hit_rate"]),
                             pct(r["hit_rate_since_start"]), format_size(int(r.get("bytes_per_s", 0))) + "/s",
                             format_size(r["held_bytes"]), f"{r['evictions_per_s']:.0f}"]
                            + ([format_size(r["ssd_held_bytes"] or 0), f"{r['ssd_evictions_per_s'] or 0:.0f}"]
                               if ssd else []) for r in rows])


def _namespaces(rows: list[dict[str, Any]]) -> str:
    ssd = any(r["ssd_blocks"] is not None for r in rows)
    heads = ["ns", "tenant", "model", "group", "lookups/s", "hit", "got+put/s", "blocks", "held",
             "Δblocks/s"] + (["ssd blocks"] if ssd else [])
    return table_of(heads, [[r["id"], r["tenant"] or "(default)", r["model"] + (f" [{r['kv_group']}]"
                                                                                  if r["kv_group"] else ""),
                             r["group"], f"{r.get('lookups_per_s', 0):.0f}", pct(r.get("hit_rate")),
                             format_size(int(r.get("bytes_per_s", 0))) + "/s", r["blocks"],
                             format_size(r["held_bytes"]), f"{r['blocks_per_s']:+.0f}"]
                            + ([r["ssd_blocks"] or 0] if ssd else []) for r in rows])


def _movement(m: dict[str, Any]) -> list[str]:
    lines = [f"moved (blocks/s): evicted {m['evictions_per_s']:.0f}, demoted {m['demotions_per_s']:.0f}, "
             f"promoted {m['promotions_per_s']:.0f}, dropped {m['dropped_per_s']:.0f}, "
             f"prefetched {m['prefetched_per_s']:.0f}"]
    if m["prefetch"]:
        p = m["prefetch"]
        lines.append(f"predictive prefetch (blocks/s): landed {p['landed_per_s']:.0f}, used {p['used_per_s']:.0f}; "
                     f"precision since start {pct(p['precision'])}")
    if m["write_through"]:
        w = m["write_through"]
        lines.append(f"write-through {'on' if w['enabled'] else 'off'}: {w['pending']} block(s) on their way to "
                     f"disk, oldest {w['oldest_pending_s']:.2f} s; {w['synced']} synced"
                     + (f", lag p50 {us(w['lag_p50_s'])}, p99 {us(w['lag_p99_s'])}" if w["synced"] else ""))
    if m["remote"]:
        r = m["remote"]
        lines.append(f"remote store {'up' if r['up'] else 'DOWN'}: puts {r['puts_per_s']:.0f}/s, gets "
                     f"{r['gets_per_s']:.0f}/s, unreachable {r['unreachable_per_s']:.0f}/s, "
                     f"{format_size(r['staged_bytes'] or 0)} staged")
    return lines


def _paths(rows: list[dict[str, Any]]) -> str:
    return table_of(["path", "lane", "bytes/s", "ops/s", "queued", "in flight", "p50", "p99", "busy"],
                    [[r["path"], r["lane"], rate_of(r["bytes_per_s"]), f"{r['transfers_per_s']:.0f}", r["queued"],
                      r["in_flight"], *([us(r["p50_s"]), us(r["p99_s"])] if r["transfers_per_s"] else ["-", "-"]),
                      r["rejected"]] for r in rows])
