"""`kvstore top` as an operator keeps it open, against the default daemon (no SSD tier) while two tenants put, look
up and get: in a pseudo-terminal (redrawn in place, live rates, a row per tenant and per namespace, `s` cycles the
sort, `q` quits and gives the terminal back), as `--json` (one object an interval, the documented fields), as plain
lines into a pipe, and filtered to one tenant or namespace."""
from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvstore.cli.rates import Sample, block_bytes, interval
from kvstore.cli.top import CLEAR
from kvstore.client import Client
from tests.conftest import GEOM, DaemonProc, block, hashes, spec

TENANTS = [{"name": "a", "secret": "secret-a"}, {"name": "b", "secret": "secret-b"}]


def load(d: DaemonProc, tenant: str, stop: threading.Event) -> None:
    """One engine of a tenant: every round, 8 new blocks (a lookup that misses, then their put) and the tenant's 32
    hot blocks looked up (hits) and read back; the pool (16 MiB, 8 KiB blocks) fills in about a second, then
    evicts."""
    with Client(d.socket, tenant=tenant, secret=f"secret-{tenant}") as c:
        ns = c.namespace(spec(f"model-{tenant}"))
        hot, blocks = hashes(32, tag=tenant.encode()), [block(i) for i in range(32)]
        outs = [bytearray(GEOM.full_bytes) for _ in range(8)]
        i = 0
        while not stop.is_set():
            fresh = hashes(8, start=1000 + 8 * i, tag=tenant.encode())
            ns.lookup(fresh)
            ns.put(fresh, blocks[:8])
            ns.put(hot, blocks)
            ns.lookup(hot)
            ns.get(hot[:8], outs)
            i += 1
            time.sleep(0.01)


@pytest.fixture
def loaded(tmp_path: Path, daemons: list[DaemonProc]) -> Iterator[DaemonProc]:
    """The default daemon (no SSD tier) with tenants a and b, each loading it from its own thread."""
    conf = tmp_path / "kvstore.yaml"
    conf.write_text(yaml.safe_dump({"tenants": TENANTS}))
    d = DaemonProc(env={"KVSTORE_CONFIG": str(conf)}).start()
    daemons.append(d)
    stop = threading.Event()
    engines = [threading.Thread(target=load, args=(d, t, stop), daemon=True) for t in ("a", "b")]
    for t in engines:
        t.start()
    yield d
    stop.set()
    for t in engines:
        t.join(timeout=30)


def top(d: DaemonProc, *args: str, admin: bool = True) -> list[str]:
    """`kvstore top` into a pipe, as the daemon's admin (with its admin secret: tenants have secrets) or not."""
    r = subprocess.run([sys.executable, "-m", "kvstore", "--socket", d.socket, "top", "--interval", "0.5", *args],
                       capture_output=True, text=True, timeout=60, env=d.cli_env() if admin else None)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


class Terminal:
    """`kvstore top` in a pseudo-terminal of 60 rows by 200 columns: what it drew, and keys typed into it."""

    def __init__(self, d: DaemonProc, *args: str) -> None:
        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 60, 200, 0, 0))
        self.proc = subprocess.Popen([sys.executable, "-m", "kvstore", "--socket", d.socket, "top", *args],
                                     stdin=slave, stdout=slave, stderr=slave, close_fds=True, env=d.cli_env())
        os.close(slave)
        self.output = ""

    def read(self, timeout: float = 0.2) -> bool:
        """Whatever it wrote within `timeout`; False once it closed the terminal."""
        if not select.select([self.master], [], [], timeout)[0]:
            return True
        try:
            chunk = os.read(self.master, 65536)
        except OSError:                                 # EIO: the process exited
            return False
        self.output += chunk.decode(errors="replace").replace("\r", "")
        return bool(chunk)

    def screen(self, looks_right: Callable[[str], bool], timeout: float = 30.0) -> str:
        """The first screen (what follows a clear) that looks right, within `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            alive = self.read()
            for s in self.output.split(CLEAR)[1:]:
                if looks_right(s):
                    return s
            assert alive, self.output
        raise AssertionError(f"no such screen within {timeout} s; the last:\n{self.output.split(CLEAR)[-1]}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)


def tenant_rows(screen: str) -> dict[str, list[str]]:
    """The tenant table's rows: name → cells (lookup blk/s, hit, hit since start, got+put/s, held, evict/s)."""
    return {m[1]: m[2].split() for m in re.finditer(r"^(a|b|\(default\))\s{2,}(\d.*)$", screen, re.M)}


def live(screen: str) -> bool:
    rows = tenant_rows(screen)
    return all(t in rows and int(rows[t][0]) > 0 and rows[t][1].endswith("%") for t in ("a", "b"))


def test_top_in_a_terminal_shows_live_rates_per_tenant_and_namespace_and_keys_work(loaded):
    term = Terminal(loaded, "--interval", "0.5")
    try:
        screen = term.screen(live)                               # both tenants busy, hit rates known
        assert re.search(r"^kvstore top — up \d+m\d\ds, ready, every 0.5 s; \d+ connection\(s\), 2 namespace\(s\)\n"
                         r"used: host \S+ \S+ of 16.0 MiB \(\d+%\)$", screen, re.M), screen
        assert "sort: activity (s: next sort, q: quit)" in screen
        lookup = re.search(r"^lookup\s+(\d+)\s+(\d+)\s+-\s+(\S+)%\s+(\S+)%\s+(\S+)%$", screen, re.M)
        assert lookup and int(lookup[1]) > 0 and int(lookup[2]) > 0, screen
        assert 0 < float(lookup[3]) < 100 and float(lookup[5]) > 0       # hits and misses: the new blocks miss
        get = re.search(r"^get\s+(\d+)\s+(\S+ \S+/s)\s+100.0%", screen, re.M)
        assert get and int(get[1]) > 0 and not get[2].startswith("0 B"), screen
        assert re.search(r"^since start: lookup hit rate host \S+%, lower tiers 0.0%, miss \S+%; hit-rate "
                         r"ceiling \S+%", screen, re.M)
        for t in ("a", "b"):                 # a row per namespace, whose tenant it is: its lookups/s and hit rate
            row = re.search(rf"^\d+\s+{t}\s+model-{t}\s+model-{t}\s+(\d+)\s+(\S+)%\s+\S+ \S+/s\s+\d+\s+\S+ \S+"
                            rf"\s+[+-]\d+$", screen, re.M)
            assert row and int(row[1]) > 0 and 0 < float(row[2]) < 100, screen
        assert "moved (blocks/s): evicted" in screen and "no traffic paths" not in screen

        os.write(term.master, b"s")                               # the next sort, drawn at once
        assert "sort: hit" in term.screen(lambda s: "sort: hit (s: next sort" in s, timeout=5)
        os.write(term.master, b"q")
        assert term.proc.wait(timeout=10) == 0
        while term.read():
            pass
        assert term.output.endswith("\x1b[?25h"), term.output[-200:]     # the cursor given back
    finally:
        term.close()


DOCUMENTED = {"time", "seconds", "daemon", "ops", "hit_rates", "since_start", "tenants", "namespaces", "movement",
              "paths", "sort", "viewer"}


def test_top_json_is_one_object_an_interval_with_the_documented_fields(loaded):
    time.sleep(1.0)                                              # the engines under way
    frames = [json.loads(line) for line in top(loaded, "--json", "--count", "3")]
    assert len(frames) == 3 and all(set(f) == DOCUMENTED for f in frames)
    f = frames[-1]
    assert f["daemon"]["state"] == "ready" and f["daemon"]["tiers"]["host"]["capacity_bytes"] == 16 << 20
    assert 0.4 < f["seconds"] < 5.0
    o = f["ops"]
    assert o["lookups_per_s"] > 0 and o["lookup_blocks_per_s"] > 0 and o["put_blocks_per_s"] > 0
    assert o["bytes_exact"] and o["get_bytes_per_s"] == pytest.approx(o["get_blocks_per_s"] * GEOM.full_bytes)
    shares = f["hit_rates"]["lookup"]
    assert sum(shares.values()) == pytest.approx(1.0) and shares["lower"] == 0.0 and shares["miss"] > 0
    assert f["hit_rates"]["acquire"]["host"] > 0.9                   # the gets read hot blocks
    assert set(f["since_start"]) == {"hit_rates", "ceiling"} and f["viewer"] == {"tenant": "", "admin": True}
    tenants = {r["tenant"]: r for r in f["tenants"]}
    for t in ("a", "b"):
        assert tenants[t]["lookup_blocks_per_s"] > 0 and 0 < tenants[t]["hit_rate"] < 1, tenants[t]
        assert tenants[t]["held_bytes"] > 0 and tenants[t]["ssd_held_bytes"] is None
        assert tenants[t]["bytes_per_s"] > 0                 # its namespaces' gets and puts
    assert {n["model"]: n["tenant"] for n in f["namespaces"]} == {"model-a": "a", "model-b": "b"}
    for n in f["namespaces"]:                                        # per namespace: its own ops and hit rate
        assert n["lookups_per_s"] > 0 and 0 < n["hit_rate"] < 1 and n["bytes_per_s"] > 0, n
        assert n["hit_rate"] == pytest.approx(tenants[n["tenant"]]["hit_rate"], abs=0.05)   # its tenant's only ns
    m = f["movement"]
    assert (m["write_through"], m["remote"], m["prefetch"], f["paths"]) == (None, None, None, [])
    assert [r["lookup_blocks_per_s"] for r in f["tenants"]] == sorted(
        (r["lookup_blocks_per_s"] for r in f["tenants"]), reverse=True)         # sorted by activity


def test_top_filters_to_a_tenant_or_a_namespace_and_prints_plain_lines_into_a_pipe(loaded):
    (one,) = [json.loads(line) for line in top(loaded, "--json", "--count", "1", "--tenant", "a")]
    assert [r["tenant"] for r in one["tenants"]] == ["a"]
    assert [n["model"] for n in one["namespaces"]] == ["model-a"]
    (one,) = [json.loads(line) for line in top(loaded, "--json", "--count", "1", "--ns", "model-b")]
    assert ([r["tenant"] for r in one["tenants"]], [n["model"] for n in one["namespaces"]]) == (["b"], ["model-b"])
    text = "\n".join(top(loaded, "--count", "1", "--tenant", "b", "--sort", "name"))
    assert "\x1b" not in text and text.startswith("kvstore top — up ") and "sort: name\n" in text
    assert set(tenant_rows(text)) == {"b"}
    (mine,) = [json.loads(line) for line in top(loaded, "--json", "--count", "1", admin=False)]
    assert mine["viewer"] == {"tenant": "", "admin": False}              # the daemon's user without the secret:
    assert not {r["tenant"] for r in mine["tenants"] + mine["namespaces"]} & {"a", "b"}   # its own tenant's only
    assert "not the admin: tenant (default)'s rows only" in "\n".join(top(loaded, "--count", "1", admin=False))
    r = subprocess.run([sys.executable, "-m", "kvstore", "top", "--sort", "fastest"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "invalid choice: 'fastest'" in r.stderr
    r = subprocess.run([sys.executable, "-m", "kvstore", "--socket", loaded.socket, "top", "--interval", "0"],
                       capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stderr) == (1, "kvstore: --interval must be above 0 seconds, got 0\n")


def test_an_interval_counts_from_zero_after_a_restart_and_marks_estimated_bytes():
    """No daemon: two samples by hand. A restarted daemon (another pid) has counters from zero — its rates are
    since its start, never negative; bytes per second over namespaces of two block sizes are an estimate."""
    def stats(pid: int, hits: int) -> dict[str, Any]:
        return {"pid": pid, "uptime_s": 1.0, "connections": 1, "namespaces": 2,
                "tiers": [{"tier": "host", "used_bytes": 0, "capacity_bytes": 1}],
                "counters": {"lookups": 1, "hits": hits, "hits_host": hits, "misses": 0, "gets": 10, "puts": 0}}
    listing = {"namespaces": [{"id": 1, "digest": "01", "model": "m", "group": "m", "slot_bytes": 1000, "blocks": 3,
                               "bytes": 3000}, {"id": 2, "digest": "02", "model": "n", "group": "n",
                                                "slot_bytes": 2000, "blocks": 1, "bytes": 2000}]}
    f = interval(Sample(stats(1, 500), listing, 0.0), Sample(stats(2, 40), listing, 2.0))
    assert (f["ops"]["lookup_blocks_per_s"], f["hit_rates"]["lookup"]["host"]) == (20.0, 1.0)  # 40 hits in 2 s
    assert block_bytes(listing) == (1250.0, False) and f["ops"]["get_bytes_per_s"] == 10 * 1250.0 / 2
    assert not f["ops"]["bytes_exact"]
