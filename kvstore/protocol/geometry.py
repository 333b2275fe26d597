"""Block geometry: how many bytes one block of tokens takes, layer by layer.

A Full Block is block-major: layer 0's bytes, then layer 1's, ... (DualPath §4.1). Layer Block i is the i-th
contiguous `layer_bytes` slice of it, so writing the layers one by one into a slot yields the Full Block with no
re-layout. Within a layer the bytes are the engine's own page, in the engine's layout (`layout` names it and is part
of the namespace); kvstore never transposes them. `typed_view` is a convenience for tests and tools.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

# itemsize of every dtype an engine may hand us; numpy has no bfloat16/fp8, so typed views use same-width ints.
DTYPES: dict[str, tuple[int, str]] = {
    "float32": (4, "float32"),
    "float16": (2, "float16"),
    "bfloat16": (2, "uint16"),
    "float8_e4m3fn": (1, "uint8"),
    "float8_e5m2": (1, "uint8"),
    "int8": (1, "int8"),
    "uint8": (1, "uint8"),
}
MAX_FULL_BYTES = 1 << 30


class GeometryError(ValueError):
    """A geometry field is missing, unknown or out of bounds; the message names it."""
LAYOUT_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.,:*")


@dataclass(frozen=True, slots=True)
class Geometry:
    """One block of `tokens` tokens across `layers` layers; `kv` is 2 for K and V, 1 for a single latent (MLA).

    `layout` names the engine's page layout within a layer (e.g. "kv,tokens,heads,dim" — the default, for which
    typed views are shaped — or "vllm-cpu:heads,tokens,2*dim"); bytes of two layouts never mix.
    """

    layers: int
    tokens: int
    kv_heads: int
    head_dim: int
    dtype: str = "float16"
    kv: int = 2
    layout: str = "kv,tokens,heads,dim"

    def __post_init__(self) -> None:
        for name, lo, hi in (("layers", 1, 4096), ("tokens", 1, 1 << 16), ("kv_heads", 1, 4096),
                             ("head_dim", 1, 1 << 16)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise GeometryError(f"geometry.{name} must be an integer in {lo}..{hi}, got {v!r}")
        if not isinstance(self.dtype, str) or self.dtype not in DTYPES:
            raise GeometryError(f"geometry.dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if isinstance(self.kv, bool) or not isinstance(self.kv, int) or self.kv not in (1, 2):
            raise GeometryError(f"geometry.kv must be 2 (K and V) or 1 (one latent), got {self.kv!r}")
        if not isinstance(self.layout, str) or not 1 <= len(self.layout) <= 64 or set(self.layout) - LAYOUT_CHARS:
            raise GeometryError(f"geometry.layout must be 1..64 characters of [A-Za-z0-9_-.,:*], got {self.layout!r}")
        if self.full_bytes > MAX_FULL_BYTES:
            raise GeometryError(f"geometry gives {self.full_bytes} bytes per block, above the 1 GiB limit")

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][0]

    @property
    def layer_bytes(self) -> int:
        return self.kv * self.tokens * self.kv_heads * self.head_dim * self.itemsize

    @property
    def full_bytes(self) -> int:
        return self.layers * self.layer_bytes

    def layer_range(self, layer: int) -> tuple[int, int]:
        """Byte range [start, end) of Layer Block `layer` inside a Full Block."""
        if not 0 <= layer < self.layers:
            raise IndexError(f"layer {layer} outside 0..{self.layers - 1}")
        return layer * self.layer_bytes, (layer + 1) * self.layer_bytes

    def typed_view(self, buf: Any) -> np.ndarray:
        """A Full Block's bytes as [layers, kv, tokens, heads, dim] (flat per layer for other layouts)."""
        arr = np.frombuffer(buf, dtype=DTYPES[self.dtype][1], count=self.full_bytes // self.itemsize)
        if self.layout == "kv,tokens,heads,dim":
            return arr.reshape(self.layers, self.kv, self.tokens, self.kv_heads, self.head_dim)
        return arr.reshape(self.layers, -1)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> Geometry:
        if not isinstance(d, dict):
            raise GeometryError("geometry must be a mapping")
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise GeometryError(f"geometry has unknown fields: {', '.join(sorted(map(str, unknown)))}")
        missing = {"layers", "tokens", "kv_heads", "head_dim"} - set(d)
        if missing:
            raise GeometryError(f"geometry is missing: {', '.join(sorted(missing))}")
        return cls(**d)
