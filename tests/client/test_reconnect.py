"""The client connects again when the daemon closed its idle connection (server.idle_timeout_s): namespaces are said
hello to again, mappings kept, and only an idempotent request in flight is sent again (issue 13, part 2). And when
the daemon was restarted under it (issue 19, part 4): namespaces renumbered, every segment mapping dropped (the new
daemon's are other memory, whatever its pid), transfers in flight ended quietly, the link back at its next use."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from connectors.daemon_link import DaemonLink
from kvstore.client import KVStoreError
from tests.conftest import GEOM, DaemonProc, block, hashes, spec, ssd_daemon, ssd_settled


def idled_out(d, client) -> None:
    """Until the daemon has closed this client's connection for idling (the client has not noticed yet)."""
    before = d.read_log().count("server.idle_timeout_s")
    deadline = time.monotonic() + 20
    while d.read_log().count("server.idle_timeout_s") == before:
        assert time.monotonic() < deadline, d.read_log()[-2000:]
        time.sleep(0.05)


def test_a_client_carries_on_after_the_daemon_closed_its_idle_connection(start_daemon):
    """Before, a client whose connection the daemon closed got ConnectionError on its next request; engines keep
    connections for hours, so an idle timeout would have been an outage."""
    d = start_daemon(env={"KVSTORE_SERVER_IDLE_TIMEOUT_S": "0.3"})
    with d.client() as c:
        ns = c.namespace(spec())
        hs, want = hashes(16), [block(i) for i in range(16)]
        assert ns.put(hs, want).stored == 16
        mapped = set(c.mapped_segments())
        idled_out(d, c)
        assert ns.lookup(hs) == 16                           # connected again, said hello again
        assert c.reconnects == 1 and set(c.mapped_segments()) == mapped
        outs = [bytearray(GEOM.full_bytes) for _ in hs]
        assert ns.get(hs, outs) == 16 and [bytes(o) for o in outs] == want
        idled_out(d, c)
        more = hashes(4, start=100)
        assert ns.put(more, [block(100 + i) for i in range(4)]).stored == 4
        assert c.reconnects == 2


def test_a_forgotten_namespace_gets_its_new_id(start_daemon):
    d = start_daemon(env={"KVSTORE_SERVER_IDLE_TIMEOUT_S": "0.3"})
    with d.client() as c:
        ns = c.namespace(spec("empty"))                      # no block: forgotten once its connection is closed
        old = ns.id
        idled_out(d, c)
        assert ns.put(hashes(2), [block(0), block(1)]).stored == 2
        assert ns.id > old and c.reconnects == 1
        assert ns.lookup(hashes(2)) == 2


def test_only_an_idempotent_request_in_flight_is_sent_again(start_daemon):
    """A connection that breaks with a request in flight (here: the daemon closed it an instant before the client
    looked) may have run it: a lookup is sent again, a commit is not."""
    d = start_daemon(env={"KVSTORE_SERVER_IDLE_TIMEOUT_S": "0.3"})
    with d.client() as c:
        ns = c.namespace(spec())
        assert ns.put(hashes(2), [block(0), block(1)]).stored == 2
        idled_out(d, c)
        c._quiet_since = time.monotonic()                    # as if it had just spoken: no look before sending
        assert ns.lookup(hashes(2)) == 2 and c.reconnects == 1
        r = ns.reserve(hashes(2, start=10))
        r.write_blocks([block(10), block(11)])
        idled_out(d, c)                                      # the reservation went with the connection
        c._quiet_since = time.monotonic()
        with pytest.raises(ConnectionError):
            r.commit()                                       # not sent again
        with pytest.raises(KVStoreError) as e:
            r.commit()                                       # the next call connects again: nothing to commit
        assert e.value.code == "not_found"
        assert ns.lookup(hashes(2, start=10)) == 0


def test_a_connector_link_survives_an_idle_close_without_an_outage(start_daemon):
    d = start_daemon(env={"KVSTORE_SERVER_IDLE_TIMEOUT_S": "0.3"})
    link = DaemonLink(d.socket, lambda adapter: spec(), log=logging.getLogger("test"))
    try:
        ns = link.namespace()
        assert ns is not None and ns.put(hashes(4), [block(i) for i in range(4)]).stored == 4
        idled_out(d, link.client)
        again = link.namespace()
        assert again is ns and again.lookup(hashes(4)) == 4
        assert link.outages == 0 and link.client is not None and link.client.reconnects == 1
    finally:
        link.close()


# ----- a restarted daemon (issue 19, part 4): the same socket, a new process, new segments -----

def restarted(d: DaemonProc, sig: int = signal.SIGTERM) -> None:
    """Stop the daemon (gracefully, or kill -9) and start a new one on the same socket and SSD directory."""
    d.stop(sig)
    d.start()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["graceful", "kill-9"])
def test_namespaces_renumbered_by_a_restarted_daemon_keep_their_own_blocks(start_daemon, sig):
    """Before: the client kept one map of old namespace ids to new ones and applied it to every later request; a
    restarted daemon numbers namespaces from 1 again, so an id of the new daemon could be the old id of another
    namespace, and requests went to the wrong namespace (b's commit to a, a's lookup found b's blocks)."""
    d = start_daemon()
    with d.client() as c:
        a, b = c.namespace(spec("a")), c.namespace(spec("b"))
        restarted(d, sig)
        with d.client() as other:
            other.namespace(spec("b"))                       # b is the new daemon's first namespace now
            assert b.put(hashes(2), [block(0), block(1)]).stored == 2   # c connects again: ids renumbered
            assert c.reconnects == 1 and (a.id, b.id) != (1, 2)
            assert a.lookup(hashes(2)) == 0                  # a holds nothing
            assert b.lookup(hashes(2)) == 2
            outs = [bytearray(GEOM.full_bytes) for _ in range(2)]
            assert other.namespace(spec("b")).get(hashes(2), outs) == 2 and outs == [block(0), block(1)]


class PidOneDaemon(DaemonProc):
    """A daemon that is pid 1 of a pid namespace of its own, as in a container: every start has the same pid."""

    def start(self, wait: bool = True) -> DaemonProc:
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-m", "kvstore",
                                      "serve"], env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        if wait:
            self.wait_ready()
        return self

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        assert self.proc is not None
        with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
            inner = [int(p) for p in f.read().split()]
        for pid in inner:                                    # the daemon itself: unshare only waits for it
            os.kill(pid, sig)
        return super().stop(signal.SIGKILL if not inner else sig, timeout)


def _can_unshare_pids() -> bool:
    try:
        return subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@pytest.mark.skipif(not _can_unshare_pids(), reason="needs `unshare --pid` (root or user namespaces)")
def test_a_restarted_daemon_with_the_same_pid_gets_fresh_segment_mappings(daemons):
    """Before: the client took a daemon with the pid of the one it had mapped segments of for the same daemon and
    kept the old mappings; in a container the daemon is pid 1 at every start, so after a restart the client copied
    blocks into the dead daemon's memory and committed them to the new one: other readers found them corrupt."""
    d = PidOneDaemon()
    daemons.append(d)
    d.start()
    with d.client() as c:
        ns = c.namespace(spec())
        assert c.daemon_pid == 1 and ns.put(hashes(4), [block(i) for i in range(4)]).stored == 4
        restarted(d, signal.SIGKILL)
        assert ns.put(hashes(4, start=10), [block(10 + i) for i in range(4)]).stored == 4
        assert c.reconnects == 1 and c.daemon_pid == 1
        with d.client() as fresh:                            # a reader that maps the new daemon's segments
            outs = [bytearray(GEOM.full_bytes) for _ in range(4)]
            assert fresh.namespace(spec()).get(hashes(4, start=10), outs) == 4
            assert outs == [block(10 + i) for i in range(4)]
            assert fresh.namespace(spec()).put(hashes(2, start=20), [block(20), block(21)]).stored == 2
        outs = [bytearray(GEOM.full_bytes) for _ in range(2)]
        assert ns.get(hashes(2, start=20), outs, verify=False) == 2 and outs == [block(20), block(21)]


def test_leases_and_reservations_of_a_killed_daemon_end_quietly(daemons):
    """A transfer in flight when the daemon died: its copies touch only the dead daemon's memory, its release and
    commit fail as connection errors, every call while no daemon listens is a connection error, and the first call
    after a new daemon answers works, with what the old one made durable. Before: once a reconnect had found no
    daemon, the client's socket stayed closed and every later call failed with EBADF (an OSError, not a
    ConnectionError), even with the daemon back."""
    d = ssd_daemon(daemons, KVSTORE_SSD_WRITE_THROUGH="true", KVSTORE_SSD_SYNC="always")
    hs = hashes(4)
    with d.client() as c:
        ns = c.namespace(spec())
        assert ns.put(hs, [block(i) for i in range(4)]).stored == 4
        ssd_settled(c)
        lease = ns.acquire(hs)
        res = ns.reserve(hashes(2, start=10))
        d.stop(signal.SIGKILL)
        outs = [bytearray(GEOM.full_bytes) for _ in hs]
        lease.read_blocks(outs)                              # the old mapping still reads: no crash
        res.write_blocks([block(10), block(11)])
        for call in (lease.release, res.commit, lambda: ns.lookup(hs), lambda: ns.lookup(hs)):
            with pytest.raises(ConnectionError):
                call()
        d.start()
        assert ns.get(hs, outs) == 4 and outs == [block(i) for i in range(4)]   # durable: back from SSD
        assert ns.lookup(hashes(2, start=10)) == 0           # never committed to the new daemon
        assert c.reconnects == 1


def test_a_link_finds_a_restarted_daemon_at_its_next_use(daemons):
    """Before: after any failure the link waited retry_s (5 s by default) before it tried again, so an engine kept
    missing for seconds after the restarted daemon answered. Now a daemon that is not there costs one failed
    connect to find out, and the link tries again at its next use; retry_s is for a daemon that did not answer."""
    d = ssd_daemon(daemons, KVSTORE_SSD_WRITE_THROUGH="true", KVSTORE_SSD_SYNC="always")
    link = DaemonLink(d.socket, lambda adapter: spec(), log=logging.getLogger("test"), retry_s=3600)
    try:
        ns = link.namespace()
        assert ns is not None and ns.put(hashes(4), [block(i) for i in range(4)]).stored == 4
        assert link.client is not None
        ssd_settled(link.client)
        d.stop(signal.SIGKILL)
        with pytest.raises(ConnectionError):
            ns.lookup(hashes(4))                             # what a connector sees, and reports:
        link.failed(ConnectionError("the daemon closed the connection"))
        assert link.namespace() is None                      # still away: a miss, found out at once
        d.start()
        ns = link.namespace()                                # the daemon answers: so does the link
        assert ns is not None and ns.lookup(hashes(4)) == 4
        assert link.outages == 1
    finally:
        link.close()


def test_a_get_meeting_a_restarted_daemon_is_sent_again(daemons):
    """`get` streams its acquire; like a plain acquire, its first request on a connection a restarted daemon no
    longer has is sent again on a new one (the old connection's pins went with it), not raised to the caller."""
    d = ssd_daemon(daemons, KVSTORE_SSD_WRITE_THROUGH="true", KVSTORE_SSD_SYNC="always")
    hs = hashes(4)
    with d.client() as c:
        ns = c.namespace(spec())
        assert ns.put(hs, [block(i) for i in range(4)], durable=True).durability == "durable"
        restarted(d, signal.SIGTERM)
        outs = [bytearray(GEOM.full_bytes) for _ in hs]
        assert ns.get(hs, outs) == 4 and outs == [block(i) for i in range(4)]   # from the SSD, on a new connection
        assert c.reconnects == 1 and c.stats()["pinned"] == 0
