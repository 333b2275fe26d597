"""Several client processes at once: byte-exact round trips, the cap holds at every sample, resize under load."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

from tests.conftest import GEOM

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _spawn(sock: str, seed: int, n: int, threads: int = 1) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "tests.workers", "roundtrip", sock, str(seed), str(n),
                             str(threads)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(procs: list[subprocess.Popen[bytes]]) -> list[dict[str, int]]:
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()[-2000:] + out.decode()
        results.append({k: int(v) for k, v in (kv.split("=") for kv in out.decode().split())})
    return results


class CapSampler(threading.Thread):
    """Samples the daemon's accounting and the pages its memfds really hold, as fast as it can."""

    def __init__(self, daemon: object) -> None:
        super().__init__(daemon=True)
        self.d = daemon
        self.stop = threading.Event()
        self.samples = 0
        self.worst = 0
        self.capacity = 0

    def run(self) -> None:
        with self.d.client() as c:  # type: ignore[attr-defined]
            while not self.stop.is_set():
                host = c.stats()["tiers"][0]
                self.capacity = host["capacity_bytes"]
                self.worst = max(self.worst, host["mapped_bytes"] + host["reaping_bytes"],
                                 host["resident_bytes"] + host["reaping_bytes"])
                self.samples += 1


def test_four_processes_roundtrip_byte_exact_under_the_cap(start_daemon):
    d = start_daemon(capacity="2MiB", segment="1MiB")   # 256 blocks: the workers' 4×64+64 keys overflow it
    sampler = CapSampler(d)
    sampler.start()
    results = _finish([_spawn(d.socket, seed, 64) for seed in range(1, 5)])
    sampler.stop.set()
    sampler.join()
    assert sum(r["bad"] for r in results) == 0
    assert all(r["loaded"] > 0 for r in results)
    assert sum(r["stored"] for r in results) >= 4 * 64      # private keys all stored; shared ones deduplicated
    assert sampler.samples > 10
    assert sampler.worst <= sampler.capacity == 2 << 20
    with d.client() as c:
        s = c.stats()
        assert s["counters"]["evictions"] > 0
        assert (s["pinned"], s["reserved"]) == (0, 0)


def test_two_copy_threads_roundtrip(daemon):
    results = _finish([_spawn(daemon.socket, seed, 32, threads=2) for seed in (7, 8)])
    assert [r["bad"] for r in results] == [0, 0]
    assert all(r["loaded"] == 32 + 16 for r in results)


def test_resize_grow_and_shrink_while_clients_work(start_daemon):
    d = start_daemon(capacity="4MiB", segment="1MiB")
    procs = [_spawn(d.socket, seed, 96) for seed in range(11, 15)]
    sizes = [2, 6, 1, 3, 8, 2, 4]
    with d.client() as c:
        i = 0
        while any(p.poll() is None for p in procs):
            r = c.resize(sizes[i % len(sizes)] << 20)
            assert r["capacity"] == sizes[i % len(sizes)] << 20
            assert r["mapped_bytes"] - r["draining_bytes"] <= r["capacity"]
            i += 1
        results = _finish(procs)
        assert sum(r["bad"] for r in results) == 0
        assert i > 3
        s = c.stats()
        assert s["tiers"][0]["mapped_bytes"] <= s["tiers"][0]["capacity_bytes"]
        assert s["blocks"] * GEOM.full_bytes == s["tiers"][0]["used_bytes"]
