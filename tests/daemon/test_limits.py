"""Per-connection bounds against a live daemon (issue 13, part 2): a client that holds all it can, walks away from
its reservations, opens namespaces without end, asks for tiny blocks, sends oversized msgpack or idles without a
namespace gets a clear status or loses its connection, and the others keep storing and reading byte-exact blocks."""
from __future__ import annotations

import os
import socket
import struct
import tempfile
import time

import msgpack
import pytest

from kvstore.client import Client, KVStoreError
from kvstore.protocol import VERSION, ReserveStatus
from kvstore.protocol.geometry import Geometry
from tests.conftest import GEOM, DaemonProc, block, hashes, spec, ssd_settled

PER_MIB = (1 << 20) // GEOM.full_bytes      # 128 blocks of 8 KiB per MiB


def wait_for(predicate, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_client_that_reserves_until_no_space_and_idles_leaves_the_others_room(start_daemon):
    """Before, one connection could reserve every slot of the pool and sit on them: every other writer got
    no_space. By default (server.max_reserved_fraction 0.5) its uncommitted reservations hold half the pool at
    most — per tenant (issue 29): its tenant's other connections share that half; another tenant keeps the rest."""
    import yaml

    conf = os.path.join(tempfile.mkdtemp(), "kvstore.yaml")
    with open(conf, "w") as f:
        yaml.safe_dump({"tenants": [{"name": "hostile", "secret": "h"}, {"name": "other", "secret": "o"}]}, f)
    d = start_daemon("4MiB", env={"KVSTORE_CONFIG": conf,          # the caps, not the order: evict by recency
                                  "KVSTORE_POOL_EVICTION": "lru"})
    hostile, other = Client(d.socket, tenant="hostile", secret="h"), Client(d.socket, tenant="other", secret="o")
    accomplice = Client(d.socket, tenant="hostile", secret="h")
    try:
        ns = hostile.namespace(spec())
        held, refused, batch = 0, False, 0
        while not refused:                                   # reserve until no_space, never commit
            r = ns.reserve(hashes(64, start=64 * batch, tag=b"hostile"))
            held += len(r.reserved)
            refused = ReserveStatus.NO_SPACE in r.status
            r.done = True                                    # and keep the slots: no abort
            batch += 1
        assert held == 2 * PER_MIB                           # half of the 4 MiB pool
        assert other.stats()["counters"]["held_cap"] >= 1
        more = accomplice.namespace(spec()).reserve(hashes(8, tag=b"accomplice"))
        assert more.reserved == [] and ReserveStatus.NO_SPACE in more.status   # a second connection gains nothing
        mine = other.namespace(spec())
        hs, want = hashes(3 * PER_MIB), [block(i) for i in range(3 * PER_MIB)]
        for i in range(0, len(hs), PER_MIB):                 # more than the room left: the others evict their own
            put = mine.put(hs[i:i + PER_MIB], want[i:i + PER_MIB])
            assert put.stored == PER_MIB and put.no_space == 0
            outs = [bytearray(GEOM.full_bytes) for _ in range(PER_MIB)]
            assert mine.get(hs[i:i + PER_MIB], outs) == PER_MIB
            assert [bytes(o) for o in outs] == want[i:i + PER_MIB]
    finally:
        hostile.close()
        other.close()
        accomplice.close()


def test_an_acquire_gets_the_prefix_within_the_cap(start_daemon):
    d = start_daemon("4MiB", env={"KVSTORE_SERVER_MAX_HELD_FRACTION": "0.5"})
    with d.client() as c:
        ns = c.namespace(spec())
        hs, want = hashes(3 * PER_MIB), [block(i) for i in range(3 * PER_MIB)]
        assert ns.put(hs, want).stored == 3 * PER_MIB
        before = c.stats()["counters"]["held_cap"]
        lease = ns.acquire(hs[:1000])
        assert len(lease) == 2 * PER_MIB                     # pinned: half the pool, the prefix within it
        outs = [bytearray(GEOM.full_bytes) for _ in range(len(lease))]
        lease.read_blocks(outs)
        assert [bytes(o) for o in outs] == want[:len(lease)]
        assert c.stats()["counters"]["held_cap"] == before + 1
        lease.release()
        with ns.acquire(hs[2 * PER_MIB:]) as rest:           # released: the rest fits again
            assert len(rest) == PER_MIB


def test_an_uncommitted_reservation_is_aborted_after_its_lease(start_daemon):
    """Before, a reservation lived as long as its connection: a client that reserved and walked away (but kept the
    connection) held its slots, and the keys stayed "in progress" for every other writer, for good."""
    d = start_daemon(env={"KVSTORE_SERVER_RESERVATION_LEASE_S": "0.3"})
    hs = hashes(4)
    with d.client() as slow, d.client() as other:
        ns = slow.namespace(spec())
        r = ns.reserve(hs)
        r.write_blocks([block(i) for i in range(4)])
        wait_for(lambda: other.stats()["counters"]["reservations_expired"] == 4, "the lease to end")
        assert other.stats()["reserved"] == 0
        with pytest.raises(KVStoreError) as e:
            r.commit()                                       # too late: nothing was committed
        assert e.value.code == "not_found"
        assert "server.reservation_lease_s" in d.read_log()
        theirs = other.namespace(spec())
        assert theirs.put(hs, [block(10 + i) for i in range(4)]).stored == 4   # the keys are free again
        outs = [bytearray(GEOM.full_bytes) for _ in hs]
        assert ns.get(hs, outs) == 4 and [bytes(o) for o in outs] == [block(10 + i) for i in range(4)]


def test_a_renewed_reservation_outlives_its_lease(start_daemon):
    """A writer whose copies outlast the lease (a vLLM forward pass saving 32 layers of an 8K prompt on a CPU took
    150 s against the 60 s lease: every reservation of the step was aborted mid-pass) renews it and commits."""
    d = start_daemon(env={"KVSTORE_SERVER_RESERVATION_LEASE_S": "0.4"})
    with d.client() as c:
        ns = c.namespace(spec())
        assert c.lease_s == 0.4                              # hello says how long a lease is
        r = ns.reserve(hashes(3))
        for _ in range(6):                                   # 1.2 s in all, three leases
            time.sleep(0.2)
            assert c.renew() == 3
        r.write_blocks([block(i) for i in range(3)])
        r.commit()
        assert c.stats()["counters"]["reservations_expired"] == 0
        outs = [bytearray(GEOM.full_bytes) for _ in range(3)]
        assert ns.get(hashes(3), outs) == 3 and [bytes(o) for o in outs] == [block(i) for i in range(3)]
        r2 = ns.reserve(hashes(2, start=10))                 # one not renewed still ends
        wait_for(lambda: c.stats()["counters"]["reservations_expired"] == 2, "the lease to end")
        assert c.renew() == 0
        with pytest.raises(KVStoreError):
            r2.commit()


def test_a_committed_reservation_is_not_touched_by_the_lease(start_daemon):
    d = start_daemon(env={"KVSTORE_SERVER_RESERVATION_LEASE_S": "0.3"})
    with d.client() as c:
        ns = c.namespace(spec())
        assert ns.put(hashes(4), [block(i) for i in range(4)]).stored == 4
        r = ns.reserve(hashes(2, start=10))                  # a lease that is still running is left alone
        time.sleep(0.6)
        outs = [bytearray(GEOM.full_bytes) for _ in range(4)]
        assert ns.get(hashes(4), outs) == 4 and [bytes(o) for o in outs] == [block(i) for i in range(4)]
        assert c.stats()["counters"]["reservations_expired"] == 2   # the committed ones were not counted
        with pytest.raises(KVStoreError):
            r.commit()


def test_namespaces_per_connection_are_capped(start_daemon):
    d = start_daemon(env={"KVSTORE_SERVER_MAX_NAMESPACES_PER_CONNECTION": "2"})
    with d.client() as c:
        a, b = c.namespace(spec("a")), c.namespace(spec("b"))
        assert c.namespace(spec("a")).id == a.id             # saying hello again to one it holds is free
        with pytest.raises(KVStoreError) as e:
            c.namespace(spec("c"))
        assert e.value.code == "over_limit" and "server.max_namespaces_per_connection" in e.value.message
        assert b.put(hashes(2), [block(0), block(1)]).stored == 2   # the connection serves on
    with d.client() as c:                                    # a cap per connection, not per daemon
        assert c.namespace(spec("c")).id > b.id


def test_a_geometry_below_the_minimum_block_size_is_refused(daemon):
    """Before, 1-byte blocks were accepted: a 64 MiB segment of them builds 64 Mi-entry slot lists under the state
    lock (seconds, and GiBs outside the cap)."""
    tiny = Geometry(layers=1, tokens=1, kv_heads=1, head_dim=1, dtype="uint8", kv=1)
    with daemon.client() as c:
        with pytest.raises(KVStoreError) as e:
            c.namespace(spec(geometry=tiny))
        assert e.value.code == "wrong_geometry" and "server.min_block_bytes" in e.value.message
        assert c.stats()["namespaces"] == 0
        assert c.namespace(spec()).put(hashes(1), [block(0)]).stored == 1


def test_unused_namespaces_are_forgotten_and_their_blocks_found_again(tmp_path, daemons):
    """Before, every namespace ever said hello to stayed in the daemon's books for good."""
    d = DaemonProc(env={"KVSTORE_SSD_DIR": str(tmp_path / "ssd")}).start()
    daemons.append(d)
    hs, want = hashes(8), [block(i) for i in range(8)]
    with d.client() as admin:
        with d.client() as c:
            ns = c.namespace(spec("gone"))
            old = ns.id
            assert ns.put(hs, want).stored == 8
            assert admin.stats()["namespaces"] == 1
        assert admin.stats()["namespaces"] == 1              # its blocks are still in the host pool
        admin.evict(everything=True)                         # now on SSD only
        ssd_settled(admin)
        wait_for(lambda: admin.stats()["namespaces"] == 0, "the namespace to be forgotten")
        assert admin.stats()["namespaces_forgotten"] == 1
        with d.client() as c:                                # said hello to again: a new id, the same blocks
            ns = c.namespace(spec("gone"))
            assert ns.id > old
            outs = [bytearray(GEOM.full_bytes) for _ in hs]
            assert ns.get(hs, outs) == 8 and [bytes(o) for o in outs] == want


def raw_reply(sock: socket.socket) -> dict | None:
    head = b""
    while len(head) < 4:
        chunk = sock.recv(4 - len(head))
        if not chunk:
            return None
        head += chunk
    (n,) = struct.unpack("<I", head)
    body = b""
    while len(body) < n:
        body += sock.recv(n - len(body))
    return msgpack.unpackb(body, raw=False)


def frame(msg: bytes) -> bytes:
    return struct.pack("<I", len(msg)) + msg


@pytest.mark.parametrize("value", [[None] * 100_000, [[None] * 3000] * 3, {str(i): 0 for i in range(1000)},
                                   {"namespace": {str(i): None for i in range(100)}}])
def test_msgpack_beyond_the_request_limits_is_refused_while_decoding(daemon, value):
    """Before, a 1 MiB frame decoded into whatever it declared (here up to 100 000 objects) before the schema looked
    at it; now the decoder refuses containers no valid request has, and closes the connection."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(20)
        s.connect(daemon.socket)
        s.sendall(frame(msgpack.packb({"v": VERSION, "op": "ping", "id": 1, "junk": value}, use_bin_type=True)))
        reply = raw_reply(s)
        assert reply is not None and reply["error"]["code"] == "bad_frame"
        assert "longer than this daemon accepts" in reply["error"]["message"]
        assert raw_reply(s) is None                          # then closed
    with daemon.client() as c:
        assert c.ping()["pong"] is True


def test_an_idle_connection_is_closed_unless_it_pins_blocks(start_daemon):
    """Before, a connection that sent nothing was kept for good: 64 of them locked everyone out. Now one that idles
    is closed (its reservations released), unless it pins blocks: a lease's slots stay its own while it copies."""
    d = start_daemon(env={"KVSTORE_SERVER_IDLE_TIMEOUT_S": "0.3"})
    with d.client() as reader, d.client() as writer:
        ns = reader.namespace(spec())
        assert ns.put(hashes(2), [block(0), block(1)]).stored == 2
        lease = ns.acquire(hashes(2))
        mine = writer.namespace(spec())
        r = mine.reserve(hashes(2, start=10))
        r.done = True                                        # neither committed nor aborted
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as idle:
            idle.settimeout(20)
            idle.connect(d.socket)
            assert idle.recv(1) == b""                       # closed by the daemon, not by our timeout
        assert "server.idle_timeout_s" in d.read_log()
        wait_for(lambda: d.client().stats()["reserved"] == 0, "the idle writer to lose its reservations")
        time.sleep(1.0)                                      # the reader, pinning, idles longer than that: kept
        outs = [bytearray(GEOM.full_bytes) for _ in range(2)]
        lease.read_blocks(outs)
        assert [bytes(o) for o in outs] == [block(0), block(1)]
        lease.release()
        assert ns.lookup(hashes(2)) == 2 and reader.reconnects == 0
        assert writer.stats()["counters"]["idle_closed"] >= 2 and writer.reconnects == 1
