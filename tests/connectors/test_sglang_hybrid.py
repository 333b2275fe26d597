"""The SGLang backend's v2 interface for hybrid models (connectors/sglang_hybrid.py) against a real daemon.

SGLang's real pools are built on the CPU: a full-attention `MHATokenToKVPool` with its `MHATokenToKVPoolHost` (the
anchor), a sliding-window one (a second MHA pool of its own geometry, as `build_hybrid_swa_group` pairs them) and a
Mamba2 state pool (`MambaPool` with its `MambaPoolHost`, one state per page). They are registered in a real
`HostPoolGroup` and handed to the backend as SGLang's `HybridCacheController.attach_storage_backend` does:
`register_mem_pool_host(anchor)`, `register_mem_host_pool_v2(pool, name)` for every entry, then
`on_host_pools_registered()`. The full-attention pages move by the v1 calls, the side pools by the v2 calls,
with `PoolTransfer`s shaped like the controller's (trailing keys, placeholder keys at query time). Runs in
.venv-sglang (tests/setup_sglang_env.sh); skipped elsewhere.
"""
from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest

from tests.conftest import DaemonProc
from tests.engine_guard import engine_missing

pytestmark = pytest.mark.sglang

try:
    import torch
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolHitPolicy, PoolName, PoolTransfer
    from sglang.srt.mem_cache.memory_pool import MambaPool, MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
except Exception as e:  # noqa: BLE001 - any import failure means: no SGLang here
    engine_missing("sglang", e)

from kvstore.client import Namespace  # noqa: E402
from kvstore.connectors.sglang_backend import KVStoreHiCache, page_key  # noqa: E402 - needs SGLang

PAGE = 4
TRAIL, ALL = PoolHitPolicy.TRAILING_PAGES, PoolHitPolicy.ALL_PAGES


def mha_pair(head_dim: int) -> tuple[Any, Any]:
    dev = MHATokenToKVPool(size=64, page_size=PAGE, dtype=torch.float32, head_num=2, head_dim=head_dim, layer_num=2,
                           device="cpu", enable_memory_saver=False, start_layer=0, end_layer=2)
    host = MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, "layer_first",
                                pin_memory=False, device="cpu", device_capacity_tokens=64, start_layer=0, end_layer=2)
    return dev, host


def mamba_pair() -> tuple[Any, Any]:
    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=32, n_groups=1, num_heads=4, head_dim=8,
                                    state_size=16, conv_kernel=4)
    params = Mamba2CacheParams(shape=shape, layers=[1, 3],
                               dtype=Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32))
    dev = MambaPool(size=8, spec_state_size=0, cache_params=params, mamba_layer_ids=[1, 3], device="cpu")
    host = MambaPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, device_capacity=8, pin_memory=False,
                         device="cpu", layout="page_first")
    return dev, host


def group(side: str, swa_head_dim: int = 16) -> Any:
    """A real HostPoolGroup: full-attention anchor + one side pool ("swa" or "mamba")."""
    kv_dev, kv_host = mha_pair(32)
    entries = [PoolEntry(name=PoolName.KV, host_pool=kv_host, device_pool=kv_dev, layer_mapper=lambda i: i,
                         is_primary_index_anchor=True)]
    dev, host = mha_pair(swa_head_dim) if side == "swa" else mamba_pair()
    entries.append(PoolEntry(name=PoolName.SWA if side == "swa" else PoolName.MAMBA, host_pool=host, device_pool=dev,
                             layer_mapper=lambda i: i))
    g = HostPoolGroup(entries)
    for e in g.entries:                                  # random bytes in every buffer of every pool
        bufs = e.host_pool.kv_buffer if isinstance(e.host_pool.kv_buffer, list) else [e.host_pool.kv_buffer]
        for i, t in enumerate(bufs):
            flat = t.reshape(-1).view(torch.uint8)
            flat.copy_(torch.from_numpy(np.random.default_rng(i + 7 * len(side)).integers(0, 256, flat.numel(),
                                                                                            dtype=np.uint8)))
    return g


def attach(daemon: DaemonProc, g: Any, **extra: Any) -> KVStoreHiCache:
    """The backend as HybridCacheController.attach_storage_backend registers it."""
    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                               model_name="tiny-hybrid",
                               extra_config={"socket": daemon.socket, "interface_v1": 1, "retry_s": 0.2, **extra})
    b = KVStoreHiCache(cfg, {})
    b.register_mem_pool_host(g.anchor_entry.host_pool)
    for e in g.entries:
        b.register_mem_host_pool_v2(e.host_pool, e.name)
    b.on_host_pools_registered()
    return b


def keys(n: int, tag: str) -> list[str]:
    return [hashlib.sha256(f"{tag}{i}".encode()).hexdigest() for i in range(n)]


def pages(pool: Any, idx: torch.Tensor, n: int) -> list[bytes]:
    step = int(pool.page_size)
    return [pool.get_data_page(int(idx[i * step]), flat=True).contiguous().view(torch.uint8).numpy().tobytes()
            for i in range(n)]


def query(b: KVStoreHiCache, ks: list[str], name: Any, policy: Any, n: int) -> tuple[int, list[int], dict]:
    """batch_exists_v2 as the controller asks it at prefetch: placeholder keys give the trailing page count."""
    r = b.batch_exists_v2(ks, [PoolTransfer(name=name, keys=["__placeholder__"] * n, hit_policy=policy)])
    return r.kv_hit_pages, r.restorable_prefix_pages, r.extra_pool_hit_pages


def side_ns(daemon: DaemonProc, b: KVStoreHiCache, name: str) -> tuple[Any, Namespace]:
    c = daemon.client()
    return c, c.namespace(b._specs[f"sglang-pool:{name}"])


def store_swa(daemon: DaemonProc, tag: str) -> tuple[Any, KVStoreHiCache, list[str], torch.Tensor, torch.Tensor]:
    """6 full-attention pages, and the window pages of two request ends (pages 0-1 and 4-5) in the SWA pool."""
    g = group("swa")
    a = attach(daemon, g)
    ks = keys(6, tag)
    kv, swa = g.get_pool(PoolName.KV), g.get_pool(PoolName.SWA)
    kv_src, swa_src = kv.alloc(6 * PAGE), swa.alloc(6 * PAGE)
    assert a.batch_set_v1(ks, kv_src) == [True] * 6
    for lo in (0, 4):
        t = PoolTransfer(name=PoolName.SWA, host_indices=swa_src[lo * PAGE:(lo + 2) * PAGE], keys=ks[lo:lo + 2],
                         hit_policy=TRAIL)
        assert a.batch_set_v2([t]) == {PoolName.SWA: [True, True]}
    return g, a, ks, kv_src, swa_src


def test_swa_pages_round_trip_and_hits_follow_the_window(daemon):
    g, a, ks, kv_src, swa_src = store_swa(daemon, "swa")
    # a fresh backend over fresh pools: the usable ends are where the 2-page window is stored
    g2 = group("swa")
    b = attach(daemon, g2)
    assert query(b, ks, PoolName.SWA, TRAIL, 2) == (6, [1, 2, 6], {PoolName.KV: 6, PoolName.SWA: 6})
    assert query(b, ks, PoolName.SWA, ALL, 0)[:2] == (2, [1, 2])          # all_pages: the leading run only
    assert query(b, ks, PoolName.KV, ALL, 0)[:2] == (6, list(range(1, 7)))  # the anchor named: the v1 pages
    assert query(b, ks[:5], PoolName.SWA, TRAIL, 2)[:2] == (2, [1, 2])    # a prefix ending at 5: window 3-4 absent
    assert query(b, ks, PoolName.SWA, TRAIL, 3)[:2] == (2, [1, 2])        # a wider window is not there at 6

    # the load: KV by v1, the window by v2, byte for byte
    kv2, swa2 = g2.get_pool(PoolName.KV), g2.get_pool(PoolName.SWA)
    kv_dst, swa_dst = kv2.alloc(6 * PAGE), swa2.alloc(2 * PAGE)
    assert b.batch_get_v1(ks, kv_dst) == [True] * 6
    got = b.batch_get_v2([PoolTransfer(name=PoolName.SWA, host_indices=swa_dst, keys=ks[4:6], hit_policy=TRAIL)])
    assert got == {PoolName.SWA: [True, True]}
    assert pages(kv2, kv_dst, 6) == pages(g.get_pool(PoolName.KV), kv_src, 6)
    assert pages(swa2, swa_dst, 2) == pages(g.get_pool(PoolName.SWA), swa_src[4 * PAGE:], 2)
    # a window with a missing page loads its leading present pages only
    got = b.batch_get_v2([PoolTransfer(name=PoolName.SWA, host_indices=swa_dst, keys=ks[1:3], hit_policy=TRAIL)])
    assert got == {PoolName.SWA: [True, False]}

    # deleting a trailing SWA page of the longest end shrinks the hit to the next end that is whole
    c, ns = side_ns(daemon, b, "swa")
    assert ns.delete([page_key(ks[5])]) == 1
    assert query(b, ks, PoolName.SWA, TRAIL, 2)[:2] == (2, [1, 2])
    assert ns.delete([page_key(ks[0])]) == 1
    assert query(b, ks, PoolName.SWA, TRAIL, 2)[:2] == (0, [])            # never a hit with the window missing
    c.close()
    for x in (a, b):
        x.close()


def test_mamba_states_round_trip_and_a_missing_state_is_never_a_hit(daemon):
    g = group("mamba")
    a = attach(daemon, g)
    ks = keys(6, "mamba")
    kv, mamba = g.get_pool(PoolName.KV), g.get_pool(PoolName.MAMBA)
    kv_src, states = kv.alloc(6 * PAGE), mamba.alloc(2)
    assert a.batch_set_v1(ks, kv_src) == [True] * 6
    for i, end in enumerate((3, 6)):                     # one state per request end, under its last page's hash
        t = PoolTransfer(name=PoolName.MAMBA, host_indices=states[i:i + 1], keys=[ks[end - 1]], hit_policy=TRAIL)
        assert a.batch_set_v2([t]) == {PoolName.MAMBA: [True]}

    g2 = group("mamba")
    b = attach(daemon, g2)
    assert query(b, ks, PoolName.MAMBA, TRAIL, 1) == (6, [3, 6], {PoolName.KV: 6, PoolName.MAMBA: 6})
    assert query(b, ks[:5], PoolName.MAMBA, TRAIL, 1)[:2] == (3, [3])     # the state at 5 was never saved
    slot = g2.get_pool(PoolName.MAMBA).alloc(1)
    got = b.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=slot, keys=[ks[5]], hit_policy=TRAIL)])
    assert got == {PoolName.MAMBA: [True]}
    assert pages(g2.get_pool(PoolName.MAMBA), slot, 1) == pages(mamba, states[1:], 1)
    assert pages(mamba, states[1:], 1) != pages(mamba, states[:1], 1)

    # delete the state at 6: the hit falls back to 3; delete that one too: no hit, though all KV pages are there
    c, ns = side_ns(daemon, b, "mamba")
    assert ns.delete([page_key(ks[5])]) == 1
    assert query(b, ks, PoolName.MAMBA, TRAIL, 1)[:2] == (3, [3])
    assert ns.delete([page_key(ks[2])]) == 1
    assert query(b, ks, PoolName.MAMBA, TRAIL, 1)[:2] == (0, [])
    assert b.batch_exists(ks) == 6                                        # v1 (no side pool asked) is unchanged
    c.close()
    with daemon.client() as cl:
        layouts = {(r["geometry"]["layout"], r["geometry"]["dtype"], r["blocks"]) for r in cl.list()["namespaces"]}
    assert ("sglang-mamba:temporal,conv", "uint8", 0) in layouts                  # both states deleted
    for x in (a, b):
        x.close()


def test_pools_that_cannot_be_checked_give_no_hit(daemon, monkeypatch):
    g, a, ks, _, _ = store_swa(daemon, "unk")
    assert query(a, ks, PoolName.SWA, TRAIL, 2)[0] == 6
    assert query(a, ks, PoolName.INDEXER, ALL, 0) == (0, [], {PoolName.KV: 6})      # never registered
    assert query(a, ks, PoolName.SWA, PoolHitPolicy.BLOCK_GROUPS, 1)[:2] == (0, [])  # a policy we do not serve
    t = PoolTransfer(name=PoolName.INDEXER, host_indices=torch.arange(PAGE), keys=ks[:1])
    assert a.batch_get_v2([t]) == {PoolName.INDEXER: [False]} and a.batch_set_v2([t]) == {PoolName.INDEXER: [False]}

    # a state pool this backend cannot store (slot side states) is registered as such: no hit, no write
    gm = group("mamba")
    monkeypatch.setattr(gm.get_pool(PoolName.MAMBA), "slot_state_device_tensors", [torch.zeros(9, 2)], raising=False)
    m = attach(daemon, gm)
    assert m.batch_set_v1(ks, gm.get_pool(PoolName.KV).alloc(6 * PAGE)) == [True] * 6
    assert query(m, ks, PoolName.MAMBA, TRAIL, 1)[:2] == (0, [])
    t = PoolTransfer(name=PoolName.MAMBA, host_indices=torch.arange(1), keys=ks[-1:], hit_policy=TRAIL)
    assert m.batch_set_v2([t]) == {PoolName.MAMBA: [False]}

    # the daemon away: misses, not exceptions
    daemon.stop()
    assert query(a, ks, PoolName.SWA, TRAIL, 2)[:2] == (0, [])
    assert a.batch_get_v2([PoolTransfer(name=PoolName.SWA, host_indices=torch.arange(PAGE), keys=ks[:1])]) == {
        PoolName.SWA: [False]}
    for x in (a, m):
        x.close()


def test_side_pool_of_the_anchors_geometry_keeps_its_own_keys_and_client_without_held(daemon, monkeypatch):
    g = group("swa", swa_head_dim=32)                    # the SWA pool's pages are as wide as the anchor's
    a = attach(daemon, g)
    ks = keys(3, "same")
    assert a.batch_set_v1(ks, g.get_pool(PoolName.KV).alloc(3 * PAGE)) == [True] * 3
    assert query(a, ks, PoolName.SWA, ALL, 0)[:2] == (0, [])              # the KV pages are not the SWA pool's
    t = PoolTransfer(name=PoolName.SWA, host_indices=g.get_pool(PoolName.SWA).alloc(PAGE), keys=ks[2:],
                     hit_policy=TRAIL)
    assert a.batch_set_v2([t]) == {PoolName.SWA: [True]}
    want = query(a, ks, PoolName.SWA, TRAIL, 1)
    assert want[:2] == (3, [3])
    monkeypatch.delattr(Namespace, "held")               # an older client: one lookup per key, the same answer
    assert query(a, ks, PoolName.SWA, TRAIL, 1) == want
    a.close()
