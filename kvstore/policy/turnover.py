"""How long a tier keeps a block nobody uses: its characteristic time, the horizon of the workflow policy's hit
density (kvstore.workflows.books.Workflows.value).

By Little's law a cache of `held` blocks that takes in a new block every `dt` seconds on average keeps a block it
does not use again for about held × dt seconds (Che's approximation of LRU's characteristic time). That is the
horizon within which a workflow's next call still finds its blocks: a small pool's is seconds, a large one's
minutes, so one workflow's worth depends on the pool that holds its blocks. Measured online from the tier's own
stores: the mean gap between new blocks over about WINDOW of them (an exponential average: a put's blocks come in a
burst, and the average over the window is still time over blocks). The horizon is REACH turnovers; None until
MIN_STORES new blocks came, or while they all came at one instant (the score keeps its residual-wait form then).
"""
from __future__ import annotations

from collections.abc import Callable

WINDOW = 256            # new blocks the average of their gaps spans
MIN_STORES = 16         # stores before the horizon is trusted (until then: None, the residual-wait order)
REACH = 2.0             # the horizon in turnovers: a block the policy values outlasts the pool's average one. Chosen
                        # on the six design families (bench/agent_families.py, seeds 1-3, gap closed: 1 -> 55.7%,
                        # 2 -> 56.2%, 4 -> 55.9%; the residual-wait order 56.3%), then judged on the held-out ones


class Turnover:
    """A tier's characteristic time (module docstring): `stored(held)` at each new block, `horizon()` in seconds."""
    __slots__ = ("clock", "last", "gap", "stores", "held")

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.last: float | None = None
        self.gap = 0.0          # the average seconds between new blocks
        self.stores = 0
        self.held = 0

    def stored(self, held: int) -> None:
        """A new block came into a tier that now holds `held` blocks."""
        now = self.clock()
        if self.last is not None:
            self.gap += (max(0.0, now - self.last) - self.gap) / min(self.stores, WINDOW)
        self.last = now
        self.stores += 1
        self.held = held

    def horizon(self) -> float | None:
        """Seconds the tier keeps a block nobody uses, or None before MIN_STORES stores."""
        turn = self.held * self.gap
        return REACH * turn if self.stores >= MIN_STORES and turn > 0.0 else None
