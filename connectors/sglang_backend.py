"""kvstore as an SGLang HiCache storage backend (the L3 tier under SGLang's host pool), loaded by name:

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
      --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
      '{"backend_name": "kvstore", "module_path": "kvstore.connectors.sglang_backend", "class_name": "KVStoreHiCache",
        "interface_v1": 1, "socket": "/run/kvstore/kvstore.sock"}'

Thin: SGLang's page hashes become kvstore keys and pages move between SGLang's host pool and the daemon's
shared-memory slots with one copy each way. No cache of its own, and the daemon is never a reason for SGLang to stop:
every failure (daemon away, refusal, a pool this backend cannot describe, bad arguments) is a per-key False, a 0 or
a None, never an exception into SGLang's prefetch or backup threads; one log line per outage, reconnect later.

The parts: this module owns the storage calls below (SGLang's contract), the daemon link, hints and the turning of
failures into misses; `sglang_pages.py` owns the mapping of the host pool to kvstore (page keys, the namespace of a
pool, views of its pages' bytes) and the byte movement between pages and slots (copies with their CRC-32C).

The contract, as SGLang's HiCache calls it (keys are page-hash strings, `host_indices` token indices of the host
pool, `page_size` per page):

- `batch_exists(keys) -> int`: how many leading keys are stored (longest contiguous prefix, host pool or SSD).
- `batch_get_v1(keys, host_indices) -> list[bool]`: load the stored prefix into the host pool's pages; True for
  each page whose bytes were copied and proved (CRC-32C) to be those committed; False from the first miss on.
- `batch_set_v1(keys, host_indices) -> list[bool]`: store the pages: True when stored now, already stored, or being
  stored by another writer of the same namespace (identical bytes by construction); False when not (no space,
  daemon away). A page is invisible to readers until its commit.
- `get/batch_get/set/batch_set/exists`: the older flat-page interface over the same blocks (a flat page from
  `get_data_page(i, flat=True)`), interchangeable with the v1 calls.
- hybrid models (sliding-window, Mamba state, indexer pools): the v2 calls `register_mem_host_pool_v2`,
  `batch_exists_v2`, `batch_get_v2`, `batch_set_v2`, in `sglang_hybrid.py` (each side pool its own namespace; a
  prefix is a hit only where every pool's pages at its end are stored). The anchor (full-attention KV) stays the
  v1 calls' namespace, so a dense model's pages and a hybrid model's full-attention pages are the same blocks.

Pages move by the pool's own `get_page_buffer_meta` (pointer and size of each piece of a page), each pointer checked
to lie inside the pool's buffers. A kvstore block is one SGLang page: its pieces one after another, so the bytes are
the host pool's own (no transposes) and the namespace's layout names their order, e.g. `layers,kv,tokens,heads,dim`
for an MHA `layer_first` pool. The namespace holds what makes page bytes identical: model (or `group`), tensor-
parallel rank and size, layers, page size, heads, head dim, dtype, byte order, pipeline stage and context-parallel
shard. MLA pools hold one latent per token (`kv=1`, head dim = kv_lora_rank + qk_rope_head_dim) replicated on every
rank: their namespace has no rank, every rank reads it and only SGLang's storage writer (rank 0) writes it; other
ranks' sets are no-ops reported True.

Hints (issue 14): where a storage call's `extra_info` (HiCacheStorageExtraInfo) carries request information in its
`extra_info` dict, the same fields as the vLLM connector's `kv_transfer_params` are read (`connectors/hints.py`:
workflow, workflow_type, agent, step, next, priority, session, and SGLang's own `session_id`), and the call's
lookup, loads or saves carry that context; the first call naming a (workflow or session, agent) pair sends its
`call` (or session turn) hint, so the context names an active workflow. SGLang 0.5.23's HiCache carries none:
its v1 calls get `HiCacheStorageExtraInfo(prefix_keys=...)` only (request ids stay in the cache controller; the
only `extra_info` dict it fills, `{"session_id": ...}`, goes to `batch_set_v2` of its unified-cache linker), and
SGLang has no per-request end to forward. So with SGLang, an agent framework sends the hints itself through the
client (`Client.workflow(wid, type).call(agent)` / `.end()`, `Client.session(sid)`), and blocks carry no context;
the daemon's policy then ranks them by the workflows' books alone.

extra config (beside SGLang's backend_name, module_path, class_name, interface_v1): socket (default
$KVSTORE_SERVER_SOCKET, else the daemon's default), model / group / salt (namespace overrides), retry_s (5: how often
a lost daemon is tried again), timeout_s (5: the longest one daemon call may take), verify (true: each block carries a
CRC-32C checked before its bytes reach the pool), tenant / tenant_secret (the tenant the engine speaks for; default
$KVSTORE_TENANT / $KVSTORE_TENANT_SECRET, else its user's).
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from kvstore.client import Namespace
from kvstore.connectors.daemon_link import DaemonLink
from kvstore.connectors.hints import parse_hints, send_start, with_context
from kvstore.connectors.sglang_hybrid import HybridV2, SidePool
from kvstore.connectors.sglang_pages import (
    KEY_SCHEME,
    MHA_ORDER,
    MLA_ORDER,
    TORCH_DTYPES,
    Legacy,
    bytes_of,
    copy_checked,
    describe_pool,
    from_block,
    legacy_shape,
    page_key,
    page_views,
    pool_buffers,
    split_slot,
    to_block,
)
from kvstore.protocol import ReserveStatus
from kvstore.protocol.geometry import Geometry
from kvstore.protocol.keys import NamespaceSpec

log = logging.getLogger("sglang.kvstore")  # under "sglang": shown wherever SGLang's own lines are

SEEN_CALLS = 4096          # (workflow, agent) pairs whose `call` was sent, most recent kept
# the mapping's names moved to sglang_pages; they stay importable from here, where they were
__all__ = ["KEY_SCHEME", "MHA_ORDER", "MLA_ORDER", "SEEN_CALLS", "TORCH_DTYPES", "KVStoreHiCache", "describe_pool",
           "page_key"]


class KVStoreHiCache(HybridV2, HiCacheStorage):
    """See the module docstring. Built by SGLang as `KVStoreHiCache(storage_config, kwargs)`; usable once
    `register_mem_pool_host(host_pool)` has described the pages."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self.config = storage_config
        self.extra = dict(storage_config.extra_config or {})
        self.verify = bool(self.extra.get("verify", True))
        self.writer = bool(storage_config.is_storage_writer)
        self.link: DaemonLink | None = None
        self.disabled: str | None = "no host pool registered yet"
        self.geometry: Geometry | None = None
        self._bufs: list[tuple[int, int, np.ndarray]] = []
        self._legacy: Legacy | None = None   # MHA layer_first: a flat page is [2, layers, piece]
        self._warned: set[str] = set()
        self._called: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._called_lock = threading.Lock()         # SGLang's prefetch and backup threads call at once
        self._specs: dict[str, NamespaceSpec] = {}   # namespaces by link adapter: "" the anchor, then side pools
        self._side: dict[str, SidePool | str] = {}

    # ----- setup -----
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        try:
            spec = describe_pool(mem_pool_host, self.config, self.extra)
            self._bufs = pool_buffers(mem_pool_host)
        except Exception as e:  # noqa: BLE001 - a pool we cannot describe means: no storage tier, SGLang runs on
            self._disable(str(e))
            return
        self.geometry = spec.geometry
        self._specs[""] = spec
        legacy = legacy_shape(self.geometry, mem_pool_host.layout)
        if legacy is not None:
            self._legacy = legacy
        if self.link is not None:
            self.link.close()
        self.link = DaemonLink(self.extra.get("socket"), self._spec_for, log=log, who="HiCache",
                               without="HiCache runs without its storage tier", per_thread=True,
                               retry_s=float(self.extra.get("retry_s", 5.0)),
                               timeout_s=float(self.extra.get("timeout_s", 5.0)),
                               tenant=self.extra.get("tenant"), secret=self.extra.get("tenant_secret"))
        self.disabled = None
        log.info("kvstore HiCache backend: model %s, tp %d/%d, %s%s", spec.model, spec.tp_rank, spec.tp_size,
                 self.geometry, "" if self.writer else " (reader: another rank writes)")

    def _spec_for(self, adapter: str) -> NamespaceSpec:
        if adapter not in self._specs:
            raise ValueError(f"no pool {adapter!r} registered")
        return self._specs[adapter]

    def _disable(self, why: str) -> None:
        log.warning("kvstore HiCache backend disabled: %s", why)
        self.disabled = why
        if self.link is not None:
            self.link.close()
        self.link = None

    def close(self) -> None:
        if self.link is not None:
            self.link.close()

    def _ns(self) -> Namespace | None:
        return None if self.link is None else self.link.namespace()

    def _failed(self, exc: BaseException) -> None:
        if isinstance(exc, (ConnectionError, OSError)):
            if self.link is not None:
                self.link.failed(exc)
            return
        why = f"{type(exc).__name__}: {exc}"
        if why not in self._warned:           # refusals and bad calls: once each, then only counted by the daemon
            self._warned.add(why)
            log.warning("kvstore: request failed (%s); the pages are misses", why)

    def _context(self, ns: Namespace, extra_info: Any) -> tuple[str, str] | None:
        """The (workflow, agent) context of a storage call, from its `extra_info.extra_info` dict (None: the
        common case). The first time a pair is seen its `call` is sent."""
        hints = parse_hints(getattr(extra_info, "extra_info", None), log)
        pair = None if hints is None else hints.context
        if hints is None or pair is None:
            return None
        with self._called_lock:
            first = pair not in self._called
            self._called[pair] = None
            self._called.move_to_end(pair)
            while len(self._called) > SEEN_CALLS:
                self._called.popitem(last=False)
        if first:
            try:
                send_start(ns.client, hints, log)
            except Exception as e:  # noqa: BLE001 - a hint is advice: never an error to SGLang
                log.debug("kvstore: hint not sent: %s: %s", type(e).__name__, e)
        return pair

    def _pages(self, host_indices: Any, n: int) -> list[list[np.ndarray]]:
        assert self.geometry is not None
        return page_views(self.mem_pool_host, self.geometry, self._bufs, host_indices, n)

    # ----- the zero-copy interface -----
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        ns = self._ns()
        if ns is None or not keys:
            return 0
        try:
            return int(ns.lookup([page_key(k) for k in keys], **with_context(self._context(ns, extra_info))))
        except Exception as e:  # noqa: BLE001 - a failed lookup is a miss
            self._failed(e)
            return 0

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        ok = [False] * len(keys)
        ns = self._ns()
        if ns is None or not keys:
            return ok
        try:
            pages = self._pages(host_indices, len(keys))
            step, ctx = ns.client.max_keys, self._context(ns, extra_info)
            for start in range(0, len(keys), step):
                n = self._load(ns, [page_key(k) for k in keys[start:start + step]], pages[start:start + step], ctx)
                ok[start:start + n] = [True] * n
                if n < len(keys[start:start + step]):
                    break
        except Exception as e:  # noqa: BLE001
            self._failed(e)
        return ok

    def _load(self, ns: Namespace, kv_keys: list[bytes], pages: list[list[np.ndarray]],
              ctx: tuple[str, str] | None = None) -> int:
        with ns.acquire(kv_keys, **with_context(ctx)) as lease:
            if not self.verify:
                ns.client.copier.copy([(piece, part) for slot, pieces in zip(lease.views, pages)
                                       for part, piece in split_slot(slot, pieces)])
                return len(lease)
            # each page's copy checked against its writer's CRC-32C, computed in the same pass as the copy: the
            # check is on the bytes the pool now holds, not on a slot that could change after a check
            for i, (slot, pieces, want) in enumerate(zip(lease.views, pages, lease.crcs)):
                if want is None or copy_checked(slot, pieces, to_slot=False) != want:
                    log.warning("kvstore: a stored page does not match its checksum; it and the pages after it "
                                "are misses")
                    return i
            return len(lease)

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        if not self.writer and self.disabled is None:
            return [True] * len(keys)              # MLA: one rank writes the replicated latent
        ok = [False] * len(keys)
        ns = self._ns()
        if ns is None or not keys:
            return ok
        try:
            pages = self._pages(host_indices, len(keys))
            step, ctx = ns.client.max_keys, self._context(ns, extra_info)
            for start in range(0, len(keys), step):     # the pages of a chain, head first
                more = start + step < len(keys)
                done = self._store(ns, [page_key(k) for k in keys[start:start + step]], pages[start:start + step],
                                   ctx, more)
                ok[start:start + len(done)] = done
                if not all(done):
                    break                              # the pages after a hole would never be read
        except Exception as e:  # noqa: BLE001
            self._failed(e)
        return ok

    def _store(self, ns: Namespace, kv_keys: list[bytes], pages: list[list[np.ndarray]],
               ctx: tuple[str, str] | None = None, more: bool = False) -> list[bool]:
        with ns.reserve(kv_keys, **with_context(ctx), more=more) as res:
            if self.verify:           # the CRC-32C of each slot computed while it is written (one pass)
                res.commit([copy_checked(slot, pages[i], to_slot=True) for slot, i in zip(res.views, res.reserved)])
            else:
                ns.client.copier.copy([pair for slot, i in zip(res.views, res.reserved)
                                       for pair in split_slot(slot, pages[i])])
                res.commit(checksum=False)
        return [s != ReserveStatus.NO_SPACE for s in res.status]   # stored, stored already, being stored

    # ----- the older flat-page interface (bytes reordered by sglang_pages.to_block / from_block) -----
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        ns = self._ns()
        if ns is None:
            return None
        try:
            target = target_location if target_location is not None else self.mem_pool_host.get_dummy_flat_data_page()
            out = bytes_of(target)
            if out.nbytes != ns.block_bytes:
                raise ValueError(f"wrong geometry: a {out.nbytes}-byte page for {ns.block_bytes}-byte blocks")
            with ns.acquire([page_key(key)]) as lease:
                if len(lease) == 0 or (self.verify and lease.verified_prefix() == 0):
                    return None
                from_block(lease.views[0], out, self._legacy)
            return target
        except Exception as e:  # noqa: BLE001
            self._failed(e)
            return None

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        targets: Sequence[Any] = target_locations if target_locations is not None else [None] * len(keys)
        return [self.get(k, t) for k, t in zip(keys, targets)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        if not self.writer and self.disabled is None:
            return True
        ns = self._ns()
        if ns is None or value is None:
            return False
        try:
            r = ns.put([page_key(key)], [to_block(bytes_of(value), self._legacy)], checksum=self.verify)
            return r.stored + r.existed + r.busy == 1
        except Exception as e:  # noqa: BLE001 - a wrong-sized page is refused by the client: False
            self._failed(e)
            return False

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        if values is None or len(values) != len(keys):
            return False
        return all([self.set(k, v) for k, v in zip(keys, values)])

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1
