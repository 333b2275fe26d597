"""LMCache 0.5.6 with its Mooncake Store remote backend, as a third side of bench_remote.py: two LMCache engine
processes (a writer "node" and a reader "node") on the bench's `mooncake_master`, driven over a pipe.

What runs is LMCache's in-process engine (`LMCacheEngine`, the path of its vLLM connector and of `python -m
lmcache.v1.standalone`) with `remote_url="mooncakestore://..."`: its `RemoteBackend` and `MooncakestoreConnector`,
which call `mooncake.store.MooncakeDistributedStore` from Python (`batch_put_from` / `batch_get_into`, zero-copy,
`save_chunk_meta: False`). LMCache's MP daemon (the one `lmcache_side.py` drives for bench_vs_lmcache) cannot be used
here: its `mooncake_store` L2 adapter needs the C++ extension `lmcache.lmcache_mooncake`, which the PyPI wheel lacks
(../notes/s9/lmcache_mooncake.md has the details and the settings below, each one tested).

Ours, not LMCache's: `PagedCPUConnector`, a subclass of LMCache's `MockGPUConnector` (LMCache's connector "for
testing and standalone mode without real GPU") whose `batched_from_gpu` / `batched_to_gpu` gather / scatter real
bytes with torch `copy_` between LMCache's memory objects (format KV_2LTD, `(2, layers, 256, heads*dim)`) and a
paged CPU KV cache (per layer `(2, pages, 16, 4, 128)` bf16, lmcache_side.py's shape with 8 layers instead of 4, so
that one 256-token chunk is 4 MiB, the bytes of one bench_remote block). On a GPU that copy would be LMCache's CUDA
kernels; the worker times it apart (`copy_s`) so the bench can show LMCache with and without it. Everything else —
token hashing, the storage manager, `RemoteBackend`, `MooncakestoreConnector`, `mooncake.store` — is LMCache's and
Mooncake's code, with `local_cpu=False` (no L1: every retrieve comes from Mooncake; LMCache's local CPU backend only
allocates its memory objects).

Run by `.venv-bench`'s python (torch, lmcache and mooncake live there; kvstore's `.venv` never imports them):

    python lmcache_mooncake_side.py writer|reader MASTER METADATA NCHUNKS CHUNK_BYTES SEGMENT_BYTES

Protocol: one JSON object a line. The worker answers `{"ready": ...}` once its engine is up, then one line per
command read from stdin: `{"op": "put", "tag": T}` (writer: store a fresh sequence T of NCHUNKS chunks from its paged
cache and poll `lookup(search_range=["RemoteBackend"])` until Mooncake holds every token: LMCache's store is
asynchronous) or `{"op": "get", "tag": T}` (reader: `lookup` then `retrieve` sequence T into its zeroed paged cache),
each answered with its seconds, the connector's copy seconds, the tokens found and a digest of the bytes; end of
stdin closes the engine (the writer must live until the reader is done, where its values sit in its own segment; the
bench has every value in one store node's segment). Replies go to
the worker's original stdout; everything the libraries print goes to stderr (the bench sends it to a log file).
"""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from typing import Any

from kvstore.tiers.remote.address import library_path

CHUNK, PAGE, HEADS, DIM = 256, 16, 4, 128
PPC = CHUNK // PAGE                       # pages per chunk
LAYER_CHUNK_BYTES = 2 * CHUNK * HEADS * DIM * 2        # K+V of one layer of one chunk, bf16: 512 KiB
FIRST_TOKEN = 100_000                     # sequence T is (FIRST_TOKEN + T, 9906, 9906, ...): fresh chunk hashes per T
HELLO = 9906
ENV = {"PYTHONHASHSEED": "0",             # LMCache's builtin chunk hash: must agree across the processes
       "LMCACHE_TRACK_USAGE": "false", "LMCACHE_LOG_LEVEL": "WARNING", "MC_LOG_LEVEL": "ERROR",
       "PYTHONWARNINGS": "ignore",
       "MC_TCP_BIND_ADDRESS": "127.0.0.1"}    # Mooncake advertises this, not the LAN address: loopback only
if library_path():                        # ... and binds its ports there, not on every address (native/kvbind.c)
    ENV.update(LD_PRELOAD=str(library_path()), KVSTORE_BIND_ANY_TO="127.0.0.1")
PACKAGES = ("lmcache", "mooncake-transfer-engine-non-cuda", "torch")
BUILD_HINT = ("bench/run_all.sh builds .venv-bench (CPU torch 2.13.0, lmcache 0.5.6, "
              "mooncake-transfer-engine-non-cuda 0.3.13.post1, kvstore), e.g. `BENCH_ONLY=remote bench/run_all.sh "
              "--quick`")


# ---------------------------------------------------------------------------------------------------------------
# the bench's side (kvstore's .venv or .venv-bench): no torch, no lmcache

def default_python() -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.join(root, ".venv-bench", "bin", "python")


def probe(python: str) -> tuple[dict[str, str] | None, str]:
    """({package: version}, "") when `python` has LMCache, Mooncake's client and torch; else (None, why not)."""
    if not os.access(python, os.X_OK):
        return None, f"{python} not found: {BUILD_HINT}"
    code = ("import importlib.metadata as m, importlib.util as u, json; "
            f"v = {{p: m.version(p) for p in {PACKAGES!r}}}; "
            "assert u.find_spec('lmcache.v1.storage_backend.connector.mooncakestore_connector'), 'lmcache'; "
            "assert u.find_spec('mooncake.store'), 'mooncake.store'; print(json.dumps(v))")
    try:
        r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120,
                           env={**os.environ, **ENV})
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{python} does not run ({e}): {BUILD_HINT}"
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        return None, f"{python} lacks {' / '.join(PACKAGES)} ({last}): {BUILD_HINT}"
    return json.loads(r.stdout.strip().splitlines()[-1]), ""


class Worker:
    """One LMCache engine process; `call` sends a command and waits for its line."""

    def __init__(self, python: str, role: str, master: str, metadata: str, nchunks: int, chunk_bytes: int,
                 segment: int, log_path: str) -> None:
        self.role, self.log_path = role, log_path
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [python, os.path.abspath(__file__), role, master, metadata, str(nchunks), str(chunk_bytes),
                 str(segment)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                env={**os.environ, **ENV}, start_new_session=True)
        self._buf = b""

    def _line(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd, deadline = self.proc.stdout.fileno(), time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"LMCache {self.role}: no answer in {timeout:.0f} s\n{self.log_tail()}")
            if select.select([fd], [], [], min(left, 1.0))[0]:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise RuntimeError(f"LMCache {self.role} exited with {self.proc.wait()}\n{self.log_tail()}")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return dict(json.loads(line))

    def ready(self, timeout: float = 180.0) -> dict[str, Any]:
        return self._line(timeout)

    def call(self, op: str, tag: int, timeout: float = 120.0) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, "tag": tag}).encode() + b"\n")
        self.proc.stdin.flush()
        r = self._line(timeout)
        if "error" in r:
            raise RuntimeError(f"LMCache {self.role}: {r['error']}\n{self.log_tail()}")
        return r

    def log_tail(self, n: int = 3000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return ""

    def close(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            try:
                if self.proc.stdin is not None:
                    self.proc.stdin.close()
                self.proc.wait(timeout)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


# ---------------------------------------------------------------------------------------------------------------
# the worker (.venv-bench): LMCache's engine

def make_engine(name: str, master: str, metadata: str, pages: int, layers: int, segment: int,
                staging_gb: float) -> tuple[Any, Any]:
    import torch
    from lmcache.utils import mock_up_broadcast_fn, mock_up_broadcast_object_fn
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.gpu_connector.mock_gpu_connector import MockGPUConnector
    from lmcache.v1.metadata import LMCacheMetadata

    class PagedCPUConnector(MockGPUConnector):
        """Ours: chunk i of a request lives at pages base + 16·i ... (kwarg base=); the copies are timed."""

        def __init__(self) -> None:
            super().__init__((layers, 2, CHUNK, HEADS, DIM))
            self.kv = [torch.zeros(2, pages, PAGE, HEADS, DIM, dtype=torch.bfloat16) for _ in range(layers)]
            self.copy_s = 0.0

        def _pages(self, base: int, start: int) -> slice:
            p = base + (start // CHUNK) * PPC
            return slice(p, p + PPC)

        def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
            t0 = time.perf_counter()
            for m, s in zip(memory_objs, starts):
                sl, t = self._pages(kw["base"], s), m.tensor          # t: (2, layers, 256, HEADS*DIM)
                for i, c in enumerate(self.kv):
                    t[:, i].copy_(c[:, sl].reshape(2, CHUNK, HEADS * DIM))
            self.copy_s += time.perf_counter() - t0

        def batched_to_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
            t0 = time.perf_counter()
            for m, s in zip(memory_objs, starts):
                sl, t = self._pages(kw["base"], s), m.tensor
                for i, c in enumerate(self.kv):
                    c[:, sl].copy_(t[:, i].reshape(2, PPC, PAGE, HEADS, DIM))
            self.copy_s += time.perf_counter() - t0

        def from_gpu(self, memory_obj: Any, start: int, end: int, **kw: Any) -> None:
            self.batched_from_gpu([memory_obj], [start], [end], **kw)

        def to_gpu(self, memory_obj: Any, start: int, end: int, **kw: Any) -> None:
            self.batched_to_gpu([memory_obj], [start], [end], **kw)

    cfg = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK,
        local_cpu=False,               # no L1: every hit comes from Mooncake
        max_local_cpu_size=staging_gb,  # GB of memory objects (staging for the puts and gets)
        remote_url=f"mooncakestore://{master}/",   # the scheme picks the connector; host:port here is not used
        remote_serde="naive",
        lmcache_instance_id=name,
        extra_config={
            "local_hostname": "127.0.0.1",
            "metadata_server": metadata,
            # LMCache forwards "master_server_address" as-is, but mooncake 0.3.13's dict setup() reads
            # "master_server_addr" (default 127.0.0.1:50051); the mooncake_ prefix is stripped and the key forwarded
            "mooncake_master_server_addr": master,
            "protocol": "tcp",
            "global_segment_size": str(segment),   # bytes this node lends the store (bench_remote: 0, like the rest)
            "local_buffer_size": str(64 << 20),    # only used with save_chunk_meta=True
            "save_chunk_meta": False,   # zero-copy batch_put_from / batch_get_into into LMCache's memory objects
            "transfer_timeout": 60,     # s; LMCache drops a put that takes longer (a warning only)
        },
    )
    md = LMCacheMetadata(model_name="bench-remote", world_size=1, local_world_size=1, worker_id=0,
                         local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=(layers, 2, CHUNK, HEADS, DIM),
                         use_mla=False, role="worker")
    conn = PagedCPUConnector()
    eng = LMCacheEngineBuilder.get_or_create(name, cfg, md, conn, mock_up_broadcast_fn, mock_up_broadcast_object_fn)
    eng.post_init()
    return eng, conn


def digest(kv: list[Any]) -> str:
    import hashlib

    import torch

    h = hashlib.sha256()
    for c in kv:
        h.update(c.contiguous().view(torch.int16).numpy().tobytes())
    return h.hexdigest()[:16]


def worker(role: str, master: str, metadata: str, nchunks: int, chunk_bytes: int, segment: int) -> None:
    reply = os.fdopen(os.dup(1), "w", buffering=1)    # the pipe to the bench; fd 1 goes to the log
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def answer(**kw: Any) -> None:
        reply.write(json.dumps(kw) + "\n")

    if chunk_bytes % LAYER_CHUNK_BYTES:
        answer(error=f"a chunk of {chunk_bytes} bytes is not a whole number of layers of {LAYER_CHUNK_BYTES}")
        return
    import torch

    # our copy on one thread: torch's OpenMP team of 2 threads made it 10-50x slower on a loaded 2-core machine
    # (threads spinning for a busy core), and one thread copies at memcpy-like speed (4+ GB/s here)
    torch.set_num_threads(1)
    layers = chunk_bytes // LAYER_CHUNK_BYTES
    staging_gb = max(0.5, 2 * nchunks * chunk_bytes / 1e9)
    eng, conn = make_engine(f"lmc-{role}-{os.getpid()}", master, metadata, nchunks * PPC, layers, segment,
                            staging_gb)
    if role == "writer":
        g = torch.Generator().manual_seed(1)
        for c in conn.kv:
            c.copy_(torch.randn(c.shape, generator=g).to(torch.bfloat16))
    answer(ready=True, layers=layers, chunk_tokens=CHUNK, digest=digest(conn.kv) if role == "writer" else "")
    for line in sys.stdin:
        try:
            cmd = json.loads(line)
            toks = torch.tensor([FIRST_TOKEN + int(cmd["tag"])] + [HELLO] * (nchunks * CHUNK - 1), dtype=torch.long)
            if cmd["op"] == "put" and role == "writer":
                conn.copy_s = 0.0
                t0 = time.perf_counter()
                eng.store(toks, base=0)
                stored_s = time.perf_counter() - t0
                deadline, hit = time.monotonic() + 60, 0
                while time.monotonic() < deadline:       # the remote put is asynchronous: poll Mooncake
                    hit = eng.lookup(toks, search_range=["RemoteBackend"])
                    if hit >= len(toks):
                        break
                    time.sleep(0.002)
                dt = time.perf_counter() - t0
                answer(s=dt, store_call_s=stored_s, copy_s=conn.copy_s, tokens=hit, of=len(toks))
            elif cmd["op"] == "get" and role == "reader":
                for c in conn.kv:
                    c.zero_()
                conn.copy_s = 0.0
                t0 = time.perf_counter()
                hit = eng.lookup(toks)
                got = int(eng.retrieve(toks, base=0).sum())
                dt = time.perf_counter() - t0
                answer(s=dt, copy_s=conn.copy_s, lookup_tokens=hit, tokens=got, of=len(toks), digest=digest(conn.kv))
            else:
                answer(error=f"{role} does not do {cmd!r}")
        except Exception as e:  # noqa: BLE001 - reported to the bench, which prints it with the log
            answer(error=f"{type(e).__name__}: {e}")
    eng.close()


if __name__ == "__main__":
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    worker(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
