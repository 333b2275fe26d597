"""Base and residual blocks of LoRA agents (ForkKV §5.1–5.2), from the client's side.

A `Pair` is a base namespace (role `base`: the base model's projections, keyed by tokens alone, shared by every
adapter) and one adapter's residual namespace (role `residual`: its down-projection `xA`, rank-r wide) over the same
block hashes. Each part is put on its own (`pair.base.put`, `pair.residual.put`); a lookup or an acquire of the pair
is one request that answers both prefixes, so an engine sees a partial hit — the residual outlived its base — and
recomputes only the base there.

How the parts are combined is the engine's (ForkKV's ResidualAttention kernel; `connectors/forkkv_reference.py`
rebuilds K and V in plain torch): kvstore stores the shape, it does not run it.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstore.client.blocks import Lease, Namespace
from kvstore.client.hints import ContextLike, context_fields
from kvstore.protocol.keys import pack_keys

if TYPE_CHECKING:
    from kvstore.client.connection import Client


@dataclass(frozen=True, slots=True)
class PairHit:
    """The prefixes of one pair lookup, in blocks: any tier's, and the host pool's."""
    base: int
    residual: int
    base_host: int
    residual_host: int

    @property
    def full(self) -> int:
        """Blocks usable as they are: both parts present."""
        return min(self.base, self.residual)

    @property
    def base_only_missing(self) -> int:
        """Blocks past the base prefix whose residual survived: recompute the base there, keep the residual."""
        return max(0, self.residual - self.base)


@dataclass(frozen=True, slots=True)
class ForkView:
    """What a forked agent starts from: the inherited base prefix (`base`, `host` of it in the host pool), its own
    residual prefix (`residual`) and its parent's (`parent`, None without one)."""
    base: int
    host: int
    residual: int
    parent: int | None


class Pair:
    """A base namespace and one adapter's residual namespace, on one client."""

    def __init__(self, base: Namespace, residual: Namespace) -> None:
        self.base = base
        self.residual = residual
        self.client: Client = base.client

    def lookup(self, hashes: Sequence[bytes], context: ContextLike = None) -> PairHit:
        """Both prefixes in one round trip (at most the client's max_keys blocks)."""
        r = self.client.call("lookup", ns=self.base.id, residual=self.residual.id, keys=self._keys(hashes),
                             **context_fields(context))
        return PairHit(r["n"], r["residual"]["n"], r["host"], r["residual"]["host"])

    def acquire(self, hashes: Sequence[bytes], lane: str = "critical",
                context: ContextLike = None) -> tuple[Lease, Lease]:
        """Pin both prefixes in one request: (base lease, residual lease); each may be shorter than the other."""
        r = self.client.call("acquire", ns=self.base.id, residual=self.residual.id, keys=self._keys(hashes),
                             lane=lane, **context_fields(context))
        return Lease(self.base, r["slots"], r.get("crcs")), Lease(self.residual, r["residual"]["slots"],
                                                                    r["residual"].get("crcs"))

    def get(self, hashes: Sequence[bytes], base_outs: Sequence[Any], residual_outs: Sequence[Any],
            batch: int = 32, lane: str = "critical", context: ContextLike = None) -> tuple[int, int]:
        """Load both verified prefixes (copies checked against their writers' CRC-32C): (base blocks, residual
        blocks). Each prefix ends at its first missing or failing block; the other goes on without it."""
        if not len(hashes) == len(base_outs) == len(residual_outs):
            raise ValueError(f"{len(hashes)} hashes, {len(base_outs)} base and {len(residual_outs)} residual "
                             "output buffers")
        got = [0, 0]
        leases: list[Lease] = []
        try:
            for i in range(0, len(hashes), batch):
                base, res = self.acquire(hashes[i:i + batch], lane, context)
                leases += [base, res]
                asked = len(hashes[i:i + batch])
                for k, (lease, outs) in enumerate(((base, base_outs), (res, residual_outs))):
                    if got[k] == i:                    # this part's prefix still runs
                        got[k] += lease.read_verified(outs[i:i + len(lease)])
                if got[0] < i + asked and got[1] < i + asked:
                    break
        finally:
            for lease in reversed(leases):
                lease.release()
        return got[0], got[1]

    def fork(self, hashes: Sequence[bytes], parent: Namespace | None = None) -> ForkView:
        """This pair's adapter forks the context `hashes` (from `parent`'s residual namespace, if named): it
        inherits the base blocks by reference; what it answers is what the agent must still compute."""
        return self.client.fork(self.base, self.residual, hashes, parent)

    def _keys(self, hashes: Sequence[bytes]) -> bytes:
        keys = pack_keys(hashes)
        if len(hashes) > self.client.max_keys:
            raise ValueError(f"a pair request takes at most {self.client.max_keys} blocks at a time")
        return keys
