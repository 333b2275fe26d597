"""Which agent a workflow calls next: PBKV's predictor (§4.1), pluggable; the default is a first-order transition
model over (workflow type, agent), learned online from the hints.

PBKV's own predictor is a GraphSAGE network trained offline on traces; what the eviction policy needs from any
predictor is K distributions over the next agents of a workflow (and its end), from which it computes each
workflow's lookahead reuse value (kvstore.workflows.books). The transition model counts, per workflow type, how often
agent b followed agent a (START before the first, END after the last), and propagates those counts K steps as a
Markov chain with END absorbing. With no counts yet for a (type, agent) it falls back to the type-agnostic counts of
that agent, then to "continues" (so a workflow nobody has seen end yet is treated as live, never as retired).

It also keeps its own score: top-1 accuracy of the 1-step and 3-step predictions, checked as the calls arrive.
"""
from __future__ import annotations

from bisect import bisect_right
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

START = "<start>"
END = "<end>"
ANY = ""                      # the type-agnostic counts


class Predictor(Protocol):
    def observe(self, wtype: str, prev: str, agent: str) -> None:
        """Agent `agent` followed `prev` (START: the first call; END as `agent`: the workflow ended)."""
        ...

    def lookahead(self, wtype: str, agent: str, k: int) -> list[dict[str, float]]:
        """For a workflow of `wtype` that has just called `agent`: for each of the next `k` steps, the probability
        of each agent being called at that step, and of END having come by then (absorbing)."""
        ...


@dataclass
class Accuracy:
    """Top-1 accuracy of the predictions at 1 and 3 steps, as calls arrive."""
    hits: Counter[int] = field(default_factory=Counter)
    total: Counter[int] = field(default_factory=Counter)

    def rate(self, k: int) -> float | None:
        return self.hits[k] / self.total[k] if self.total[k] else None


class TransitionModel:
    """The default predictor (module docstring)."""

    def __init__(self, horizon: int = 3) -> None:
        self.counts: dict[tuple[str, str], Counter[str]] = {}
        self.horizon = horizon
        self.accuracy = Accuracy()
        self._cache: dict[tuple[str, str, int], list[dict[str, float]]] = {}
        self._pending: dict[str, list[tuple[int, int, str]]] = {}   # workflow → (steps left, k, agent)

    def observe(self, wtype: str, prev: str, agent: str) -> None:
        for t in (wtype, ANY) if wtype else (ANY,):
            self.counts.setdefault((t, prev), Counter())[agent] += 1
        self._cache.clear()

    def next_of(self, wtype: str, agent: str) -> dict[str, float]:
        """One step: the distribution of what follows `agent` in a workflow of `wtype`."""
        c = self.counts.get((wtype, agent)) or self.counts.get((ANY, agent))
        if not c:
            return {}                              # unknown: "continues", with no agent to name
        total = sum(c.values())
        return {a: n / total for a, n in c.items()}

    def lookahead(self, wtype: str, agent: str, k: int) -> list[dict[str, float]]:
        key = (wtype, agent, k)
        got = self._cache.get(key)
        if got is None:
            got = self._cache[key] = self._propagate(wtype, agent, k)
        return got

    def _propagate(self, wtype: str, agent: str, k: int) -> list[dict[str, float]]:
        out = []
        dist = {agent: 1.0}
        for _ in range(k):
            step: dict[str, float] = {}
            for a, p in dist.items():
                if a == END:
                    step[END] = step.get(END, 0.0) + p
                    continue
                nxt = self.next_of(wtype, a)
                if not nxt:
                    step[a] = step.get(a, 0.0) + p     # unknown successor: alive, agent unknown (kept as is)
                for b, q in nxt.items():
                    step[b] = step.get(b, 0.0) + p * q
            dist = step
            out.append(dist)
        return out

    # ----- its own score -----
    def called(self, wid: str, wtype: str, prev: str, agent: str) -> None:
        """A call arrived: score the predictions due now, learn the transition, predict from here."""
        left = []
        for remaining, k, predicted in self._pending.get(wid, ()):
            if remaining == 1:
                self.accuracy.total[k] += 1
                self.accuracy.hits[k] += predicted == agent
            else:
                left.append((remaining - 1, k, predicted))
        self.observe(wtype, prev, agent)
        ahead = self.lookahead(wtype, agent, max(3, self.horizon))
        left += [(k, k, _top(ahead[k - 1])) for k in (1, 3)]
        self._pending[wid] = left

    def ended(self, wid: str, wtype: str, last: str) -> None:
        self.observe(wtype, last, END)
        self._pending.pop(wid, None)


def _top(dist: dict[str, float]) -> str:
    agents = {a: p for a, p in dist.items() if a != END}
    return max(agents, key=lambda a: agents[a]) if agents else END


def survival(ahead: Sequence[dict[str, float]]) -> list[float]:
    """P(the workflow is still running at step k), k = 1..K, from a lookahead (END absorbing)."""
    return [1.0 - d.get(END, 0.0) for d in ahead]


class Gaps:
    """When a workflow calls again: the seconds between its calls, learned online per (type, agent of the earlier
    call), for the eviction policy's time-aware score and the predictive prefetch's timing.

    Agent workflows wait between calls on the engine's decode and on tools (tests run, documents are fetched, a user
    thinks), and those waits are not memoryless: a workflow that just called is the one least likely to call next.
    So the estimate is the expected *residual* wait given the time already waited, E[G − e | G > e], from the last
    `keep` gaps of the key (its empirical distribution): under memoryless gaps it stays near the mean whatever e is,
    and the score falls back to the plain lookahead order. A workflow that has waited longer than every gap seen is
    treated as ever less likely to come back soon (residual = mean + how far past the largest gap it is).
    Keys are bounded (`max_keys`, the oldest-made goes): hint strings come from clients.
    """

    def __init__(self, keep: int = 64, max_keys: int = 4096) -> None:
        self.keep = keep
        self.max_keys = max_keys
        self._samples: dict[tuple[str, str], deque[float]] = {}
        self._sorted: dict[tuple[str, str], tuple[list[float], list[float]]] = {}   # sorted gaps, suffix sums
        self.total = 0.0                      # over every key: the mean gap is the scale of the score
        self.count = 0

    def observe(self, wtype: str, agent: str, gap: float) -> None:
        gap = max(0.0, gap)
        self.total += gap
        self.count += 1
        for key in ((wtype, agent), (wtype, ANY)):
            s = self._samples.get(key)
            if s is None:
                if len(self._samples) >= self.max_keys:
                    old = next(iter(self._samples))
                    del self._samples[old]
                    self._sorted.pop(old, None)
                s = self._samples[key] = deque(maxlen=self.keep)
            s.append(gap)
            self._sorted.pop(key, None)

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None

    def residual(self, wtype: str, agent: str, elapsed: float) -> float | None:
        """Expected seconds until the next call of a workflow of `wtype` whose last call (by `agent`) was `elapsed`
        seconds ago; None while nothing is learned for the type."""
        key = (wtype, agent) if (wtype, agent) in self._samples else (wtype, ANY)
        s = self._samples.get(key)
        if not s:
            return None
        got = self._sorted.get(key)
        if got is None:
            gaps = sorted(s)
            suffix = [0.0] * (len(gaps) + 1)
            for i in range(len(gaps) - 1, -1, -1):
                suffix[i] = suffix[i + 1] + gaps[i]
            got = self._sorted[key] = (gaps, suffix)
        gaps, suffix = got
        j = bisect_right(gaps, elapsed)
        if j == len(gaps):                    # past every gap seen: ever less likely to come back soon
            return suffix[0] / len(gaps) + (elapsed - gaps[-1])
        return suffix[j] / (len(gaps) - j) - elapsed
