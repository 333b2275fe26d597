"""One step's saves on the worker side of kvstore's vLLM connector (`StepSaves`, held by `vllm_worker.py`'s
worker): the reservations made at the first layer saved, the layers written into their slots one by one, the
commits (with each block's CRC-32C) once a save's every layer is in, the renewal of a pass that outlasts a third of
the daemon's lease, and at the step's end the commits the GPU path queued and the aborts of what never got all its
layers. It reads the worker's link, pages and mover; it decides nothing about requests."""
from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from kvstore.client import Reservation
from kvstore.connectors.hints import with_context
from kvstore.connectors.vllm_common import CHAIN_KEYS, KVStoreConnectorMetadata, RequestBlocks, log
from kvstore.connectors.vllm_moves import LayerPlace, Move

if TYPE_CHECKING:
    from kvstore.connectors.vllm_worker import KVStoreConnectorWorker


class StepSaves:
    """See the module docstring."""

    def __init__(self, worker: KVStoreConnectorWorker) -> None:
        self.w = worker
        self.reservations: list[tuple[Move, Reservation]] | None = None
        self.reserved_at = 0.0                    # when this step's reservations were made or last renewed
        self.to_commit: list[tuple[Move, Reservation]] = []

    def save_layer(self, layer: LayerPlace, meta: KVStoreConnectorMetadata) -> None:
        """One layer of this step's saves, pages -> slots; a save whose every layer is in is committed."""
        assert self.w.link is not None
        if self.reservations is None:
            self.reservations = self._reserve(meta.saves)
            self.reserved_at = time.monotonic()
        elif self.reservations and time.monotonic() - self.reserved_at > self._lease_s() / 3:
            self._renew()
        li = layer.li
        a = self.w.groups[layer.part].geometry.layer_range(li)[0]
        for move, res in self.reservations:
            if move.part.group != layer.part or res.done or not move.ids:
                continue
            try:
                if self.w._cuda and self.w.link.client is not None:
                    self.w._mover.pin(self.w.link.client)
                t0 = time.perf_counter()
                self.w._mover.save_layer(self.w._pages[layer.gi], move.ids, res.views, a, move.crcs)
                self.w._count(load=False, blocks=len(move.ids), layer=layer, seconds=time.perf_counter() - t0)
                move.moved(li)
                if len(move.done) == self.w._group_layers(layer.part):
                    if self.w._cuda:
                        self.to_commit.append((move, res))       # committed in `finish`, after a sync
                    else:
                        self._commit(move, res)
            except Exception as e:  # noqa: BLE001
                self.w._io_failed(e)
                res.done = True

    def _lease_s(self) -> float:
        return self.w.link.client.lease_s if self.w.link is not None and self.w.link.client is not None else 60.0

    def _renew(self) -> None:
        """A forward pass that outlasts a third of the daemon's reservation lease (a long prompt on a slow machine):
        the reservations of this step are extended, else the daemon would abort them mid-pass (and give their
        slots to other writers while this one still copies into them)."""
        self.reserved_at = time.monotonic()
        try:
            assert self.w.link is not None and self.w.link.client is not None
            self.w.link.client.renew()
        except Exception as e:  # noqa: BLE001 - a lease not renewed is a later commit refused, nothing worse
            self.w._io_failed(e)

    def _reserve(self, saves: list[RequestBlocks]) -> list[tuple[Move, Reservation]]:
        """This step's reservations, one per request with blocks to save (at the first layer saved)."""
        out: list[tuple[Move, Reservation]] = []
        assert self.w.link is not None
        for t in saves:
            ns = self.w.link.namespace(t.adapter, t.group)
            if ns is None:
                continue
            keep = self.w.link.client.max_keys if self.w.link.client is not None else CHAIN_KEYS
            if len(t.hashes) > keep:          # a daemon configured for fewer keys a request: the chain's end
                t = replace(t, hashes=t.hashes[-keep:], block_ids=t.block_ids[-keep:])
            try:
                res = ns.reserve(t.hashes, **with_context(t.context))
            except Exception as e:  # noqa: BLE001 - a block not saved is a later miss, nothing worse
                self.w._io_failed(e)
                continue
            ids = [t.block_ids[p] for p in res.reserved]     # res.views are the reserved slots, in order
            checked = self.w.verify and self.w._mover.checksums
            out.append((Move(t, ids, crcs=np.zeros(len(ids), np.uint32) if checked else None), res))
        return out

    def _commit(self, move: Move, res: Reservation) -> None:
        """Publish a save with each block's CRC-32C (readers verify): the one computed while copying where the
        layers came in order, else read from the slots."""
        durable = move.part.durable
        crcs: list[int] | None = None
        if self.w.verify:
            crcs = move.crcs.tolist() if move.crcs is not None and move.in_order else res.checksums()
        try:
            res.commit(crcs=crcs, durable=durable, durable_timeout_s=self.w.durable_wait_s if durable else None)
        except Exception as e:  # noqa: BLE001 - a block not saved is a later miss, nothing worse
            self.w._io_failed(e)
            res.done = True
            return
        answer = res.durability
        if durable and self.w.durable_wait_s > 0 and answer is not None and answer["durability"] != "durable":
            log.info("kvstore: a durable save got %s (%d of %d block(s) pending, %d failed)", answer["durability"],
                     answer["pending"], answer["blocks"], answer["failed"])

    def finish(self) -> None:
        """The step's end: every queued copy into a slot done (GPU) before it is published or aborted (an aborted
        slot goes to another writer at once), the queued commits made, and what never got all its layers aborted:
        nothing half-written is published."""
        if self.w._cuda and self.reservations:
            self.w._mover.sync()
        for move, res in self.to_commit:
            self._commit(move, res)
        self.to_commit = []
        for _, res in self.reservations or []:
            if not res.done:
                try:
                    res.abort()
                except Exception as e:  # noqa: BLE001
                    self.w._io_failed(e)
        self.reservations = None
