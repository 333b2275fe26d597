"""The remote tier stays on loopback when told to: every process a test starts (mooncake_master, Mooncake's metadata
server, the daemons) listens on 127.0.0.1 only and talks to 127.0.0.1 only, read from /proc/<pid>/net/tcp* for
their own sockets; a daemon's transfer endpoint, as the metadata server tells the other nodes, is 127.0.0.1; one
setting (remote.hostname) decides it even against MC_TCP_BIND_ADDRESS in the environment; remote.bind_address
0.0.0.0 is what widens the ports, and a daemon started without its bind guard says its ports listen everywhere.
Also: a block whose node died is a miss without asking again, not a hit whose get fails slowly."""
from __future__ import annotations

import json
import signal
import urllib.parse
import urllib.request
from typing import Any

import pytest

from kvstore.tiers.remote.address import LISTEN, is_loopback, sockets
from tests.conftest import DaemonProc, block, hashes, spec
from tests.mooncake_master import MooncakeMaster, master_binary
from tests.tiers.test_remote_tier import get_all, get_eventually, node, put_through, remote_of, wait_for

pytestmark = [pytest.mark.mooncake,
              pytest.mark.skipif(master_binary() is None, reason="Mooncake Store is not installed: pip install "
                                 "'kvstore[mooncake]' (make test installs it)")]


def not_on_loopback(pid: int) -> list[str]:
    """The sockets of `pid` bound to, or connected to, an address that is not loopback."""
    bad = []
    for state, (laddr, lport), (raddr, rport) in sockets(pid):
        if not is_loopback(laddr) or state != LISTEN and not is_loopback(raddr):
            bad.append(f"{'listen' if state == LISTEN else 'conn'} {laddr}:{lport} -> {raddr}:{rport}")
    return bad


def metadata_entry(m: MooncakeMaster, key: str) -> dict[str, Any]:
    url = f"{m.metadata}?key={urllib.parse.quote(key, safe='')}"
    with urllib.request.urlopen(url, timeout=5) as r:
        return dict(json.loads(r.read()))


def test_every_process_listens_and_talks_on_loopback_only(master, daemons):
    # MC_TCP_BIND_ADDRESS empty: the daemons set it from remote.hostname themselves (tests/mooncake_master.py sets
    # it for this process)
    a = node(daemons, master, KVSTORE_REMOTE_PLACEMENT="write_through", MC_TCP_BIND_ADDRESS="")
    b = node(daemons, master, MC_TCP_BIND_ADDRESS="")
    hs = hashes(16, tag=b"loopback")
    put_through(a, hs, range(16))
    assert get_all(b, hs) == [block(i) for i in range(16)]          # bytes moved node to node
    assert remote_of(b)["counters"]["gets"] == 16
    pids = [*master.pids, a.proc.pid, b.proc.pid]
    assert len(pids) == 4
    for pid in pids:
        assert any(state == LISTEN for state, _, _ in sockets(pid)), f"pid {pid} listens on nothing?"
        assert not_on_loopback(pid) == [], f"pid {pid}"
    for d in (a, b):
        ep = remote_of(d)["endpoint"]
        assert ep["advertised"] == "127.0.0.1"
        assert len(ep["ports"]) == 2 and len(ep["listening"]) == 2
        assert all(x.startswith("127.0.0.1:") for x in ep["listening"])
        # what the other nodes read, asked of the metadata server itself
        assert metadata_entry(master, f"mooncake/rpc_meta/{ep['segment']}")["ip_or_host_name"] == "127.0.0.1"
        assert metadata_entry(master, f"mooncake/ram/{ep['segment']}")["tcp_data_host"] == "127.0.0.1"
    assert "listening on 127.0.0.1:" in a.read_log()


def test_remote_hostname_decides_over_the_environment(master, daemons):
    """MC_TCP_BIND_ADDRESS left in the environment (by another Mooncake user's setup, say) does not send this
    node's bytes elsewhere: remote.hostname replaces it, and the log says so."""
    d = node(daemons, master, MC_TCP_BIND_ADDRESS="192.0.2.77")
    assert remote_of(d)["endpoint"]["advertised"] == "127.0.0.1"
    assert "MC_TCP_BIND_ADDRESS=192.0.2.77 in the environment is replaced by remote.hostname's 127.0.0.1" \
        in d.read_log()
    assert not_on_loopback(d.proc.pid) == []


def _transfer_listeners(d: DaemonProc) -> list[str]:
    return list(remote_of(d)["endpoint"]["listening"])


def test_bind_address_any_listens_everywhere_on_purpose(master, daemons):
    d = node(daemons, master, KVSTORE_REMOTE_BIND_ADDRESS="0.0.0.0")
    wide = _transfer_listeners(d)
    assert len(wide) == 2 and all(not is_loopback(x.rpartition(":")[0]) for x in wide)
    assert remote_of(d)["endpoint"]["advertised"] == "127.0.0.1"    # still told loopback: traffic stays there
    assert "not only on" not in d.read_log()                           # asked for: no warning


def test_a_daemon_without_its_bind_guard_warns_that_its_ports_listen_everywhere(master, daemons):
    d = node(daemons, master, KVSTORE_BIND_GUARD="1", LD_PRELOAD="")  # as if the re-exec had been tried
    assert any(not is_loopback(x.rpartition(":")[0]) for x in _transfer_listeners(d))
    log = d.read_log()
    assert "the bind guard (native/kvbind.c) is not loaded" in log
    assert "the transfer engine listens on" in log and "not only on 127.0.0.1" in log


def test_a_dead_nodes_blocks_are_misses_without_asking_again(master, daemons):
    """One replica, the writer killed: the master names its blocks until its client_ttl (10 s) ends. The first
    get that reaches the dead node fails (a miss, never wrong bytes); from then on lookups of those blocks are
    misses at once, without waiting on the dead node for each."""
    a = node(daemons, master, KVSTORE_REMOTE_PLACEMENT="write_through")
    b = node(daemons, master, KVSTORE_REMOTE_KNOWN_S="0.5", KVSTORE_REMOTE_SEGMENT_BYTES="0")  # all in A's
    hs = hashes(4, tag=b"dead")
    put_through(a, hs, range(4))
    a.stop(signal.SIGKILL)
    assert get_all(b, hs) == []                                        # the first block's transfer fails
    with b.client() as c:
        assert remote_of(b, c)["counters"]["unreachable"] == 1
        assert c.namespace(spec()).lookup(hs) == 0                      # not asked of the master again
        assert remote_of(b, c)["counters"]["unreachable"] == 1


def test_blocks_committed_while_the_master_is_down_are_published_when_it_returns(master, daemons):
    a = node(daemons, master, KVSTORE_REMOTE_PLACEMENT="write_through", KVSTORE_REMOTE_TIMEOUT_S="1")
    b = node(daemons, master)
    master.stop()
    wait_for(lambda: not remote_of(a)["up"], "A sees the store down (its link asks every remote.retry_s)")
    hs = hashes(8, tag=b"while-down")
    with a.client() as c:
        assert c.namespace(spec()).put(hs, [block(300 + i) for i in range(8)]).stored == 8
        assert c.stats()["counters"].get("published", 0) == 0
    assert remote_of(a)["counters"].get("puts", 0) == 0
    master.start()
    wait_for(lambda: remote_of(a)["up"] and remote_of(b)["up"], "both link again", timeout=60)
    with b.client() as c:
        ns = c.namespace(spec())
        wait_for(lambda: ns.lookup(hs) == 8, "A publishes what waited: B finds it", timeout=60)
    get_eventually(b, hs, [block(300 + i) for i in range(8)], "B gets what A published after the return")
    assert remote_of(a)["counters"]["puts"] >= 8


def test_a_mooncake_client_this_process_sets_up_listens_on_loopback_only(master):
    """The tests' own Mooncake clients (rogue writers, the conformance suite's remote tier) bind where they arm the
    bind guard, which make test preloads into pytest (under make test a skip here fails the run: engine guard)."""
    from mooncake.store import MooncakeDistributedStore

    from kvstore.tiers.remote.address import guard_loaded, listeners
    from tests.mooncake_master import setup_on_loopback

    if not guard_loaded():
        pytest.skip("the bind guard is not preloaded in this process (make test preloads it)")
    before = set(listeners())
    store = MooncakeDistributedStore()
    assert setup_on_loopback(store, master.metadata, master.address, 16 << 20, 16 << 20) == 0
    try:
        ports = set(listeners()) - before
        assert len(ports) == 2 and all(is_loopback(a) for a, _ in ports), ports
    finally:
        store.close()


def test_a_hostname_that_does_not_resolve_is_refused_at_start_with_the_setting_named(master):
    d = DaemonProc("16MiB", "1MiB", env=master.env(KVSTORE_REMOTE_HOSTNAME="no-such-node.invalid"))
    try:
        with pytest.raises(RuntimeError, match="remote.hostname 'no-such-node.invalid' does not resolve"):
            d.start()
    finally:
        d.cleanup()
