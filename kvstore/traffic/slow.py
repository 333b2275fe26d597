"""A seeded slow-device model for tests and benchmarks: each transfer on a path takes the time a device of the
given bandwidth would need for its bytes, scaled by a seeded random factor. It sleeps in the path's worker, so
the arbiter, the queues and the lanes see exactly what a slower disk would make them see — same order, same
counts — without the test depending on how fast this machine's disk is.

Enabled in a daemon by `KVSTORE_SLOW_DEVICE=<path>:<bytes per second>[:<seed>]`, e.g. `ssd:50MB:7`; several paths
separated by commas, e.g. `ssd:8MB:1,net:8MB:2`."""
from __future__ import annotations

import os
import random
import threading
import time

from kvstore.traffic.path import Transfer
from kvstore.units import parse_size


class SlowDevice:
    def __init__(self, bytes_per_s: float, seed: int = 0, jitter: float = 0.5) -> None:
        self.bytes_per_s = bytes_per_s
        self.jitter = jitter
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def __call__(self, t: Transfer) -> None:
        with self._lock:
            factor = 1.0 + self.jitter * (2 * self._rng.random() - 1)
        time.sleep(max(t.nbytes, 4096) / self.bytes_per_s * factor)


def from_env(path: str) -> SlowDevice | None:
    """The slow device KVSTORE_SLOW_DEVICE asks for on `path`, if any."""
    for spec in os.environ.get("KVSTORE_SLOW_DEVICE", "").split(","):
        parts = spec.strip().split(":")
        if len(parts) >= 2 and parts[0] == path:
            return SlowDevice(parse_size(parts[1]), int(parts[2]) if len(parts) > 2 else 0)
    return None
