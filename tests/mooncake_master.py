"""A real `mooncake_master` for the remote tier's tests, and Mooncake's HTTP metadata server beside it (no etcd), on
free ports, every one bound to 127.0.0.1 only, killed at teardown. The binaries come with the `kvstore[mooncake]`
extra (beside the venv's python).

Loopback only, on purpose: the master's RPC, metrics and metadata ports are told 127.0.0.1 (`--rpc_address`,
`--metrics_host`; the master's built-in metadata server listens on every address whatever
`--http_metadata_server_host` says, in mooncake 0.3.13, so Mooncake's standalone one runs instead, with `--host`),
and a daemon's environment (`env`) names 127.0.0.1 as its remote.hostname, which the daemon hands to Mooncake's
transfer engine (kvstore.tiers.remote.address). tests/tiers/test_remote_loopback.py checks every socket."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

# Every Mooncake client this process or its children set up (the tests' rogue clients, the benchmarks' raw nodes)
# advertises loopback: Mooncake's transfer engine reads this, not the hostname its setup is given. Daemons set it
# themselves from remote.hostname.
os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"


def setup_on_loopback(store: Any, metadata: str, master: str, segment: int, buffer: int) -> int:
    """`store.setup` for a Mooncake client this process sets up itself (a test's rogue client, a benchmark's raw
    node): advertised on 127.0.0.1 (above), its transfer ports bound to 127.0.0.1 by the bind guard where this
    process has it preloaded (make test preloads it; kvstore.tiers.remote.address), its code otherwise."""
    from kvstore.tiers.remote.address import armed

    with armed("127.0.0.1"):
        return int(store.setup("127.0.0.1", metadata, segment, buffer, "tcp", "", master))


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """`n` distinct free loopback ports: every socket is held until all are chosen (closing one before binding the
    next can hand the same port out twice: a master whose RPC and metrics ports collided exited at start, in CI)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def master_binary(name: str = "mooncake_master") -> str | None:
    here = os.path.join(os.path.dirname(sys.executable), name)
    return here if os.access(here, os.X_OK) else shutil.which(name)


class MooncakeMaster:
    def __init__(self, log_dir: str | None = None) -> None:
        binary = master_binary()
        if binary is None:
            raise RuntimeError("mooncake_master not found: pip install 'kvstore[mooncake]'")
        self.binary = binary
        self.own_dir = log_dir is None
        self.dir = log_dir or tempfile.mkdtemp(prefix="kvs-mc-")
        self.rpc_port, self.http_port, self.metrics_port = free_ports(3)
        self.proc: subprocess.Popen[bytes] | None = None
        self.meta: subprocess.Popen[bytes] | None = None
        self.log_path = os.path.join(self.dir, "master.log")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def command(self) -> list[str]:
        return [self.binary, f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
                "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics_port}", "--rpc_thread_num=2"]

    def metadata_command(self) -> list[str]:
        script = master_binary("mooncake_http_metadata_server")
        run = [script] if script else [sys.executable, "-m", "mooncake.http_metadata_server"]
        return [*run, "--host=127.0.0.1", f"--port={self.http_port}", "--log-level=WARNING"]

    @property
    def pids(self) -> list[int]:
        """The processes this master is (the master and its metadata server), while they run."""
        return [p.pid for p in (self.proc, self.meta) if p is not None and p.poll() is None]

    def start(self, timeout: float = 20.0) -> MooncakeMaster:
        log = open(self.log_path, "ab")
        self.meta = subprocess.Popen(self.metadata_command(), stdout=log, stderr=subprocess.STDOUT)
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for what, p in (("mooncake_master", self.proc), ("the metadata server", self.meta)):
                if p.poll() is not None:
                    raise RuntimeError(f"{what} exited with {p.returncode}:\n{self.read_log()}")
            if all(_listening(p) for p in (self.rpc_port, self.http_port)):
                return self
            time.sleep(0.1)
        raise TimeoutError(f"mooncake_master not listening after {timeout} s:\n{self.read_log()}")

    def read_log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-4000:]

    def stop(self, sig: int = signal.SIGKILL) -> None:
        """Stop the master and its metadata server (a master started again knows nothing of the old one's books,
        as when its built-in metadata server went with it)."""
        for p in (self.proc, self.meta):
            if p is not None and p.poll() is None:
                p.send_signal(sig)
                p.wait(timeout=30)

    def close(self) -> None:
        """Stop it and remove the directory it made for its log."""
        self.stop()
        if self.own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def env(self, **extra: str) -> dict[str, str]:
        """A daemon's environment for a remote tier on this master."""
        return {"KVSTORE_REMOTE_MASTER": self.address, "KVSTORE_REMOTE_METADATA": self.metadata,
                "KVSTORE_REMOTE_HOSTNAME": "127.0.0.1",
                "KVSTORE_REMOTE_SEGMENT_BYTES": "64MiB", "KVSTORE_REMOTE_BUFFER_BYTES": "16MiB",
                "KVSTORE_REMOTE_STAGING_BYTES": "16MiB", "KVSTORE_REMOTE_RETRY_S": "0.5", **extra}


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False
