"""`kvstore ping | stats | ls | resize | evict | serve` as a user runs them (`python -m kvstore --socket PATH ...`)
against a real daemon: human tables, `--json` that agrees with the client, clear errors and exit codes."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from kvstore.client import Client
from tests.conftest import GEOM, block, hashes, spec, ssd_settled


def kvstore(*args: str, sock: str | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    head = ["--socket", sock] if sock else []
    return subprocess.run([sys.executable, "-m", "kvstore", *head, *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})


def kvstore_json(*args: str, sock: str) -> Any:
    r = kvstore(*args, "--json", sock=sock)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def put(c: Client, n: int, model: str = "tiny") -> tuple[int, list[bytes]]:
    ns = c.namespace(spec(model))
    hs = hashes(n, tag=model.encode())
    assert ns.put(hs, [block(i) for i in range(n)]).stored == n
    return ns.id, hs


def test_ping(daemon):
    r = kvstore("ping", sock=daemon.socket)
    assert r.returncode == 0 and r.stdout.startswith(f"pong from {daemon.socket} in ")
    j = kvstore_json("ping", sock=daemon.socket)
    assert j["ok"] is True and j["rtt_us"] > 0
    # without --socket, the configured one (here from the environment)
    r = kvstore("ping", env={"KVSTORE_SERVER_SOCKET": daemon.socket})
    assert r.returncode == 0 and daemon.socket in r.stdout


def test_stats_table_and_json_agree_with_the_client(daemon):
    with daemon.client() as c:
        nid, hs = put(c, 5)
        ns = c.namespace(spec("tiny"))
        assert ns.lookup(hs) == 5 and ns.lookup(hashes(2, tag=b"absent")) == 0
        with ns.acquire(hs[:2]) as lease:
            assert len(lease) == 2
        s = c.stats()
        j = kvstore_json("stats", sock=daemon.socket)
        text = kvstore("stats", sock=daemon.socket).stdout
    assert j["counters"] == s["counters"]
    assert [j["counters"][k] for k in ("puts", "hits", "misses", "gets")] == [5, 5, 2, 2]
    assert j["tiers"] == s["tiers"]
    assert j["tiers"][0]["used_bytes"] == 5 * GEOM.full_bytes
    assert (j["blocks"], j["namespaces"], j["pinned"], j["reserved"], j["pid"]) == (5, 1, 0, 0, daemon.proc.pid)
    # the human table: a row per tier, a row per counter
    assert re.search(r"^tier\s+capacity\s+mapped\s+used\s+resident\s+blocks\s+segments$", text, re.M)
    assert re.search(r"^host\s+16\.0 MiB\s+1\.0 MiB\s+40\.0 KiB\s+\S+ \S+\s+5\s+1$", text, re.M), text
    assert re.search(r"^puts\s+5$", text, re.M) and re.search(r"^misses\s+2$", text, re.M)
    assert f"pid {daemon.proc.pid}" in text


def test_ls_lists_namespaces_and_their_hashes(daemon):
    with daemon.client() as c:
        nid, hs = put(c, 5)
        put(c, 2, model="other")
        listed = c.list(nid, limit=100)["keys"]
    text = kvstore("ls", sock=daemon.socket).stdout
    row_re = rf"^{nid}\s+tiny\s+tiny\s+-\s+0/1\s+base\s+[0-9a-f]{{12}}\s+5\s+40\.0 KiB\s+8\.0 KiB$"
    assert re.search(row_re, text, re.M), text
    assert re.search(r"^\d+\s+other\s+.*\s2\s+16\.0 KiB\s+8\.0 KiB$", text, re.M)
    j = kvstore_json("ls", "--ns", str(nid), sock=daemon.socket)
    (row,) = [n for n in j["namespaces"] if n["id"] == nid]
    assert (row["model"], row["blocks"], row["bytes"], row["slot_bytes"]) == ("tiny", 5, 5 * GEOM.full_bytes,
                                                                             GEOM.full_bytes)
    assert row["digest"] == spec("tiny").digest().hex()
    assert sorted(k for k, _ in j["keys"]) == sorted(h.hex() for h in hs)
    assert sorted(j["keys"]) == sorted([k.hex(), gid] for k, gid in listed)     # the same slots the client sees
    assert len(kvstore_json("ls", "--ns", str(nid), "--limit", "2", sock=daemon.socket)["keys"]) == 2
    text = kvstore("ls", "--ns", str(nid), sock=daemon.socket).stdout
    assert all(h.hex() in text for h in hs)


def test_ls_shows_the_kv_groups_of_a_hybrid_model_and_their_bytes(daemon):
    """A hybrid model's groups are namespaces told apart by their KV group (the connectors' salt label)."""
    from dataclasses import replace

    with daemon.client() as c:
        for label, n in (("0:window64", 2), ("1:full", 6)):
            ns = c.namespace(replace(spec("gemma"), salt=f"hash=sha256_cbor|kv_group={label}"))
            assert ns.put(hashes(n, tag=label.encode()), [block(i) for i in range(n)]).stored == n
        nid, _ = put(c, 3)
    text = kvstore("ls", sock=daemon.socket).stdout
    window = r"^\d+\s+gemma\s+gemma\s+0:window64\s+-\s+0/1\s+base\s+[0-9a-f]{12}\s+2\s+16\.0 KiB"
    assert re.search(window, text, re.M), text
    assert re.search(r"^\d+\s+gemma\s+gemma\s+1:full\s+.*\s6\s+48\.0 KiB", text, re.M), text
    assert re.search(rf"^{nid}\s+tiny\s+tiny\s+-\s+-\s+0/1", text, re.M), text      # a dense model: no group
    rows = {r["kv_group"]: r["bytes"] for r in kvstore_json("ls", sock=daemon.socket)["namespaces"]}
    assert rows == {"0:window64": 2 * GEOM.full_bytes, "1:full": 6 * GEOM.full_bytes, "": 3 * GEOM.full_bytes}


def test_ls_limit_zero_lists_no_hashes(daemon):
    with daemon.client() as c:
        nid, _ = put(c, 3)
    assert kvstore_json("ls", "--ns", str(nid), "--limit", "0", sock=daemon.socket)["keys"] == []


def test_resize(daemon):
    j = kvstore_json("resize", "8MiB", sock=daemon.socket)
    assert (j["capacity"], j["released_segments"], j["evicted"]) == (8 << 20, 0, 0)
    with daemon.client() as c:
        assert c.stats()["tiers"][0]["capacity_bytes"] == 8 << 20
    r = kvstore("resize", "32MiB", sock=daemon.socket)
    assert r.returncode == 0 and r.stdout.startswith("host pool capacity 32.0 MiB")
    with daemon.client() as c:
        assert c.stats()["tiers"][0]["capacity_bytes"] == 32 << 20


def test_evict(daemon):
    with daemon.client() as c:
        nid, hs = put(c, 5)
        j = kvstore_json("evict", "--bytes", "8KiB", sock=daemon.socket)
        assert (j["blocks"], j["bytes"]) == (1, GEOM.full_bytes)
        assert c.namespace(spec("tiny")).lookup(hs) == 4          # LRU: the oldest, the prefix's last, went
        j = kvstore_json("evict", "--all", sock=daemon.socket)
        assert (j["blocks"], j["bytes"]) == (4, 4 * GEOM.full_bytes)
        s = c.stats()
        assert (s["blocks"], s["tiers"][0]["used_bytes"], s["counters"]["evictions"]) == (0, 0, 5)
        r = kvstore("evict", "--all", sock=daemon.socket)
        assert r.returncode == 0 and r.stdout.strip() == "evicted 0 block(s), 0 B"


@pytest.mark.parametrize("args", [("ping",), ("stats",), ("ls", "--json"), ("resize", "8MiB"), ("evict", "--all")])
def test_no_daemon_is_a_clear_error_and_exit_2(tmp_path, args):
    path = str(tmp_path / "kvstore.sock")
    r = kvstore(*args, sock=path)
    assert r.returncode == 2
    assert r.stderr == (f"kvstore: no kvstore daemon at {path} (No such file or directory); start one with "
                        f"`kvstore serve` or `make serve`\n")
    assert r.stdout == ""


def test_stale_socket_without_a_daemon_is_exit_2(tmp_path):
    path = str(tmp_path / "kvstore.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(path)                                   # the file stays, nobody listens
    r = kvstore("stats", sock=path)
    assert r.returncode == 2 and "Connection refused" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("args, fragment", [
    (("resize", "1000"), "bad_request: resize: 1000 bytes is below one segment"),
    (("ls", "--ns", "99"), "unknown_namespace: list: no namespace 99"),
    (("evict", "--all", "--ns", "99"), "unknown_namespace: evict: no namespace 99"),
    (("resize", "lots"), "expected a size such as 64MiB"),
])
def test_refusals_exit_1_with_the_reason(daemon, args, fragment):
    r = kvstore(*args, sock=daemon.socket)
    assert r.returncode == 1
    assert r.stderr.startswith("kvstore: ") and fragment in r.stderr and "Traceback" not in r.stderr


def test_serve_takes_socket_and_capacity_flags(tmp_path):
    path = str(tmp_path / "run" / "kvstore.sock")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    with open(tmp_path / "log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvstore", "--socket", path, "serve", "--capacity", "8MiB"],
                                env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while kvstore("ping", sock=path).returncode != 0:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "log").read_text()
            time.sleep(0.05)
        j = kvstore_json("stats", sock=path)
        assert (j["socket"], j["tiers"][0]["capacity_bytes"], j["pid"]) == (path, 8 << 20, proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_stats_and_top_show_traffic_per_lane(start_daemon, tmp_path):
    d = start_daemon(capacity="1MiB", env={"KVSTORE_SSD_DIR": str(tmp_path / "ssd")})
    with d.client() as c:
        ns = c.namespace(spec())
        hs = hashes(200)
        assert ns.put(hs, [block(i) for i in range(200)]).stored == 200     # 72 demoted in the background
        c.evict(everything=True)
        ssd_settled(c)
    text = kvstore("stats", sock=d.socket).stdout
    assert re.search(r"^ssd\s+critical\s+0\s+0\s+0\s", text, re.M), text
    assert re.search(r"^ssd\s+background\s+0\s+0\s+\d+\s", text, re.M)
    assert "ssd scan: ready, 0 of 0 records" in text
    top = subprocess.Popen([sys.executable, "-m", "kvstore", "--socket", d.socket, "top", "--json",
                            "--interval", "1", "--count", "3"], stdout=subprocess.PIPE, text=True)
    assert top.stdout is not None
    reading = threading.Event()

    def critical_reads() -> None:               # until top's first interval is over, however slow it starts
        with d.client() as c:
            ns = c.namespace(spec())
            while not reading.is_set():
                assert ns.get(hs[:20], [bytearray(GEOM.full_bytes) for _ in range(20)]) == 20   # from the SSD
                c.evict(everything=True)                    # (on the SSD already: the next get reads it again)
    reader = threading.Thread(target=critical_reads)
    reader.start()
    first = top.stdout.readline()
    reading.set()
    reader.join()
    out, _ = top.communicate(timeout=30)
    lines = [json.loads(x) for x in [first, *out.splitlines()]]
    assert len(lines) == 3 and top.returncode == 0
    crit = [r for r in lines[0]["paths"] if r["lane"] == "critical"][0]
    assert crit["transfers_per_s"] > 0 and crit["bytes_per_s"] > 0 and crit["p99_s"] > 0
    assert [r for r in lines[2]["paths"] if r["lane"] == "critical"][0]["transfers_per_s"] == 0   # quiet after
