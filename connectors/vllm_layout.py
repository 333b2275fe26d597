"""Helpers of the vLLM connector that do not depend on vLLM's connector interface: the block geometry, page layout
and namespace derived from the engine's configuration. The link to the daemon (lazy connect, one log line per
outage, retry later) is `daemon_link.py`; the page movers, which copy Layer Blocks between the engine's KV pages and
the daemon's slots, are in `kv_pages.py`.

Kept apart from `vllm_connector.py` so that the connector stays thin and these parts can be read (and tested) alone.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from kvstore.protocol.geometry import Geometry
from kvstore.protocol.keys import NamespaceSpec

# torch dtype name -> kvstore Geometry dtype
TORCH_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16",
                "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2", "int8": "int8", "uint8": "uint8"}

# The page of one block of one layer in vLLM 0.32 is a logical [heads, tokens, 2*dim] (K then V in the last dim),
# laid out by the KV cache layout the engine core resolves (KVCacheLayout: a permutation of [L, B, H, N, C]). The
# slot keeps the page's bytes in memory order, so the namespace names that order: the layout's H, N and C in their
# physical order, e.g. LBHNC and BLHNC (cross-layer) give "heads,tokens,2*dim", LBNHC gives "tokens,heads,2*dim".
PAGE_DIMS = {"H": "heads", "N": "tokens", "C": "2*dim"}
CPU_LAYOUT = "vllm-cpu:heads,tokens,2*dim"      # what the CPU build resolves (LBHNC)


def page_layout(device: str, kv_cache_layout: str | None) -> str:
    """The namespace's layout name for an engine on `device` whose KV cache layout is `kv_cache_layout` (the name
    of a vLLM KVCacheLayout; None where the engine does not say, taken as LBHNC)."""
    name = (kv_cache_layout or "LBHNC").upper()
    if sorted(name) != sorted("LBHNC"):
        raise ValueError(f"KV cache layout {kv_cache_layout!r} is not a permutation of L, B, H, N, C")
    return f"vllm-{device}:" + ",".join(PAGE_DIMS[d] for d in name if d in PAGE_DIMS)


def layout_of_pages(device: str, page_order: tuple[int, ...]) -> str:
    """The layout name that a tensor's page order (LayerPages.page_order over [heads, tokens, C]) stands for."""
    names = ("heads", "tokens", "2*dim")
    full = list(page_order) + [d for d in range(3) if d not in page_order]   # size-1 dims carry no order
    return f"vllm-{device}:" + ",".join(names[d] for d in full)


def layer_order(layer_names: Sequence[str]) -> list[str]:
    """Attention layers in model order (by the number in their name, e.g. model.layers.3.self_attn.attn)."""
    def index(name: str) -> tuple[int, str]:
        nums = re.findall(r"\.(\d+)\.", f".{name}.")
        return (int(nums[0]) if nums else 1 << 30, name)
    return sorted(layer_names, key=index)


def torch_dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def engine_identity(vllm_config: Any, kv_cache_config: Any, extra: dict[str, Any]) -> tuple[Geometry, dict[str, Any]]:
    """The block geometry and the namespace fields (except the adapter) of this engine, computed the same way by the
    scheduler and the worker from the configuration alone. Raises ValueError when the engine's KV cannot be stored
    (several KV cache groups, a non-attention spec, an unsupported dtype)."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(f"{len(groups)} KV cache groups (hybrid or sliding-window models) are not supported yet")
    spec = groups[0].kv_cache_spec
    for attr in ("num_kv_heads", "head_size", "dtype", "block_size"):
        if not hasattr(spec, attr):
            raise ValueError(f"KV cache spec {type(spec).__name__} is not an attention spec")
    if getattr(spec, "head_size_v", spec.head_size) not in (None, spec.head_size):
        raise ValueError("K and V head sizes differ")
    dtype = TORCH_DTYPES.get(torch_dtype_name(spec.dtype))
    if dtype is None:
        raise ValueError(f"KV dtype {spec.dtype} is not supported")
    device = str(getattr(vllm_config.device_config, "device_type", "cpu") or "cpu")
    resolved = getattr(kv_cache_config, "kv_cache_layout", None) or \
        getattr(vllm_config.cache_config, "kv_cache_layout", None)
    layout = page_layout(device, resolved)
    geometry = Geometry(layers=len(groups[0].layer_names), tokens=int(spec.block_size),
                        kv_heads=int(spec.num_kv_heads), head_dim=int(spec.head_size), dtype=dtype, kv=2,
                        layout=layout)
    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    algo = str(cache.prefix_caching_hash_algo)
    # Everything else that changes the bytes of a page or the meaning of a block hash goes into the salt: the hash
    # algorithm (keys of two algorithms never meet), the KV quantisation, the pipeline stage (its layers).
    salt = "|".join([f"hash={algo}", f"kv_quant={getattr(spec, 'kv_quant_mode', 'none')}",
                     f"cache_dtype={cache.cache_dtype}", f"pp={parallel.pipeline_parallel_size}",
                     f"revision={model_config.revision or ''}", str(extra.get("salt", ""))])
    fields = {"model": str(extra.get("model") or model_config.model)[:256], "group": str(extra.get("group", "")),
              "tp_size": int(parallel.tensor_parallel_size), "salt": salt[:256], "hash_algo": algo}
    return geometry, fields


def make_spec(geometry: Geometry, fields: dict[str, Any], tp_rank: int, adapter: str) -> NamespaceSpec:
    return NamespaceSpec(model=fields["model"], geometry=geometry, group=fields["group"], adapter=adapter[:256],
                         tp_rank=tp_rank, tp_size=fields["tp_size"], salt=fields["salt"])
