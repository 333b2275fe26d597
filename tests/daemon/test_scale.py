"""Scale (issue 13 part 8): one daemon with the default 64 MiB segments holds over a million 4 KiB blocks, stored
and looked up 1024 keys a request; the counts are exact, no two keys share a slot, and a sample reads back
byte-exact (the sample was written; every other block is the zeros of its fresh slot, which a sample of those
checks too). Only the sample's pages are touched, so the 4 GiB pool costs its books, not 4 GiB of memory."""
from __future__ import annotations

import random

import numpy as np

from kvstore.checksum import crc32c as block_crc  # the writer's checksum (end-to-end CRC-32C)
from kvstore.protocol.geometry import Geometry
from kvstore.tiers.host import HostPool
from tests.conftest import spec

SMALL = Geometry(layers=1, tokens=16, kv_heads=2, head_dim=32, dtype="float16")     # 4 KiB, the smallest block
BLOCK = SMALL.full_bytes
N = 1 << 20                     # keys: 1 048 576
BATCH = 1024                    # server.max_keys_per_request
SAMPLE = 512                    # blocks written with content of their own (one in 2048)


def key_blob(tag: int, n: int) -> bytes:
    """n distinct 16-byte block hashes, packed: (tag, i) as two big-endian 64-bit words."""
    a = np.empty((n, 2), dtype=">u8")
    a[:, 0] = tag
    a[:, 1] = np.arange(n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)     # odd multiplier: distinct, spread
    return a.tobytes()


def content(i: int) -> bytes:
    return random.Random(i).randbytes(BLOCK)


def test_a_million_keys_in_default_segments(start_daemon):
    d = start_daemon(capacity="4160MiB", segment="64MiB", env={"KVSTORE_LOG_LEVEL": "info"})
    keys = key_blob(0x5CA1E, N)
    sample = set(random.Random(1).sample(range(N), SAMPLE))
    zero_crc = block_crc(bytes(BLOCK))
    gids: list[int] = []
    with d.client() as c:
        ns = c.namespace(spec("scale", geometry=SMALL))
        for start in range(0, N, BATCH):
            blob = keys[start * 16:(start + BATCH) * 16]
            r = c.call("reserve", ns=ns.id, keys=blob)
            assert r["status"] == [0] * BATCH, f"batch at {start}: {set(r['status'])}"
            crcs = []
            for i, gid in enumerate(r["slots"], start):
                if i in sample:
                    c.slot(gid)[:] = np.frombuffer(content(i), np.uint8)
                crcs.append(block_crc(content(i)) if i in sample else zero_crc)
            assert c.call("commit", ns=ns.id, keys=blob, crcs=crcs)["n"] == BATCH
            gids += r["slots"]
        assert len(set(gids)) == N, "two keys share a slot"

        s = c.stats()
        host = s["tiers"][0]
        assert (s["blocks"], s["reserved"], s["pinned"]) == (N, 0, 0)
        assert (host["used_bytes"], host["segment_bytes"]) == (N * BLOCK, 64 << 20)
        assert host["segments"] == N * BLOCK // HostPool(1, 64 << 20).segment_size(BLOCK)   # small blocks: 4 MiB
        assert s["counters"]["evictions"] == 0

        # every key found, 1024 a request; keys never stored are not
        for start in range(0, N, BATCH):
            assert c.call("lookup", ns=ns.id, keys=keys[start * 16:(start + BATCH) * 16])["n"] == BATCH
        assert ns.lookup([bytes(16)] + [k.to_bytes(16, "big") for k in range(1, 9)]) == 0
        assert c.call("lookup", ns=ns.id, keys=key_blob(0xD1FF, BATCH))["n"] == 0

        # the sample's batches acquired: the slots reserved, the bytes written (or the fresh slot's zeros)
        for start in sorted({i - i % BATCH for i in random.Random(2).sample(sorted(sample), 16)}):
            r = c.call("acquire", ns=ns.id, keys=keys[start * 16:(start + BATCH) * 16])
            assert r["slots"] == gids[start:start + BATCH]
            for i in [j for j in range(start, start + BATCH) if j in sample] + [start + 1, start + 777]:
                want = content(i) if i in sample else bytes(BLOCK)
                assert bytes(c.slot(gids[i])) == want, f"block {i}"
                assert r["crcs"][i - start] == block_crc(want)
            c.call("release", slots=r["slots"])
        assert c.stats()["pinned"] == 0
