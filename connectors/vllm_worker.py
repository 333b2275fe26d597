"""The worker side of kvstore's vLLM connector (`KVStoreConnectorWorker`), built by `KVStoreConnector` in each of
vLLM's workers. It owns the engine's KV pages and every byte that moves: what to move comes from the scheduler, in
the metadata bound to each step (`vllm_common.KVStoreConnectorMetadata`); it decides nothing about requests itself.

Worker side: loads are acquired (pinned) in `start_load_kv` and copied layer by layer in `wait_for_layer_load`;
saves are reserved at the first `save_kv_layer` of a step, written layer by layer, and committed when the last
layer is in, with each block's CRC-32C. A load first checks every block against its CRC-32C; a block that is missing,
altered or could not be loaded is reported by `get_block_ids_with_load_errors`, so vLLM recomputes it (with
`kv_load_failure_policy: recompute`) instead of using bad KV. A save the scheduler marked durable is committed
durable, and waits for the disk at most `durable_wait_s` (see "Durability" in `vllm_connector.py`).

The GPU path: the pool's segments are registered as pinned memory once, loads of every layer are queued on the
connector's stream at `start_load_kv` (each attention layer waits only for its own layer's event), saves are queued
after the layer's compute, and the blocks are committed in `wait_for_save` after one stream sync, so the last layer
never stalls the forward pass. On CPU the same movers copy at once (`kv_pages.py`). The saves of a step are
`vllm_saves.StepSaves`.

Hybrid models (several KV groups, `kv_groups.py`): each move is one request's blocks of one group, in that group's
namespace, and each layer belongs to one group. Their loads are whole (vLLM's asynchronous protocol: every group's
blocks copied and checked before the request runs, reported by `received`), and recurrent-state layers, which vLLM
never hooks, move whole: loaded in `start_load_kv`, saved in `wait_for_save`.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore.client import KVStoreError, Lease
from kvstore.connectors.daemon_link import DaemonLink
from kvstore.connectors.hints import with_context
from kvstore.connectors.kv_groups import STATE
from kvstore.connectors.kv_pages import CpuMover, CudaMover, LayerPages
from kvstore.connectors.vllm_common import (
    ConnectorConfig,
    ConnectorSide,
    KVStoreConnectorMetadata,
    RequestBlocks,
    log,
)
from kvstore.connectors.vllm_layout import layout_of_pages
from kvstore.connectors.vllm_moves import LayerPlace, Move, MoveStats
from kvstore.connectors.vllm_saves import StepSaves

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.v1.kv_cache_interface import KVCacheConfig


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
    try:
        return int(get_tensor_model_parallel_rank())
    except (AssertionError, RuntimeError):
        return 0


class KVStoreConnectorWorker(ConnectorSide):
    link: DaemonLink | None       # ConnectorSide's; None once `_disable` has closed it

    def __init__(self, config: ConnectorConfig, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
        self.verify = config.verify
        self.durable_wait_s = config.durable_wait_s
        self.copy_engine = config.copy_engine
        self._kv_cache_config = kv_cache_config
        self._layers: dict[str, LayerPlace] = {}
        self._saves = StepSaves(self)
        self._pages: dict[int, LayerPages] = {}   # by LayerPlace.gi
        self._mover: CpuMover | CudaMover = CpuMover()
        self._cuda = False
        self._leases: list[tuple[Move, Lease]] = []
        self._load_errors: set[int] = set()
        self._received: dict[str, bool] = {}      # whole loads done since vLLM last asked: request -> all good
        self.stats = MoveStats()
        super().__init__(config, vllm_config, kv_cache_config, "worker", _tp_rank())

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if self.link is None:
            return
        missing = [n for g in self.groups for n in g.layer_names if n not in kv_caches]
        if missing:
            self._disable(f"no KV tensor for layer(s) {', '.join(missing[:4])} of the engine's KV cache groups")
            return
        num_blocks = getattr(self._kv_cache_config, "num_blocks", None)
        for part, group in enumerate(self.groups):
            for li, name in enumerate(group.layer_names):
                kv = kv_caches[name]
                layer = self._layers[name] = LayerPlace(part, li, len(self._pages))
                try:
                    pages = LayerPages(kv, num_blocks)
                except (ValueError, AttributeError, TypeError) as e:
                    self._disable(f"layer {name}: {e}")
                    return
                if pages.page_bytes != group.geometry.layer_bytes:
                    self._disable(f"layer {name}: a page is {pages.page_bytes} bytes (shape {tuple(kv.shape)}), "
                                  f"the namespace's geometry expects {group.geometry.layer_bytes}")
                    return
                found = layout_of_pages(kv.device.type, pages.page_order)
                if group.rule.kind != "state" and found != group.geometry.layout:    # never mix two layouts
                    self._disable(f"layer {name}: pages in the order {found}, the namespace says "
                                  f"{group.geometry.layout}")
                    return
                self._pages[layer.gi] = pages
        device = kv_caches[self.groups[0].layer_names[0]].device
        if device.type == "cuda":
            try:
                self._mover = CudaMover(device, engine=self.copy_engine)
            except Exception as e:  # noqa: BLE001 - e.g. copy_engine: kernel without Triton: no cache, no crash
                self._disable(f"the GPU copier could not start: {type(e).__name__}: {e}")
                return
            self._cuda = True
        first = self._pages[0]
        log.info("kvstore connector: %d layers in %d KV group(s), %d run(s) of %d bytes per page, %s copies",
                 len(self._pages), len(self.groups), first.chunks, first.chunk_bytes, device.type)

    def _group_layers(self, part: int) -> int:
        return self.groups[part].geometry.layers

    def _disable(self, why: str) -> None:
        log.warning("kvstore connector disabled: %s", why)
        self.disabled = why
        if self.link is not None:
            self.link.close()
        self.link = None

    def _io_failed(self, exc: BaseException) -> None:
        if isinstance(exc, KVStoreError):
            log.warning("kvstore: request refused: %s", exc)
        elif self.link is not None:
            self.link.failed(exc)

    def start_load_kv(self, meta: KVConnectorMetadata | None) -> None:
        if self.link is None or not isinstance(meta, KVStoreConnectorMetadata):
            return
        for t in meta.loads:
            if t.whole:
                self._received[t.req_id] = self._load_whole(t) and self._received.get(t.req_id, True)
                continue
            ns = self.link.namespace(t.adapter, t.group)
            if ns is None:
                self._load_errors.update(t.block_ids)
                continue
            try:
                lease = ns.acquire(t.hashes, **with_context(t.context))
            except Exception as e:  # noqa: BLE001 - any failure here means: recompute these blocks
                self._io_failed(e)
                self._load_errors.update(t.block_ids)
                continue
            n = len(lease)
            if self.verify:           # a block committed without a CRC cannot be proven: it ends the load
                n = next((i for i, c in enumerate(lease.crcs) if c is None), n)
                if not self._mover.checksums:      # the device copies: check the slots before it reads them
                    n = self._checked_slots(lease, n, t.req_id)
            if n < len(t.hashes):     # evicted since the scheduler's lookup, or altered: the rest is recomputed
                self._load_errors.update(t.block_ids[n:])
            part = RequestBlocks(t.req_id, t.adapter, t.hashes[:n], t.block_ids[:n], context=t.context,
                                 group=t.group)
            move = Move(part, part.block_ids, crcs=np.zeros(n, np.uint32) if self.verify and self._mover.checksums
                         else None)
            if self._cuda and part.block_ids:
                try:
                    self._enqueue_loads(part, lease)
                    move.done.update(range(self._group_layers(part.group)))
                except Exception as e:  # noqa: BLE001 - a load not queued is a load error, never a crash
                    self._io_failed(e)
                    self._load_errors.update(part.block_ids)
                    part.block_ids = []
            elif self._unhooked(part.group):
                for layer in self._layers_of(part.group):
                    self._load_layer(layer, move, lease)
            self._leases.append((move, lease))

    def _load_whole(self, t: RequestBlocks) -> bool:
        """A load of vLLM's asynchronous kind (hybrid models): every block of one group copied into the engine's
        pages now, all its layers, and checked against its writer's CRC-32C. False where any block is missing,
        altered or could not be copied: vLLM then recomputes the request from its start."""
        if not t.hashes:                  # all this group needs lies in the engine's local hit
            return True
        ns = self.link.namespace(t.adapter, t.group) if self.link is not None else None
        if ns is None:
            return False
        try:
            lease = ns.acquire(t.hashes, **with_context(t.context))
        except Exception as e:  # noqa: BLE001 - any failure here means: recompute the request
            self._io_failed(e)
            return False
        try:
            whole = len(lease) == len(t.hashes) and not (self.verify and None in lease.crcs)
            if self.verify and not self._mover.checksums:
                whole = whole and self._checked_slots(lease, len(lease), t.req_id) == len(lease)
            if not whole or not t.block_ids:
                return whole
            move = Move(t, t.block_ids, crcs=np.zeros(len(t.block_ids), np.uint32)
                         if self.verify and self._mover.checksums else None)
            if self._cuda:
                self._enqueue_loads(t, lease)
                self._mover.sync()
                return True
            for layer in sorted(self._layers_of(t.group), key=lambda x: x.li):
                self._load_layer(layer, move, lease)
            if len(move.done) < self._group_layers(t.group) or not t.block_ids:
                return False
            if move.crcs is not None and move.crcs.tolist() != list(lease.crcs):
                log.warning("kvstore: a block of request %s does not match its checksum: recomputed", t.req_id)
                return False
            return True
        except Exception as e:  # noqa: BLE001
            self._io_failed(e)
            return False
        finally:
            self._release([lease])

    def received(self) -> tuple[set[str], set[str]]:
        """(requests whose whole loads are done, those of them that failed) since the last call: vLLM's transfer
        results (a failed load is reported as both, so that the request leaves its wait and is recomputed)."""
        done, self._received = self._received, {}
        return set(done), {r for r, ok in done.items() if not ok}

    def _unhooked(self, part: int) -> bool:
        """Whether vLLM never calls the layer hooks (wait_for_layer_load, save_kv_layer) for this group's layers:
        its recurrent-state layers are not attention layers. Their states move whole, before the forward pass
        (loads) and after it (saves), which is also when they are whole."""
        return self.groups[part].rule.kind == STATE

    def _layers_of(self, part: int) -> list[LayerPlace]:
        return [layer for layer in self._layers.values() if layer.part == part]

    def _checked_slots(self, lease: Lease, n: int, req_id: str) -> int:
        """How many of the first n blocks match their CRC-32C in their slots now (the GPU path's check)."""
        m = lease.verified_prefix()
        if m < n:
            log.warning("kvstore: block %d of request %s does not match its checksum: recomputed", m, req_id)
        return min(m, n)

    def _enqueue_loads(self, part: RequestBlocks, lease: Lease) -> None:
        """GPU: every layer's copies queued now on the mover's stream; each attention layer waits for its own."""
        assert self.link is not None and self.link.client is not None
        self._mover.pin(self.link.client)
        geometry = self.groups[part.group].geometry
        for layer in self._layers_of(part.group):
            self._mover.load_layer(layer.gi, self._pages[layer.gi], part.block_ids, lease.views,
                                   geometry.layer_range(layer.li)[0])
            if self._unhooked(part.group):        # no layer hook waits for it: the compute stream waits now
                self._mover.wait_layer(layer.gi)

    def wait_for_layer_load(self, layer_name: str) -> None:
        layer = self._layers.get(layer_name)
        if layer is None or not self._leases:
            return
        if self._cuda:
            self._mover.wait_layer(layer.gi)
            return
        for move, lease in self._leases:
            self._load_layer(layer, move, lease)

    def _load_layer(self, layer: LayerPlace, move: Move, lease: Lease) -> None:
        """One layer of one load, slots -> pages (CPU), its CRC continued; a failure makes its blocks load errors."""
        t = move.part
        if t.group != layer.part or layer.li in move.done or not t.block_ids:
            return
        try:
            t0 = time.perf_counter()
            a = self.groups[layer.part].geometry.layer_range(layer.li)[0]
            self._mover.load_layer(layer.gi, self._pages[layer.gi], t.block_ids, lease.views, a, move.crcs)
            self._count(load=True, blocks=len(t.block_ids), layer=layer, seconds=time.perf_counter() - t0)
            move.moved(layer.li)
        except Exception as e:  # noqa: BLE001
            self._io_failed(e)
            self._load_errors.update(t.block_ids)
            t.block_ids = []

    def _count(self, load: bool, blocks: int, layer: LayerPlace, seconds: float) -> None:
        self.stats.count(load, blocks, blocks * self._pages[layer.gi].page_bytes, layer.li, seconds)

    def _check_loads(self) -> None:
        """After the forward pass: every block loaded in full, and (CPU) its copy equal to its writer's CRC-32C,
        checked on the bytes the engine read, not on the slot. A block that fails, and those after it, are load
        errors: vLLM drops this step's output for the request and recomputes from there. Run by `wait_for_save`, and
        by `get_block_ids_with_load_errors` where vLLM defers the first (a draft model's pass), once per load."""
        for move, lease in self._leases:
            t = move.part
            if not t.block_ids or move.checked:
                continue
            move.checked = True
            if len(move.done) < self._group_layers(t.group):
                self._load_errors.update(t.block_ids)     # a layer was never loaded
                continue
            if move.crcs is None:
                continue
            if move.in_order:
                bad = next((i for i, (got, want) in enumerate(zip(move.crcs.tolist(), lease.crcs)) if got != want),
                           None)
            else:                     # layers came out of order: the chain is not the slot's CRC; check the slots
                m = lease.verified_prefix()
                bad = m if m < len(t.block_ids) else None
            if bad is not None:
                log.warning("kvstore: block %d of request %s does not match its checksum: recomputed", bad, t.req_id)
                self._load_errors.update(t.block_ids[bad:])

    def save_kv_layer(self, layer_name: str, meta: KVConnectorMetadata | None) -> None:
        layer = self._layers.get(layer_name)
        if layer is None or self.link is None or not isinstance(meta, KVStoreConnectorMetadata) or not meta.saves:
            return
        self._saves.save_layer(layer, meta)

    def wait_for_save(self, meta: KVConnectorMetadata | None = None) -> None:
        if self.link is not None and isinstance(meta, KVStoreConnectorMetadata) and \
                any(self._unhooked(t.group) for t in meta.saves):
            for layer in self._layers.values():      # the states, whole after the forward pass
                if self._unhooked(layer.part):
                    self._saves.save_layer(layer, meta)
        self._saves.finish()
        self._check_loads()
        self._release_leases()

    def _release_leases(self) -> None:
        leases, self._leases = self._leases, []
        self._release([lease for _, lease in leases])

    def _release(self, leases: list[Lease]) -> None:
        if leases:
            self._mover.sync()                # no copy may still read a slot once it is unpinned
        for lease in leases:
            try:
                lease.release()
            except Exception as e:  # noqa: BLE001
                self._io_failed(e)
        if leases and self.link is not None and self.link.client is not None:
            try:
                self.link.client.flush()
            except Exception as e:  # noqa: BLE001
                self._io_failed(e)

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._check_loads()
        errors, self._load_errors = self._load_errors, set()
        if errors:
            log.warning("kvstore: %d block(s) could not be loaded; vLLM recomputes them", len(errors))
        return errors

    def shutdown(self) -> None:
        if self.link is not None:
            self._release_leases()
            try:
                self._mover.close()
            except Exception as e:  # noqa: BLE001 - unpinning at exit must not raise into vLLM's shutdown
                log.debug("kvstore: closing the mover: %s", e)
            self.link.close()
