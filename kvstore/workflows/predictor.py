"""Which agent a workflow calls next: PBKV's predictor (§4.1), pluggable; the default is a first-order transition
model over (workflow type, agent), learned online from the hints.

PBKV's own predictor is a GraphSAGE network trained offline on traces; what the eviction policy needs from any
predictor is K distributions over the next agents of a workflow (and its end), from which it computes each
workflow's lookahead reuse value (kvstore.workflows.books). The transition model counts, per workflow type, how often
agent b followed agent a (START before the first, END after the last), and propagates those counts K steps as a
Markov chain with END absorbing. With no counts yet for a (type, agent) it falls back to the type-agnostic counts of
that agent, then to "continues" (so a workflow nobody has seen end yet is treated as live, never as retired).

It also keeps its own score: top-1 accuracy of the 1-step and 3-step predictions, checked as the calls arrive.

Bounded (hint strings come from clients; the daemon keeps one model per tenant, kvstore.workflows.books): at most
`max_keys` (type, agent) pairs and `max_bytes` of them (an estimate: `footprint`), the least recently counted pair
forgotten beyond either; at most `max_successors` named successors per pair — a newcomer beyond them takes the place
of the rarest, whose count goes to OTHER (a successor alive but unnamed; END is always kept); and a lookahead keeps
the `max_successors` likeliest agents of each step, the rest of the mass as OTHER. So one lookahead expands at most
K·(max_successors+2)² successor pairs however wide the graph the hints drew (`max_expansions` in `stats`), and a
workflow's pending predictions go with it (`forget`, at its end or retirement).
"""
from __future__ import annotations

import math
from array import array
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

START = "<start>"
END = "<end>"
OTHER = "<other>"             # the successors pooled beyond max_successors: alive, no agent named
ANY = ""                      # the type-agnostic counts
KEY_BYTES = 480               # a (type, agent) pair's books (the Counter, its tuple and map entry), past its strings
SUCCESSOR_BYTES = 120         # one successor's entry in a Counter, past its name
STR_BYTES = 49                # a str's own header (CPython, ASCII)
GAP_KEY_BYTES = 1600          # a gap key's books past its buckets: its object, arrays' headers, the suffix sums, its
                              # tuple (strings of up to 256 bytes each); the buckets: GAP_BUCKET_BYTES each


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

    def __init__(self, horizon: int = 3, max_keys: int = 4096, max_successors: int = 16,
                 max_bytes: int = 4 << 20) -> None:
        self.counts: OrderedDict[tuple[str, str], Counter[str]] = OrderedDict()   # least recently counted first
        self.horizon = horizon
        self.max_keys = max_keys
        self.max_successors = max_successors
        self.max_bytes = max_bytes
        self.bytes = 0                          # the estimate of the counts' bytes (module docstring)
        self.accuracy = Accuracy()
        self.work: Counter[str] = Counter()     # pooled, forgotten, pruned, lookaheads, expansions
        self.max_expansions = 0                 # the most successor pairs one lookahead expanded
        self._cache: dict[tuple[str, str, int], list[dict[str, float]]] = {}
        self._pending: dict[str, list[tuple[int, int, str]]] = {}   # workflow → (steps left, k, agent)

    def observe(self, wtype: str, prev: str, agent: str) -> None:
        for t in (wtype, ANY) if wtype else (ANY,):
            self._count((t, prev), agent)
        while len(self.counts) > 1 and (len(self.counts) > self.max_keys or self.bytes > self.max_bytes):
            key, c = self.counts.popitem(last=False)
            self.bytes -= _key_bytes(key, c)
            self.work["forgotten"] += 1
        self._cache.clear()

    def _count(self, key: tuple[str, str], agent: str) -> None:
        c = self.counts.get(key)
        if c is None:
            c = self.counts[key] = Counter()
            self.bytes += _key_bytes(key, c)
        else:
            self.counts.move_to_end(key)
        if agent not in c:
            if agent not in (END, OTHER) and len(c) - (END in c) - (OTHER in c) >= self.max_successors:
                rare = min((a for a in c if a not in (END, OTHER)), key=c.__getitem__)
                c[OTHER] += c.pop(rare)                 # the rarest named successor: pooled, unnamed
                self.bytes -= SUCCESSOR_BYTES + STR_BYTES + len(rare)
                self.work["pooled"] += 1
            self.bytes += SUCCESSOR_BYTES + STR_BYTES + len(agent)
        c[agent] += 1

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
            if len(self._cache) >= self.max_keys:
                self._cache.clear()
            got = self._cache[key] = self._propagate(wtype, agent, k)
        return got

    def _propagate(self, wtype: str, agent: str, k: int) -> list[dict[str, float]]:
        out = []
        dist = {agent: 1.0}
        expanded = 0
        for _ in range(k):
            step: dict[str, float] = {}
            for a, p in dist.items():
                if a == END:
                    step[END] = step.get(END, 0.0) + p
                    continue
                nxt = self.next_of(wtype, a)
                if not nxt:
                    step[a] = step.get(a, 0.0) + p     # unknown successor: alive, agent unknown (kept as is)
                expanded += len(nxt)
                for b, q in nxt.items():
                    step[b] = step.get(b, 0.0) + p * q
            dist = self._prune(step)
            out.append(dist)
        self.work["lookaheads"] += 1
        self.work["expansions"] += expanded
        self.max_expansions = max(self.max_expansions, expanded)
        return out

    def _prune(self, step: dict[str, float]) -> dict[str, float]:
        """The step's `max_successors` likeliest agents, END, and the rest of the mass as OTHER (alive)."""
        named = [a for a in step if a not in (END, OTHER)]
        if len(named) <= self.max_successors:
            return step
        keep = sorted(named, key=step.__getitem__, reverse=True)[:self.max_successors]
        out = {a: step[a] for a in keep}
        if END in step:
            out[END] = step[END]
        out[OTHER] = 1.0 - math.fsum(out.values())
        self.work["pruned"] += len(named) - len(keep)
        return out

    def stats(self) -> dict[str, int]:
        """The books' size (pairs, successors, the bytes estimate) and the work counters (module docstring)."""
        return {"keys": len(self.counts), "successors": sum(len(c) for c in self.counts.values()),
                "bytes": self.bytes, "pending": len(self._pending), "max_expansions": self.max_expansions,
                **{k: self.work[k] for k in ("pooled", "forgotten", "pruned", "lookaheads", "expansions")}}

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
        self.forget(wid)

    def forget(self, wid: str) -> None:
        """The workflow is gone (ended or retired): its pending predictions go with it, unscored."""
        self._pending.pop(wid, None)


def _key_bytes(key: tuple[str, str], c: Counter[str]) -> int:
    """The estimate of one pair's books: its own and its successors' (module docstring)."""
    return (KEY_BYTES + 2 * STR_BYTES + len(key[0]) + len(key[1])
            + sum(SUCCESSOR_BYTES + STR_BYTES + len(a) for a in c))


def _top(dist: dict[str, float]) -> str:
    agents = {a: p for a, p in dist.items() if a not in (END, OTHER)}
    return max(agents, key=lambda a: agents[a]) if agents else END


def survival(ahead: Sequence[dict[str, float]]) -> list[float]:
    """P(the workflow is still running at step k), k = 1..K, from a lookahead (END absorbing)."""
    return [1.0 - d.get(END, 0.0) for d in ahead]


class Gaps:
    """When a workflow calls again: the seconds between its calls, learned online per (type, agent of the earlier
    call), for the eviction policy's time-aware score and the predictive prefetch's timing.

    Agent workflows wait between calls on the engine's decode and on tools (tests run, documents are fetched, a user
    thinks), and those waits are not memoryless: a workflow that just called may be the least likely to call next
    (a decode plus a tool run), or the likeliest (heavy-tailed tool waits: most answer at once, some take minutes).
    So the estimate is the expected *residual* wait given the time already waited, E[G − e | G > e], from the
    key's distribution of gaps: under memoryless gaps it stays near the mean whatever e is, and the score falls
    back to the plain lookahead order. A workflow that has waited longer than every gap seen is treated as ever
    less likely to come back soon (residual = mean + how far past the largest gap it is).

    The distribution is a histogram of BUCKETS log-spaced buckets (a quarter octave each, from BASE_S: 1 ms to
    ~3 hours), each with its count and its gaps' sum (so a bucket's gaps are exact on average), forgetting with an
    effective window of `keep` gaps (each new one weighs 1/(1 − 1/keep) times the one before; 0: never forgets,
    every gap weighs the same). Issue 34: a window
    of the last 64 gaps kept as samples saw too little of a heavy tail (tool waits with σ = 1.4 lognormal) and
    misjudged when a long-waiting workflow comes back; a window of ~1000 closed 4–8 points more of the LRU→Belady
    gap there, and the histogram holds it in less memory than 64 samples did.
    Keys are bounded (`max_keys`, the oldest-made goes, and `max_bytes`: each key's books are estimated at
    GAP_KEY_BYTES + BUCKETS × GAP_BUCKET_BYTES): hint strings come from clients.
    """

    def __init__(self, keep: int = 1024, max_keys: int = 4096, max_bytes: int = 4 << 20) -> None:
        self.keep = keep
        self.max_keys = max(1, min(max_keys, max_bytes // (GAP_KEY_BYTES + BUCKETS * GAP_BUCKET_BYTES)))
        self._hist: dict[tuple[str, str], _Hist] = {}
        self.total = 0.0                      # over every key: the mean gap is the scale of the score
        self.count = 0

    def observe(self, wtype: str, agent: str, gap: float) -> None:
        gap = max(0.0, gap)
        self.total += gap
        self.count += 1
        for key in ((wtype, agent), (wtype, ANY)):
            h = self._hist.get(key)
            if h is None:
                if len(self._hist) >= self.max_keys:
                    del self._hist[next(iter(self._hist))]
                h = self._hist[key] = _Hist()
            h.add(gap, self.keep)

    def __len__(self) -> int:
        return len(self._hist)

    def bytes(self) -> int:
        """The estimate of the books' bytes (the class docstring)."""
        return len(self._hist) * (GAP_KEY_BYTES + BUCKETS * GAP_BUCKET_BYTES)

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None

    def density(self, wtype: str, agent: str, elapsed: float, horizon: float) -> float | None:
        """Hit density (LHD, Beckmann et al., NSDI 2018) of a block of a workflow of `wtype` whose last call (by
        `agent`) was `elapsed` seconds ago, in a cache that keeps an unused block about `horizon` seconds: the
        probability that the next call comes within the horizon over the expected time the block occupies the
        cache until then (min(wait, horizon)), per second; None while nothing is learned for the type."""
        h = self._hist.get((wtype, agent)) or self._hist.get((wtype, ANY))
        return None if h is None else h.density(elapsed, horizon)

    def residual(self, wtype: str, agent: str, elapsed: float) -> float | None:
        """Expected seconds until the next call of a workflow of `wtype` whose last call (by `agent`) was `elapsed`
        seconds ago; None while nothing is learned for the type."""
        h = self._hist.get((wtype, agent)) or self._hist.get((wtype, ANY))
        return None if h is None else h.residual(elapsed)


BUCKETS = 96                  # a quarter octave each from BASE_S: 1 ms .. ~4.6 hours (the last takes the rest)
BASE_S = 1e-3
GAP_BUCKET_BYTES = 16         # a bucket's count and sum (two doubles in arrays)


def _bucket(gap: float) -> int:
    return 0 if gap <= BASE_S else min(BUCKETS - 1, int(4 * math.log2(gap / BASE_S)) + 1)


class _Hist:
    """One key's gaps (Gaps' docstring): weighted counts and sums per bucket, the largest gap, and suffix sums
    rebuilt at the first residual after a change."""
    __slots__ = ("n", "s", "weight", "largest", "_suffix")

    def __init__(self) -> None:
        self.n = array("d", [0.0]) * BUCKETS
        self.s = array("d", [0.0]) * BUCKETS
        self.weight = 1.0
        self.largest = 0.0
        self._suffix: tuple[list[float], list[float]] | None = None

    def add(self, gap: float, keep: int) -> None:
        if self.weight > 1e12:                               # renormalize: the ratios are all that matter
            for i in range(BUCKETS):
                self.n[i] /= self.weight
                self.s[i] /= self.weight
            self.weight = 1.0
        b = _bucket(gap)
        self.n[b] += self.weight
        self.s[b] += self.weight * gap
        if keep > 0:
            self.weight /= 1.0 - 1.0 / max(2, keep)
        self.largest = max(self.largest, gap)
        self._suffix = None

    def density(self, elapsed: float, horizon: float) -> float:
        """Gaps.density for this key, O(1) as `residual`: the gaps past `elapsed` wait (the bucket of `elapsed` by
        its gaps' mean), those that end within the horizon are hits (the bucket of the horizon's end, likewise)."""
        sn, ss = self._sums()
        b, e, end = _bucket(elapsed), _bucket(elapsed + horizon), elapsed + horizon
        nb = self.n[b]
        mean_b = self.s[b] / nb if nb else 0.0
        waiting = sn[b + 1] + (nb if mean_b > elapsed else 0.0)
        if waiting <= 0.0:                                      # past every gap seen: as `residual` says
            return 1.0 / max(self.residual(elapsed), 1e-9)
        hits = hit_s = 0.0
        if e > b:                                               # the buckets between, whole; the last, by its mean
            hits, hit_s = sn[b + 1] - sn[e], ss[b + 1] - ss[e]
            if self.n[e] and self.s[e] / self.n[e] <= end:
                hits, hit_s = hits + self.n[e], hit_s + self.s[e]
        if nb and elapsed < mean_b <= end:
            hits, hit_s = hits + nb, hit_s + self.s[b]
        return hits / max(hit_s - elapsed * hits + horizon * (waiting - hits), 1e-9)

    def _sums(self) -> tuple[list[float], list[float]]:
        """Suffix sums of the counts and the gaps, rebuilt after a change."""
        if self._suffix is None:
            sn, ss = [0.0] * (BUCKETS + 1), [0.0] * (BUCKETS + 1)
            for i in range(BUCKETS - 1, -1, -1):
                sn[i], ss[i] = sn[i + 1] + self.n[i], ss[i + 1] + self.s[i]
            self._suffix = (sn, ss)
        return self._suffix

    def residual(self, elapsed: float) -> float:
        sn, ss = self._sums()
        b = _bucket(elapsed)
        n, s = sn[b + 1], ss[b + 1]
        if self.n[b] and self.s[b] / self.n[b] > elapsed:    # the bucket of `elapsed`: by its gaps' mean
            n, s = n + self.n[b], s + self.s[b]
        if n <= 0.0:                                         # past every gap seen: ever less likely soon
            return ss[0] / sn[0] + (elapsed - self.largest)
        return s / n - elapsed
