"""Client processes for the concurrency tests: `python -m tests.workers MODE SOCKET SEED N`.

Every block's content is derived from its hash, so any reader can check any block it loads without a shared
oracle; a worker exits 1 on the first wrong byte and prints its counts as `key=value` pairs.
"""
from __future__ import annotations

import hashlib
import sys

from kvstore.client import Client
from tests.conftest import GEOM, spec


def content(h: bytes) -> bytes:
    """The one correct content of the block with hash h."""
    out = bytearray()
    counter = 0
    while len(out) < GEOM.full_bytes:
        out += hashlib.blake2b(h + counter.to_bytes(4, "little"), digest_size=64).digest()
        counter += 1
    return bytes(out[:GEOM.full_bytes])


def key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def roundtrip(sock: str, seed: int, n: int, copy_threads: int = 1) -> dict[str, int]:
    """Put private and shared keys in batches, read them back; verify every byte loaded."""
    counts = {"stored": 0, "loaded": 0, "bad": 0}
    with Client(sock, copy_threads=copy_threads) as c:
        ns = c.namespace(spec())
        for start in range(0, n, 16):
            # private keys of this worker, and keys every worker writes (same content: dedup on reserve)
            hs = [key(seed * 1_000_000 + i) for i in range(start, start + 16)]
            hs += [key(i) for i in range(start, start + 8)]
            r = ns.put(hs, [content(h) for h in hs], batch=12)
            counts["stored"] += r.stored
            outs = [bytearray(GEOM.full_bytes) for _ in hs]
            for h, o in zip(hs, outs):
                if ns.get([h], [o]) == 1:
                    counts["loaded"] += 1
                    if bytes(o) != content(h):
                        counts["bad"] += 1
    return counts


def writer(sock: str, seed: int, n: int, copy_threads: int = 1) -> dict[str, int]:
    """Put batches of new keys (seed*1e6 + i) until the daemon goes away; print each batch once committed."""
    counts = {"stored": 0, "bad": 0}
    try:
        with Client(sock) as c:
            ns = c.namespace(spec())
            for start in range(0, n, 8):
                hs = [key(seed * 1_000_000 + i) for i in range(start, start + 8)]
                counts["stored"] += ns.put(hs, [content(h) for h in hs]).stored
                print(f"committed {start + 8}", flush=True)
    except (ConnectionError, OSError):
        pass
    return counts


if __name__ == "__main__":
    mode, sock, seed, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    threads = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    result = {"roundtrip": roundtrip, "writer": writer}[mode](sock, seed, n, threads)
    print(" ".join(f"{k}={v}" for k, v in result.items()), flush=True)
    sys.exit(1 if result["bad"] else 0)
