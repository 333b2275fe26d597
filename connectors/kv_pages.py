"""Where an engine's KV pages lie, and the movers that copy Layer Blocks between them and the daemon's slots.

A layer's KV tensor has the engine's blocks on dim 0; the page of block b is `kv[b]`, whose bytes may be one run
(a block-compact layout) or several runs (heads outside the blocks, say). `LayerPages` reads that from the tensor's
strides alone: a page is `chunks` runs of `chunk_bytes` at fixed offsets from the block's start, and its bytes go
into the slot's layer range run after run, in memory order. The slot holds the page exactly as the engine keeps it,
whatever the layout; the namespace names that byte order (`page_order`), so two layouts never mix.

Two movers share one interface (`load_layer` / `wait_layer` / `save_layer` / `sync`):
- `CpuMover`: one native call per layer (kvstore.checksum.copy_pages: every block's runs, each block's CRC-32C
  continued in the same pass, GIL released), done at once.
- `CudaMover`: the pool's segments registered once as pinned host memory; each layer's runs move on the mover's own
  stream, device <-> slot, without a staging copy. With Triton, one kernel per layer copies every run of every block
  (it reads and writes the pinned slots through unified addressing); without it, one `copy_` per run (DMA). The
  kernel proves itself byte-exact once before first use; if it cannot, the mover copies run by run.
"""
from __future__ import annotations

import logging
import mmap
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvstore.checksum import copy_pages

log = logging.getLogger("vllm.kvstore")

CUDA_HOST_REGISTER_PORTABLE = 1
CUDA_HOST_REGISTER_MAPPED = 2
REGISTER_FLAGS = CUDA_HOST_REGISTER_PORTABLE | CUDA_HOST_REGISTER_MAPPED
COPY_ENGINES = ("auto", "kernel", "copy")
# A load of this many bytes per layer is written around the caches (non-temporal stores). Regular stores first read
# every line they write, and the checked copy cannot hide that as memcpy does (rep movsb): measured in the engine
# (bench_vllm_ttft, 2K tokens of 128 KiB, 9 MiB a layer, two runs of each), the checked load's copy ran at 3.7-6.8
# GB/s with regular stores and 8.7-9.3 GB/s streamed (memcpy 10-12), and the time above vLLM's floor fell from
# 0.039-0.071 s to 0.034-0.037 s (unchecked 0.020-0.036): the attention that reads the layer next lost nothing. At
# 512 tokens (2.2 MiB a layer) the two copied at the same speed (6.0 / 6.3 GB/s): below this the layer stays cached.
STREAM_LOAD_BYTES = 4 << 20
TABLES_KEPT = 16             # transfers whose run tables the CUDA mover keeps (loads and saves of a step)


class LayerPages:
    """The byte geometry of one layer's pages: block b's page is the runs at `base + b * block_stride + offsets[k]`
    (bytes from the start of the tensor's storage), each `chunk_bytes` long, in memory order."""

    def __init__(self, kv: Any, num_blocks: int | None = None) -> None:
        if kv.dim() < 2:
            raise ValueError(f"a KV tensor needs a block dimension and a page (shape {tuple(kv.shape)})")
        if num_blocks is not None and int(kv.shape[0]) != num_blocks:
            raise ValueError(f"the KV tensor has {kv.shape[0]} blocks on dim 0, the engine {num_blocks}")
        self.kv = kv
        es = kv.element_size()
        sizes = [int(s) for s in kv.shape[1:]]
        strides = [int(s) for s in kv.stride()[1:]]
        # the page's dims in memory order (largest stride first; size-1 dims carry no bytes)
        order = sorted((d for d in range(len(sizes)) if sizes[d] > 1), key=lambda d: -strides[d])
        self.page_order = tuple(order)
        dense: list[int] = []                   # the innermost dims that make one run of memory
        run = 1
        for d in reversed(order):
            if strides[d] != run:
                break
            dense.append(d)
            run *= sizes[d]
        offsets = np.zeros(1, dtype=np.int64)
        for d in (d for d in order if d not in dense):   # every combination of the outer indices, in memory order
            offsets = (offsets[:, None] + np.arange(sizes[d], dtype=np.int64)[None, :] * strides[d]).reshape(-1)
        self.chunk_bytes = run * es
        self.chunks = len(offsets)
        self.page_bytes = self.chunk_bytes * self.chunks
        self.offsets = offsets * es
        self.block_stride = int(kv.stride(0)) * es
        self.base = int(kv.storage_offset()) * es
        # what makes two layers' runs sit at the same offsets from their first page (a transfer's table is shared)
        self.run_key = (self.block_stride, self.chunk_bytes, self.offsets.tobytes())
        dense_bytes = int(np.prod(sizes, dtype=np.int64)) * es
        if self.page_bytes != dense_bytes or len(set(self.offsets.tolist())) < self.chunks:
            raise ValueError(f"a KV page overlaps itself (shape {tuple(kv.shape)}, strides {tuple(kv.stride())})")

    def run_starts(self, block_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Byte offsets (from the storage's start) of every run of the given blocks, block by block."""
        ids = np.asarray(block_ids, dtype=np.int64)
        return (self.base + ids[:, None] * self.block_stride + self.offsets[None, :]).reshape(-1)

    def slot_runs(self, slots: Sequence[np.ndarray], a: int, blocks: int) -> list[np.ndarray]:
        """The runs of the first `blocks` slots' layer range starting at byte `a`, slot by slot: they match
        `run_starts` of as many block ids (a lease may hold more blocks than the engine loads)."""
        if len(slots) < blocks:
            raise ValueError(f"{blocks} pages to move but only {len(slots)} slots")
        cb = self.chunk_bytes
        return [s[a + k * cb:a + (k + 1) * cb] for s in slots[:blocks] for k in range(self.chunks)]


class RunTable:
    """One transfer's runs on the GPU, for every layer of it: row 0 the sources, row 1 the destinations, each an
    address less its layer's shift (a run's offset from its layer tensor's first page, a slot's start: a layer adds
    where its tensor's pages and its range in the slot begin). Holds the slot list it was made from: the same list
    object (a lease's views; a streaming lease only appends) means the same addresses, and while it is held its id
    cannot name another list."""

    __slots__ = ("slots", "gpu", "bits", "slot_bytes")

    def __init__(self, slots: Sequence[np.ndarray], gpu: Any, bits: int, slot_bytes: int) -> None:
        self.slots, self.gpu, self.bits, self.slot_bytes = slots, gpu, bits, slot_bytes


def _align(bits: int) -> int:
    """The largest of 16, 8 and 1 dividing every address, shift and the run length OR-ed into `bits`."""
    return 16 if not bits & 15 else 8 if not bits & 7 else 1


def storage_bytes(kv: Any) -> Any:
    """A flat uint8 tensor over the whole storage of `kv`, on its device (no copy)."""
    import torch

    return torch.empty(0, dtype=torch.uint8, device=kv.device).set_(kv.untyped_storage())


class CpuMover:
    """Copies at once, on the calling thread: one native call per layer for every block's runs (GIL released), and
    with `crcs` each block's CRC-32C continued over the bytes as they are copied (`checksum.copy_pages`)."""

    engine = "cpu"
    checksums = True             # load_layer / save_layer continue the blocks' CRC-32C as they copy

    def __init__(self) -> None:
        self._flat: dict[int, np.ndarray] = {}

    def _move(self, pages: LayerPages, block_ids: Sequence[int], slots: Sequence[np.ndarray], a: int,
              crcs: np.ndarray | None, to_slots: bool) -> None:
        if len(slots) < len(block_ids):
            raise ValueError(f"{len(block_ids)} pages to move but only {len(slots)} slots")
        flat = self._flat.get(id(pages))
        if flat is None:
            flat = self._flat[id(pages)] = storage_bytes(pages.kv).numpy()
        nbytes = len(block_ids) * pages.page_bytes
        copy_pages(flat, pages.run_starts(block_ids), slots[:len(block_ids)], a, pages.chunk_bytes, crcs,
                   to_slots=to_slots, stream=to_slots or nbytes >= STREAM_LOAD_BYTES)

    def load_layer(self, layer: int, pages: LayerPages, block_ids: Sequence[int], slots: Sequence[np.ndarray],
                   a: int, crcs: np.ndarray | None = None) -> None:
        """Slots -> pages for one layer; `crcs` (one per block) continued over the bytes loaded. A layer of
        STREAM_LOAD_BYTES or more is written around the caches."""
        self._move(pages, block_ids, slots, a, crcs, to_slots=False)

    def wait_layer(self, layer: int) -> None:
        pass

    def save_layer(self, pages: LayerPages, block_ids: Sequence[int], slots: Sequence[np.ndarray], a: int,
                   crcs: np.ndarray | None = None) -> None:
        """Pages -> slots for one layer (written around the caches: a slot is not read again soon); `crcs`
        continued over the bytes saved."""
        self._move(pages, block_ids, slots, a, crcs, to_slots=True)

    def sync(self) -> None:
        pass

    def pin(self, client: Any) -> None:
        pass

    def close(self) -> None:
        pass


class CudaMover:
    """Device <-> slot copies on the mover's own stream, queued without waiting: `load_layer` records an event per
    layer (the compute stream waits on it in `wait_layer`); `save_layer` first waits for the compute stream; `sync`
    before a commit, so the daemon never publishes a slot still being written. `engine`: "auto" (the kernel where
    it proves itself, else copy_), "kernel" or "copy"."""

    checksums = False            # the bytes move by DMA or a kernel: CRCs come from the slots, not the copy

    def __init__(self, device: Any, engine: str = "auto") -> None:
        import torch

        if engine not in COPY_ENGINES:
            raise ValueError(f"copy_engine must be one of {', '.join(COPY_ENGINES)}, got {engine!r}")
        self.torch = torch
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(device=self.device)
        self.registered: dict[int, int] = {}     # address of a pinned segment -> its bytes
        self.events: dict[int, Any] = {}
        self._flat: dict[int, Any] = {}
        self._tables: dict[tuple[Any, ...], RunTable] = {}
        self._kernels: list[Any] = []
        if engine != "copy":
            try:
                from kvstore.connectors.cuda_copy import chunk_copy_kernel
                self._kernels = [chunk_copy_kernel(vectorize=True), chunk_copy_kernel(vectorize=False)]
            except Exception as e:  # noqa: BLE001 - no Triton: copy_ does the same with more calls
                if engine == "kernel":
                    raise
                log.info("kvstore: no copy kernel (%s: %s); copying run by run", type(e).__name__, e)
        self._kernel: Any = None
        self.engine = "kernel?" if self._kernels else "copy"

    # ----- pinned slots -----
    def pin(self, client: Any) -> None:
        """Register every segment `client` maps as pinned memory (once each); the client unpins each one through
        this mover just before it unmaps it (a shrink released it, or the client closes)."""
        if self.unpin not in client.before_unmap:
            client.before_unmap.append(self.unpin)
        cudart = self.torch.cuda.cudart()
        for sid, arr in client.mapped_segments().items():
            addr = arr.ctypes.data
            if addr not in self.registered:
                err = cudart.cudaHostRegister(addr, arr.nbytes, REGISTER_FLAGS)
                if int(err) != 0:
                    raise RuntimeError(f"cudaHostRegister of segment {sid} ({arr.nbytes} bytes) failed: {err}")
                self.registered[addr] = arr.nbytes

    def unpin(self, sid: int, arr: np.ndarray) -> None:
        """Let go of a segment about to be unmapped; copies still queued may read it, so they finish first."""
        self._tables.clear()              # their slot views would keep the mapping exported
        if self.registered.pop(arr.ctypes.data, None) is not None:
            self.sync()
            self.torch.cuda.cudart().cudaHostUnregister(arr.ctypes.data)

    def close(self) -> None:
        """Finish every queued copy and unpin every segment."""
        self.sync()
        cudart = self.torch.cuda.cudart()
        for addr in list(self.registered):
            del self.registered[addr]
            cudart.cudaHostUnregister(addr)

    # ----- the copies -----
    def _gpu_flat(self, pages: LayerPages) -> Any:
        flat = self._flat.get(id(pages))
        if flat is None:
            flat = self._flat[id(pages)] = storage_bytes(pages.kv)
        return flat

    def _move(self, pages: LayerPages, block_ids: Sequence[int], slots: Sequence[np.ndarray], a: int,
              to_device: bool) -> None:
        if not len(block_ids):
            return
        if self.engine == "kernel?":
            self._prove(pages)
        flat = self._gpu_flat(pages)
        if self._kernel is not None:
            table = self._table(pages, block_ids, slots, to_device)
            if a < 0 or a + pages.page_bytes > table.slot_bytes:
                raise ValueError(f"a layer range at {a} (+{pages.page_bytes}) outside slots of {table.slot_bytes} "
                                 f"bytes")
            dev_shift = flat.data_ptr() + pages.base
            src, dst = (a, dev_shift) if to_device else (dev_shift, a)
            self._kernel(table.gpu, pages.chunk_bytes, _align(table.bits | src | dst), src, dst)
            return
        runs = pages.slot_runs(slots, a, len(block_ids))
        cb = pages.chunk_bytes
        for start, run in zip(pages.run_starts(block_ids).tolist(), runs):
            gpu, cpu = flat[start:start + cb], self.torch.from_numpy(run)
            if to_device:
                gpu.copy_(cpu, non_blocking=True)
            else:
                cpu.copy_(gpu, non_blocking=True)

    def _table(self, pages: LayerPages, block_ids: Sequence[int], slots: Sequence[np.ndarray],
               to_device: bool) -> RunTable:
        """The transfer's run addresses on the GPU, made at its first layer and reused by the others (see
        RunTable): the per-layer cost is then one kernel launch, not a table of every run built in Python."""
        ids = np.asarray(block_ids, dtype=np.int64)
        key = (pages.run_key, ids.tobytes(), id(slots), to_device)
        hit = self._tables.get(key)
        if hit is not None and hit.slots is slots:
            return hit
        n = len(ids)
        if len(slots) < n:
            raise ValueError(f"{n} pages to move but only {len(slots)} slots")
        slot_at = np.fromiter((s.ctypes.data for s in slots[:n]), dtype=np.int64, count=n)
        host = (slot_at[:, None] + np.arange(pages.chunks, dtype=np.int64)[None, :] * pages.chunk_bytes).reshape(-1)
        dev = pages.run_starts(ids) - pages.base
        src, dst = (host, dev) if to_device else (dev, host)
        both = np.stack([src, dst])
        table = RunTable(slots, self._upload(both), int(np.bitwise_or.reduce(both.reshape(-1))) | pages.chunk_bytes,
                         min(int(s.nbytes) for s in slots[:n]))
        if len(self._tables) >= TABLES_KEPT:
            self._tables.pop(next(iter(self._tables)))
        self._tables[key] = table
        return table

    def _upload(self, table: np.ndarray) -> Any:
        """The table on the GPU, through the caching pinned allocator, so the upload is queued on the stream too (a
        pageable upload would wait for every copy queued before it)."""
        return self.torch.from_numpy(table).pin_memory().to(self.device, non_blocking=True)

    def _prove(self, pages: LayerPages) -> None:
        """Copy device -> registered shared memory -> device through the kernel and compare, vectorised first,
        then with plain accesses. If neither is byte-exact (or both fail), log it and copy run by run from then on:
        a kernel that cannot reach registered slots must never serve KV."""
        for kernel in self._kernels:
            if self._kernel_works(kernel, max(pages.chunk_bytes, 1 << 16)):
                self._kernel, self.engine = kernel, "kernel"
                return
        log.warning("kvstore: the copy kernel is not byte-exact here; copying run by run with copy_")
        self.engine = "copy"

    def _kernel_works(self, kernel: Any, n: int) -> bool:
        torch = self.torch
        buf = mmap.mmap(-1, n)
        arr = np.frombuffer(buf, dtype=np.uint8)
        addr = arr.ctypes.data
        cudart = torch.cuda.cudart()
        registered = False
        try:
            registered = int(cudart.cudaHostRegister(addr, n, REGISTER_FLAGS)) == 0
            with torch.cuda.stream(self.stream):
                src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=self.device)
                back = torch.zeros_like(src)
                for s, d in ((src.data_ptr(), addr), (addr, back.data_ptr())):
                    kernel(torch.tensor([[s], [d]], dtype=torch.int64, device=self.device), n, 16)
            self.stream.synchronize()
            return registered and bool(torch.equal(src, back))
        except Exception as e:  # noqa: BLE001
            log.warning("kvstore: a copy kernel failed (%s: %s)", type(e).__name__, e)
            return False
        finally:
            if registered:
                cudart.cudaHostUnregister(addr)
            del arr
            buf.close()

    def load_layer(self, layer: int, pages: LayerPages, block_ids: Sequence[int], slots: Sequence[np.ndarray],
                   a: int, crcs: np.ndarray | None = None) -> None:
        """Queued on the mover's stream. `crcs` is not continued here (the device copies the bytes, not the CPU):
        the caller checks the slots before it queues the load (`checksums` is False)."""
        torch = self.torch
        with torch.cuda.stream(self.stream):
            self._move(pages, block_ids, slots, a, to_device=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        self.events[layer] = ev

    def wait_layer(self, layer: int) -> None:
        ev = self.events.pop(layer, None)
        if ev is not None:
            self.torch.cuda.current_stream(self.device).wait_event(ev)

    def save_layer(self, pages: LayerPages, block_ids: Sequence[int], slots: Sequence[np.ndarray], a: int,
                   crcs: np.ndarray | None = None) -> None:
        torch = self.torch
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self._move(pages, block_ids, slots, a, to_device=False)

    def sync(self) -> None:
        self.stream.synchronize()
        self._tables.clear()
