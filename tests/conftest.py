"""Test fixtures: a real daemon process per test (started with `python -m kvstore serve`), real clients."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest

from kvstore.client import Client
from kvstore.protocol.geometry import Geometry
from kvstore.protocol.keys import NamespaceSpec

MiB = 1 << 20

# Two layers of tests. The system layer runs real daemon processes, masters and engines; the unit layer runs in
# this process (`make unit`: in a couple of minutes, the loop to run while editing). A test is a system test when it
# asks for a daemon fixture or its module starts processes; marked here, so that every test file needs no marker.
SYSTEM_FIXTURES = {"daemon", "daemons", "start_daemon", "master", "conformance_master"}
SPAWNS = re.compile(r"DaemonProc\(|subprocess|Popen|_engine_run|MooncakeMaster\(|mp\.Process|multiprocessing")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    spawning: dict[str, bool] = {}
    for item in items:
        path = str(item.path)
        if path not in spawning:
            try:
                spawning[path] = bool(SPAWNS.search(item.path.read_text()))
            except OSError:
                spawning[path] = True
        if spawning[path] or SYSTEM_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.system)


ADMIN_SECRET = "test-admin-secret"      # each test daemon's server.admin_secret (DaemonProc.client passes it)


class DaemonProc:
    def __init__(self, capacity: str = "16MiB", segment: str = "1MiB", env: dict[str, str] | None = None,
                 argv: list[str] | None = None) -> None:
        self.argv = argv or [sys.executable, "-m", "kvstore", "serve"]
        self.dir = tempfile.mkdtemp(prefix="kvs-")
        self.socket = os.path.join(self.dir, "run", "kvstore.sock")
        self.env = {**os.environ, "KVSTORE_SERVER_SOCKET": self.socket, "KVSTORE_POOL_CAPACITY": capacity,
                    "KVSTORE_POOL_SEGMENT_BYTES": segment, "KVSTORE_LOG_LEVEL": "debug",
                    "KVSTORE_SERVER_ADMIN_SECRET": ADMIN_SECRET, **(env or {})}
        self.log_path = os.path.join(self.dir, "daemon.log")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, wait: bool = True) -> DaemonProc:
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv, env=self.env,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 20.0, scanned: bool = True) -> None:
        """Until the daemon answers — and, with `scanned`, until its SSD tier has scanned its records (it serves
        during the scan, but a block not scanned yet is a miss, which most tests do not want)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.read_log()}")
            try:
                with Client(self.socket) as c:
                    tiers = c.stats()["tiers"] if scanned else []
                if all(t.get("scan", {}).get("state", "ready") == "ready" for t in tiers):
                    return
            except (ConnectionError, OSError):
                pass
            time.sleep(0.05)
        raise TimeoutError(f"daemon not ready after {timeout} s:\n{self.read_log()}")

    def read_log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def client(self, **kw: object) -> Client:
        """A client of the daemon's own user; with the admin secret the daemon was given (the admin role where
        tenants have secrets), unless `admin_secret` says otherwise."""
        kw.setdefault("admin_secret", self.env.get("KVSTORE_SERVER_ADMIN_SECRET") or "")
        return Client(self.socket, **kw)  # type: ignore[arg-type]

    def cli_env(self) -> dict[str, str]:
        """The environment for `kvstore` CLI commands against this daemon as its admin."""
        return {**os.environ, "KVSTORE_ADMIN_SECRET": self.env.get("KVSTORE_SERVER_ADMIN_SECRET", "")}

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.stop(signal.SIGKILL)
        shutil.rmtree(self.dir, ignore_errors=True)


def ssd_daemon(started: list[DaemonProc], capacity: str = "16MiB", segment: str = "1MiB",
               ssd_capacity: str = "64MiB", **env: str) -> DaemonProc:
    """A started daemon with an SSD tier: in `KVSTORE_SSD_DIR` if given (a directory that restarts share), else in
    the daemon's own directory. Appended to `started` (the `daemons` fixture), which kills it at teardown."""
    d = DaemonProc(capacity, segment, env={"KVSTORE_SSD_CAPACITY": ssd_capacity, **env})
    if "KVSTORE_SSD_DIR" not in env:
        d.env["KVSTORE_SSD_DIR"] = os.path.join(d.dir, "ssd")
    started.append(d)
    return d.start()


@pytest.fixture
def start_daemon() -> Iterator[type[DaemonProc]]:
    """Factory: start_daemon(capacity=..., segment=...) → a running DaemonProc, killed at teardown."""
    started: list[DaemonProc] = []

    def make(*args: object, **kw: object) -> DaemonProc:
        d = DaemonProc(*args, **kw)  # type: ignore[arg-type]
        started.append(d)
        return d.start()

    yield make  # type: ignore[misc]
    for d in started:
        d.cleanup()


@pytest.fixture
def daemons() -> Iterator[list[DaemonProc]]:
    """A list the test appends the daemons it starts itself to (restarts on one directory, several configs); all
    are killed at teardown."""
    started: list[DaemonProc] = []
    yield started
    for d in started:
        d.cleanup()


@pytest.fixture
def daemon(start_daemon: type[DaemonProc]) -> DaemonProc:
    return start_daemon()  # type: ignore[call-arg]


# A small geometry: 2 layers × (2 × 16 tokens × 2 heads × 32 dims) fp16 = 8 KiB per block.
GEOM = Geometry(layers=2, tokens=16, kv_heads=2, head_dim=32, dtype="float16")


def spec(model: str = "tiny", geometry: Geometry = GEOM, **kw: object) -> NamespaceSpec:
    return NamespaceSpec(model=model, geometry=geometry, **kw)  # type: ignore[arg-type]


def block(seed: int, nbytes: int = GEOM.full_bytes) -> bytes:
    """Deterministic, distinct content per seed."""
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def hashes(n: int, start: int = 0, tag: bytes = b"") -> list[bytes]:
    import hashlib

    return [hashlib.blake2b(tag + i.to_bytes(8, "little"), digest_size=16).digest() for i in range(start, start + n)]


def ssd_settled(c: Client, timeout: float = 30.0) -> dict:
    """The daemon's stats once its SSD tier has written everything staged, its traffic path is idle, no block is
    pinned and the write-through has nothing queued or in flight: what a test reads after demotions, promotions,
    write-throughs or deletes it started."""
    deadline = time.monotonic() + timeout
    while True:
        s = c.stats()
        ssd = next(t for t in s["tiers"] if t["tier"] == "ssd")
        lanes = [r for p in s["traffic"] if p["path"] in ("ssd", "mem") for r in p["lanes"].values()]
        wt = s.get("write_through") or {"queued": 0, "writing": 0}
        if ssd["staged_blocks"] == 0 and s["pinned"] == 0 and not wt["queued"] and not wt["writing"] and \
                not any(r["queued"] or r["in_flight"] for r in lanes):
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"the SSD tier did not settle in {timeout} s: {ssd}, {s['traffic']}")
        time.sleep(0.01)
