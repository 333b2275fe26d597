"""Helpers of the vLLM connector that do not depend on vLLM's connector interface: the block geometry, page layout
and namespace derived from the engine's configuration. The link to the daemon (lazy connect, one log line per
outage, retry later) is `daemon_link.py`; the page movers, which copy Layer Blocks between the engine's KV pages and
the daemon's slots, are in `kv_pages.py`.

Kept apart from `vllm_connector.py` so that the connector stays thin and these parts can be read (and tested) alone.
"""
from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvstore.connectors.kv_groups import FULL, STATE, WINDOW, GroupRule
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


@dataclass(frozen=True)
class KVGroup:
    """One of the engine's KV cache groups as kvstore stores it: its rule (kv_groups), its geometry (one Layer
    Block per layer of the group, in model order), its layers, and its index among vLLM's groups."""
    index: int
    rule: GroupRule
    geometry: Geometry
    layer_names: tuple[str, ...]
    label: str                    # in the namespace's salt: "" for a model with one group (its namespace as ever)


def _attention_geometry(spec: Any, layers: int, layout: str) -> Geometry:
    for attr in ("num_kv_heads", "head_size", "dtype", "block_size"):
        if not hasattr(spec, attr):
            raise ValueError(f"KV cache spec {type(spec).__name__} is not an attention spec")
    if getattr(spec, "head_size_v", spec.head_size) not in (None, spec.head_size):
        raise ValueError("K and V head sizes differ")
    dtype = TORCH_DTYPES.get(torch_dtype_name(spec.dtype))
    if dtype is None:
        raise ValueError(f"KV dtype {spec.dtype} is not supported")
    kv = 1 if "MLA" in type(spec).__name__ else 2
    return Geometry(layers=layers, tokens=int(spec.block_size), kv_heads=int(spec.num_kv_heads),
                    head_dim=int(spec.head_size), dtype=dtype, kv=kv, layout=layout)


def _group_rule(spec: Any, hash_block: int) -> tuple[GroupRule, str]:
    """The kv_groups rule of a vLLM KV cache spec, and the label that names it; ValueError for a spec kvstore does
    not restore exactly (named in the message)."""
    kind = type(spec).__name__
    block = int(spec.block_size)
    if block != hash_block:
        raise ValueError(f"KV cache group {kind} has blocks of {block} tokens, the block hashes {hash_block}")
    if kind in ("FullAttentionSpec", "MLAAttentionSpec"):
        return GroupRule(FULL), "full"
    if kind in ("SlidingWindowSpec", "SlidingWindowMLASpec"):
        window = int(spec.sliding_window)
        if getattr(spec, "extra_retained_tokens", 0):
            raise ValueError("sliding-window groups with extra retained tokens (multi-token speculative decoding)")
        return GroupRule(WINDOW, -(-(window - 1) // block)), f"window{window}"
    if kind == "MambaSpec":
        mode = str(getattr(spec, "mamba_cache_mode", "none"))
        if mode != "align":
            raise ValueError(f"a Mamba group with mamba_cache_mode {mode!r} (kvstore restores states at block "
                             f"ends: use --mamba-cache-mode align)")
        if getattr(spec, "num_speculative_blocks", 0):
            raise ValueError("a Mamba group with speculative blocks")
        return GroupRule(STATE), "state"
    raise ValueError(f"KV cache spec {kind} is not one kvstore stores (full, sliding-window, Mamba)")


def kv_groups(vllm_config: Any, kv_cache_config: Any, layout: str) -> list[KVGroup]:
    """The engine's prefix-cacheable KV cache groups as kvstore stores them (vLLM restores the other groups
    itself after a load). Raises ValueError where one of them cannot be restored exactly, so that the connector
    serves no hit rather than a wrong one."""
    groups = list(kv_cache_config.kv_cache_groups)
    cacheable = getattr(kv_cache_config, "prefix_cacheable_group_ids", tuple(range(len(groups))))
    hash_block = int(getattr(kv_cache_config, "hash_block_size", None) or vllm_config.cache_config.block_size)
    out = []
    for i in cacheable:
        spec = groups[i].kv_cache_spec
        rule, label = _group_rule(spec, hash_block)
        names = tuple(layer_order(list(groups[i].layer_names)))
        if rule.kind == STATE:
            geometry = state_geometry(spec, len(names))
        else:
            geometry = _attention_geometry(spec, len(names), layout)
        out.append(KVGroup(i, rule, geometry, names, label))
    if not out:
        raise ValueError("no KV cache group is prefix-cacheable")
    if len(groups) == 1:
        return [replace(out[0], label="")]
    return [replace(g, label=f"{g.index}:{g.label}") for g in out]


def state_geometry(spec: Any, layers: int) -> Geometry:
    """A recurrent-state page (Mamba: its conv and SSM states, one page per block and layer) as a byte geometry:
    the state's own bytes a layer (not the padding vLLM adds to equal an attention page: the worker gets the
    state as a byte view of that size), as uint8 (kv_heads x head_dim within the Geometry's bounds)."""
    nbytes = int(getattr(spec, "state_content_size_bytes", None) or spec.page_size_bytes)
    dim = math.gcd(nbytes, 1 << 16)
    if nbytes // dim > 4096:
        raise ValueError(f"a state page of {nbytes} bytes has no byte geometry")
    return Geometry(layers=layers, tokens=1, kv_heads=nbytes // dim, head_dim=dim, dtype="uint8", kv=1,
                    layout="vllm-state:" + ",".join(torch_dtype_name(d) for d in spec.dtypes)[:52])


def engine_identity(vllm_config: Any, kv_cache_config: Any,
                    extra: dict[str, Any]) -> tuple[list[KVGroup], dict[str, Any]]:
    """The KV groups (their geometries) and the namespace fields (except the adapter) of this engine, computed the
    same way by the scheduler and the worker from the configuration alone. Raises ValueError when the engine's KV
    cannot be stored (a group kvstore cannot restore exactly, an unsupported dtype)."""
    device = str(getattr(vllm_config.device_config, "device_type", "cpu") or "cpu")
    resolved = getattr(kv_cache_config, "kv_cache_layout", None) or \
        getattr(vllm_config.cache_config, "kv_cache_layout", None)
    groups = kv_groups(vllm_config, kv_cache_config, page_layout(device, resolved))
    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    algo = str(cache.prefix_caching_hash_algo)
    # Everything else that changes the bytes of a page or the meaning of a block hash goes into the salt: the hash
    # algorithm (keys of two algorithms never meet), the KV quantisation, the pipeline stage (its layers).
    spec = groups[0]
    quant = getattr(kv_cache_config.kv_cache_groups[spec.index].kv_cache_spec, "kv_quant_mode", "none")
    salt = "|".join([f"hash={algo}", f"kv_quant={quant}",
                     f"cache_dtype={cache.cache_dtype}", f"pp={parallel.pipeline_parallel_size}",
                     f"revision={model_config.revision or ''}", str(extra.get("salt", ""))])
    fields = {"model": str(extra.get("model") or model_config.model)[:256], "group": str(extra.get("group", "")),
              "tp_size": int(parallel.tensor_parallel_size), "salt": salt, "hash_algo": algo}
    return groups, fields


def make_spec(group: KVGroup, fields: dict[str, Any], tp_rank: int, adapter: str) -> NamespaceSpec:
    """The namespace of one KV group: a hybrid model's groups differ by their label in the salt (a model with one
    group keeps the salt it always had, and the blocks stored under it)."""
    salt = fields["salt"] + (f"|kv_group={group.label}" if group.label else "")
    return NamespaceSpec(model=fields["model"], geometry=group.geometry, group=fields["group"], adapter=adapter[:256],
                         tp_rank=tp_rank, tp_size=fields["tp_size"], salt=salt[:256])
