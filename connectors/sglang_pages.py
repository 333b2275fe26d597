"""SGLang's host pool as kvstore sees it: the page/geometry mapping and the byte movement of the HiCache backend
(`sglang_backend.KVStoreHiCache`, which owns the storage calls, the daemon link, hints and failures).

This module owns:

- keys: `page_key`, an SGLang page hash as a 16-byte kvstore key;
- the namespace: `describe_pool`, what makes a host pool's page bytes identical (model or group, tensor-parallel
  rank and size, layers, page size, heads, head dim, dtype, byte order per host layout, pipeline stage, context-
  parallel shard), or a ValueError naming what the backend cannot store; `namespace_spec` the part every pool
  shares (model or group, shard salt), also for the hybrid side pools of `sglang_hybrid.py`;
- the pool's bytes: `pool_buffers` (the pool's contiguous CPU tensors) and `page_views` (no-copy views of each
  page's pieces from the pool's own `get_page_buffer_meta`, each checked to lie inside those buffers);
- data movement: `split_slot` and `copy_checked` (a page's pieces one after another in a block's slot, copied
  either way with the CRC-32C computed in the same pass), and `to_block` / `from_block` for the older flat-page
  interface (an MHA `layer_first` flat page is [2, layers, piece]; its block is [layers, 2, piece]).

Nothing here talks to the daemon or logs; every function is pure over its arguments.
"""
from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

from kvstore.checksum import copy_crc32c
from kvstore.protocol.geometry import Geometry
from kvstore.protocol.keys import NamespaceSpec, block_key

TORCH_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16",
                "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2", "int8": "int8", "uint8": "uint8"}
# Byte order of one page as the pool's get_page_buffer_meta pieces follow each other, per host layout.
MHA_ORDER = {"layer_first": "layers,kv,tokens,heads,dim", "page_first": "kv,tokens,layers,heads,dim",
             "page_first_direct": "kv,layers,tokens,heads,dim", "page_head": "kv,heads,tokens,layers,dim"}
# MLA: layer_first and page_first_direct give the same bytes, so they share blocks.
MLA_ORDER = {"layer_first": "layers,tokens,latent", "page_first": "tokens,layers,latent",
             "page_first_direct": "layers,tokens,latent"}
KEY_SCHEME = "sglang-sha256-pages"


def page_key(key: str) -> bytes:
    """An SGLang page key as a 16-byte kvstore key: a hex hash (SHA-256) is folded to 128 bits like any long engine
    hash; any other string is hashed in its own domain, so it can never meet a hex key."""
    try:
        raw = bytes.fromhex(key)
        if 16 <= len(raw) <= 64:
            return block_key(raw)
    except (ValueError, TypeError):
        pass
    return hashlib.blake2b(str(key).encode(), digest_size=16, person=b"kvstore-sgl-key").digest()


def describe_pool(pool: Any, config: HiCacheStorageConfig, extra: dict[str, Any]) -> NamespaceSpec:
    """The namespace of a host pool's pages, or ValueError naming what this backend cannot store."""
    layout = str(getattr(pool, "layout", "?"))
    dtype = TORCH_DTYPES.get(str(getattr(pool, "dtype", "?")).removeprefix("torch."))
    if dtype is None:
        raise ValueError(f"host pool dtype {getattr(pool, 'dtype', '?')} is not supported")
    layers, tokens = int(pool.layer_num), int(pool.page_size)
    if hasattr(pool, "kv_lora_rank"):                                   # MLA: one latent per token, replicated
        if layout not in MLA_ORDER:
            raise ValueError(f"MLA host layout {layout!r} is not supported (supported: {', '.join(MLA_ORDER)})")
        order = f"sglang-mla:{MLA_ORDER[layout]}:lora{pool.kv_lora_rank},rope{pool.qk_rope_head_dim}"
        geometry = Geometry(layers=layers, tokens=tokens, kv_heads=1, head_dim=int(pool.kv_cache_dim), dtype=dtype,
                            kv=1, layout=order)
        tp_rank, tp_size = 0, 1
    else:
        if layout not in MHA_ORDER:
            raise ValueError(f"host layout {layout!r} is not supported (supported: {', '.join(MHA_ORDER)})")
        if int(getattr(pool, "v_head_dim", pool.head_dim)) != int(pool.head_dim):
            raise ValueError("K and V head dims differ")
        geometry = Geometry(layers=layers, tokens=tokens, kv_heads=int(pool.head_num), head_dim=int(pool.head_dim),
                            dtype=dtype, kv=2, layout=f"sglang:{MHA_ORDER[layout]}")
        tp_rank, tp_size = int(config.tp_rank), int(config.tp_size)
    return namespace_spec(geometry, pool, config, extra, tp_rank, tp_size)


def namespace_spec(geometry: Geometry, pool: Any, config: HiCacheStorageConfig, extra: dict[str, Any], tp_rank: int,
                   tp_size: int) -> NamespaceSpec:
    """A pool's namespace: its geometry and tensor-parallel place, the model (or group) and the shard salt."""
    shard = [f"keys={KEY_SCHEME}", f"pp={config.pp_rank}/{config.pp_size}"]
    if config.attn_cp_size > 1:
        shard.append(f"cp={config.attn_cp_rank}/{config.attn_cp_size}")
    if config.dcp_size > 1:
        shard.append(f"dcp={config.dcp_rank}/{config.dcp_size}")
    if getattr(pool, "storage_format_tag", None):
        shard.append(f"format={pool.storage_format_tag}")
    if extra.get("salt"):
        shard.append(str(extra["salt"]))
    model = str(extra.get("model") or config.model_name or "sglang")[:256]
    return NamespaceSpec(model=model, geometry=geometry, group=str(extra.get("group", ""))[:256], tp_rank=tp_rank,
                         tp_size=tp_size, salt="|".join(shard)[:256])


def bytes_of(t: Any) -> np.ndarray:
    """A flat uint8 view of a contiguous CPU tensor (no copy)."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("pages must be contiguous CPU tensors")
    return t.reshape(-1).view(torch.uint8).numpy()


def pool_buffers(pool: Any) -> list[tuple[int, int, np.ndarray]]:
    """(address, bytes, uint8 view) of every contiguous CPU tensor that holds the pool's pages."""
    found: list[tuple[int, int, np.ndarray]] = []
    for name in ("kv_buffer", "k_buffer", "v_buffer"):
        held = getattr(pool, name, None)
        for t in held if isinstance(held, (list, tuple)) else [held]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_contiguous() and t.numel():
                found.append((t.data_ptr(), t.numel() * t.element_size(), bytes_of(t)))
    if not found:
        raise ValueError(f"the host pool ({type(pool).__name__}) has no contiguous CPU buffers")
    return found


def copy_checked(slot: np.ndarray, pieces: list[np.ndarray], to_slot: bool) -> int:
    """Copy a page's pieces into its slot (or back) and return the CRC-32C of the slot's bytes, continued piece by
    piece in the same pass as the copy."""
    crc = 0
    for part, piece in split_slot(slot, pieces):
        crc = copy_crc32c(part, piece, crc=crc) if to_slot else copy_crc32c(piece, part, crc=crc)
    return crc


def split_slot(slot: np.ndarray, pieces: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    """(slot part, page piece) pairs: a page's pieces (its K and V parts per layer, as the host pool lays them out)
    lie one after another in the block's slot."""
    pairs, at = [], 0
    for piece in pieces:
        pairs.append((slot[at:at + piece.nbytes], piece))
        at += piece.nbytes
    return pairs


Legacy = tuple[int, int, int]      # a flat page's [2, layers, piece] shape, where its block orders it otherwise


def legacy_shape(geometry: Geometry, layout: str) -> Legacy | None:
    """The flat-page shape that `to_block` / `from_block` reorder (MHA `layer_first`), else None: flat = block."""
    if geometry.kv == 2 and layout == "layer_first":
        return (2, geometry.layers, geometry.layer_bytes // 2)
    return None


def to_block(flat: np.ndarray, legacy: Legacy | None) -> np.ndarray:
    """A flat page (`get_data_page(i, flat=True)`) as the bytes of its kvstore block."""
    if legacy is None:
        return flat
    return np.ascontiguousarray(flat.reshape(legacy).transpose(1, 0, 2)).reshape(-1)


def from_block(slot: np.ndarray, out: np.ndarray, legacy: Legacy | None) -> None:
    """A block's bytes copied into a flat page."""
    if legacy is None:
        np.copyto(out, slot)
    else:
        two, layers, piece = legacy
        np.copyto(out.reshape(legacy), slot.reshape(layers, two, piece).transpose(1, 0, 2))


def page_views(pool: Any, geometry: Geometry, bufs: list[tuple[int, int, np.ndarray]], host_indices: Any,
               n: int) -> list[list[np.ndarray]]:
    """Byte views of each page's pieces in the host pool (no copy), checked against the geometry."""
    page = int(getattr(pool, "logical_page_size", pool.page_size))
    if int(host_indices.numel()) != n * page:
        raise ValueError(f"{host_indices.numel()} host indices for {n} pages of {page} tokens")
    ptrs, sizes = pool.get_page_buffer_meta(host_indices)
    if len(ptrs) != len(sizes) or len(ptrs) % max(n, 1):
        raise ValueError(f"{len(ptrs)} buffer pieces for {n} pages")
    per = len(ptrs) // max(n, 1)
    pages = []
    for i in range(n):
        page_sizes = sizes[i * per:(i + 1) * per]
        if sum(page_sizes) != geometry.full_bytes:
            raise ValueError(f"wrong geometry: a page is {sum(page_sizes)} bytes, the namespace expects "
                             f"{geometry.full_bytes}")
        pages.append([piece_view(bufs, p, s) for p, s in zip(ptrs[i * per:(i + 1) * per], page_sizes)])
    return pages


def piece_view(bufs: list[tuple[int, int, np.ndarray]], ptr: int, size: int) -> np.ndarray:
    """The bytes at `ptr` (+`size`) as a view of the pool buffer that holds them, or ValueError."""
    for base, nbytes, arr in bufs:
        off = int(ptr) - base
        if 0 <= off and off + int(size) <= nbytes:
            return arr[off:off + int(size)]
    raise ValueError(f"a page piece at {ptr:#x} (+{size}) lies outside the host pool's buffers")
