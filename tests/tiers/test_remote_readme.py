"""The README's "Several nodes" steps, run as written: its shell block starts a master, its metadata server and two
daemons on this host's loopback (configs/two-node.yaml, fixed ports 50051, 8080, 9003), its Python block puts
blocks on A and reads them back from B, byte-exact. Every process the block started listens on loopback only."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstore.client import Client
from kvstore.tiers.remote.address import is_loopback, listeners
from tests.mooncake_master import master_binary

pytestmark = [pytest.mark.mooncake,
              pytest.mark.skipif(master_binary() is None, reason="Mooncake Store is not installed: pip install "
                                 "'kvstore[mooncake]' (make test installs it)")]
ROOT = Path(__file__).resolve().parents[2]
PORTS = (50051, 8080, 9003)
SOCKETS = ("/tmp/kvstore-a/kvstore.sock", "/tmp/kvstore-b/kvstore.sock")


def readme_block(name: str) -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(rf"<!-- readme-two-daemons:{name} -->\n```\w+\n(.*?)```", text, re.S)
    assert m is not None, f"the README has no block marked readme-two-daemons:{name}"
    return m.group(1)


def port_taken(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def remote_up(path: str) -> bool:
    try:
        with Client(path) as c:
            return any(t.get("tier") == "remote" and t["up"] for t in c.stats()["tiers"])
    except (ConnectionError, OSError):
        return False


def descendants(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout.split()
    kids = [int(p) for p in out]
    return kids + [g for k in kids for g in descendants(k)]


def test_the_readme_gives_two_daemons_sharing_blocks(tmp_path: Path) -> None:
    if any(port_taken(p) for p in PORTS):
        pytest.skip(f"a port the README uses ({PORTS}) is taken on this machine")
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
           "MC_TCP_BIND_ADDRESS": ""}          # as a user's shell: the daemons set it themselves
    for k in [k for k in env if k.startswith("KVSTORE_")]:
        del env[k]
    log = open(tmp_path / "servers.log", "wb")
    shell = subprocess.Popen(["bash", "-c", readme_block("shell") + "wait\n"], cwd=ROOT, env=env, stdout=log,
                             stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not all(remote_up(p) for p in SOCKETS):
            assert shell.poll() is None and time.monotonic() < deadline, (tmp_path / "servers.log").read_text()
            time.sleep(0.2)
        run = subprocess.run([sys.executable, "-c", readme_block("python")], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        assert run.stdout.splitlines() == ["A stored 16", "B got 16 of 16 byte-exact: True"]
        started = descendants(shell.pid)
        assert len(started) >= 4
        for pid in started:
            assert all(is_loopback(a) for a, _ in listeners(pid)), (pid, listeners(pid))
    finally:
        os.killpg(shell.pid, signal.SIGTERM)
        try:
            shell.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(shell.pid, signal.SIGKILL)
            shell.wait()
        log.close()
