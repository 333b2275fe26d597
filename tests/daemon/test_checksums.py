"""End-to-end checksums against a live daemon: the writer's CRC-32C travels with a block through every tier, and no
block whose bytes differ from what its writer committed is ever served as verified — altered in shared memory after
its commit, demoted to SSD, promoted back, or committed without a CRC at all."""
from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest

from kvstore.checksum import crc32c
from kvstore.client import Namespace
from kvstore.tiers.ssd.record import HEADER_BYTES, BadRecord, Header, check_record
from tests.conftest import GEOM, DaemonProc, block, hashes, spec, ssd_daemon, ssd_settled


def _alter_in_place(ns: Namespace, h: bytes) -> None:
    """What a buggy or hostile client can do: write a committed block's shared slot."""
    with ns.acquire([h]) as lease:
        assert len(lease) == 1
        lease.views[0][:64] ^= 0xFF


def test_put_commits_each_blocks_crc32c_and_get_checks_its_own_copy(daemon: DaemonProc) -> None:
    hs = hashes(6)
    with daemon.client() as c:
        ns = c.namespace(spec())
        assert ns.put(hs, [block(i) for i in range(6)]).stored == 6
        with ns.acquire(hs) as lease:        # the daemon hands back each block's writer CRC
            assert lease.crcs == [crc32c(block(i)) for i in range(6)]
            assert lease.verified_prefix() == 6
        _alter_in_place(ns, hs[3])
        outs = [np.zeros(GEOM.full_bytes, np.uint8) for _ in hs]
        assert ns.get(hs, outs) == 3         # the altered block ends the prefix: never a wrong byte
        assert all(outs[i].tobytes() == block(i) for i in range(3))
        assert ns.get(hs, outs, verify=False) == 6      # the reader asked for no check: it gets the bytes


def test_a_block_committed_without_a_crc_is_never_verified(daemon: DaemonProc) -> None:
    hs = hashes(2, tag=b"nocrc")
    with daemon.client() as c:
        ns = c.namespace(spec())
        with ns.reserve(hs) as r:
            r.write_blocks([block(1), block(2)])
            assert r.commit(checksum=False) == 2
        with ns.acquire(hs) as lease:
            assert lease.crcs == [None, None] and lease.verified_prefix() == 0
        out = [np.zeros(GEOM.full_bytes, np.uint8) for _ in hs]
        assert ns.get(hs, out) == 0
        assert ns.get(hs, out, verify=False) == 2 and out[1].tobytes() == block(2)


def test_a_block_altered_after_commit_is_not_written_to_ssd_nor_served(daemons: list[DaemonProc]) -> None:
    """Before: the SSD record's CRC was computed from the slot at write time, so the altered bytes came back from
    SSD as verified. Now the tier checks them against the writer's CRC first: not stored, a miss."""
    d = ssd_daemon(daemons)
    hs = hashes(4, tag=b"alter")
    with d.client() as c:
        ns = c.namespace(spec())
        assert ns.put(hs, [block(10 + i) for i in range(4)]).stored == 4
        _alter_in_place(ns, hs[2])
        assert c.evict(everything=True)["blocks"] == 4          # all demoted through staging to SSD
        s = ssd_settled(c)
        ssd = s["tiers"][1]
        assert ssd["counters"].get("crc_mismatch", 0) == 1 and ssd["blocks"] == 3
        outs = [np.zeros(GEOM.full_bytes, np.uint8) for _ in hs]
        assert ns.get(hs, outs) == 2                            # promoted, verified, up to the bad one
        assert [o.tobytes() for o in outs[:2]] == [block(10), block(11)]
        assert ns.lookup(hs) == 2
        with ns.acquire(hs[3:]) as lease:                       # the one after it came back with its CRC
            assert lease.crcs == [crc32c(block(13))] and lease.verified_prefix() == 1


def test_the_writers_crc_survives_a_restart_through_the_ssd_record(daemons: list[DaemonProc]) -> None:
    d = ssd_daemon(daemons, KVSTORE_SSD_WRITE_THROUGH="true", KVSTORE_SSD_SYNC="always")
    hs = hashes(3, tag=b"restart")
    with d.client() as c:
        ns = c.namespace(spec())
        ns.put(hs, [block(20 + i) for i in range(2)] + [block(22)])
        with ns.reserve(hashes(1, tag=b"bare")) as r:          # one without a CRC, for contrast
            r.write_blocks([block(30)])
            r.commit(checksum=False)
        ssd_settled(c)
    d.stop()
    d.start()
    with d.client() as c:
        ns = c.namespace(spec())
        with ns.acquire(hs) as lease:
            assert lease.crcs == [crc32c(block(20 + i)) for i in range(3)]
            assert lease.verified_prefix() == 3
        with ns.acquire(hashes(1, tag=b"bare")) as lease:
            assert len(lease) == 1 and lease.crcs == [None]    # its record's CRC is the tier's, not a writer's


def test_version_1_records_are_read_as_blocks_without_a_writers_crc() -> None:
    """Records written before CRC-32C (zlib CRC-32, no flags) stay readable after an upgrade, unverified."""
    ns, h, body = b"n" * 16, b"h" * 16, block(5)
    fields = struct.pack("<8sII16s16sQIQ", b"KVSREC01", 1, HEADER_BYTES, ns, h, len(body), zlib.crc32(body), 9)
    raw = (fields + struct.pack("<I", zlib.crc32(fields))).ljust(HEADER_BYTES, b"\0")
    header = check_record(raw, body, ns + h, len(body))
    assert header.seq == 9 and header.writer_crc is None
    current = Header(ns, h, len(body), crc32c(body), 9, writer=True).pack()
    assert check_record(current, body, ns + h, len(body)).writer_crc == crc32c(body)
    future = bytearray(current)
    future[8:12] = struct.pack("<I", 3)                     # a format this daemon does not know: a miss
    with pytest.raises(BadRecord) as e:
        check_record(bytes(future), body, ns + h, len(body))
    assert e.value.reason == "version"
