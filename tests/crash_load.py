"""The load the crash tests put on a daemon until it dies: client threads that put, delete and get blocks, each
with its own connection, recording every request in the oracle (tests/oracle.py), plus a controller that now and
then pauses them, waits for the SSD tier to settle (the blocks acknowledged so far are durable from then on) and
resumes them. Each thread owns a set of keys (it alone puts and deletes them) and reads any key, checking every
byte it is served. Some puts ask for durability (put(..., durable=True)): one answered `durable` must survive; and a
monitor polls the daemon's stats without pausing anyone, recording write-through watermarks (the oracle's
`watermark`: puts older than the oldest write still pending are on disk)."""
from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstore.client import Client
from kvstore.client.blocks import Namespace
from kvstore.client.connection import KVStoreError
from tests.conftest import GEOM, DaemonProc, spec, ssd_settled
from tests.oracle import CHECK_BEFORE_SCAN, Oracle
from tests.workers import content, key

WORKERS = 3
KEYS_PER_WORKER = 64
UNIVERSE = [key(900_000 + i) for i in range(WORKERS * KEYS_PER_WORKER)]   # worker w owns UNIVERSE[w::WORKERS]

# The daemon the crash tests run: write-through with sync=always (a block is durable once the tier settles), a
# host pool smaller than the keys (evictions, demotions and promotions happen too) and an SSD tier large enough
# that it never evicts (a durable block can only go by a delete).
ENV = {"KVSTORE_SSD_CAPACITY": "64MiB", "KVSTORE_SSD_WRITE_THROUGH": "true", "KVSTORE_SSD_SYNC": "always"}
DURABLE_SHARE = 0.25          # of the puts, those that ask for durability
DURABLE_TIMEOUT_S = 2.0
POLL_S = 0.05                 # the watermark monitor's period


def start(ssd_dir: str, started: list[DaemonProc], **env: str) -> DaemonProc:
    """A daemon on `ssd_dir`, answering: with CHECK_BEFORE_SCAN (tests/oracle.py) as soon as it answers, else once
    its SSD scan is done."""
    d = DaemonProc(capacity="1MiB", segment="1MiB", env={"KVSTORE_SSD_DIR": ssd_dir, **ENV, **env})
    started.append(d)
    d.start(wait=False)
    d.wait_ready(scanned=not CHECK_BEFORE_SCAN)
    return d


class Gate:
    """Where the client threads stop while the controller waits for the SSD tier to settle."""

    def __init__(self, threads: int) -> None:
        self.cond = threading.Condition()
        self.closed = False
        self.waiting = 0
        self.threads = threads

    def passing(self) -> None:
        with self.cond:
            self.waiting += 1
            self.cond.notify_all()
            while self.closed:
                self.cond.wait()
            self.waiting -= 1

    def left(self) -> None:
        """A thread is gone (its daemon died): never wait for it again."""
        with self.cond:
            self.threads -= 1
            self.cond.notify_all()

    def close(self, timeout: float = 10.0) -> bool:
        with self.cond:
            self.closed = True
            return self.cond.wait_for(lambda: self.waiting >= self.threads, timeout)

    def open(self) -> None:
        with self.cond:
            self.closed = False
            self.cond.notify_all()


@dataclass
class Killer:
    """SIGKILL the daemon once; `cut` is when (time.monotonic() just before the signal)."""
    pid: int
    cut: float = 0.0
    after_delete: bool = False            # armed: the first acknowledged delete fires it
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fire(self) -> None:
        with self.lock:
            if not self.cut:
                self.cut = time.monotonic()
                os.kill(self.pid, signal.SIGKILL)


@dataclass
class Load:
    d: DaemonProc
    life: int
    oracle: Oracle
    rng: random.Random
    killer: Killer
    gate: Gate = field(default_factory=lambda: Gate(WORKERS))
    wrong: list[str] = field(default_factory=list)       # bytes served that were never written for the key

    def worker(self, w: int, seed: int) -> None:
        rng = random.Random(seed)
        mine = UNIVERSE[w::WORKERS]
        last = mine[0]
        try:
            with Client(self.d.socket) as c:
                ns = c.namespace(spec())
                while True:
                    self.gate.passing()
                    r = rng.random()
                    if r < 0.45:
                        last = rng.choice(mine)
                        self._put(ns, last, durable=rng.random() < DURABLE_SHARE)
                    elif r < 0.65:          # half the time the block just put: its write-through is in flight
                        self._delete(ns, last if rng.random() < 0.5 else rng.choice(mine))
                    else:
                        self._get(ns, rng.choice(UNIVERSE))
        except (ConnectionError, OSError):
            pass                                    # the daemon is gone
        finally:
            self.gate.left()

    def _put(self, ns: Namespace, k: bytes, durable: bool = False) -> None:
        op = self.oracle.begin(k, "put", self.life)
        try:
            r = ns.put([k], [content(k)], durable=durable, durable_timeout_s=DURABLE_TIMEOUT_S if durable else None)
        except KVStoreError:
            return                                  # refused: the key stays as it was (the oracle: either)
        self.oracle.acked(op, stored=r.stored + r.existed == 1, durable=r.durability == "durable")

    def _delete(self, ns: Namespace, k: bytes) -> None:
        op = self.oracle.begin(k, "delete", self.life)
        try:
            ns.delete([k])
        except KVStoreError:
            return
        self.oracle.acked(op)
        if self.killer.after_delete:
            self.killer.fire()

    def _get(self, ns: Namespace, k: bytes) -> None:
        buf = bytearray(GEOM.full_bytes)
        try:
            n = ns.get([k], [buf])
        except KVStoreError:
            return
        if n == 1 and bytes(buf) != content(k):
            self.wrong.append(f"{k.hex()}: served wrong bytes while the daemon ran (life {self.life})")

    def checkpoint(self) -> None:
        """Pause the threads, wait for the SSD tier to settle (what was acknowledged is durable now), resume."""
        if not self.gate.close():
            self.gate.open()
            return
        try:
            start = time.monotonic()
            with self.d.client() as c:
                s = ssd_settled(c)
            ssd = s["tiers"][1]["counters"]
            assert not ssd.get("evictions") and not s["counters"].get("write_through_skipped"), \
                f"the crash oracle assumes no SSD eviction and no skipped write-through: {ssd}, {s['counters']}"
            self.oracle.settled(self.life, start, time.monotonic())
        except (ConnectionError, OSError):
            pass                                    # killed meanwhile: no settle recorded
        finally:
            self.gate.open()

    def monitor(self, stop: threading.Event) -> None:
        """Poll the stats until `stop` or the daemon's death; record a watermark whenever nothing has left the
        durable path (no write-through skipped, lost or failed): every put acknowledged before the oldest pending
        write-through's commit is on disk."""
        try:
            with self.d.client() as c:
                while not stop.wait(POLL_S):
                    asked = time.monotonic()
                    s = c.stats()
                    wt = s["write_through"]
                    left = s["counters"]["write_through_skipped"] + sum(
                        wt["settled"].get(k, 0) for k in ("lost", "write_failed"))
                    if not left:
                        self.oracle.watermark(self.life, asked - wt["oldest_pending_s"], time.monotonic())
        except (ConnectionError, OSError):
            pass                                    # the daemon is gone

    def run(self, seconds: float, checkpoints: int, then: Callable[[], None] | None = None) -> list[str]:
        """Run the threads for about `seconds` with `checkpoints` settles at random moments, then call `then`
        (e.g. the kill) and wait for the threads to end. The wrong bytes seen."""
        threads = [threading.Thread(target=self.worker, args=(w, self.rng.getrandbits(32)), daemon=True)
                   for w in range(WORKERS)]
        stop = threading.Event()
        threads.append(threading.Thread(target=self.monitor, args=(stop,), daemon=True))
        for t in threads:
            t.start()
        marks = sorted(self.rng.uniform(0, seconds) for _ in range(checkpoints))
        begun = time.monotonic()
        for m in marks:
            time.sleep(max(0.0, begun + m - time.monotonic()))
            if self.killer.cut:
                break
            self.checkpoint()
        time.sleep(max(0.0, begun + seconds - time.monotonic()))
        if then is not None:
            then()
        stop.set()
        for t in threads:
            t.join(timeout=60)
        return self.wrong


def verify(d: DaemonProc, oracle: Oracle, cut: float) -> list[str]:
    """Read every key of the universe from the restarted daemon: each broken promise, as a line."""
    failures = []
    with d.client() as c:
        ns = c.namespace(spec())
        for k in UNIVERSE:
            buf = bytearray(GEOM.full_bytes)
            served = bytes(buf) if ns.get([k], [buf]) == 1 else None
            why = oracle.check(k, served, content(k), cut)
            if why is not None:
                failures.append(why)
    return failures
