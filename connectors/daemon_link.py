"""An engine connector's link to the daemon: a connection that is never a reason for the engine to stop or wait long.

Both connectors hold one (`vllm_connector.py` per role, `sglang_backend.py` per backend). It connects lazily and
opens namespaces on first use, by adapter (`spec_for(adapter)` gives the NamespaceSpec; an engine without adapters
asks for "") and part (a model whose KV has several groups, each with its own geometry, keeps each in a namespace of
its own: part k > 0 is `spec_for(adapter, k)`; kvstore.connectors.kv_groups). Every daemon call is bounded by the
client's socket timeout. When the daemon does not answer (or the connection breaks), the connector calls
`failed(exc)`: the client is closed and one warning is logged for the whole outage; the first namespace opened
afterwards logs the way back. Meanwhile `namespace()` returns None, which the connectors turn into misses. When to
try again depends on what failed:
- the connection broke, or no daemon listens at the socket (a daemon stopping, killed, or restarting under the
  engine): at the next use. Finding out costs one connect() (microseconds when nobody listens), and a restarted
  daemon is used from its first answer on, with fresh namespaces and segment mappings (a new client);
- the daemon did not answer within `timeout_s` (hung, or swamped), or another OS error: `retry_s` later, so that a
  daemon that cannot answer costs the engine one timeout per `retry_s`, not one per request.
A namespace the daemon refuses is not an outage: one warning, and that adapter is asked again `retry_s` later.

A Client is not thread-safe. `per_thread=False` (vLLM: each role calls from one thread) keeps one connection;
`per_thread=True` (SGLang's prefetch and backup threads call at once) keeps one per calling thread, with one shared
view of the daemon's health: a daemon that did not answer one thread is not asked by any of them before `retry_s`.

Imports only the client: no engine, no daemon.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvstore.client import Client, KVStoreError, Namespace
from kvstore.protocol.keys import NamespaceSpec


class _Connection:
    """One client and the namespaces opened on it, by (adapter, part)."""

    __slots__ = ("client", "spaces")

    def __init__(self, client: Client) -> None:
        self.client = client
        self.spaces: dict[tuple[str, int], Namespace] = {}


class _Shared:
    """Where a link keeps its connection when every thread uses the same one."""

    conn: _Connection | None = None


class _PerThread(threading.local):
    """Where a link keeps its connections when each thread has its own."""

    conn: _Connection | None = None


class DaemonLink:
    """See the module docstring. `log` and `who` say where the link's warnings go and whose they are; `without`
    says, in the outage warning, what the engine does meanwhile."""

    def __init__(self, path: str | None, spec_for: Callable[..., NamespaceSpec], *, log: logging.Logger,
                 who: str = "", without: str = "serving without the external KV cache", per_thread: bool = False,
                 retry_s: float = 5.0, timeout_s: float = 5.0, tenant: str | None = None,
                 secret: str | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        """`clock`: what the retry windows are measured with (a test's own clock moves them without sleeping)."""
        self.path = path
        self.tenant, self.secret = tenant, secret     # None: KVSTORE_TENANT / KVSTORE_TENANT_SECRET, else none
        self.spec_for = spec_for
        self.log = log
        self.tag = f"kvstore ({who})" if who else "kvstore"
        self.without = without
        self.per_thread = per_thread
        self.retry_s = retry_s
        self.timeout_s = timeout_s
        self.clock = clock
        self._held: _Shared | _PerThread = _PerThread() if per_thread else _Shared()
        self._lock = threading.Lock()
        self._clients: list[Client] = []          # every open client, of every thread: what close() closes
        self._retry_at = 0.0
        self._refused: dict[tuple[str, int], float] = {}   # (adapter, part) -> when it may be asked again
        self._down_since: float | None = None
        self.outages = 0

    @property
    def client(self) -> Client | None:
        """The calling thread's client (the link's only one without `per_thread`), or None while not connected."""
        conn = self._held.conn
        return None if conn is None else conn.client

    def namespace(self, adapter: str = "", part: int = 0) -> Namespace | None:
        """The namespace for `adapter` (and `part`), or None while the daemon is away or refuses it."""
        conn = self._held.conn
        key = (adapter, part)
        ns = None if conn is None else conn.spaces.get(key)
        if ns is not None:
            return ns
        now = self.clock()
        if now < self._retry_at or now < self._refused.get(key, 0.0):
            return None
        which = (f" of adapter {adapter!r}" if adapter else "") + (f" (KV group {part})" if part else "")
        try:
            spec = self.spec_for(adapter, part) if part else self.spec_for(adapter)
        except ValueError as e:                   # no namespace can describe it: no cache for it, no outage
            self._refuse(key, f"{self.tag}: no namespace{which}: {e}")
            return None
        try:
            if conn is None:
                conn = self._connect()
            ns = conn.spaces[key] = conn.client.namespace(spec)
        except KVStoreError as e:                 # the daemon refuses it: no cache for it, no outage
            self._answered(conn)
            self._refuse(key, f"{self.tag}: namespace{which} refused: {e}")
            return None
        except (ConnectionError, OSError) as e:
            self.failed(e)
            return None
        self._answered(conn)
        return ns

    def _connect(self) -> _Connection:
        client = Client(self.path, timeout=self.timeout_s, tenant=self.tenant, secret=self.secret)
        with self._lock:
            self._clients.append(client)
        conn = self._held.conn = _Connection(client)
        return conn

    def _refuse(self, key: tuple[str, int], why: str) -> None:
        self._refused[key] = self.clock() + self.retry_s
        self.log.warning("%s; asked again in %.1f s", why, self.retry_s)

    def _answered(self, conn: _Connection | None) -> None:
        """The daemon answered: if it was away, say it is back."""
        with self._lock:
            if self._down_since is not None and conn is not None:
                self.log.warning("%s: daemon at %s is back after %.1f s", self.tag, conn.client.path,
                                 self.clock() - self._down_since)
                self._down_since = None

    def failed(self, exc: BaseException) -> None:
        """A daemon call of this thread failed (or could not connect): drop its client, log once, and try again at
        the next use if the daemon is gone (a broken connection, nobody listening), else `retry_s` later."""
        conn, self._held.conn = self._held.conn, None
        if conn is not None:
            with self._lock:
                if conn.client in self._clients:
                    self._clients.remove(conn.client)
            _close(conn.client)
        gone = isinstance(exc, ConnectionError)        # not a TimeoutError: that is a daemon that did not answer
        with self._lock:
            self._retry_at = self.clock() + (0.0 if gone else self.retry_s)
            if self._down_since is None:
                self._down_since = self.clock()
                self.outages += 1
                when = "trying again at each use" if gone else f"trying again every {self.retry_s:.1f} s"
                self.log.warning("%s: daemon unavailable (%s: %s); %s, %s", self.tag, type(exc).__name__, exc,
                                 self.without, when)

    def close(self) -> None:
        """Close every connection of the link (of every thread); a later call connects again."""
        with self._lock:
            clients, self._clients = self._clients, []
        for c in clients:
            _close(c)
        self._held = _PerThread() if self.per_thread else _Shared()


def _close(client: Client) -> None:
    try:
        client.close()
    except Exception:  # noqa: BLE001 - closing a broken client must not raise into the engine
        pass
