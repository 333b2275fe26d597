"""How much of what a workflow touches its own later calls read again, learned per workflow type (issue 34).

Why: the workflow policy prices an active workflow's blocks by its lookahead — the calls it is expected to make —
under the prefix-sharing convention of agent frameworks (each prompt carries the history so far, so a later call
rereads what an earlier one stored: PBKV's "later agents inherit"). Not every workflow is built that way. In a
static pipeline whose stages each begin with their own role prompt, no stage reads another's blocks: the only reuse
is across workflows (a stage's role prompt, a popular input under it), and pricing the pipeline's own blocks by its
remaining stages kept dead blocks over those shared ones (bench/agent_families' `pipeline`, offline, seeds 1–3: 28%
of the LRU→Belady gap closed on average against 50% for the no-hint default; with this, 43%).

So the books count, per type, the blocks a workflow touched for the first time (stored or read), once its next call
is over (that call could reread them: the blocks of a workflow's last call, or its only one, never count), and the
reads of a block by a later call of a workflow that touched it before (not the same call's second look: a
whole-chain save refreshes what the call read), each forgetting with an effective window of WINDOW calls.
`share(type)` scales the type's lookahead value: reads again / first touches over FULL_AT, capped at 1 — a
detector more than a measure: a type that rereads even one block in twenty keeps its whole value (a retrieval
reader's documents are reread by its next hop while its retriever's prompts never are; scaling by the mean share
cost that family 20 points of the gap at a quarter of its peak), one that rereads nothing is worth only what its
blocks are worth to the workflows to come. 1 until MIN_STORED blocks are counted (the convention until the type
shows otherwise). Types are bounded (`max_keys`, the oldest-made goes, and `max_bytes` at REUSE_KEY_BYTES a type:
an eighth of a model's bytes, kvstore.workflows.books): hint strings come from clients.
"""
from __future__ import annotations

WINDOW = 256                # calls: each new one weighs 1/(1 − 1/WINDOW) the one before
MIN_STORED = 64.0           # blocks counted before the measured share replaces the convention's 1
FULL_AT = 0.05              # a share from which the value is whole: a type that rereads some of its blocks
REUSE_KEY_BYTES = 560       # a type's books, estimated: its entry, its list of two floats and its name (hint
                            # strings are up to 256 bytes; tracemalloc: ~105 with a 40-character name)


class SelfReuse:
    """Per workflow type: [blocks a later call could reread, reads again by the same workflow], each decayed per
    call (module docstring)."""
    __slots__ = ("max_keys", "_books")

    def __init__(self, max_keys: int = 4096, max_bytes: int = 512 << 10) -> None:
        self.max_keys = max(1, min(max_keys, max_bytes // REUSE_KEY_BYTES))
        self._books: dict[str, list[float]] = {}

    def _of(self, wtype: str) -> list[float]:
        b = self._books.get(wtype)
        if b is None:
            if len(self._books) >= self.max_keys:
                del self._books[next(iter(self._books))]
            b = self._books[wtype] = [0.0, 0.0]
        return b

    def counted(self, wtype: str, offered: int, rereads: int) -> None:
        """A call of a workflow of `wtype` is over (the workflow called again, or ended): its previous call touched
        `offered` blocks first (each block is offered once: the share is rereads per block a workflow touched),
        and this call reread `rereads` blocks the workflow had touched before (a workflow's first call is never
        counted: nothing could be reread). The workflow counts during its calls (`Workflow.fresh`, `.offered`,
        `.rereads`): a touch costs an increment, not a lookup here."""
        b = self._of(wtype)
        b[0] = b[0] * (1.0 - 1.0 / WINDOW) + offered
        b[1] = b[1] * (1.0 - 1.0 / WINDOW) + rereads

    def share(self, wtype: str) -> float:
        b = self._books.get(wtype)
        if b is None or b[0] < MIN_STORED:
            return 1.0
        return min(1.0, b[1] / (b[0] * FULL_AT))

    def __len__(self) -> int:
        return len(self._books)

    def bytes(self) -> int:
        """The estimate of the books' bytes: REUSE_KEY_BYTES a type (its string, entry and two floats)."""
        return len(self._books) * REUSE_KEY_BYTES


__all__ = ["SelfReuse"]
