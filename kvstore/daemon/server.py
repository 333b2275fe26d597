"""`kvstore serve`: the daemon's lifecycle. Binds the Unix socket (0600 in a 0700 directory, refusing to steal
a live daemon's socket), accepts connections up to the cap (one thread each: ops are short book-keeping under one
lock, and blocking sockets keep a round trip near the raw socket's), and shuts down gracefully on SIGTERM or
Ctrl-C: stop accepting, let requests in flight finish, close connections, release the pool. A second signal forces
the exit. A client over the cap gets a `too_many_connections` error frame; its connection stays open a moment
(write side shut) so that a request it already sent cannot make its send fail before it reads the refusal.

Each accepted connection is identified by the kernel (SO_PEERCRED: pid, uid, gid; kvstore.daemon.tenants). The
accept loop's tick (every LEASE_SWEEP_S at least) also aborts reservations older than server.reservation_lease_s,
so a client that reserves and walks away cannot keep slots from the others, retires workflows without activity
for hints.idle_s (kvstore.daemon.hints), and starts the predictive prefetch of workflows due soon
(kvstore.movers.predictive)."""
from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import struct
import sys
import threading
import time
from collections import deque
from types import FrameType

from kvstore.daemon import process
from kvstore.daemon.admin import snapshot
from kvstore.daemon.config import Config
from kvstore.daemon.metrics import serve_metrics
from kvstore.daemon.server_config import socket_gid, socket_mode
from kvstore.daemon.session import Session
from kvstore.daemon.state import State, build_state
from kvstore.daemon.tenants import Peer
from kvstore.movers.persist import persist_host_pool
from kvstore.private_dir import NotASocket, NotPrivateDir, SocketServed, ensure_private_dir, listen_private
from kvstore.protocol import Code, encode, error
from kvstore.tiers import DurableTier, TierUnavailable
from kvstore.units import format_size

log = logging.getLogger("kvstore")
REFUSED_LINGER_S = 1.0   # how long a refused connection stays open for its client to read the refusal
MAX_LINGERING = 64       # refused connections kept open at once; beyond that the oldest is closed at once
ACCEPT_BACKOFF_S = 0.05  # out of fds: the pause before the next accept
LEASE_SWEEP_S = 0.2      # how often expired reservations are looked for


class StartupError(RuntimeError):
    """The daemon cannot start; the message says why and what to do."""


class SocketInUse(StartupError):
    pass


def prepare_socket_dir(path: str, group: int | None = None) -> None:
    """The socket's directory: ours alone (0700; 0710 of server.socket_group), never a shared one like /tmp
    (kvstore.private_dir)."""
    d = os.path.dirname(path) or "."
    try:
        ensure_private_dir(d, "socket directory", group)
    except NotPrivateDir as e:
        raise StartupError(f"{e}; or set server.socket / KVSTORE_SERVER_SOCKET") from None


def bind_unix(path: str, mode: int = 0o600, group: int | None = None) -> socket.socket:
    try:
        return _bind_unix(path, mode, group)
    except OSError as e:
        raise StartupError(f"cannot listen at {path}: {e.strerror or e}") from None


def _bind_unix(path: str, mode: int, group: int | None) -> socket.socket:
    prepare_socket_dir(path, group)
    try:
        return listen_private(path, 128, mode, group)
    except NotASocket:
        raise StartupError(f"{path} exists and is not a socket; refusing to replace it (remove it or set "
                           f"server.socket / KVSTORE_SERVER_SOCKET to another path)") from None
    except SocketServed:
        raise SocketInUse(f"another kvstore daemon is serving at {path}; stop it first (or set "
                          f"server.socket / KVSTORE_SERVER_SOCKET to another path)") from None


class Daemon:
    def __init__(self, config: Config) -> None:
        """Builds the whole state: the lower tiers open (and start their scans) before the socket is bound, so a
        refused tier directory starts nothing."""
        self.config = config
        try:
            self.state: State = build_state(config)
        except TierUnavailable as e:
            raise StartupError(str(e)) from None
        self.sessions: dict[int, tuple[Session, threading.Thread]] = {}
        self.stopping = threading.Event()
        self.listener: socket.socket | None = None
        self.metrics_server: object | None = None
        self._refused: deque[tuple[float, socket.socket]] = deque()
        self._signals = 0
        self._last_accept_error = 0.0
        self._next_sweep = 0.0

    def serve(self) -> None:
        cfg = self.config
        # Threads waiting on I/O (an engine's SSD read) must get the GIL back quickly from threads copying or
        # checksumming: Python's default switch interval (5 ms) would be the latency of a critical read.
        sys.setswitchinterval(float(os.environ.get("KVSTORE_SWITCH_INTERVAL", "0.0005")))
        process.harden()
        self.listener = bind_unix(cfg.server.socket, socket_mode(cfg.server), socket_gid(cfg.server))
        self.listener.settimeout(0.2)
        try:
            if cfg.metrics.enabled:
                self._start_metrics()
            self._install_signals()
            log.info("kvstore serving at %s — host pool %s in %s segments (pid %d); try `kvstore stats`",
                     cfg.server.socket, format_size(cfg.pool.capacity), format_size(cfg.pool.segment_bytes),
                     os.getpid())
            while not self.stopping.is_set():
                now = time.monotonic()
                self._close_refused(now)
                if now >= self._next_sweep:
                    self._expire_reservations(now)
                    self._expire_pins(now)
                    self._retire_idle_workflows()
                    self._predict()
                self._drain_moves()
                try:
                    conn, _ = self.listener.accept()
                except TimeoutError:
                    continue
                except OSError as e:
                    self._accept_failed(e)
                    continue
                self._admit(conn)
        finally:
            self._shutdown()

    def _expire_reservations(self, now: float) -> None:
        """Abort reservations past their lease (server.reservation_lease_s): O(connections + expired)."""
        self._next_sweep = now + LEASE_SWEEP_S
        expired: list[tuple[Session, int]] = []
        with self.state.lock:
            for session, _ in list(self.sessions.values()):
                if session.holdings.leases:
                    n = self.state.index.expire(session.holdings, now)
                    if n:
                        expired.append((session, n))
        for session, n in expired:
            log.warning("client %s left %d reservation(s) uncommitted for %g s (server.reservation_lease_s): "
                        "aborted; its later commit of them gets not_found. Commit or abort each reservation "
                        "within the lease", session.peer, n, self.config.server.reservation_lease_s)

    def _expire_pins(self, now: float) -> None:
        """Drop pins held past server.pin_lease_s (each from when this sweep first saw it): a reader that keeps its
        connection busy still cannot keep memory from eviction, reclaim or another tenant's quota for good."""
        lease = self.config.server.pin_lease_s
        dropped: list[tuple[Session, int]] = []
        with self.state.lock:
            for session, _ in list(self.sessions.values()):
                h = session.holdings
                if not h.pins and not h.pin_seen:
                    continue
                for gid in [g for g in h.pin_seen if not h.pins[g]]:
                    del h.pin_seen[gid]
                old = [g for g in h.pins if now - h.pin_seen.setdefault(g, now) >= lease]
                if old:
                    counts = {g: h.pins[g] for g in old}
                    self.state.index.release([g for g, n in counts.items() for _ in range(n)], h)
                    for g in old:
                        del h.pin_seen[g]
                    if len(h.expired_pins) > 65536:
                        h.expired_pins.clear()
                    h.expired_pins.update(counts)
                    self.state.counters["pins_expired"] += len(old)
                    dropped.append((session, len(old)))
        for session, n in dropped:
            log.warning("client %s held %d pin(s) for %g s (server.pin_lease_s): dropped; its copies out of those "
                        "slots fail their CRC check if the slots were reused", session.peer, n, lease)

    def _retire_idle_workflows(self) -> None:
        """Workflows and sessions idle past hints.idle_s are retired: O(retired), under the state lock. The keys
        looked up since the last tick are hashed into the hit-rate ceiling's sketch after it (kvstore.hll)."""
        with self.state.lock:
            n = self.state.hints.sweep()
            looked_up = self.state.looked_up.take()
        self.state.looked_up.fold(looked_up)
        if n:
            log.debug("retired %d workflow(s) idle for %g s (hints.idle_s)", n, self.config.hints.idle_s)

    def _predict(self) -> None:
        """The predictive prefetch's tick (bounded work: prefetch.blocks_per_tick blocks queued at most). The
        retired blocks it evicts for room are copied down without the state lock, as a request's are."""
        st = self.state
        if st.predictive is None:
            return
        st.defer_copies()
        try:
            with st.lock:
                st.predictive.tick()
        finally:
            st.copy_deferred()

    def _drain_moves(self) -> None:
        """While a lent segment is being emptied (kvstore.index.capacity: memory moving to another block size or
        tenant), a few drain steps at each wake of this loop, so that the cap is exact again without waiting for
        requests to make them. Each step holds the state lock for one chunk; its copies run after it."""
        st = self.state
        for _ in range(8):
            if not st.index.moving:
                return
            st.defer_copies()
            try:
                with st.lock:
                    st.index.drain_some()
            finally:
                st.copy_deferred()

    def _accept_failed(self, e: OSError) -> None:
        """Out of fds (or kernel memory): the connection waits in the backlog; the daemon serves the others, backs
        off a moment and tries again. Logged once per run of failures, counted always."""
        if e.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
            raise e
        with self.state.lock:
            self.state.metrics.accept_errors += 1
            first = self.state.metrics.accept_errors == 1 or time.monotonic() - self._last_accept_error > 10
        self._last_accept_error = time.monotonic()
        if first:
            log.error("accept failed: %s; new clients wait until fds are free (open-file limit %d: raise it, or "
                      "lower server.max_connections)", e.strerror, process.state()["fd_limit"])
        time.sleep(ACCEPT_BACKOFF_S)

    def _start_metrics(self) -> None:
        m = self.config.metrics
        try:
            self.metrics_server = serve_metrics(m, self._snapshot)
        except OSError as e:
            raise StartupError(f"cannot serve metrics at {m.host}:{m.port}: {e.strerror or e} (set metrics.port / "
                               f"KVSTORE_METRICS_PORT to a free port)") from None
        log.info("metrics at http://%s:%d/metrics", m.host, m.port)

    def _snapshot(self) -> dict[str, object]:
        with self.state.lock:
            return snapshot(self.state)

    def _admit(self, conn: socket.socket) -> None:
        conn.settimeout(None)
        # A reply the client does not read blocks its sender only this long: then the connection is dropped (with
        # its pins and reservations), so a stalled client costs its own session, never the daemon's threads.
        secs = self.config.server.send_timeout_s
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(secs), int(secs % 1 * 1e6)))
        st = self.state
        peer = Peer.of(conn)
        with st.lock:
            why = None
            if st.connections >= self.config.server.max_connections:
                why = (f"the daemon serves at most {self.config.server.max_connections} connections; try again "
                       "later")
            else:
                why = st.access.uid_full(peer)
            if why:
                st.metrics.refused_connections += 1
            else:
                st.connections += 1
        if why:
            log.warning("refused a client (%s): %s", peer, why)
            self._refuse(conn, why)
            return
        session = Session(st, conn, peer)
        t = threading.Thread(target=self._run_session, args=(session,), name=f"conn-{peer.pid}", daemon=True)
        self.sessions[id(session)] = (session, t)
        t.start()

    def _refuse(self, conn: socket.socket, why: str) -> None:
        try:
            conn.sendall(encode(error(0, Code.TOO_MANY_CONNECTIONS, why)))
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            conn.close()
            return
        self._refused.append((time.monotonic() + REFUSED_LINGER_S, conn))
        while len(self._refused) > MAX_LINGERING:
            self._refused.popleft()[1].close()

    def _close_refused(self, now: float) -> None:
        while self._refused and self._refused[0][0] <= now:
            self._refused.popleft()[1].close()

    def _run_session(self, session: Session) -> None:
        try:
            session.run()
        finally:
            self.sessions.pop(id(session), None)

    def _install_signals(self) -> None:
        def on_signal(signum: int, frame: FrameType | None) -> None:
            self._signals += 1
            if self._signals > 1:
                log.warning("second signal: exiting now")
                os._exit(1)
            log.info("%s: draining (a second signal forces exit)", signal.Signals(signum).name)
            self.stopping.set()

        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, on_signal)
            signal.signal(signal.SIGINT, on_signal)

    def stop(self) -> None:
        self.stopping.set()

    def _shutdown(self) -> None:
        self._close_refused(float("inf"))
        if self.listener is not None:
            self.listener.close()
            try:
                os.unlink(self.config.server.socket)
            except FileNotFoundError:
                pass
        # Stop reading new requests; a request in flight finishes and its reply is still sent.
        for session, _ in list(self.sessions.values()):
            try:
                session.sock.shutdown(socket.SHUT_RD)
            except OSError:
                pass
        deadline = self.config.server.shutdown_timeout_s
        for _, t in list(self.sessions.values()):
            t.join(timeout=deadline)
        if self.metrics_server is not None:
            self.metrics_server.shutdown()  # type: ignore[attr-defined]
        self._stop_movers()
        with self.state.lock:
            self.state.pool.close()
        self.state.lower.close()             # each writes what it has staged: a graceful stop loses no demoted block
        self.state.traffic.close()
        log.info("kvstore stopped")

    def _stop_movers(self) -> None:
        st = self.state
        if st.prefetcher is not None:
            st.prefetcher.close()
        if st.write_through is not None:
            st.write_through.close()         # before the pool closes: its writes read from the slots
        if st.publisher is not None:
            st.publisher.close()
        ssd = next((t for t in st.lower if isinstance(t, DurableTier)), None) if st.lower else None
        if ssd is not None and ssd.persist_on_stop:
            t0 = time.monotonic()
            with st.lock:
                written, left = persist_host_pool(st.index, st.pool, ssd, self.config.server.shutdown_timeout_s)
            log.info("%s: wrote %d block(s) of the host pool in %.1f s for the next start%s", ssd.name, written,
                     time.monotonic() - t0, f"; {left} left out (shutdown_timeout_s)" if left else "")
