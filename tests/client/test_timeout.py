"""The client's timeout is the kernel's (SO_RCVTIMEO / SO_SNDTIMEO on a blocking socket: Python's own timeout polls
before every recv, which costs a round trip 19 → 55 µs across cores here): a peer that never answers still ends a
call with TimeoutError after the timeout, not a hang, and a working daemon is unaffected."""
from __future__ import annotations

import os
import socket
import struct
import tempfile
import threading
import time

import pytest

from kvstore.client import Client


def test_a_peer_that_never_answers_times_out_with_timeout_error():
    d = tempfile.mkdtemp(prefix="kvs-to-", dir="/tmp")
    path = os.path.join(d, "s")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    held: list[socket.socket] = []
    t = threading.Thread(target=lambda: held.append(srv.accept()[0]), daemon=True)
    t.start()
    try:
        c = Client(path, timeout=0.3)
        assert c.sock.gettimeout() is None                       # blocking: the kernel keeps the timeout
        rcv = struct.unpack("ll", c.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16))
        assert rcv == (0, 300000)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="did not answer within 0.3 s"):
            c.ping()
        assert 0.25 <= time.monotonic() - t0 < 5
        c.close()
    finally:
        for s in held:
            s.close()
        srv.close()
        os.unlink(path)
        os.rmdir(d)


def test_a_client_without_timeout_blocks_and_still_talks(start_daemon):
    d = start_daemon()
    with Client(d.socket, timeout=None) as c:
        assert c.sock.gettimeout() is None
        assert c.ping()["pong"] is True
    with Client(d.socket) as c:                                  # the default, 30 s
        assert c.sock.gettimeout() is None
        assert struct.unpack("ll", c.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16)) == (30, 0)
        assert c.ping()["pong"] is True
