"""One client connection: read a frame, check it, run its op under the state lock, reply. Bad input gets a
structured error (a refusal of the books becomes its protocol code here); a frame that cannot be parsed also
closes the connection; nothing a client sends can stop the daemon serving the others. When the connection ends, for
any reason, its reservations and pins are dropped.

The connection's limits are set here, from the configuration: the share of the pool it may hold
(server.max_held_fraction), its namespaces (server.max_namespaces_per_connection), its peer's role and tenant
(kvstore.daemon.tenants). One that sends nothing for server.idle_timeout_s is closed, its reservations released,
unless it pins blocks (a reader's copy out of a slot must not find it reused). Engines keep connections for hours:
the client connects again by itself before its next request (kvstore.client.connection)."""
from __future__ import annotations

import logging
import os
import socket
import struct
import time
from functools import partial
from typing import Any

from kvstore.daemon.ops import HANDLERS, Reply
from kvstore.daemon.state import State
from kvstore.daemon.tenants import Conn, Peer, is_admin
from kvstore.index import GroupMismatch, InvalidRequest, NotHeld, OverLimit, Refused, TooLarge, UnknownNamespace
from kvstore.protocol import (
    VERSION,
    Code,
    FrameReader,
    Limits,
    ProtocolError,
    check_request,
    decode,
    encode,
    error,
    ok,
)
from kvstore.protocol.frames import send_frame

log = logging.getLogger("kvstore")
REFUSALS: dict[type[Refused], str] = {UnknownNamespace: Code.UNKNOWN_NAMESPACE, NotHeld: Code.NOT_FOUND,
                                      InvalidRequest: Code.BAD_REQUEST, TooLarge: Code.WRONG_GEOMETRY,
                                      OverLimit: Code.OVER_LIMIT, GroupMismatch: Code.WRONG_GEOMETRY}


class Session:
    def __init__(self, state: State, sock: socket.socket, peer: Peer) -> None:
        cfg = state.config.server
        self.state = state
        self.sock = sock
        self.peer = peer
        self.holdings = Conn(peer=peer, admin=is_admin(state.config, peer), held_share=cfg.max_held_fraction,
                             reserved_share=cfg.max_reserved_fraction,
                             max_namespaces=cfg.max_namespaces_per_connection)
        with state.lock:
            state.access.connected(self.holdings)
        self.in_request = False
        self._frames = FrameReader(cfg.max_frame_bytes)
        self._limits = Limits.for_requests(cfg.max_frame_bytes, cfg.max_keys_per_request)
        self._max_keys = cfg.max_keys_per_request
        secs = cfg.idle_timeout_s    # recv wakes up this often: a connection with no namespace is then closed
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", int(secs), int(secs % 1 * 1e6)))

    def run(self) -> None:
        try:
            while self._serve_one():
                pass
        except (BlockingIOError, TimeoutError):
            log.warning("client %s stopped reading its replies for %.1f s (server.send_timeout_s): disconnected",
                        self.peer, self.state.config.server.send_timeout_s)
        except OSError as e:
            log.debug("connection %s ended: %s", self.peer, e)
        finally:
            with self.state.lock:
                if self.holdings.reserved or self.holdings.pins:
                    log.info("client %s left holding %d reservation(s) and %d pin(s): released", self.peer,
                             len(self.holdings.reserved), sum(self.holdings.pins.values()))
                self.state.index.disconnect(self.holdings)
                self.state.access.disconnected(self.holdings)
                self.state.connections -= 1
            self.sock.close()

    def _serve_one(self) -> bool:
        body = self._next_frame()
        if body is None:
            return False
        self.in_request = True
        try:
            return self._handle(body)
        finally:
            self.in_request = False

    def _next_frame(self) -> bytes | memoryview | None:
        """The next request's body, or None when the connection ends or announces an oversize frame (refused
        from its header, before any of it is buffered). Reads in 64 KiB chunks: a small request costs one recv,
        and pipelined requests wait in the reader, which never holds more than one frame plus one chunk."""
        frames, chunk = self._frames, None
        while True:
            try:
                body = frames.next() if chunk is None else frames.feed_next(chunk)
            except ProtocolError as e:
                self._fail(0, e.code, e.message)
                return None
            if body is not None:
                return body
            try:
                chunk = self.sock.recv(1 << 16)
            except (BlockingIOError, TimeoutError):
                if self.holdings.pins:
                    chunk = None
                    continue                  # its lease's slots must stay its own while it copies
                self._idle_closed()
                return None
            if not chunk:
                return None

    def _idle_closed(self) -> None:
        with self.state.lock:
            self.state.counters["idle_closed"] += 1
        log.info("client %s sent nothing for %g s (server.idle_timeout_s) and pins no block: closed (the client "
                 "library connects again when it next needs the daemon)", self.peer,
                 self.state.config.server.idle_timeout_s)

    def _handle(self, body: bytes | memoryview) -> bool:
        t0 = time.perf_counter()
        st, op, rid = self.state, "?", 0
        replied: list[bool] = []              # a streaming op sent its last reply itself
        try:
            msg = decode(body, self._limits)
            rid = msg["id"] if type(msg.get("id")) is int else 0   # echoed even when invalid; never a bool
            op, rid = check_request(msg, self._max_keys)
            if msg.get("stream"):             # partial replies, sent while the op waits without the lock
                msg["_emit"] = partial(self._emit, rid, replied)
            if st.demotion is None:           # nothing to defer: no lower tier
                with st.lock:
                    result = HANDLERS[op](st, self.holdings, msg)
                    st.metrics.observe(op, time.perf_counter() - t0)
            else:
                result = self._run_deferring(op, msg, t0)
        except ProtocolError as e:
            if not replied:
                self._fail(rid, e.code, e.message)
            return e.code != Code.BAD_FRAME
        except Refused as e:
            if not replied:
                self._fail(rid, REFUSALS.get(type(e), Code.BAD_REQUEST), str(e))
            return True
        except Exception as e:  # a bug must cost one request, not the daemon
            log.exception("op %s from %s failed", op, self.peer)
            if not replied:                   # (after its last reply, a second one would answer the next request)
                self._fail(rid, Code.INTERNAL, f"{op}: internal error {type(e).__name__}; see the daemon log")
            return True
        if isinstance(result, Reply):
            if not result.sent:
                self._send(ok(rid, **result.fields), result.fds)
            return not result.close
        self.sock.sendall(encode({"v": VERSION, "id": rid, "ok": True, **result}))   # ok(): without the kwargs
        return True

    def _run_deferring(self, op: str, msg: dict[str, Any], t0: float) -> dict[str, Any] | Reply:
        st = self.state
        st.defer_copies()                     # demotion copies of blocks the op evicts: after the lock, before
        try:                                  # the reply (the client writes a slot only once it has the reply)
            with st.lock:
                result = HANDLERS[op](st, self.holdings, msg)
                st.metrics.observe(op, time.perf_counter() - t0)
        finally:
            st.copy_deferred()
        return result

    def _fail(self, rid: int, code: str, message: str) -> None:
        with self.state.lock:
            self.state.metrics.errors[code] += 1
        log.debug("error %s to %s: %s", code, self.peer, message)
        self._send(error(rid, code, message))

    def _emit(self, rid: int, replied: list[bool], fields: dict[str, Any], fds: list[int], more: bool = True) -> None:
        """A streaming op's reply: partial (`more`), or its last, after which the op's own reply is not sent."""
        if not more:
            replied.append(True)
        self._send(ok(rid, more=more, **fields), fds)

    def _send(self, msg: dict[str, Any], fds: list[int] | None = None) -> None:
        data = encode(msg)
        try:
            send_frame(self.sock, data, fds)
        finally:
            for fd in fds or ():
                os.close(fd)
