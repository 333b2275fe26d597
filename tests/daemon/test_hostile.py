"""Hostile and unlucky clients against a live daemon (issue 13, first part): each attack is made, and the daemon
keeps serving everyone else byte-exact."""
from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import time

import pytest

from kvstore.client import KVStoreError
from tests.conftest import GEOM, DaemonProc, block, hashes, spec, ssd_settled


def test_a_client_cannot_truncate_or_grow_a_segment(tmp_path, daemons):
    """Segments are sealed: before, ftruncate(fd, 0) on a segment fd from the `segments` op succeeded, and the
    daemon's next touch of that segment (here a demotion copy) killed it with SIGBUS."""
    d = DaemonProc("2MiB", env={"KVSTORE_SSD_DIR": str(tmp_path / "ssd")}).start()
    daemons.append(d)
    hs = hashes(64)
    with d.client() as c:
        ns = c.namespace(spec())
        assert ns.put(hs, [block(i) for i in range(64)]).stored == 64
        live = c.call("segments", ids=[])["live"]
        reply, fds = c._roundtrip("segments", {"ids": live}, want_fds=True)
        try:
            assert len(fds) == len(live) >= 1
            for fd in fds:
                size = os.fstat(fd).st_size
                for length in (0, size // 2, size * 2):
                    with pytest.raises(PermissionError):
                        os.ftruncate(fd, length)
                assert os.fstat(fd).st_size == size
        finally:
            for fd in fds:
                os.close(fd)
        c.evict(everything=True)                          # the daemon copies every slot to SSD
        ssd_settled(c)
        outs = [bytearray(GEOM.full_bytes) for _ in hs]
        assert ns.get(hs, outs) == 64
        assert [bytes(o) for o in outs] == [block(i) for i in range(64)]
    assert d.proc is not None and d.proc.poll() is None


@pytest.mark.parametrize("field,value", [("kv", 1.0), ("kv", True), ("layers", 2.0), ("head_dim", "32")])
def test_a_geometry_field_that_is_not_a_strict_integer_is_refused(daemon, field, value):
    """Before, kv = 1.0 passed: block sizes became floats and every reserve leaked a memfd until the daemon hit its
    fd limit and exited."""
    geometry = {**GEOM.to_dict(), field: value}
    with daemon.client() as c:
        with pytest.raises(KVStoreError) as e:
            c.call("hello", namespace={"model": "m", "geometry": geometry})
        assert e.value.code == "wrong_geometry" and f"geometry.{field}" in e.value.message
        ns = c.namespace(spec())                         # the connection and the daemon serve on
        assert ns.put(hashes(2), [block(0), block(1)]).stored == 2


def test_the_daemon_is_not_dumpable_and_raises_its_fd_limit(daemon):
    with daemon.client() as c:
        process = c.stats()["process"]
    assert process["dumpable"] is False
    with open(f"/proc/{daemon.proc.pid}/limits") as f:
        soft, hard = next(line.split()[3:5] for line in f if line.startswith("Max open files"))
    assert process["fd_limit"] == int(soft) == (int(hard) if hard != "unlimited" else resource.RLIM_INFINITY)


class LowFdDaemon(DaemonProc):
    """A daemon whose hard limit on open files is `fds`."""

    def __init__(self, fds: int, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.fds = fds

    def start(self, wait: bool = True) -> DaemonProc:
        self.log = open(self.log_path, "ab")
        limit = self.fds
        self.proc = subprocess.Popen([sys.executable, "-m", "kvstore", "serve"], env=self.env, stdout=self.log,
                                     stderr=subprocess.STDOUT,
                                     preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit)))
        if wait:
            self.wait_ready()
        return self


def test_out_of_fds_the_daemon_backs_off_and_keeps_serving(daemons):
    """Before, an accept that failed with EMFILE ended the serve loop: the daemon shut down."""
    d = LowFdDaemon(48, env={"KVSTORE_SERVER_MAX_CONNECTIONS": "4096"}).start()
    daemons.append(d)
    socks = []
    try:
        for _ in range(80):                               # more than the daemon has fds for: the rest wait
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(d.socket)
            socks.append(s)
        deadline = time.monotonic() + 10
        while "accept failed" not in d.read_log():       # the daemon ran out of fds (EMFILE)
            assert time.monotonic() < deadline, d.read_log()[-2000:]
            time.sleep(0.05)
    finally:
        for s in socks:
            s.close()
    assert d.proc is not None and d.proc.poll() is None
    with d.client() as c:                                 # fds are free again: served, byte-exact
        ns = c.namespace(spec())
        assert ns.put(hashes(4), [block(i) for i in range(4)]).stored == 4
        outs = [bytearray(GEOM.full_bytes) for _ in range(4)]
        assert ns.get(hashes(4), outs) == 4 and [bytes(o) for o in outs] == [block(i) for i in range(4)]
        assert c.stats()["counters"]["accept_errors"] >= 1


def test_a_full_critical_lane_shortens_a_get_and_leaves_nothing_stuck(tmp_path, daemons):
    """Before, a full critical queue raised Busy out of the SSD read path: the get failed (internal error), its keys
    stayed "promoting" for good (every later get waited 5 s and missed them), and reads already queued could land in
    slots freed meanwhile."""
    d = DaemonProc("2MiB", env={"KVSTORE_SSD_DIR": str(tmp_path / "ssd"), "KVSTORE_TRAFFIC_QUEUE_CRITICAL": "1",
                                "KVSTORE_TRAFFIC_SSD_IN_FLIGHT": "1", "KVSTORE_SLOW_DEVICE": "ssd:4MB:3"}).start()
    daemons.append(d)
    hs, want = hashes(16), [block(i) for i in range(16)]
    with d.client() as c:
        ns = c.namespace(spec())
        assert ns.put(hs, want).stored == 16
        c.evict(everything=True)
        ssd_settled(c)
        outs = [bytearray(GEOM.full_bytes) for _ in hs]
        assert ns.get(hs, outs, batch=16) == 16           # each refusal ends one promotion; the get goes on
        assert [bytes(o) for o in outs] == want
        s = ssd_settled(c)
        assert s["tiers"][1]["counters"]["busy"] >= 1     # the lane did refuse reads
        assert s["errors"].get("internal", 0) == 0 and s["reserved"] == 0
        outs = [bytearray(GEOM.full_bytes) for _ in hs]   # nothing left "promoting": all 16 again, from the host
        assert ns.get(hs, outs, batch=16) == 16 and [bytes(o) for o in outs] == want


def test_a_client_that_stops_reading_loses_its_connection_not_a_daemon_thread(start_daemon):
    """Before, a client that pipelined requests and never read the replies blocked its session thread in send for
    good (with whatever it held); now the send times out and the connection is dropped, its pins released."""
    from kvstore.protocol import VERSION, encode

    d = start_daemon(env={"KVSTORE_SERVER_SEND_TIMEOUT_S": "0.5"})
    with d.client() as other:
        ns = other.namespace(spec())
        assert ns.put(hashes(4), [block(i) for i in range(4)]).stored == 4
        base = other.stats()["connections"]
        stalled = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.connect(d.socket)
        stalled.sendall(b"".join(encode({"v": VERSION, "op": "stats", "id": i}) for i in range(3000)))
        deadline = time.monotonic() + 20
        while "stopped reading its replies" not in d.read_log():
            assert time.monotonic() < deadline, d.read_log()[-2000:]
            outs = [bytearray(GEOM.full_bytes) for _ in range(4)]   # everyone else is served meanwhile
            assert ns.get(hashes(4), outs) == 4 and [bytes(o) for o in outs] == [block(i) for i in range(4)]
            time.sleep(0.05)
        while other.stats()["connections"] != base:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        stalled.close()
