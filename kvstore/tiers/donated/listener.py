"""The donors' socket: where processes with idle memory lend it to the donated tier and take it back.

A Unix socket of its own (the daemon's op table is not the tier's), mode 0600 in a private directory like the
daemon's, speaking the daemon's frames (kvstore.protocol.frames: a 4-byte length, then a msgpack map) with the
daemon's replies ({"v", "id", "ok": true, ...} or {"ok": false, "error": {"code", "message"}}). One thread accepts;
each donor connection has a thread of its own, so that one donor's reclaim (which may take up to its deadline)
never delays another's. Requests, one at a time per connection:

- `donate` {id, name, bytes, kind: "memfd"} with the memfd as the one fd of the message (SCM_RIGHTS), or
  {kind: "cuda", handle, device, offset} with none -> {region}. The memfd must be exactly `bytes` long and sealed
  against shrinking (kvstore.tiers.donated.memory says why). A daemon takes one kind (`kind` below).
- `reclaim` {id, region, deadline_ms} -> {region, migrated, dropped, seconds, deadline_passed, unmapped}: the reply
  comes once nothing of the daemon's touches the region any more; only then may the donor reuse it. A memfd
  region's unmap follows the reply (the donor's pages outlive the daemon's mapping; nothing reads or writes through
  it any more): a short deadline is not stretched by a munmap of the whole region.

A donor may reclaim only regions it donated on the same connection. A connection that ends (the donor exited or
was killed) has its regions reclaimed with deadline 0 and never read again: its memory may be gone. A bad request
gets an error and the connection stays; a frame that cannot be parsed gets an error and the connection is closed
(the stream cannot be resynced); either way the other donors are served on.
"""
from __future__ import annotations

import itertools
import logging
import os
import socket
import stat
import threading
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstore.private_dir import NotASocket, SocketServed, ensure_private_dir, listen_private
from kvstore.protocol.codes import Code, ProtocolError
from kvstore.protocol.frames import FrameReader, Limits, decode, encode
from kvstore.protocol.schemas import error, ok
from kvstore.tiers import TierUnavailable
from kvstore.tiers.donated.memory import Refused, open_memory

if TYPE_CHECKING:
    from kvstore.tiers.donated.tier import DonatedTier

log = logging.getLogger("kvstore")
KINDS = ("memfd", "cuda")


def socket_beside(server_socket: str) -> str:
    """The donors' socket next to the daemon's: same private directory, `donate.sock`."""
    return os.path.join(os.path.dirname(server_socket) or ".", "donate.sock")
MAX_FRAME = 64 << 10
MAX_FDS = 8                 # fds one message may carry before the rest are cut (and the message refused)
LIMITS = Limits(max_bin_len=1024, max_str_len=4096, max_array_len=16, max_map_len=16)
RECV_BYTES = 64 << 10
MAX_NAME = 128


class _Hangup(Exception):
    """The connection cannot go on (an unparseable frame): it is closed after the error reply."""


@dataclass(eq=False)
class _Donor:
    id: int
    sock: socket.socket
    regions: set[int] = field(default_factory=set)


class DonateListener:
    def __init__(self, tier: DonatedTier, socket_path: str, kind: str = "memfd", max_donors: int = 16,
                 max_bytes: int = 0, max_deadline_s: float = 60.0) -> None:
        """`kind`: the regions this daemon takes (memfd on every machine, cuda where CUDA is); `max_bytes`: all
        regions together (0: no cap); `max_deadline_s`: a reclaim asking for more gets this."""
        if kind not in KINDS:
            raise ValueError(f"donated.kind must be one of {', '.join(KINDS)}, got {kind!r}")
        self.tier = tier
        self.path = socket_path
        self.kind = kind
        self.max_donors = max_donors
        self.max_bytes = max_bytes
        self.max_deadline_s = max_deadline_s
        self.sock = bind_private(socket_path)
        self.sock.settimeout(0.2)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._donors: dict[int, tuple[_Donor, threading.Thread]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="kvstore-donate", daemon=True)

    def start(self) -> DonateListener:
        self._thread.start()
        return self

    def donors(self) -> int:
        with self._lock:
            return len(self._donors)

    # ----- connections -----
    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                log.exception("donated: accept failed")
                continue
            conn.settimeout(None)
            donor = _Donor(next(self._ids), conn)
            t = threading.Thread(target=self._serve, args=(donor,), name=f"kvstore-donor-{donor.id}", daemon=True)
            with self._lock:
                full = len(self._donors) >= self.max_donors
                if not full:
                    self._donors[donor.id] = (donor, t)
            if full:
                self._refuse(conn)
            else:
                t.start()

    def _refuse(self, conn: socket.socket) -> None:
        try:
            conn.sendall(encode(error(0, Code.TOO_MANY_CONNECTIONS,
                                      f"this daemon takes {self.max_donors} donors at once")))
        except OSError:
            pass
        conn.close()

    def _serve(self, donor: _Donor) -> None:
        """One donor's requests, until its connection ends; then its regions are reclaimed (deadline 0)."""
        frames = FrameReader(limit=MAX_FRAME)
        fds: list[int] = []
        try:
            while True:
                cut = self._recv(donor.sock, frames, fds)
                if cut is None:
                    break
                while (body := frames.next()) is not None:
                    taken, fds = fds, []
                    self._handle(donor, body, taken, cut)
                    cut = False
        except ProtocolError as e:          # a frame over the limit: the stream cannot be resynced
            self._send(donor, error(0, e.code, e.message))
        except (_Hangup, OSError):
            pass
        finally:
            for fd in fds:
                os.close(fd)
            donor.sock.close()
            self._gone(donor)

    def _recv(self, sock: socket.socket, frames: FrameReader, fds: list[int]) -> bool | None:
        """Feed what the socket gives into `frames` and its fds into `fds`; whether fds were cut (more than
        MAX_FDS); None when the connection ended."""
        data, anc, flags, _ = sock.recvmsg(RECV_BYTES, socket.CMSG_SPACE(MAX_FDS * 4))
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array("i", payload[: len(payload) - len(payload) % 4]))
        if not data:
            return None
        frames.feed(data)
        return bool(flags & socket.MSG_CTRUNC)

    def _gone(self, donor: _Donor) -> None:
        with self._lock:
            self._donors.pop(donor.id, None)
        for rid in sorted(donor.regions):
            try:
                self.tier.reclaim(rid, 0.0, dead=True)
            except KeyError:
                pass
            except Exception:
                log.exception("donated: dropping region %d of a donor that left failed", rid)

    # ----- requests -----
    def _handle(self, donor: _Donor, body: bytes, fds: list[int], cut: bool) -> None:
        """Answer one request; the fds that came with it are closed here unless a region keeps them."""
        try:
            msg = decode(body, LIMITS)
        except ProtocolError as e:
            _close(fds)
            self._send(donor, error(0, e.code, e.message))
            raise _Hangup from None
        rid = msg.get("id", 0) if type(msg.get("id", 0)) is int else 0
        op = msg.get("op")
        unmap: Callable[[], bool] | None = None
        try:
            if op == "donate":
                if cut:
                    _close(fds)
                    raise Refused(f"a memfd donation carries exactly one fd; this one carried more than {MAX_FDS}")
                reply = self._donate(donor, msg, fds)
            else:
                _close(fds)
                if fds:
                    raise Refused(f"{str(op)[:32]!r} carries no fd, this one carried {len(fds)}")
                if op == "reclaim":
                    reply, unmap = self._reclaim(donor, msg)
                else:
                    self._send(donor, error(rid, Code.UNKNOWN_OP, f"unknown op {str(op)[:32]!r}; the donors' "
                                                                  f"socket takes donate and reclaim"))
                    return
        except Refused as e:
            self._send(donor, error(rid, Code.BAD_REQUEST, f"{op}: {e}"))
            return
        except _Unknown as e:
            self._send(donor, error(rid, Code.NOT_FOUND, f"{op}: {e}"))
            return
        except _Full as e:
            self._send(donor, error(rid, Code.NO_SPACE, f"{op}: {e}"))
            return
        except Exception as e:      # a bug must cost one request, not the listener
            log.exception("donated: %s from donor %d failed", op, donor.id)
            self._send(donor, error(rid, Code.INTERNAL, f"{op}: internal error {type(e).__name__}"))
            return
        try:
            self._send(donor, ok(rid, **reply))
        finally:
            if unmap is not None:
                unmap()                 # a memfd region's unmap: the donor has its answer already

    def _donate(self, donor: _Donor, msg: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        try:
            name, nbytes, kind = msg.get("name", ""), msg.get("bytes"), msg.get("kind")
            if not isinstance(name, str) or len(name) > MAX_NAME:
                raise Refused(f"name is a string of at most {MAX_NAME} characters")
            if type(nbytes) is not int or nbytes <= 0:
                raise Refused("bytes is the region's size, an integer above 0")
            if kind != self.kind:
                raise Refused(f"this daemon takes regions of kind {self.kind!r}, not {str(kind)[:16]!r}")
            if self.max_bytes and self.tier.donated_bytes() + nbytes > self.max_bytes:
                raise _Full(f"{nbytes} more bytes would exceed donated.max_bytes ({self.max_bytes})")
        except BaseException:
            _close(fds)
            raise
        mem = open_memory(kind, nbytes, fds, msg)
        region = self.tier.add_region(name or f"donor-{donor.id}", mem, donor.id)
        donor.regions.add(region)
        return {"region": region, "bytes": nbytes}

    def _reclaim(self, donor: _Donor, msg: dict[str, Any]) -> tuple[dict[str, Any], Callable[[], bool]]:
        """The reply, and the region's unmap, for after it (DonatedTier.reclaim_before_unmap)."""
        region, deadline_ms = msg.get("region"), msg.get("deadline_ms", 0)
        if type(deadline_ms) not in (int, float) or deadline_ms < 0:
            raise Refused("deadline_ms is a number of milliseconds >= 0")
        if type(region) is not int or region not in donor.regions:
            raise _Unknown(f"region {str(region)[:24]} is not one this connection donated (and has not given back)")
        try:
            return self.tier.reclaim_before_unmap(region, min(deadline_ms / 1000, self.max_deadline_s))
        except KeyError:
            raise _Unknown(f"region {region} is not in use (given back already)") from None
        finally:
            donor.regions.discard(region)

    def _send(self, donor: _Donor, msg: dict[str, Any]) -> None:
        try:
            donor.sock.sendall(encode(msg))
        except OSError:
            pass                        # its connection ended: _serve sees it next

    def close(self) -> None:
        """Stop accepting, end every donor's connection (their regions are given back, deadline 0), remove the
        socket."""
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()
        try:
            if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                os.unlink(self.path)
        except OSError:
            pass
        with self._lock:
            donors = list(self._donors.values())
        for donor, _ in donors:
            try:
                donor.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for _, t in donors:
            t.join(timeout=30)


class _Unknown(Exception):
    """Not a region of this connection (not_found)."""


class _Full(Exception):
    """Over donated.max_bytes (no_space)."""


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def bind_private(path: str) -> socket.socket:
    """Listen at `path`, 0600, in a private directory (as the daemon's own socket): a stale socket is replaced,
    one another process serves at is not (TierUnavailable)."""
    try:
        ensure_private_dir(os.path.dirname(path) or ".", "donated socket directory")
        return listen_private(path, 16)
    except NotASocket:
        raise TierUnavailable(f"{path} exists and is not a socket; refusing to replace it") from None
    except SocketServed:
        raise TierUnavailable(f"another process is serving donors at {path}") from None
    except OSError as e:
        raise TierUnavailable(f"cannot listen for donors at {path}: {e.strerror or e}") from None
