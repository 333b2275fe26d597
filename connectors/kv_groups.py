"""A model's KV as groups, each with its own rule for what a prefix end needs (issue 35), for every engine.

Hybrid models keep several kinds of KV side by side, and each kind needs something different to resume at a prefix
end E (in blocks):
- `full` attention (and latent or indexer caches): every block before E;
- `window` (sliding-window attention of W tokens): only the blocks the first new token can see, the last
  `window_blocks` before E (vLLM: cdiv(W - 1, block_size); fewer where E is smaller);
- `state` (Mamba, gated delta-net, linear attention): one state, the one after block E - 1, keyed by that block's
  hash.
Each group is a namespace of its own (its own geometry), keyed by the same chained block hashes. A prefix end is
*restorable* only where every group has what its rule needs there: attention KV restored without the recurrent
state makes the engine skip the prefix in its recurrent layers too, and its output is garbage. `usable_end` is that
rule; the connectors ask each group's namespace once (a chained `lookup` for full groups, `held` for the others)
and load exactly `needed(E)` of each group.

What to keep (`keep`): full groups keep every block. Window groups keep what the ends a later request can resume
from need, nothing else: the end of every engine step (where a turn stops: the next turn of a chat or an agent
resumes there; every block of a decode), and the end of the prefix the prompt shared with what the daemon held at
its lookup (where it left another request's chain: the next prompt that shares it — a system prompt, a document, a
common history — resumes there). Optionally a checkpoint every K blocks too (the connector's
`window_checkpoint_blocks`). A state group can keep only the states its engine computed: the state at the end of
each step that ends on a block boundary (vLLM's align mode ends prefill chunks there; a chunked prefill leaves one
per chunk).

Measured (bench/bench_hybrid.py: a 5:1 sliding-window model, window 4 blocks, through the daemon under LRU, equal
DRAM): on the public Mooncake trace, keeping every window block stores as many bytes as a dense model and hits 1.05x
its rate at 25% of the dense working set; step ends and shared-prefix ends store 0.33x the bytes and hit 1.37x
(61.3% against 44.6%), 63.4% of the 65.1% an unbounded dense cache reaches; checkpoints every 16 blocks add 30% of
bytes for less (58.5% at 25%, 64.3% unbounded). On an agentic multi-turn trace (sessions resume at their last end),
checkpoints cost hits under pressure (62.0% against 77.7% for step ends alone at 25%).

Engine-agnostic: no vLLM or SGLang import.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

FULL, WINDOW, STATE = "full", "window", "state"
KINDS = (FULL, WINDOW, STATE)


@dataclass(frozen=True)
class GroupRule:
    """What one group needs to resume at a prefix end: `kind` (full, window or state) and, for a window group, how
    many blocks before the end its first new token sees."""
    kind: str
    window_blocks: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"a KV group's kind is one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == WINDOW and self.window_blocks < 1:
            raise ValueError(f"a window group needs at least one block before its end, got {self.window_blocks}")

    def needed(self, end: int) -> range:
        """Block positions this group must restore to resume at `end` blocks."""
        if end <= 0:
            return range(0)
        if self.kind == FULL:
            return range(end)
        if self.kind == WINDOW:
            return range(max(0, end - self.window_blocks), end)
        return range(end - 1, end)

    def keep(self, lo: int, hi: int, ends: Sequence[int], every: int = 0) -> list[int]:
        """Positions in [lo, hi) worth storing for this group once blocks up to `hi` are computed: full groups all
        of them; the others what the restorable ends in (lo, hi] need — each of `ends` and, with `every`, each
        multiple of it. Sorted, each once."""
        if self.kind == FULL:
            return list(range(lo, hi))
        wanted = {e for e in ends if lo < e <= hi}
        if every > 0:
            wanted.update(range((lo // every + 1) * every, hi + 1, every))
        out: set[int] = set()
        for e in wanted:
            out.update(p for p in self.needed(e) if lo <= p < hi)
        return sorted(out)


def usable_end(rules: Sequence[GroupRule], full_prefix: int, held: Sequence[Sequence[bool] | None],
               align: int = 1) -> int:
    """The longest prefix end (in blocks, at most `full_prefix`, a multiple of `align`) at which every group can be
    restored: `full_prefix` is the chained prefix every full group holds (the least of their lookups); `held[g]`
    says, for a window or state group g, which of the positions [0, full_prefix) it holds (None for full groups).
    0 where no end is restorable."""
    bound = full_prefix - full_prefix % max(1, align)
    runs: list[tuple[GroupRule, list[int] | Sequence[bool]]] = []
    for rule, mask in zip(rules, held):
        if rule.kind == FULL:
            continue
        if mask is None or len(mask) < bound:
            raise ValueError(f"a {rule.kind} group's held mask covers {0 if mask is None else len(mask)} of "
                             f"{bound} positions")
        runs.append((rule, _run_lengths(mask[:bound]) if rule.kind == WINDOW else mask))
    for end in range(bound, 0, -max(1, align)):
        if all(_restorable(rule, r, end) for rule, r in runs):
            return end
    return 0


def _run_lengths(mask: Sequence[bool]) -> list[int]:
    """run[i]: how many consecutive positions up to and including i are held."""
    out, run = [], 0
    for there in mask:
        run = run + 1 if there else 0
        out.append(run)
    return out


def _restorable(rule: GroupRule, r: Sequence[int] | Sequence[bool], end: int) -> bool:
    if rule.kind == WINDOW:
        return int(r[end - 1]) >= min(end, rule.window_blocks)
    return bool(r[end - 1])
