"""The remote tier's link to the store: connecting, staying linked, and whether the store answers now (`up`).

Faults: a call the store does not answer marks the tier down (`record_down`, from whichever part made the call);
while it is down, lookups and reads are misses at once (the host pool and the SSD keep serving), staged blocks
wait, and the link thread asks the master every `remote.retry_s` whether it answers again (Mooncake's client links
again by itself to a restarted master, its segment mounted again; the blocks the old master knew are gone). The
client is set up once, in the link thread, and only once the master's ports accept connections: its setup holds
the GIL until it gives up. While linked, the same thread asks the master every `remote.retry_s` whether it still
answers (one small RPC), so that a master gone while nothing called it is known down before a lookup or a put
waits on it.

The link owns `up`, `down_since`, `last_error` and `stopping` (the tier is closing: the link and the writer
threads end), all under the tier's lock (wire.py); a change is notified on its condition, which the writer and
a closing tier wait on. Each time the client is set up it reports where the other nodes reach this node
(kvstore.tiers.remote.address).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvstore.tiers.remote import address
from kvstore.tiers.remote.client import StoreDown
from kvstore.tiers.remote.wire import TierPart, Wire

log = logging.getLogger("kvstore")


class Link(TierPart):
    def __init__(self, wire: Wire) -> None:
        super().__init__(wire)
        self.up = False
        self.down_since = time.monotonic()
        self.last_error = "not connected yet"
        self.stopping = False
        self.on_tick: Callable[[], None] | None = None     # every remote.retry_s while up (the books' removals)
        self.thread = threading.Thread(target=self._keep_linked, name="kvstore-remote-link", daemon=True)

    def _keep_linked(self) -> None:
        """Connect, and connect again whenever the store is found down (every remote.retry_s). While linked, ask
        the master every remote.retry_s whether it answers (one small RPC), so that a master gone while nothing
        called it is known down before a lookup or a put waits on it (and publishing holds its queue)."""
        while True:
            with self.cond:
                deadline = time.monotonic() + self.cfg.retry_s
                while self.up and not self.stopping and time.monotonic() < deadline:
                    self.cond.wait(deadline - time.monotonic())
                if self.stopping:
                    return
                up = self.up
            if up:
                if not self.client.healthy():
                    self.record_down(StoreDown(f"the master at {self.cfg.master} does not answer"))
                elif self.on_tick is not None:
                    self.on_tick()                  # the books' removals not done yet
                continue
            if not self._try_link():
                with self.cond:
                    self.cond.wait(self.cfg.retry_s)

    def _try_link(self) -> bool:
        """Set the client up (once, and only when the master's ports answer: see MooncakeClient.reachable), or see
        whether the master answers again (the client links again by itself after a restart)."""
        try:
            if not self.client.connected:
                why = self.client.reachable()
                if why is not None:
                    raise StoreDown(why)
                self.client.connect()
                self.counters["connects"] += 1
                self._report_endpoint()
            elif not self.client.healthy():
                raise StoreDown(f"the master at {self.cfg.master} does not answer")
            if self.staging is not None:
                self.client.register(self.staging.addr, self.staging.size)
            self.client.register(self.pad.addr, self.pad.size)
        except StoreDown as e:
            self.record_down(e, quiet=True)
            return False
        with self.cond:
            was = time.monotonic() - self.down_since
            self.up = True
            self.cond.notify_all()
        log.info("remote: linked to Mooncake Store at %s (down %.1f s before)", self.cfg.master, was)
        return True

    def _report_endpoint(self) -> None:
        """Say where the other nodes reach this node and where its transfer ports listen; warn where that is not
        what remote.hostname and remote.bind_address ask for (kvstore.tiers.remote.address)."""
        ep = self.client.endpoint
        if ep.get("advertised"):
            log.info("remote: this node's transfer endpoint is %s (ports %s), listening on %s", ep["advertised"],
                     ", ".join(str(p) for p in ep["ports"]) or "?", ", ".join(ep["listening"]) or "?")
        for problem in address.problems(ep, self.client.advertised, self.client.listen):
            log.warning("remote: %s", problem)

    def record_down(self, e: Exception, quiet: bool = False) -> None:
        with self.cond:
            if self.up:
                self.up = False
                self.down_since = time.monotonic()
                self.counters["went_down"] += 1
                log.warning("remote: %s; remote lookups are misses until it answers again (tried every %g s)",
                            e, self.cfg.retry_s)
            elif not quiet:
                log.debug("remote: %s", e)
            self.last_error = str(e)
            self.cond.notify_all()
