"""LMCache's per-node daemon (MP mode) and a client for it, driven through LMCache's own Python client classes.

The daemon is `python -m lmcache.v1.multiprocess.http_server` started as a subprocess (DRAM tier L1, optionally the
fs tier L2). The client is LMCache's own `ServerBenchClient` (the class behind `lmcache bench server`), which
registers a paged KV cache of CPU tensors with the daemon and asks it to STORE / RETRIEVE block ranges of it; the
daemon moves the bytes itself, over POSIX shared memory (`lmcache_driven`), or the client gathers them into
shared-memory slots (`engine_driven`). We call its methods one by one, so that both systems run the identical
workload, and use its own request client for LOOKUP (polled every 0.2 ms instead of its CLI's 50 ms).

Unit of transfer: one LMCache chunk of 256 tokens of a KV cache shaped `(2, NB, 16, 4, 128)` bf16 × 4 layers =
2 MiB, the same bytes as one kvstore block. Needs `torch` and `lmcache` (the `.venv-bench` environment).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ServerProcess  # noqa: E402

CHUNK_TOKENS = 256
PAGE_TOKENS = 16
PAGES_PER_CHUNK = CHUNK_TOKENS // PAGE_TOKENS
CHUNK_BYTES = 2 << 20
HELLO = 9906

os.environ["LMCACHE_TRACK_USAGE"] = "false"          # it reports usage by default
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")  # its client logs every operation at INFO


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def version() -> str:
    from importlib.metadata import version as v

    return v("lmcache")


class LMCacheServer(ServerProcess):
    """The MP daemon with an L1 of `l1_gb` and, with `fs_dir`, the fs L2 adapter (`odirect`: its O_DIRECT mode)."""
    STOP_SIGNAL = signal.SIGINT
    STOP_WAIT_S = 20.0

    def __init__(self, l1_gb: float, fs_dir: str | None = None, odirect: bool = False,
                 watermark: float | None = None) -> None:
        self.l1_gb, self.fs_dir, self.odirect, self.watermark = l1_gb, fs_dir, odirect, watermark
        self.port, self.http_port = _free_port(), _free_port()
        self.dir = tempfile.mkdtemp(prefix="lmcb-", dir="/tmp")
        self.log_path = os.path.join(self.dir, "server.log")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def rpc_url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def argv(self) -> list[str]:
        a = [sys.executable, "-m", "lmcache.v1.multiprocess.http_server", "--host", "127.0.0.1",
             "--port", str(self.port), "--http-host", "127.0.0.1", "--http-port", str(self.http_port),
             "--l1-size-gb", str(self.l1_gb), "--eviction-policy", "LRU", "--chunk-size", str(CHUNK_TOKENS),
             "--supported-transfer-mode", "auto"]
        if self.watermark is not None:
            a += ["--eviction-trigger-watermark", str(self.watermark)]
        if self.fs_dir:
            a += ["--l2-adapter", json.dumps({"type": "fs", "base_path": self.fs_dir, "use_odirect": self.odirect})]
        return a

    def start(self, timeout: float = 90.0) -> LMCacheServer:
        env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "LMCACHE_LOG_LEVEL": "WARNING",
               "PYTHONWARNINGS": "ignore"}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv(), env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lmcache server exited with {self.proc.returncode}:\n{self.read_log()[-3000:]}")
            try:
                with urllib.request.urlopen(self.http_url + "/api/healthcheck", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2), \
                        socket.create_connection(("127.0.0.1", self.http_port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"lmcache server not ready after {timeout} s:\n{self.read_log()[-3000:]}")



class LMCacheClient:
    """One simulated engine worker (TP 1) with a paged CPU KV cache of `pages` pages of 16 tokens (128 KiB each,
    2 MiB per 256-token chunk). `seq` (an int) names a token sequence: (seq, HELLO, HELLO, ...), so LMCache's chained
    chunk hashes make every sequence's chunks distinct; a sequence's chunk i lives at pages `base + 16·i ...`."""

    def __init__(self, server: LMCacheServer, pages: int, transfer_mode: str = "lmcache_driven") -> None:
        from lmcache.cli.commands.bench.server_bench.client import ServerBenchClient
        from lmcache.cli.commands.bench.server_bench.config import BenchConfig

        self.mode = transfer_mode
        self.pages = pages
        cfg = BenchConfig(rpc_url=server.rpc_url, http_url=server.http_url, mode="cpu", transfer_mode=transfer_mode,
                          tp_size=1, use_mla=False, num_tokens=CHUNK_TOKENS,
                          kvcache_shape_spec=f"(2,{pages},{PAGE_TOKENS},4,128):bfloat16:4",
                          num_blocks=pages, block_size=PAGE_TOKENS)
        self.bc = ServerBenchClient(cfg, log=lambda _m: None)
        self.bc.start()
        self.n_req = 0

    # --- the KV cache the engine owns ---
    def layers(self) -> list[Any]:
        return list(self.bc._workers[0].kv_caches.values())

    def fill(self, base: int, nchunks: int, value: int) -> None:
        for t in self.layers():
            t[:, base:base + nchunks * PAGES_PER_CHUNK].fill_(value)

    def sample(self, base: int, chunk: int) -> list[float]:
        """One value per layer of a chunk's first page (a cheap check that a retrieve wrote the right bytes)."""
        p = base + chunk * PAGES_PER_CHUNK
        return [float(t[0, p, 0, 0, 0]) for t in self.layers()]

    # --- operations; each takes the sequence as explicit token ids ---
    @staticmethod
    def tokens(seq: int, nchunks: int) -> tuple[int, ...]:
        return (seq,) + (HELLO,) * (nchunks * CHUNK_TOKENS)

    def _request(self, tokens: tuple[int, ...], base: int) -> Any:
        from lmcache.cli.commands.bench.server_bench.client import RequestContext

        self.n_req += 1
        full = (len(tokens) // CHUNK_TOKENS) * CHUNK_TOKENS
        return RequestContext(sequence_id=self.n_req, request_id=f"r{self.n_req}-{os.getpid()}",
                              request_kind="bench", token_ids=tokens, num_full_tokens=full,
                              total_chunks=full // CHUNK_TOKENS, chunk_size=CHUNK_TOKENS, block_offset=base,
                              num_blocks=full // PAGE_TOKENS)

    def store(self, tokens: tuple[int, ...], base: int, first_chunk: int = 0, nchunks: int | None = None) -> bool:
        """STORE chunks [first_chunk, first_chunk + nchunks) of `tokens` from pages starting at `base` (the
        sequence's chunk 0). Returns when the daemon replied (its commit may still be in flight)."""
        req = self._request(tokens, base)
        n = req.total_chunks - first_chunk if nchunks is None else nchunks
        r = self.bc.store(req, first_chunk * CHUNK_TOKENS, n * CHUNK_TOKENS)
        self.bc.end_session(req)
        return r is None or r.succeeded

    def clear(self, server: LMCacheServer) -> None:
        """Drop everything in L1 (its HTTP API), so the next repetition reuses the same memory."""
        req = urllib.request.Request(server.http_url + "/cache/clear", data=json.dumps({"tier": "l1"}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()

    @staticmethod
    def _key(req: Any) -> Any:
        from lmcache.cli.commands.bench.server_bench.helpers import _make_key

        return _make_key(req.token_ids, req.request_id, start=0, end=req.num_full_tokens, world_size=1)

    def lookup(self, tokens: tuple[int, ...], end_session: bool = True) -> tuple[int, Any]:
        """Longest stored prefix in chunks (LOOKUP, then QUERY_PREFETCH_STATUS until it answers). The daemon holds a
        read lock per hit chunk (and prefetches L2 hits into L1) until a RETRIEVE or FREE_LOOKUP_LOCKS: END_SESSION
        does not release them (they expire after the L1 read TTL, 300 s). With `end_session` (no RETRIEVE follows)
        the locks are freed and the session ended here, as an engine's connector does (`release`); without it the
        caller must RETRIEVE or `release`."""
        from lmcache.cli.commands.bench.server_bench.helpers import _send_lookup, _wait_for_result

        req = self._request(tokens, 0)
        rc = self.bc._req_client
        key = self._key(req)
        if not _send_lookup(rc, key):
            raise TimeoutError("LMCache LOOKUP timed out")
        deadline = time.monotonic() + 30
        while True:
            hit = _wait_for_result(rc.query_prefetch_status(req.request_id))
            if isinstance(hit, int):
                break
            if time.monotonic() > deadline:
                raise TimeoutError("LMCache prefetch status never answered")
            time.sleep(0.0002)
        if end_session:
            self.release(req, hit)
        return hit, req

    def release(self, req: Any, hit: int) -> None:
        """What an engine does with a looked-up prefix it will not retrieve: FREE_LOOKUP_LOCKS, then END_SESSION.
        A read-locked chunk is neither evicted nor removed by /cache/clear, so locks left behind fill L1 until
        stores fail to allocate (and are dropped, the STORE still answering success)."""
        from lmcache.cli.commands.bench.server_bench.helpers import _wait_for_result

        if hit:
            _wait_for_result(self.bc._req_client.free_lookup_locks(self._key(req), 1))
        self.bc.end_session(req)

    def retrieve(self, req: Any, base: int, nchunks: int) -> bool:
        """RETRIEVE the first `nchunks` chunks of a looked-up request into pages starting at `base`."""
        req2 = type(req)(**{**req.__dict__, "block_offset": base})
        r = self.bc.retrieve(req2, 0, nchunks * CHUNK_TOKENS)
        self.bc.end_session(req2)
        return r is None or r.succeeded

    def lookup_retrieve(self, tokens: tuple[int, ...], base: int) -> int:
        """What an engine does for a prompt: LOOKUP, then RETRIEVE the hit prefix. Returns the chunks loaded."""
        hit, req = self.lookup(tokens, end_session=False)
        if hit and not self.retrieve(req, base, hit):
            return 0
        if not hit:
            self.bc.end_session(req)
        return hit

    def close(self) -> None:
        self.bc.close()
