"""Namespaces and block keys.

A key is (namespace, block hash). The namespace is the digest of everything that makes KV bytes identical: the
KV-sharing group (by default the model; ICaRus models with a shared frozen encoder declare one group and hit each
other's prefixes), the adapter, the geometry (dtype and layout included), the tensor-parallel rank and size, the
role (base or residual, ForkKV) and an optional salt. The model name alone is not in the digest: it is the default
group. Block hashes are chained over the token prefix, so a key names a whole prefix.

On the wire every block hash is exactly 16 bytes: `block_key` folds longer engine hashes (vLLM's sha256_cbor is 32
bytes) to 128 bits with BLAKE2b, in the client, so the daemon never hashes on its hot path.
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from kvstore.protocol.geometry import Geometry

HASH_BYTES = 16
ROOT_HASH = bytes(HASH_BYTES)
ROLES = ("base", "residual")
_NAME_LIMIT = 256


@dataclass(frozen=True, slots=True)
class NamespaceSpec:
    model: str
    geometry: Geometry
    group: str = ""          # KV-sharing group; "" means the model
    adapter: str = ""        # LoRA adapter whose KV this is; "" for none
    tp_rank: int = 0
    tp_size: int = 1
    role: str = "base"
    salt: str = ""

    def __post_init__(self) -> None:
        for name in ("model", "group", "adapter", "salt"):
            v = getattr(self, name)
            if not isinstance(v, str) or len(v) > _NAME_LIMIT:
                raise ValueError(f"namespace.{name} must be a string of at most {_NAME_LIMIT} characters")
        if not self.model:
            raise ValueError("namespace.model must not be empty")
        if not isinstance(self.geometry, Geometry):
            raise ValueError("namespace.geometry must be a Geometry")
        for name in ("tp_rank", "tp_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 65535:
                raise ValueError(f"namespace.{name} must be an integer in 0..65535, got {v!r}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"namespace.tp_rank {self.tp_rank} must be below tp_size {self.tp_size}")
        if self.role not in ROLES:
            raise ValueError(f"namespace.role must be base or residual, got {self.role!r}")

    @property
    def share_group(self) -> str:
        return self.group or self.model

    def digest(self, tenant: str = "") -> bytes:
        """Stable 16-byte identity: equal digests ⇔ identical KV bytes for identical tokens, in one tenant. The
        tenant (the daemon's, kvstore.daemon.tenants) separates equal specs of different tenants; the default
        tenant "" adds nothing, so digests (and the SSD records named by them) stay as they were."""
        ident: list[object] = [self.share_group, self.adapter, sorted(self.geometry.to_dict().items()),
                               self.tp_rank, self.tp_size, self.role, self.salt]
        if tenant:
            ident.append(["tenant", tenant])
        return hashlib.blake2b(msgpack.packb(ident), digest_size=16, person=b"kvstore-ns-v1").digest()

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "group": self.group, "adapter": self.adapter, "tp_rank": self.tp_rank,
                "tp_size": self.tp_size, "role": self.role, "salt": self.salt, "geometry": self.geometry.to_dict()}

    @classmethod
    def from_dict(cls, d: Any) -> NamespaceSpec:
        if not isinstance(d, dict):
            raise ValueError("namespace must be a mapping")
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"namespace has unknown fields: {', '.join(sorted(map(str, unknown)))}")
        if "model" not in d or "geometry" not in d:
            raise ValueError("namespace needs model and geometry")
        return cls(**{**d, "geometry": Geometry.from_dict(d["geometry"])})


def block_key(h: bytes) -> bytes:
    """An engine's block hash (16..64 bytes) as a 16-byte key hash; 16-byte hashes pass through unchanged."""
    if not isinstance(h, (bytes, bytearray)) or not HASH_BYTES <= len(h) <= 64:
        raise ValueError(f"a block hash must be 16..64 bytes (at least 128 bits), got {type(h).__name__} "
                         f"of length {len(h) if isinstance(h, (bytes, bytearray)) else '?'}")
    if len(h) == HASH_BYTES:
        return bytes(h)
    return hashlib.blake2b(h, digest_size=HASH_BYTES).digest()


def pack_keys(hashes: Sequence[bytes]) -> bytes:
    """Hashes as one wire blob of 16 bytes each (what every batched op carries)."""
    if set(map(len, hashes)) <= {HASH_BYTES}:      # the common case, 16-byte hashes: no call per hash
        blob = b"".join(hashes)
        if len(blob) == HASH_BYTES * len(hashes):
            return blob
    return b"".join(block_key(h) for h in hashes)


def chain_hashes(tokens: Sequence[int], block_tokens: int, parent: bytes = ROOT_HASH) -> list[bytes]:
    """Chained 128-bit hashes of every full block of `tokens`: h_i = H(h_{i-1} || tokens of block i).

    A trailing partial block gets no hash: only full blocks are stored.
    """
    if block_tokens <= 0:
        raise ValueError("block_tokens must be positive")
    out = []
    h = parent
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        chunk = array("q", tokens[start:start + block_tokens]).tobytes()
        h = hashlib.blake2b(h + chunk, digest_size=HASH_BYTES, person=b"kvstore-blk-v1").digest()
        out.append(h)
    return out
