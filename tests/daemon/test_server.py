"""The daemon's lifecycle and manners: a private socket (RELIABILITY 14), the connection cap (9), one daemon per
socket, a stale socket replaced, and SIGTERM (17): exit 0, socket removed, clients holding pins closed."""
from __future__ import annotations

import os
import signal
import socket
import stat
import struct
import subprocess
import sys
import time
from collections.abc import Iterator

import msgpack
import pytest

from kvstore.client import Client, KVStoreError
from tests.conftest import DaemonProc, block, hashes, spec


@pytest.fixture
def unstarted() -> Iterator[type[DaemonProc]]:
    """Factory of daemons not started yet (the test prepares their directory first), cleaned up at teardown."""
    made: list[DaemonProc] = []

    def make(**kw: object) -> DaemonProc:
        d = DaemonProc(**kw)  # type: ignore[arg-type]
        made.append(d)
        return d

    yield make  # type: ignore[misc]
    for d in made:
        if d.proc is not None:
            d.cleanup()
        else:
            import shutil

            shutil.rmtree(d.dir, ignore_errors=True)


def serve_once(d: DaemonProc) -> subprocess.CompletedProcess[str]:
    """Run `kvstore serve` with the daemon's environment, expecting it to refuse to start."""
    return subprocess.run([sys.executable, "-m", "kvstore", "serve"], env=d.env, capture_output=True, text=True,
                          timeout=30)


def mode(path: str) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def first_client(d: DaemonProc) -> Client:
    """A client once the readiness probe's connection is gone (its session ends asynchronously), so that it is the
    daemon's only one."""
    deadline = time.monotonic() + 10
    while True:
        c = Client(d.socket)
        try:
            if c.stats()["connections"] == 1:
                return c
        except KVStoreError as e:               # over a cap of 1 while the probe still counts
            assert e.code == "too_many_connections"
        c.close()
        assert time.monotonic() < deadline, "the daemon still counts the readiness probe"
        time.sleep(0.01)


def settle(c: Client, connections: int) -> None:
    """Wait until the daemon counts `connections` (a closed client's session ends asynchronously)."""
    deadline = time.monotonic() + 10
    while (n := c.stats()["connections"]) != connections:
        assert time.monotonic() < deadline, f"{n} connections, expected {connections}"
        time.sleep(0.01)


# ----- a private socket -----

def test_socket_is_0600_in_a_0700_directory(daemon):
    st = os.lstat(daemon.socket)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_uid == os.getuid()
    assert mode(os.path.dirname(daemon.socket)) == 0o700


def test_an_open_directory_of_ours_is_tightened_to_0700(unstarted):
    d = unstarted()
    run = os.path.dirname(d.socket)
    os.makedirs(run)
    os.chmod(run, 0o755)
    d.start()
    assert mode(run) == 0o700
    assert mode(d.socket) == 0o600


def test_a_shared_directory_is_refused_not_tightened(unstarted):
    d = unstarted()
    run = os.path.dirname(d.socket)
    os.makedirs(run)
    os.chmod(run, 0o1777)                      # like /tmp
    r = serve_once(d)
    assert r.returncode == 1
    assert f"socket directory {run} is shared" in r.stderr and "Traceback" not in r.stderr
    assert stat.S_IMODE(os.stat(run).st_mode) == 0o1777
    assert os.listdir(run) == []


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a directory to another user")
def test_a_directory_of_another_user_is_refused(unstarted):
    d = unstarted()
    run = os.path.dirname(d.socket)
    os.makedirs(run, mode=0o700)
    os.chown(run, 65534, 65534)
    r = serve_once(d)
    assert r.returncode == 1
    assert f"socket directory {run} belongs to uid 65534" in r.stderr and "Traceback" not in r.stderr
    assert os.listdir(run) == []


def test_a_file_that_is_not_a_socket_is_never_replaced(unstarted):
    d = unstarted()
    os.makedirs(os.path.dirname(d.socket), mode=0o700)
    with open(d.socket, "w") as f:
        f.write("precious")
    r = serve_once(d)
    assert r.returncode == 1
    assert f"{d.socket} exists and is not a socket" in r.stderr and "Traceback" not in r.stderr
    with open(d.socket) as f:
        assert f.read() == "precious"


# ----- the connection cap -----

def test_connection_cap_refuses_cleanly_counts_and_recovers(start_daemon):
    d = start_daemon(env={"KVSTORE_SERVER_MAX_CONNECTIONS": "3"})
    held = [first_client(d)]
    refused = held[0].stats()["counters"]["refused_connections"]
    held += [Client(d.socket), Client(d.socket)]
    assert all(c.ping()["pong"] for c in held)      # three clients served

    fourth = Client(d.socket)                           # connect() succeeds: the refusal comes as an error frame
    with pytest.raises(KVStoreError) as e:
        fourth.ping()
    assert e.value.code == "too_many_connections"
    assert "at most 3 connections" in e.value.message
    with pytest.raises(ConnectionError):            # and then the connection is closed
        fourth.ping()
    fourth.close()

    s = held[0].stats()
    assert (s["counters"]["refused_connections"], s["connections"]) == (refused + 1, 3)
    assert s["errors"].get("too_many_connections", 0) == 0   # a refusal is not an op error

    held.pop().close()                              # one leaves: a newcomer is served
    settle(held[0], 2)
    with Client(d.socket) as newcomer:
        assert newcomer.ping()["pong"] is True
        assert newcomer.stats()["counters"]["refused_connections"] == refused + 1
    for c in held:
        c.close()


def test_refused_client_reads_exactly_one_error_frame_then_eof(start_daemon):
    d = start_daemon(env={"KVSTORE_SERVER_MAX_CONNECTIONS": "1"})
    with first_client(d) as only:
        before = only.stats()["counters"]["refused_connections"]   # first_client may have been refused once
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(d.socket)
            data = bytearray()
            while chunk := s.recv(4096):            # sends nothing: the daemon speaks first, then shuts
                data += chunk
        (n,) = struct.unpack_from("<I", data)
        assert len(data) == 4 + n
        reply = msgpack.unpackb(bytes(data[4:]), raw=False)
        assert reply["ok"] is False and reply["id"] == 0
        assert reply["error"]["code"] == "too_many_connections"
        # the CLI says so too, with the code, and exits 1
        r = subprocess.run([sys.executable, "-m", "kvstore", "--socket", d.socket, "ping"], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 1 and "too_many_connections" in r.stderr
        assert only.stats()["counters"]["refused_connections"] == before + 2
        assert only.ping()["pong"] is True


# ----- one daemon per socket -----

def test_second_daemon_on_the_same_socket_is_refused(daemon):
    inode = os.lstat(daemon.socket).st_ino
    r = serve_once(daemon)
    assert r.returncode == 1
    assert f"another kvstore daemon is serving at {daemon.socket}" in r.stderr
    assert "Traceback" not in r.stderr
    assert os.lstat(daemon.socket).st_ino == inode  # its socket untouched
    with daemon.client() as c:
        assert c.ping()["pong"] is True
        assert c.stats()["pid"] == daemon.proc.pid  # and the first daemon still answers


def test_stale_socket_of_a_killed_daemon_is_replaced(daemon):
    with daemon.client() as c:
        ns = c.namespace(spec())
        ns.put(hashes(1), [block(1)])
        first_pid = c.stats()["pid"]
    assert daemon.stop(signal.SIGKILL) == -signal.SIGKILL
    assert stat.S_ISSOCK(os.lstat(daemon.socket).st_mode)    # left behind
    daemon.start()
    with daemon.client() as c:
        s = c.stats()
        assert s["pid"] == daemon.proc.pid != first_pid
        assert s["blocks"] == 0                     # a new daemon (the host pool is memory only)
    assert mode(daemon.socket) == 0o600


# ----- graceful shutdown -----

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_exits_0_removes_socket_and_closes_clients_holding_pins(start_daemon, sig):
    # a long drain timeout: if the daemon waited for idle clients to leave, the wait below would time out
    d = start_daemon(env={"KVSTORE_SERVER_SHUTDOWN_TIMEOUT_S": "120"})
    c = d.client(timeout=10)
    ns = c.namespace(spec())
    ns.put(hashes(2), [block(0), block(1)])
    lease = ns.acquire(hashes(2))
    ns.reserve(hashes(1, start=10))
    s = c.stats()
    assert (s["pinned"], s["reserved"]) == (2, 1)
    d.proc.send_signal(sig)
    assert d.proc.wait(timeout=60) == 0
    assert not os.path.lexists(d.socket)
    with pytest.raises(ConnectionError):            # closed, not hung: the 10 s timeout would raise TimeoutError
        c.ping()
    assert [bytes(v) for v in lease.views] == [block(0), block(1)]   # the mapped slots stay readable
    log = d.read_log()
    assert "left holding 1 reservation(s) and 2 pin(s): released" in log
    assert "kvstore stopped" in log
    c.close()
