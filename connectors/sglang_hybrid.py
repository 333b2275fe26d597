"""SGLang's HiCache storage v2 interface for hybrid models (sliding-window, Mamba/linear-attention state, indexer
pools beside full attention), mixed into `sglang_backend.KVStoreHiCache`.

The contract, as SGLang 0.5.23's hybrid cache controller calls it (`mem_cache/hybrid_cache/`; its in-tree
file and Mooncake backends are the reference for the semantics):

- `register_mem_pool_host(anchor)` first (the full-attention KV pool: the v1 calls keep serving it), then
  `register_mem_host_pool_v2(host_pool, name)` for every entry of the host pool group (`PoolName.KV` is the anchor
  again; `swa`, `mamba`, `indexer`, ... are the side pools), then `on_host_pools_registered()`.
- `batch_exists_v2(keys, pool_transfers, extra_info) -> PoolTransferResult`: `keys` are the KV page hashes of the
  span; each transfer names a side pool and its `hit_policy`. A side pool's page i is stored under `keys[i]` (a
  Mamba state under the hash of the last page it covers). `all_pages`: every page of the prefix must be present;
  `trailing_pages`: only the last `len(transfer.keys)` pages before the prefix end (the SWA window; 1 for a Mamba
  state). The answer: `restorable_prefix_pages`, every prefix length (in pages) at which the KV prefix and every
  pool's required pages are present (a trailing pool leaves holes: a state at 4 and 8 but not at 6), the longest of
  them as `kv_hit_pages`, and each pool's own boundary in `extra_pool_hit_pages`. A prefix is never reported when
  some pool's pages at its end are missing, and a pool this backend cannot store (or one never registered) makes
  every prefix a miss: restoring the attention KV without the recurrent state gives garbled output.
- `batch_get_v2(transfers)` / `batch_set_v2(transfers) -> {pool name: [bool per key]}`: each transfer's `keys` and
  `host_indices` (`len(keys) * pool.page_size` indices; a Mamba pool has one slot per page). SGLang counts the
  leading Trues of a get (`count_pool_hits`); a set is True when stored now, stored already or being stored.

Each side pool is its own kvstore namespace, opened on the backend's one daemon link under its pool name: KV-like
pools (SWA) with the geometry of an MHA/MLA page (`sglang_pages.describe_pool`), a Mamba state pool as bytes
(dtype uint8, one token, `kv_heads * head_dim` = the bytes of one layer's state, layout `sglang-mamba:...`); the
pool's name and, for a state, its shapes and dtypes are in the namespace salt, so two pools never share keys.
Mamba state is sharded by tensor-parallel rank even in an MLA model: every rank writes its own.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransferResult

from kvstore.connectors.sglang_pages import describe_pool, namespace_spec, page_key, page_views, pool_buffers
from kvstore.protocol.geometry import Geometry
from kvstore.protocol.keys import NamespaceSpec

if TYPE_CHECKING:
    from kvstore.client import Namespace
    from kvstore.connectors.daemon_link import DaemonLink

log = logging.getLogger("sglang.kvstore")
MAX_HEADS, MAX_DIM = 4096, 1 << 16       # Geometry's bounds on kv_heads and head_dim


def _dtype(t: Any) -> str:
    return str(t).removeprefix("torch.")


def byte_geometry(total: int, layers: int, layout: str) -> Geometry:
    """A page of `total` bytes over `layers` layers as a byte geometry: uint8, one token, one part, the bytes of one
    layer as kv_heads * head_dim (the largest head_dim that fits)."""
    per_layer, rest = divmod(total, max(layers, 1))
    if rest or per_layer < 1 or per_layer > MAX_HEADS * MAX_DIM:
        raise ValueError(f"a {total}-byte page over {layers} layers has no byte geometry")
    for dim in range(min(per_layer, MAX_DIM), 0, -1):
        if per_layer % dim == 0:
            if per_layer // dim > MAX_HEADS:
                break
            return Geometry(layers=layers, tokens=1, kv_heads=per_layer // dim, head_dim=dim, dtype="uint8", kv=1,
                            layout=layout)
    raise ValueError(f"{per_layer} bytes per layer do not factor into heads <= {MAX_HEADS} x dim <= {MAX_DIM}")


def describe_mamba(pool: Any, config: Any, extra: dict[str, Any]) -> NamespaceSpec:
    """The namespace of a Mamba/linear-attention state pool (`MambaPoolHost`): one state per page, its bytes as the
    pool's `get_page_buffer_meta` gives them (temporal state of every layer, then each conv state)."""
    if getattr(pool, "slot_state_device_tensors", ()):
        raise ValueError("Mamba slot side states are not carried by the pool's zero-copy page metadata")
    if pool.layout not in ("page_first", "page_first_direct"):     # the two give the same page bytes
        raise ValueError(f"Mamba host layout {pool.layout!r} is not supported")
    layers, page = int(pool.num_mamba_layers), int(pool.page_size)
    temporal = int(pool.temporal_state_elem_size) * pool.temporal_dtype.itemsize
    conv = sum(int(n) * pool.conv_dtype.itemsize for n in pool.conv_state_elem_sizes)
    geometry = byte_geometry(page * layers * (temporal + conv), layers * page, "sglang-mamba:temporal,conv")
    shape = (f"state=t{'x'.join(map(str, pool.temporal_state_shape))}:{_dtype(pool.temporal_dtype)},"
             + ",".join(f"c{'x'.join(map(str, s))}" for s in pool.conv_state_shapes) + f":{_dtype(pool.conv_dtype)}")
    spec = namespace_spec(geometry, pool, config, extra, int(config.tp_rank), int(config.tp_size))
    return replace(spec, salt=f"{shape}|{spec.salt}"[:256])


def describe_side_pool(pool: Any, name: str, config: Any, extra: dict[str, Any]) -> tuple[NamespaceSpec, bool]:
    """(namespace, replicated) of a side pool: replicated pools (MLA-like) are written by the storage writer only."""
    if hasattr(pool, "temporal_buffer") and hasattr(pool, "num_mamba_layers"):
        spec, replicated = describe_mamba(pool, config, extra), False
    else:
        spec = describe_pool(pool, config, extra)
        replicated = spec.geometry.layout.startswith("sglang-mla")
    return replace(spec, salt=f"pool={name}|{spec.salt}"[:256]), replicated


@dataclass
class SidePool:
    """A registered side pool: where its pages live and which namespace (link adapter) holds them."""

    name: str
    pool: Any
    adapter: str                          # the daemon link's key of its namespace; "" is the anchor's
    geometry: Geometry
    bufs: list[tuple[int, int, np.ndarray]]
    replicated: bool = False              # written by the storage writer only (MLA-like; the anchor as in v1)


def restorable(kv_pages: int, policy: Any, trailing: int, present: list[bool]) -> list[int]:
    """The prefix lengths (pages, 1..kv_pages) at which one pool's required pages are all present."""
    if policy == PoolHitPolicy.ALL_PAGES:
        n = present.index(False) if False in present else len(present)
        return list(range(1, min(n, kv_pages) + 1))
    if policy == PoolHitPolicy.TRAILING_PAGES:
        return [end for end in range(1, kv_pages + 1) if all(present[max(0, end - trailing):end])]
    return []                                              # a policy this backend does not know: no prefix


class HybridV2:
    """The v2 calls of KVStoreHiCache (see the module docstring)."""

    link: DaemonLink | None
    writer: bool
    config: Any
    extra: dict[str, Any]
    mem_pool_host: Any
    geometry: Geometry | None
    _bufs: list[tuple[int, int, np.ndarray]]
    _specs: dict[str, NamespaceSpec]
    _side: dict[str, SidePool | str]      # pool name -> the pool, or why it cannot be stored

    if TYPE_CHECKING:
        def batch_exists(self, keys: list[str], extra_info: Any = None) -> int: ...
        def _failed(self, exc: BaseException) -> None: ...
        def _context(self, ns: Namespace, extra_info: Any) -> tuple[str, str] | None: ...
        def _load(self, ns: Namespace, kv_keys: list[bytes], pages: list[list[np.ndarray]],
                  ctx: tuple[str, str] | None = None) -> int: ...
        def _store(self, ns: Namespace, kv_keys: list[bytes], pages: list[list[np.ndarray]],
                   ctx: tuple[str, str] | None = None) -> list[bool]: ...

    # ----- setup -----
    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        name = str(host_pool_name)
        self.registered_pools = {**getattr(self, "registered_pools", {}), host_pool_name: host_pool}
        if host_pool is getattr(self, "mem_pool_host", None):  # the anchor: the v1 calls' namespace ("")
            if self.geometry is not None:
                self._side[name] = SidePool(name, host_pool, "", self.geometry, self._bufs, replicated=True)
            return
        adapter = f"sglang-pool:{name}"
        try:
            spec, replicated = describe_side_pool(host_pool, name, self.config, self.extra)
            self._specs[adapter] = spec
            self._side[name] = SidePool(name, host_pool, adapter, spec.geometry, pool_buffers(host_pool),
                                        replicated)
            log.info("kvstore HiCache backend: pool %s, %s", name, spec.geometry)
        except Exception as e:  # noqa: BLE001 - a pool we cannot store: every prefix that needs it is a miss
            self._side[name] = f"{type(e).__name__}: {e}"
            log.warning("kvstore HiCache backend: pool %s cannot be stored (%s); prefixes that need it are misses",
                        name, self._side[name])

    def on_host_pools_registered(self) -> None:
        pass

    def _pool(self, name: Any) -> tuple[SidePool, Namespace] | None:
        """A registered side pool and its namespace, or None (unknown, unstorable, daemon away)."""
        side = self._side.get(str(name))
        if isinstance(side, SidePool) and self.link is not None and getattr(self, "disabled", None) is None:
            ns = self.link.namespace(side.adapter)
            return None if ns is None else (side, ns)
        return None

    # ----- hits -----
    def batch_exists_v2(self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None) -> Any:
        try:
            return self._exists_v2(keys, list(pool_transfers or []), extra_info)
        except Exception as e:  # noqa: BLE001 - a failed lookup is a miss
            self._failed(e)
            return PoolTransferResult(0, {}, [])

    def _exists_v2(self, keys: list[str], transfers: list[Any], extra_info: Any) -> Any:
        kv_pages = self.batch_exists(keys, extra_info) if keys else 0
        hits: dict[Any, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        ends = list(range(1, kv_pages + 1))
        for t in transfers:
            if not ends:
                break
            found = self._pool(t.name)
            if found is None:                              # a pool we cannot check: no prefix is restorable
                return PoolTransferResult(0, hits, [])
            _, ns = found
            kv_keys = [page_key(k) for k in keys[:kv_pages]]
            if t.hit_policy == PoolHitPolicy.ALL_PAGES:    # the leading present pages: one lookup
                n = ns.lookup(kv_keys)
                present = [True] * n + [False] * (kv_pages - n)
            else:
                present = held(ns, kv_keys)
            pool_ends = restorable(kv_pages, t.hit_policy, max(1, len(t.keys or ())), present)
            if pool_ends:
                hits[t.name] = pool_ends[-1]
            keep = set(pool_ends)
            ends = [e for e in ends if e in keep]
        return PoolTransferResult(ends[-1] if ends else 0, hits, ends)

    # ----- data -----
    def batch_get_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[Any, list[bool]]:
        return {t.name: self._move(t, extra_info, load=True) for t in transfers}

    def batch_set_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[Any, list[bool]]:
        return {t.name: self._move(t, extra_info, load=False) for t in transfers}

    def _move(self, t: Any, extra_info: Any, load: bool) -> list[bool]:
        keys = list(t.keys or [])
        ok = [False] * len(keys)
        side = self._side.get(str(t.name))
        if not load and isinstance(side, SidePool) and side.replicated and not self.writer:
            return [True] * len(keys)                      # a replicated pool: one rank writes it
        found = self._pool(t.name)
        if found is None or not keys or t.host_indices is None:
            return ok
        side, ns = found
        try:
            pages = page_views(side.pool, side.geometry, side.bufs, t.host_indices, len(keys))
            step, ctx = ns.client.max_keys, self._context(ns, extra_info)
            for start in range(0, len(keys), step):
                part = [page_key(k) for k in keys[start:start + step]]
                if load:
                    n = self._load(ns, part, pages[start:start + step], ctx)
                    ok[start:start + n] = [True] * n
                    if n < len(part):
                        break
                else:
                    ok[start:start + len(part)] = self._store(ns, part, pages[start:start + step], ctx)
        except Exception as e:  # noqa: BLE001
            self._failed(e)
        return ok


def held(ns: Namespace, kv_keys: list[bytes]) -> list[bool]:
    """Which keys the daemon holds, each on its own (one round trip where the client has `held`)."""
    if not kv_keys:
        return []
    if hasattr(ns, "held"):
        return list(ns.held(kv_keys))
    return [ns.lookup([k]) == 1 for k in kv_keys]
