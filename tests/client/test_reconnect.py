"""The client connects again when the daemon closed its idle connection (server.idle_timeout_s): namespaces are said
hello to again, mappings kept, and only an idempotent request in flight is sent again (issue 13, part 2)."""
from __future__ import annotations

import logging
import time

import pytest

from connectors.daemon_link import DaemonLink
from kvstore.client import KVStoreError
from tests.conftest import GEOM, block, hashes, spec


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
