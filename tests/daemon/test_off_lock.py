"""Long work leaves the state lock to others (issue 13, part 4), shown against a live daemon with pause points
(kvstore.testpoints): the daemon stops a thread at a named point where it must hold no lock, the test makes other
clients' requests meanwhile, then lets it go on. No timing: a request that needed the lock would never complete
while the thread is paused.

- `list` of a namespace's keys and `evict` of a namespace walk it in chunks and let go of the lock between them.
- Memory that moves to another block size or tenant lends the retiring segment: the allocation gets its new segment
  at once, the retiring segment's blocks are copied down after the lock (readers of them wait for the copy and get
  exact bytes), a pinned block is never moved, and the pool is over its cap by at most that one segment, until its
  punch.
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvstore.client import Client
from kvstore.daemon.admin import CHUNK_BLOCKS
from kvstore.index.capacity import MOVE_CHUNK
from kvstore.protocol.geometry import Geometry
from tests.conftest import GEOM, DaemonProc, block, hashes, spec, ssd_daemon

MiB = 1 << 20
BIG = Geometry(layers=4, tokens=16, kv_heads=2, head_dim=32, dtype="float16")       # 16 KiB: another block size
TENANTS = [{"name": "a", "secret": "secret-a"}, {"name": "b", "secret": "secret-b"}]


class Paused:
    """Runs `call` in a thread until the daemon pauses at `point` (its n-th pass), then lets it go on."""

    def __init__(self, pause_dir: Path, point: str, call: Callable[[], Any]) -> None:
        self.dir, self.point = pause_dir, point
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(call,), daemon=True)
        self.thread.start()

    def _run(self, call: Callable[[], Any]) -> None:
        try:
            self.result = call()
        except BaseException as e:        # reported by finish()
            self.error = e

    def wait_paused(self, n: int = 1, timeout: float = 60.0) -> Path:
        flag = self.dir / f"{self.point}.{n}"
        deadline = time.monotonic() + timeout
        while not flag.exists():
            assert self.thread.is_alive() or flag.exists(), \
                f"finished without pausing at {self.point} ({str(self.error or self.result)[:120]}): it held the " \
                "lock throughout"
            assert time.monotonic() < deadline, f"no pause at {self.point} in {timeout} s"
            time.sleep(0.005)
        assert self.thread.is_alive()
        return flag

    def finish(self, flag: Path) -> Any:
        flag.unlink()
        self.thread.join(60)
        assert not self.thread.is_alive(), "did not finish once let go"
        if self.error is not None:
            raise self.error
        return self.result


def paused_daemon(start_daemon: Callable[..., DaemonProc], tmp_path: Path, point: str, **kw: Any) -> DaemonProc:
    return start_daemon(env={"KVSTORE_PAUSE_AT": point, "KVSTORE_PAUSE_DIR": str(tmp_path),
                             "KVSTORE_LOG_LEVEL": "info"}, **kw)


def call(d: DaemonProc, op: str, **fields: Any) -> Any:
    """One request on a connection of its own (a thread's)."""
    with d.client() as c:
        return c.call(op, **fields)


def fill(c: Client, model: str, n: int, seed: int = 0) -> tuple[Any, list[bytes]]:
    ns = c.namespace(spec(model))
    hs = hashes(n, tag=model.encode())
    assert ns.put(hs, [block(seed + i) for i in range(n)], batch=128).stored == n
    return ns, hs


def exact(ns: Any, hs: list[bytes], seeds: list[int], nbytes: int = GEOM.full_bytes) -> bool:
    outs = [bytearray(nbytes) for _ in hs]
    return ns.get(hs, outs) == len(hs) and all(bytes(o) == block(s, nbytes) for o, s in zip(outs, seeds))



def _store_big(d: DaemonProc) -> int:
    """Another client stores 4 blocks of the big geometry: its reserve moves memory to that block size."""
    with d.client() as b:
        return b.namespace(spec("b", geometry=BIG)).put(hashes(4, tag=b"b"),
                                                        [block(900 + i, BIG.full_bytes) for i in range(4)]).stored

def test_other_clients_are_served_between_the_chunks_of_a_namespace_evict(start_daemon, tmp_path):
    """Before, `evict ns=N` scanned the whole key table under the state lock: every other client waited for it."""
    n = 3 * CHUNK_BLOCKS + 17
    d = paused_daemon(start_daemon, tmp_path, "between_chunks")
    with d.client() as admin, d.client() as other:
        _, hs = fill(admin, "evicted", n)
        mine, my_hs = fill(other, "kept", 8, seed=10_000)
        ev_ns = next(r["id"] for r in admin.list()["namespaces"] if r["model"] == "evicted")
        ev = Paused(tmp_path, "between_chunks", lambda: call(d, "evict", all=True, ns=ev_ns))
        flag = ev.wait_paused()
        # the evict has made one chunk and lets go of the lock: another client stores and reads meanwhile
        assert mine.put(hashes(4, tag=b"new"), [block(20_000 + i) for i in range(4)]).stored == 4
        assert exact(mine, my_hs, list(range(10_000, 10_008)))
        rows = {r["model"]: r["blocks"] for r in other.list()["namespaces"]}
        assert rows["evicted"] == n - CHUNK_BLOCKS                    # one chunk gone, the rest still there
        assert other.stats()["counters"]["admin_chunks"] == 1
        assert ev.finish(flag) == {"blocks": n, "bytes": n * GEOM.full_bytes}
        assert admin.namespace(spec("evicted")).lookup(hs) == 0
        assert other.stats()["counters"]["admin_chunks"] == 3        # ceil(n / CHUNK_BLOCKS) - 1 pauses
        assert exact(mine, my_hs, list(range(10_000, 10_008)))


def test_other_clients_are_served_between_the_chunks_of_a_namespace_list(start_daemon, tmp_path):
    """Before, `list ns=N` scanned the whole key table under the state lock."""
    n = 2 * CHUNK_BLOCKS + 5
    d = paused_daemon(start_daemon, tmp_path, "between_chunks")
    with d.client() as admin, d.client() as other:
        ns, hs = fill(admin, "listed", n)
        ls = Paused(tmp_path, "between_chunks", lambda: call(d, "list", ns=ns.id, limit=10_000))
        flag = ls.wait_paused()
        mine, my_hs = fill(other, "other", 4, seed=500)             # served while the listing is paused
        assert exact(mine, my_hs, list(range(500, 504)))
        listed = {bytes(h): gid for h, gid in ls.finish(flag)["keys"]}
        assert listed == {bytes(h): gid for h, gid in admin.list(ns.id, limit=10_000)["keys"]}
        assert set(listed) == set(hs) and len(set(listed.values())) == n      # every key once, each its own slot


def move_daemon(start_daemon: Callable[..., DaemonProc], daemons: list[DaemonProc], tmp_path: Path,
                across: str, more: dict[str, str] | None = None) -> DaemonProc:
    env = {"KVSTORE_PAUSE_AT": "draining_copy", "KVSTORE_PAUSE_DIR": str(tmp_path), "KVSTORE_LOG_LEVEL": "info",
           "KVSTORE_TENANCY_COMPACT_BYTES": "0", **(more or {})}    # a tenant's segment as it stands (compaction
    #                                                                 copies under the lock)
    if across == "tenant":
        conf = tmp_path / "kvstore.yaml"
        conf.write_text(yaml.safe_dump({"tenants": TENANTS}))
        env["KVSTORE_CONFIG"] = str(conf)
    return ssd_daemon(daemons, capacity="4MiB", segment="1MiB", **env)


@pytest.mark.parametrize("across", ["block size", "tenant"])
def test_memory_moves_to_another_class_with_its_copies_off_the_lock(daemons, start_daemon, tmp_path, across):
    """Before, the retiring segment's blocks were copied to staging and its pages punched inline, under the state
    lock, while the allocation waited (up to 64 MiB: ~7 ms of copy plus the punch, every client stalled)."""
    d = move_daemon(start_daemon, daemons, tmp_path, across)
    per_seg = MiB // GEOM.full_bytes                                   # 128 blocks of 8 KiB a segment
    n = 4 * per_seg                                                    # the whole pool
    tenant_a = {"tenant": "a", "secret": "secret-a"} if across == "tenant" else {}
    tenant_b = {"tenant": "b", "secret": "secret-b"} if across == "tenant" else {}
    geom_b = BIG if across == "block size" else GEOM
    with Client(d.socket, **tenant_a) as a, Client(d.socket, **tenant_a) as reader, d.client() as admin:
        ns_a = a.namespace(spec("a"))
        hs = hashes(n, tag=b"a")
        assert ns_a.put(hs, [block(i) for i in range(n)]).stored == n
        pinned = reader.namespace(spec("a")).acquire(hs[:3] + hs[-3:])  # readers in two of the four segments
        seeds = list(range(3)) + list(range(n - 3, n))

        def store_b() -> int:
            with Client(d.socket, **tenant_b) as b:
                ns_b = b.namespace(spec("b", geometry=geom_b))
                return ns_b.put(hashes(8, tag=b"b"), [block(900 + i, geom_b.full_bytes) for i in range(8)]).stored

        move = Paused(tmp_path, "draining_copy", store_b)
        flag = move.wait_paused()
        # B's reserve took an idle segment of A's: its blocks are booked on SSD, their copies not made yet, and
        # the lock is free meanwhile
        host = admin.stats()["tiers"][0]
        assert host["retiring_bytes"] == MiB                               # lent: at most one segment
        assert host["mapped_bytes"] == 5 * MiB <= host["capacity_bytes"] + host["retiring_bytes"]
        assert host["mapped_bytes"] + host["reaping_bytes"] - host["retiring_bytes"] <= host["capacity_bytes"]
        assert admin.stats()["counters"]["segment_moves"] == 1
        assert [bytes(v) for v in pinned.views] == [block(s) for s in seeds]     # pinned blocks never move
        found = [i for i in range(n) if ns_a.lookup(hs[i:i + 1]) == 1]
        assert len(found) == n                                             # in the host pool or booked on SSD
        assert move.finish(flag) == 8
        # the moved blocks come back byte-exact from SSD, the others from the host pool
        assert exact(ns_a, hs[:3] + hs[-3:], seeds)
        pinned.release()
        for i in range(0, n, 64):
            assert exact(ns_a, hs[i:i + 64], list(range(i, min(i + 64, n)))), f"blocks {i}..{i + 63}"
        wait_punched(admin)


def wait_punched(c: Client) -> None:
    """Until the lent segment is punched: the cap is exact again."""
    deadline = time.monotonic() + 30
    while (host := c.stats()["tiers"][0])["retiring_bytes"]:
        assert time.monotonic() < deadline, f"the retiring segment was never punched: {host}"
        time.sleep(0.01)
    assert host["mapped_bytes"] <= host["capacity_bytes"]


def test_a_reader_of_a_moving_block_waits_for_its_copy(daemons, start_daemon, tmp_path):
    """A get of a block whose segment is moving, made while its demotion copy is not done, gets its exact bytes
    once the copy is made (never the bytes of a slot reused meanwhile)."""
    d = move_daemon(start_daemon, daemons, tmp_path, "block size")
    n = 4 * (MiB // GEOM.full_bytes)
    with d.client() as a, d.client() as admin:
        ns_a = a.namespace(spec("a"))
        hs = hashes(n, tag=b"a")
        assert ns_a.put(hs, [block(i) for i in range(n)]).stored == n

        move = Paused(tmp_path, "draining_copy", lambda: _store_big(d))
        flag = move.wait_paused()
        listed = {bytes(h) for h, _ in admin.list(ns_a.id, limit=10_000)["keys"]}
        moved = [i for i, h in enumerate(hs) if h not in listed]
        assert len(moved) == MiB // GEOM.full_bytes                       # one whole segment left the host pool
        i = moved[0]
        got: dict[str, bool] = {}

        def read() -> None:
            with d.client() as r:
                got["exact"] = exact(r.namespace(spec("a")), [hs[i]], [i])

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        deadline = time.monotonic() + 30
        while admin.stats()["reserved"] != 4 + 1:           # B's reservations, and the promotion waiting for the copy
            assert time.monotonic() < deadline and reader.is_alive(), got
            time.sleep(0.005)
        assert move.finish(flag) == 4
        reader.join(60)
        assert got == {"exact": True}
        wait_punched(admin)


def test_daemon_stats_show_the_retiring_bytes(start_daemon):
    d = start_daemon(capacity="4MiB", segment="1MiB")
    with d.client() as c:
        s = c.stats()
        assert s["tiers"][0]["retiring_bytes"] == 0
        assert {"segment_moves", "segment_moves_inline", "admin_chunks"} <= set(s["counters"])
        assert os.environ.get("KVSTORE_PAUSE_AT") is None            # no pause point outside the tests that ask


def test_a_segment_of_many_small_blocks_drains_in_steps_and_every_block_stays_exact(daemons, start_daemon, tmp_path):
    """A 1 MiB segment of 512-byte blocks (pool.small_segment_slots 0: whole segments) holds 2048 of them: the move
    evicts them a step of MOVE_CHUNK at a time (one per later request), so no request holds the lock for all 2048
    evictions; until its step a block is a host hit, after it a block comes back byte-exact from SSD."""
    tiny = Geometry(layers=1, tokens=4, kv_heads=1, head_dim=32, dtype="float16")     # 512 bytes
    d = move_daemon(start_daemon, daemons, tmp_path, "block size", {"KVSTORE_POOL_SMALL_SEGMENT_SLOTS": "0"})
    n = 4 * (MiB // tiny.full_bytes)
    with d.client() as a, d.client() as admin:
        ns_a = a.namespace(spec("tiny", geometry=tiny))
        hs = hashes(n, tag=b"tiny")
        assert ns_a.put(hs, [block(i, tiny.full_bytes) for i in range(n)], batch=1024).stored == n

        move = Paused(tmp_path, "draining_copy", lambda: _store_big(d))
        flag = move.wait_paused()
        s = admin.stats()
        assert s["counters"]["evictions"] == MOVE_CHUNK                    # one step so far
        assert s["tiers"][0]["retiring_bytes"] == MiB
        assert move.finish(flag) == 4
        for i in range(0, n, 512):                                         # each get: more steps
            assert exact(ns_a, hs[i:i + 512], list(range(i, i + 512)), tiny.full_bytes), f"blocks {i}.."
        assert admin.stats()["counters"]["evictions"] >= MiB // tiny.full_bytes
        wait_punched(admin)
