"""A real `mooncake_master` for the remote tier's tests: its own HTTP metadata server (no etcd), free ports on
loopback, killed at teardown. The binary comes with the `kvstore[mooncake]` extra (beside the venv's python)."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def master_binary() -> str | None:
    here = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    return here if os.access(here, os.X_OK) else shutil.which("mooncake_master")


class MooncakeMaster:
    def __init__(self, log_dir: str | None = None) -> None:
        binary = master_binary()
        if binary is None:
            raise RuntimeError("mooncake_master not found: pip install 'kvstore[mooncake]'")
        self.binary = binary
        self.own_dir = log_dir is None
        self.dir = log_dir or tempfile.mkdtemp(prefix="kvs-mc-")
        self.rpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = os.path.join(self.dir, "master.log")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def command(self) -> list[str]:
        return [self.binary, f"--rpc_port={self.rpc_port}", "--enable_http_metadata_server=true",
                "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={self.http_port}",
                f"--metrics_port={self.metrics_port}", "--rpc_thread_num=2"]

    def start(self, timeout: float = 20.0) -> MooncakeMaster:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}:\n{self.read_log()}")
            if all(_listening(p) for p in (self.rpc_port, self.http_port)):
                return self
            time.sleep(0.1)
        raise TimeoutError(f"mooncake_master not listening after {timeout} s:\n{self.read_log()}")

    def read_log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-4000:]

    def stop(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)

    def close(self) -> None:
        """Stop it and remove the directory it made for its log."""
        self.stop()
        if self.own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def env(self, **extra: str) -> dict[str, str]:
        """A daemon's environment for a remote tier on this master."""
        return {"KVSTORE_REMOTE_MASTER": self.address, "KVSTORE_REMOTE_METADATA": self.metadata,
                "KVSTORE_REMOTE_SEGMENT_BYTES": "64MiB", "KVSTORE_REMOTE_BUFFER_BYTES": "16MiB",
                "KVSTORE_REMOTE_STAGING_BYTES": "16MiB", "KVSTORE_REMOTE_RETRY_S": "0.5", **extra}


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False
