"""What every benchmark shares: a plain-text table, a progress line, summary statistics, a daemon started for the
run, and JSON results with the machine described."""
from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Iterable, Iterator, Sequence, TypeVar

T = TypeVar("T")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Table:
    def __init__(self, headers: Sequence[str]) -> None:
        self.rows: list[list[str]] = [list(map(str, headers))]

    def add(self, row: Sequence[Any]) -> None:
        self.rows.append([str(c) for c in row])

    def __str__(self) -> str:
        widths = [max(len(r[i]) for r in self.rows) for i in range(len(self.rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in self.rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def paced(items: Iterable[T], at: Any, speed: float) -> Iterator[T]:
    """Yield each item of a timed trace when its time comes: `at(item)` seconds after the first, run `speed` times
    faster than the trace's clock (never earlier; a late item goes at once)."""
    start = time.monotonic()
    for item in items:
        wait = start + at(item) / speed - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        yield item


def quantile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (q in 0..1) of a non-empty sample."""
    s = sorted(xs)
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summary(xs: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """n, min, p25, median, p75, p99, max of a sample, each multiplied by `scale` (e.g. 1e6 for seconds → µs)."""
    return {"n": len(xs), "min": min(xs) * scale, "p25": quantile(xs, 0.25) * scale,
            "median": quantile(xs, 0.5) * scale, "p75": quantile(xs, 0.75) * scale,
            "p99": quantile(xs, 0.99) * scale, "max": max(xs) * scale}


class ServerProcess:
    """A server process of the run (kvstore's daemon, LMCache's), with a private directory for its log and
    sockets: `read_log`, `stop` (signal, then kill after a grace period, then the directory goes) and use as a
    context manager. Subclasses set `dir`, `log_path` and `proc`, and define `start`."""
    STOP_SIGNAL = signal.SIGTERM
    STOP_WAIT_S = 15.0
    dir: str
    log_path: str
    proc: subprocess.Popen[bytes] | None

    def start(self) -> Any:
        raise NotImplementedError

    def read_log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(self.STOP_SIGNAL)
            try:
                self.proc.wait(self.STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Any:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Daemon(ServerProcess):
    """A `python -m kvstore serve` process of its own, with a short socket path in a private directory under
    /tmp, configured through KVSTORE_* variables. Use as a context manager; its log is kept for errors."""

    def __init__(self, capacity: str, segment: str = "64MiB", env: dict[str, str] | None = None) -> None:
        self.dir = tempfile.mkdtemp(prefix="kvsb-", dir="/tmp")          # 0700
        self.socket = os.path.join(self.dir, "s")
        self.env = {**os.environ, "KVSTORE_SERVER_SOCKET": self.socket, "KVSTORE_POOL_CAPACITY": capacity,
                    "KVSTORE_POOL_SEGMENT_BYTES": segment, "KVSTORE_LOG_LEVEL": "warning", **(env or {})}
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
        self.log_path = os.path.join(self.dir, "daemon.log")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> Daemon:
        from kvstore.client import Client

        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvstore", "serve"], env=self.env, cwd=ROOT,
                                         stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.read_log()}")
            try:
                with Client(self.socket) as c:
                    c.ping()
                return self
            except (ConnectionError, OSError):
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"daemon not ready after {timeout} s:\n{self.read_log()}")

    def client(self, **kw: Any) -> Any:
        from kvstore.client import Client

        return Client(self.socket, **kw)


def busy_cpus() -> float:
    """CPUs kept busy by other work right now: the 1-minute load average (a benchmark on a shared machine should
    say so next to its figures)."""
    try:
        return float(open("/proc/loadavg").read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0


def warn_if_busy(limit: float = 0.5) -> float:
    load = busy_cpus()
    if load > limit:
        progress(f"warning: load average {load:.2f} before the run: other work shares this machine's "
                 f"{os.cpu_count()} CPUs and the figures will be noisy")
    return load


def machine() -> dict[str, Any]:
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor()
    try:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
        commit = git.stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=ROOT).stdout.strip() != ""
    except OSError:
        commit, dirty = "", False
    try:
        mem = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemTotal"))
    except (OSError, StopIteration):
        mem = 0
    return {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "memory_bytes": mem,
            "python": platform.python_version(), "kernel": platform.release(), "commit": commit,
            "dirty": dirty}


def write_json(name: str, data: dict[str, Any]) -> str:
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump({"benchmark": name, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine(), **data},
                  f, indent=2)
    return path
