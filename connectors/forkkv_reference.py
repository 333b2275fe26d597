"""A reference client for ForkKV's disaggregated KV cache (ForkKV §2.2, §5.1–5.3; issue 18 item 5), in plain torch:
a tiny Llama with LoRA adapters on the K and V projections, whose KV is split, stored through kvstore as a base
namespace and one residual namespace per adapter, read back and rebuilt. It shows the storage side; running a LoRA
engine on split KV needs the engine-side kernel ForkKV describes (ResidualAttention), which vLLM and SGLang do not
ship — `residual_attention` below is that kernel's algorithm written out in torch, for checking, not for speed.

The model (`TinyLlama`, fixed seed): embeddings → per layer RMSNorm, q/k/v projections (GQA), RoPE, causal attention,
o_proj, RMSNorm, SwiGLU MLP, each with its residual add. An `Adapter` adds LoRA on k_proj and v_proj only:
k = x(W_k + s·A_k B_k), s = alpha/r, and likewise v.

What is stored, per block of `block_tokens` tokens (keys: `chain_hashes` of the tokens, the same in both namespaces):
- **base** (role "base", adapter ""): every layer's RoPE(x̄ W_k) and x̄ W_v — geometry `base_geometry`: the model's
  own, [layers, 2, tokens, kv_heads, head_dim];
- **residual** (role "residual", adapter = the adapter's name): every layer's x A_k and x A_v, no RoPE (its width r
  does not match RoPE's) — geometry `residual_geometry`: kv_heads=1, head_dim=r, i.e. [layers, 2, tokens, 1, r],
  the rank axis where a head's dims would be. Per token that is r/n of the base (n = kv_heads·head_dim).
Both float32, so the round trip through kvstore is bit-exact. Rebuilt (§5.1, §5.3; the scaling folded into B):
K = K_base + RoPE(K_res · sB_k) at the token's absolute position, V = V_base + V_res · sB_v.

Which hidden state x is (the choice this client makes, stated because the paper leaves it to the engine): at layer
0, x is the normed embedding, the same for every adapter, and the split is exact — K equals the merged LoRA
RoPE(x(W_k + sA_k B_k)). Deeper, x depends on the adapter (its K and V change the attention output that feeds the
next layer), so one base shared by every adapter is an approximation; ForkKV says so (§3.2: "sharing bCache beyond
the first layer is mathematically lossy") and accepts it. Here:
- x̄ for the base is the *base model's* hidden state (no adapter): the base namespace is exactly the base model's
  own prefix cache, a function of the tokens alone, so any agent that recomputes a missing base block (partial
  hit) writes the same bytes — what keying the base by tokens alone needs. (ForkKV's engine instead writes the base
  from whichever agent computed the context first; its bytes beyond layer 0 then depend on that agent.)
- x for the residual is the *agent's own* hidden state, in its ForkKV forward: at each layer it attends over the
  rebuilt K and V (shared base + its residual), as ForkKV's agents do, and its xA feeds that layer's residual.
So every layer's rebuilt K and V equal this forward's K and V within float tolerance; at layer 0 they also equal
the per-adapter LoRA model's; beyond it they differ from it by the approximation the paper measures.

`ForkKVClient.prepare` is what an engine does for one agent over a context: one lookup of both prefixes, one get of
both, recompute only what is missing — the base of blocks past the base prefix (the base model's forward from the
stored base prefix), then the residual of blocks past the residual prefix (the agent's forward from the stored
residual prefix) — and put what it computed. It talks to kvstore through `Client.pair` (one request answers both
prefixes, one acquire pins both) and `Client.fork` for an agent's first residuals over a context.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvstore.client import Client, Namespace, Pair
from kvstore.protocol.geometry import Geometry
from kvstore.protocol.keys import NamespaceSpec, chain_hashes

Tensor = torch.Tensor
KV = tuple[Tensor, Tensor]          # one layer's (K, V) over a run of tokens


@dataclass(frozen=True, slots=True)
class TinyConfig:
    vocab: int = 128
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    intermediate: int = 128
    layers: int = 2
    rope_theta: float = 10000.0
    eps: float = 1e-6
    rank: int = 4
    alpha: float = 8.0
    block_tokens: int = 16
    seed: int = 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @property
    def kv_width(self) -> int:
        """n: the width of one token's K (or V) in one layer."""
        return self.kv_heads * self.head_dim


def base_geometry(cfg: TinyConfig) -> Geometry:
    return Geometry(layers=cfg.layers, tokens=cfg.block_tokens, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                    dtype="float32")


def residual_geometry(cfg: TinyConfig) -> Geometry:
    return Geometry(layers=cfg.layers, tokens=cfg.block_tokens, kv_heads=1, head_dim=cfg.rank, dtype="float32")


def _randn(g: torch.Generator, *shape: int, std: float) -> Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float32) * std


class TinyLlama:
    """The base model: weights drawn from `cfg.seed`. Matrices are [in, out]: a projection is x @ W."""

    def __init__(self, cfg: TinyConfig) -> None:
        self.cfg = cfg
        g = torch.Generator().manual_seed(cfg.seed)
        h, q, n, m = cfg.hidden, cfg.heads * cfg.head_dim, cfg.kv_width, cfg.intermediate
        self.embed = _randn(g, cfg.vocab, h, std=1.0)
        self.layers: list[dict[str, Tensor]] = [{
            "in_norm": 1 + _randn(g, h, std=0.1), "wq": _randn(g, h, q, std=h ** -0.5),
            "wk": _randn(g, h, n, std=h ** -0.5), "wv": _randn(g, h, n, std=h ** -0.5),
            "wo": _randn(g, q, h, std=q ** -0.5), "post_norm": 1 + _randn(g, h, std=0.1),
            "gate": _randn(g, h, m, std=h ** -0.5), "up": _randn(g, h, m, std=h ** -0.5),
            "down": _randn(g, m, h, std=m ** -0.5)} for _ in range(cfg.layers)]
        self.inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim)

    def norm(self, x: Tensor, w: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.eps) * w

    def rope(self, x: Tensor, pos: Tensor) -> Tensor:
        """Llama's rotate-half RoPE of x [tokens, heads, head_dim] at absolute positions `pos` [tokens]."""
        freqs = pos.to(torch.float32)[:, None] * self.inv_freq[None, :]
        cos = torch.cat([freqs.cos(), freqs.cos()], -1)[:, None, :]
        sin = torch.cat([freqs.sin(), freqs.sin()], -1)[:, None, :]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin

    def heads(self, x: Tensor, count: int) -> Tensor:
        return x.reshape(x.shape[0], count, self.cfg.head_dim)

    def block_out(self, layer: dict[str, Tensor], x: Tensor, attn: Tensor) -> Tensor:
        """The rest of a layer after attention: o_proj and residual add, then the MLP and its residual add."""
        x = x + attn @ layer["wo"]
        h = self.norm(x, layer["post_norm"])
        return x + (torch.nn.functional.silu(h @ layer["gate"]) * (h @ layer["up"])) @ layer["down"]

    def attend(self, q: Tensor, q_pos: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Dense causal GQA attention: q [T, H, D] at `q_pos`, over k, v [S, G, D] at positions 0..S-1 → [T, H·D]."""
        rep = self.cfg.heads // self.cfg.kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s = torch.einsum("thd,shd->hts", q, k) / math.sqrt(self.cfg.head_dim)
        s = s.masked_fill(torch.arange(k.shape[0])[None, None, :] > q_pos[None, :, None], float("-inf"))
        return torch.einsum("hts,shd->thd", s.softmax(-1), v).reshape(q.shape[0], -1)

    def base_forward(self, tokens: Sequence[int], start: int, past: list[KV] | None) -> list[KV]:
        """The base model over `tokens` at positions start.., attending over `past` (its own K, V of positions
        0..start-1, per layer): each layer's (RoPE(x̄W_k), x̄W_v) of these tokens, shaped [T, kv_heads, head_dim]."""
        x = self.embed[torch.tensor(tokens)]
        pos = torch.arange(start, start + len(tokens))
        out: list[KV] = []
        for i, w in enumerate(self.layers):
            h = self.norm(x, w["in_norm"])
            g = self.cfg.kv_heads
            k, v = self.rope(self.heads(h @ w["wk"], g), pos), self.heads(h @ w["wv"], g)
            out.append((k, v))
            k_all = k if past is None else torch.cat([past[i][0], k])
            v_all = v if past is None else torch.cat([past[i][1], v])
            x = self.block_out(w, x, self.attend(self.rope(self.heads(h @ w["wq"], self.cfg.heads), pos), pos,
                                                 k_all, v_all))
        return out


@dataclass(frozen=True)
class Adapter:
    """LoRA on k_proj and v_proj: per layer A [hidden, r] and B [r, n]; `bk`/`bv` are B with s = alpha/r folded in."""
    name: str
    a_k: list[Tensor]
    a_v: list[Tensor]
    bk: list[Tensor]
    bv: list[Tensor]

    @classmethod
    def make(cls, cfg: TinyConfig, name: str, seed: int, b_std: float = 0.05) -> Adapter:
        """A trained-looking adapter (B nonzero) drawn from `seed`."""
        g = torch.Generator().manual_seed(seed)
        a = [[_randn(g, cfg.hidden, cfg.rank, std=cfg.hidden ** -0.5) for _ in range(cfg.layers)] for _ in "kv"]
        b = [[cfg.scaling * _randn(g, cfg.rank, cfg.kv_width, std=b_std) for _ in range(cfg.layers)] for _ in "kv"]
        return cls(name, a[0], a[1], b[0], b[1])


def residual_attention(model: TinyLlama, q: Tensor, q_pos: Tensor, base: KV, res: KV, bk: Tensor,
                       bv: Tensor) -> Tensor:
    """ForkKV Algorithm 1 (§5.3), block by block with an online softmax: each key block's K rebuilt on the fly as
    K_base + RoPE(K_res·B_k) (deferred RoPE, at the keys' absolute positions); P·V_base and P·V_res accumulated
    apart; V_res's up-projection B_v applied once at the end (associativity). q [T, H, D] at `q_pos`; base (K, V)
    [S, G, D], res (K, V) [S, r] at positions 0..S-1 → [T, H·D], causal."""
    cfg = model.cfg
    rep, (t, nh, d), r = cfg.heads // cfg.kv_heads, q.shape, res[0].shape[1]
    m = torch.full((nh, t), float("-inf"))
    total, acc, acc_r = torch.zeros(nh, t), torch.zeros(nh, t, d), torch.zeros(nh, t, r)
    for s0 in range(0, base[0].shape[0], cfg.block_tokens):
        s1 = min(s0 + cfg.block_tokens, base[0].shape[0])
        kpos = torch.arange(s0, s1)
        k = base[0][s0:s1] + model.rope(model.heads(res[0][s0:s1] @ bk, cfg.kv_heads), kpos)
        s = torch.einsum("thd,bhd->htb", q, k.repeat_interleave(rep, 1)) / math.sqrt(d)
        s = s.masked_fill(kpos[None, None, :] > q_pos[None, :, None], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        corr, p = torch.exp(m - m_new), torch.exp(s - m_new[..., None])
        total = total * corr + p.sum(-1)
        acc = acc * corr[..., None] + torch.einsum("htb,bhd->htd", p, base[1][s0:s1].repeat_interleave(rep, 1))
        acc_r = acc_r * corr[..., None] + torch.einsum("htb,br->htr", p, res[1][s0:s1])
        m = m_new
    out = acc + torch.einsum("htr,rhd->htd", acc_r, bv.reshape(r, cfg.kv_heads, d).repeat_interleave(rep, 1))
    return (out / total[..., None]).permute(1, 0, 2).reshape(t, nh * d)


def agent_forward(model: TinyLlama, adapter: Adapter, tokens: Sequence[int], start: int, base: list[KV],
                  past_res: list[KV] | None) -> list[KV]:
    """The agent's ForkKV forward over `tokens` at positions start..: attention through `residual_attention` over
    `base` (positions 0..start+T-1, per layer) and its residuals (`past_res` for 0..start-1, then these tokens').
    Each layer's (xA_k, xA_v) of these tokens, [T, r]: what the residual namespace holds."""
    x = model.embed[torch.tensor(tokens)]
    pos = torch.arange(start, start + len(tokens))
    out: list[KV] = []
    for i, w in enumerate(model.layers):
        h = model.norm(x, w["in_norm"])
        kr, vr = h @ adapter.a_k[i], h @ adapter.a_v[i]
        out.append((kr, vr))
        res = (kr, vr) if past_res is None else (torch.cat([past_res[i][0], kr]), torch.cat([past_res[i][1], vr]))
        q = model.rope(model.heads(h @ w["wq"], model.cfg.heads), pos)
        x = model.block_out(w, x, residual_attention(model, q, pos, base[i], res, adapter.bk[i], adapter.bv[i]))
    return out


def rebuild(model: TinyLlama, adapter: Adapter, base: list[KV], res: list[KV]) -> list[KV]:
    """§5.1/§5.3: per layer K = K_base + RoPE(K_res·sB_k), V = V_base + V_res·sB_v, positions 0..S-1."""
    pos = torch.arange(base[0][0].shape[0])
    g = model.cfg.kv_heads
    return [(kb + model.rope(model.heads(kr @ bk, g), pos), vb + model.heads(vr @ bv, g))
            for (kb, vb), (kr, vr), bk, bv in zip(base, res, adapter.bk, adapter.bv)]


# ----- blocks: per-layer tensors over a whole context ⇄ kvstore blocks ([layers, 2, tokens, heads, dim]) -----

def to_blocks(kv: list[KV], geometry: Geometry) -> list[np.ndarray]:
    """The blocks of per-layer (K, V) tensors that start on a block boundary, as bytes."""
    g, bt = geometry, geometry.tokens
    whole = torch.stack([torch.stack([k.reshape(-1, g.kv_heads, g.head_dim), v.reshape(-1, g.kv_heads, g.head_dim)])
                         for k, v in kv])                      # [layers, 2, tokens, heads, dim]
    return [np.ascontiguousarray(whole[:, :, i:i + bt].numpy()).view(np.uint8).reshape(-1)
            for i in range(0, whole.shape[2], bt)]


def from_blocks(blocks: Sequence[np.ndarray], geometry: Geometry, flat: bool) -> list[KV] | None:
    """Per-layer (K, V) over the blocks' tokens: [S, heads, dim], or [S, heads·dim] with `flat` (the residual);
    None for no blocks."""
    if not blocks:
        return None
    whole = torch.from_numpy(np.concatenate([geometry.typed_view(b) for b in blocks], axis=2).copy())
    shape = (whole.shape[2], -1) if flat else (whole.shape[2], geometry.kv_heads, geometry.head_dim)
    return [(whole[i, 0].reshape(shape), whole[i, 1].reshape(shape)) for i in range(geometry.layers)]


def extend(prefix: list[KV] | None, fresh: list[KV]) -> list[KV]:
    if prefix is None:
        return fresh
    return [(torch.cat([k, fk]), torch.cat([v, fv])) for (k, v), (fk, fv) in zip(prefix, fresh)]


# ----- kvstore: the pair, and one agent's prepare -----

@dataclass
class Prepared:
    """One agent's view of a context: per-layer base (K, V) [S, G, D] and residual (K, V) [S, r] over its full
    blocks, and how it came to be (blocks: looked up, loaded, computed here — per part)."""
    hashes: list[bytes]
    base: list[KV]
    residual: list[KV]
    stats: dict[str, int] = field(default_factory=dict)


class ForkKVClient:
    """Agents of one base model over kvstore. Its namespaces: `model_name`'s base (role base, no adapter) and one
    residual namespace per adapter (role residual, adapter = its name), one share group."""

    def __init__(self, client: Client, model: TinyLlama, model_name: str = "forkkv-tiny", group: str = "") -> None:
        self.client, self.model, self.cfg = client, model, model.cfg
        self.base_spec = NamespaceSpec(model=model_name, geometry=base_geometry(self.cfg), group=group, role="base")

    def residual_spec(self, adapter: str) -> NamespaceSpec:
        return NamespaceSpec(model=self.base_spec.model, geometry=residual_geometry(self.cfg),
                             group=self.base_spec.group, adapter=adapter, role="residual")

    def unified_spec(self, adapter: str) -> NamespaceSpec:
        """Where plain per-adapter prefix caching keeps an adapter's whole K and V (the baseline ForkKV replaces)."""
        return NamespaceSpec(model=self.base_spec.model, geometry=base_geometry(self.cfg),
                             group=self.base_spec.group, adapter=adapter, role="base")

    def pair(self, adapter: str) -> Pair:
        return self.client.pair(self.base_spec, self.residual_spec(adapter))

    def prepare(self, tokens: Sequence[int], adapter: Adapter) -> Prepared:
        """Everything `adapter`'s agent needs over the full blocks of `tokens`: the stored prefixes loaded, the rest
        computed and put — the base past the base prefix, then the residual past the residual prefix."""
        bg, rg = base_geometry(self.cfg), residual_geometry(self.cfg)
        hashes = chain_hashes(list(tokens), self.cfg.block_tokens)
        pair = self.pair(adapter.name)
        hit = pair.lookup(hashes)                      # both prefixes, one round trip
        if hit.residual == 0 and hit.base > 0:
            pair.fork(hashes)                          # a new agent: inherit the base by reference
        b_outs = [np.empty(bg.full_bytes, np.uint8) for _ in hashes]
        r_outs = [np.empty(rg.full_bytes, np.uint8) for _ in hashes]
        n, m = pair.get(hashes, b_outs, r_outs)        # the verified prefixes: may be shorter than the lookup's
        toks = list(tokens)[:len(hashes) * self.cfg.block_tokens]
        base = self._complete(pair.base, hashes, n, from_blocks(b_outs[:n], bg, flat=False),
                              lambda start, past: self.model.base_forward(toks[start:], start, past))
        res = self._complete(pair.residual, hashes, m, from_blocks(r_outs[:m], rg, flat=True),
                             lambda start, past: agent_forward(self.model, adapter, toks[start:], start, base, past))
        stats = {"blocks": len(hashes), "base_hit": hit.base, "residual_hit": hit.residual, "base_loaded": n,
                 "residual_loaded": m, "base_computed": len(hashes) - n, "residual_computed": len(hashes) - m}
        return Prepared(hashes, base, res, stats)

    def _complete(self, ns: Namespace, hashes: list[bytes], have: int, prefix: list[KV] | None,
                  compute: Callable[[int, list[KV] | None], list[KV]]) -> list[KV]:
        """One part over all `hashes`: its stored prefix (`have` blocks), then the rest computed from the token
        after it on, put in `ns`."""
        if have == len(hashes):
            assert prefix is not None
            return prefix
        fresh = compute(have * self.cfg.block_tokens, prefix)
        ns.put(hashes[have:], to_blocks(fresh, ns.geometry))
        return extend(prefix, fresh)
