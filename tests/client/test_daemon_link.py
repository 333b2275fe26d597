"""The connectors' link to the daemon (kvstore.connectors.daemon_link), against a real daemon: an outage is None
and one warning, a daemon that did not answer is not asked again before retry_s (one that went away is, at the
next use), a restarted daemon is found again and the way back logged once; a refused namespace is no outage;
per-thread connections share one view of the daemon's health."""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvstore.connectors.daemon_link import DaemonLink
from kvstore.protocol.geometry import Geometry
from kvstore.protocol.keys import NamespaceSpec
from tests.conftest import block, hashes, spec

LOG = logging.getLogger("kvstore.test.link")
RETRY = 0.2


class Clock:
    """The link's clock, moved by the test: a retry window passes without a sleep."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def wait_out(self, seconds: float = RETRY * 1.5) -> None:
        self.now += seconds


def messages(caplog: pytest.LogCaptureFixture, fragment: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if fragment in r.getMessage()]


def by_adapter(adapter: str) -> NamespaceSpec:
    if adapter == "unnamed":
        raise ValueError("no such adapter")
    if adapter == "huge":                   # 64 MiB blocks: larger than the whole pool, the daemon refuses it
        return spec(geometry=Geometry(layers=64, tokens=256, kv_heads=8, head_dim=128), adapter=adapter)
    return spec(adapter=adapter)


def test_outage_is_none_and_one_warning_then_the_link_finds_the_daemon_again(daemon, caplog):
    clock = Clock()
    caplog.set_level(logging.WARNING, logger=LOG.name)
    link = DaemonLink(daemon.socket, by_adapter, log=LOG, who="worker", retry_s=RETRY, clock=clock)
    ns = link.namespace()
    assert ns is not None and link.namespace() is ns          # opened once, then kept
    assert ns.put(hashes(2), [block(0), block(1)]).stored == 2

    daemon.stop()
    with pytest.raises((ConnectionError, OSError)) as e:
        ns.lookup(hashes(2))
    link.failed(e.value)                                      # what a connector does with a failed call
    assert link.client is None
    for _ in range(3):
        assert link.namespace() is None and link.namespace("a") is None
    clock.wait_out()
    assert link.namespace() is None                           # tried again, still away: the same outage
    assert link.outages == 1
    [line] = messages(caplog, "daemon unavailable")
    assert line.startswith("kvstore (worker): daemon unavailable (") and "serving without the external KV" in line

    daemon.start()                                            # a new, empty daemon on the same socket
    clock.wait_out()
    back = link.namespace()
    assert back is not None and back is not ns and back.lookup(hashes(2)) == 0
    assert link.namespace("a") is not None and link.namespace("a") is not back  # one namespace per adapter
    assert len(messages(caplog, "is back after")) == 1

    link.failed(TimeoutError("timed out"))                    # a call timed out: a second outage
    assert link.namespace() is None                           # the daemon is there, but not asked before retry_s
    clock.wait_out()
    assert link.namespace() is not None
    assert link.outages == 2 and len(messages(caplog, "is back after")) == 2
    link.close()
    assert link.client is None


def test_a_refused_namespace_is_no_outage_and_is_asked_again_after_retry(daemon, caplog):
    clock = Clock()
    caplog.set_level(logging.WARNING, logger=LOG.name)
    link = DaemonLink(daemon.socket, by_adapter, log=LOG, retry_s=RETRY, clock=clock)
    assert link.namespace("huge") is None
    assert link.namespace("unnamed") is None
    ns = link.namespace("a")                                  # the same connection serves the other adapters
    assert ns is not None and ns.put(hashes(1), [block(3)]).stored == 1
    for _ in range(3):
        assert link.namespace("huge") is None and link.namespace("unnamed") is None
    refused = messages(caplog, "refused")
    assert len(refused) == 1 and refused[0].startswith("kvstore: namespace of adapter 'huge' refused: wrong_geometry")
    assert len(messages(caplog, "no namespace of adapter 'unnamed': no such adapter")) == 1
    clock.wait_out()
    assert link.namespace("huge") is None                     # asked again: refused again
    assert len(messages(caplog, "refused")) == 2
    assert link.outages == 0 and not messages(caplog, "unavailable")
    assert link.namespace("a") is ns
    link.close()


def test_per_thread_links_have_their_own_clients_and_share_the_outage(daemon, caplog):
    clock = Clock()
    caplog.set_level(logging.WARNING, logger=LOG.name)
    link = DaemonLink(daemon.socket, lambda adapter: spec(), log=LOG, who="HiCache",
                      without="HiCache runs without its storage tier", per_thread=True, retry_s=RETRY, clock=clock)
    assert link.namespace() is not None
    other = ThreadPoolExecutor(1)                             # another thread, the same one on every call
    their_ns, theirs = other.submit(lambda: (link.namespace(), link.client)).result()
    assert their_ns is not None and other.submit(link.namespace).result() is their_ns
    assert theirs is not None and theirs is not link.client
    assert other.submit(their_ns.lookup, hashes(1)).result() == 0

    link.failed(TimeoutError("timed out"))                    # this thread's call got no answer
    assert link.client is None and theirs.sock.fileno() >= 0  # the other thread's stays open
    assert other.submit(link.namespace).result() is their_ns   # ...with its namespace
    fresh = ThreadPoolExecutor(1)
    assert fresh.submit(link.namespace).result() is None      # ...but no thread connects anew before retry_s
    [line] = messages(caplog, "daemon unavailable")
    assert line == ("kvstore (HiCache): daemon unavailable (TimeoutError: timed out); HiCache runs without its "
                    f"storage tier, trying again every {RETRY:.1f} s")
    clock.wait_out()
    assert link.namespace() is not None and fresh.submit(link.namespace).result() is not None
    assert len(messages(caplog, "is back after")) == 1

    link.failed(ConnectionResetError("broken"))               # a broken connection: the daemon went away...
    assert fresh.submit(link.namespace).result() is not None   # ...and any thread's next use connects again
    assert link.namespace() is not None and link.outages == 2
    link.close()                                              # every thread's client
    assert theirs.sock.fileno() < 0 and link.client is None
    assert other.submit(lambda: link.client).result() is None
    other.shutdown()
    fresh.shutdown()
