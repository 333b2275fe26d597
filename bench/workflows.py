"""Agent workflow traces, and the offline policies they are judged against (PBKV §6's workload families).

A trace is the sequence of requests one node's engines see, each an agent invocation (or a chat turn) with the
workflow, agent and session it belongs to and its prompt's tokens. Prompts follow the message-passing convention of
the frameworks PBKV evaluates: a family's shared system prompt, the workflow's task, then the history accumulated
by upstream agents, then the calling agent's own instruction. So agents of a workflow share its growing prefix,
workflows of a family share the system prompt, and a request's last chunk is its own.

Families (each seeded, sizes in tokens):
- `codegen` (dynamic): planner → coder → tester, then test/fix retry loops (tester → coder → tester ...) whose
  number is data dependent (geometric), sometimes a reviewer at the end;
- `factcheck` (dynamic): a planner spawns a data-dependent fan-out of sub-query retrievers (1..6), each followed
  by a verifier, then an aggregator;
- `pipeline` (static): a fixed chain of five agents;
- `chat` (multi-turn): one session of tens to hundreds of turns, each appending a few hundred tokens.
A mix runs many of them concurrently: at most `concurrency` live at once, their next requests interleaved at random
(a workflow's requests stay in order).

`hit_rates(trace, capacity, policy)` replays a trace offline with prefix semantics (a request's hit is the longest
prefix of its chunks all cached; then every chunk of it is cached): `lru`, and `oracle`, Belady's farthest next use
(with bypass), the ceiling no online policy can pass.
"""
from __future__ import annotations

import heapq
import random
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from kvstore.protocol.keys import chain_hashes

CHUNK = 256                   # tokens per block (as the connectors' default chunk)
VOCAB = 30000


@dataclass
class Request:
    workflow: str
    family: str
    agent: str
    step: int
    session: str | None
    tokens: list[int]
    last: bool = False                          # the workflow ends after this request
    hashes: list[bytes] = field(default_factory=list)
    at: float = 0.0                             # when the node serves it (seconds from the trace's start)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(n)]


class _Workflow:
    """Yields its requests one at a time; the history grows by each agent's output."""

    def __init__(self, wid: str, family: str, rng: random.Random, system: list[int], task: int) -> None:
        self.wid, self.family, self.rng = wid, family, rng
        self.history = system + _tokens(rng, task)
        self.step = 0

    def call(self, agent: str, instr: int = 64, output: int = 256, last: bool = False) -> Request:
        prompt = self.history + _tokens(self.rng, instr)
        self.history = self.history + _tokens(self.rng, output)
        self.step += 1
        return Request(self.wid, self.family, agent, self.step, None, prompt, last)


def codegen(wid: str, rng: random.Random, system: list[int]) -> Iterator[Request]:
    w = _Workflow(wid, "codegen", rng, system, rng.randint(600, 1500))
    yield w.call("planner", output=rng.randint(200, 500))
    yield w.call("coder", output=rng.randint(400, 900))
    fixes = 0
    while rng.random() < 0.6 and fixes < 6:              # the tests fail: back to the coder
        yield w.call("tester", output=rng.randint(150, 400))
        yield w.call("coder", output=rng.randint(300, 700))
        fixes += 1
    reviewer = rng.random() < 0.5
    yield w.call("tester", output=rng.randint(100, 300), last=not reviewer)
    if reviewer:
        yield w.call("reviewer", output=rng.randint(100, 300), last=True)


def factcheck(wid: str, rng: random.Random, system: list[int]) -> Iterator[Request]:
    w = _Workflow(wid, "factcheck", rng, system, rng.randint(300, 800))
    yield w.call("planner", output=rng.randint(150, 300))
    for _ in range(rng.randint(1, 6)):                   # sub-queries: how many depends on the claim
        yield w.call("retriever", output=rng.randint(400, 1000))
        yield w.call("verifier", output=rng.randint(100, 250))
    yield w.call("aggregator", output=rng.randint(100, 300), last=True)


def pipeline(wid: str, rng: random.Random, system: list[int]) -> Iterator[Request]:
    w = _Workflow(wid, "pipeline", rng, system, rng.randint(1000, 2500))
    agents = ["extractor", "analyst", "modeler", "writer", "editor"]
    for i, a in enumerate(agents):
        yield w.call(a, output=rng.randint(300, 700), last=i == len(agents) - 1)


def chat(wid: str, rng: random.Random, system: list[int], turns: tuple[int, int] = (20, 120)) -> Iterator[Request]:
    history = system + _tokens(rng, rng.randint(300, 1200))
    n = rng.randint(*turns)
    for t in range(n):
        history = history + _tokens(rng, rng.randint(100, 500))            # the user's message
        yield Request(wid, "chat", "chat", t + 1, wid, list(history), t == n - 1)
        history = history + _tokens(rng, rng.randint(80, 300))             # the reply
    # (a chat's requests carry its session id; workflows carry none)


FAMILIES = {"codegen": codegen, "factcheck": factcheck, "pipeline": pipeline, "chat": chat}
MIXES = {
    "codegen": {"codegen": 1.0},
    "factcheck": {"factcheck": 1.0},
    "pipeline": {"pipeline": 1.0},
    "chat": {"chat": 1.0},
    "mixed": {"codegen": 0.3, "factcheck": 0.3, "pipeline": 0.2, "chat": 0.2},
}


# Seconds between a workflow's calls (the engine decoding the reply, then tool runs or a user's think time: mean per
# family) and a request's own service time: a request is sent when its workflow's previous call returned and the
# gap has passed, so the next request is the one that became ready first, not a random live workflow's. Gaps are
# gamma distributed with shape GAP_SHAPE (4: a coefficient of variation of 0.5, as a decode plus a tool run are:
# neither is memoryless); shape 1 makes them exponential (memoryless: how long a workflow has waited then says
# nothing of when it calls again, the hardest case for any online policy).
GAPS = {"codegen": 4.0, "factcheck": 2.0, "pipeline": 1.0, "chat": 20.0}
GAP_SHAPE = 4.0
SERVICE_S = 0.5


def mix(name: str, workflows: int, concurrency: int, seed: int = 11, shape: float = GAP_SHAPE) -> list[Request]:
    """`workflows` workflows of the mix's families, at most `concurrency` live at once. Event driven: each live
    workflow's next request is ready at its previous one's end plus a gamma(`shape`) gap (GAPS: the mean per
    family); the node serves them in order of readiness."""
    rng = random.Random(seed)
    systems = {f: _tokens(rng, rng.randint(800, 1500)) for f in FAMILIES}
    weights = MIXES[name]
    families = rng.choices(list(weights), weights=list(weights.values()), k=workflows)
    pending = [(f, FAMILIES[f](f"{name}-{i}", random.Random(rng.random()), systems[f]))
               for i, f in enumerate(families)]
    pending.reverse()
    ready: list[tuple[float, int, str, Iterator[Request]]] = []     # (ready at, tie, family, workflow)
    now = 0.0
    out: list[Request] = []
    tie = 0
    while pending or ready:
        while pending and len(ready) < concurrency:
            f, w = pending.pop()
            tie += 1
            heapq.heappush(ready, (now + rng.expovariate(1.0), tie, f, w))
        at, _, f, w = heapq.heappop(ready)
        now = max(now, at)
        req = next(w, None)
        if req is None:
            continue
        req.hashes = chain_hashes(req.tokens, CHUNK)
        req.at = now
        out.append(req)
        now += SERVICE_S / concurrency                  # the node serves `concurrency` requests at a time
        tie += 1
        heapq.heappush(ready, (now + SERVICE_S + rng.gammavariate(shape, GAPS[f] / shape), tie, f, w))
    return out


# ----- offline replays -----
def next_uses(trace: list[Request]) -> list[list[int]]:
    """For each request, the index of the next request that uses each of its chunks (len(trace) if none)."""
    nxt: dict[bytes, int] = {}
    out: list[list[int]] = [[] for _ in trace]
    for i in range(len(trace) - 1, -1, -1):
        out[i] = [nxt.get(h, len(trace)) for h in trace[i].hashes]
        for h in trace[i].hashes:
            nxt[h] = i
    return out


def peak_live(trace: list[Request]) -> int:
    """The most chunks that are live at once (stored already and used again later): the capacity at which the
    ideal hit rate needs no eviction of anything still to be used."""
    return peak_of([r.hashes for r in trace])


def peak_of(chains: Sequence[Iterable[Hashable]]) -> int:
    """The most blocks live at once over requests' chains: a block is live from its first request to its last, if
    it has a later one (bench/agent_families.py sizes its pools by it too)."""
    first: dict[Hashable, int] = {}
    last: dict[Hashable, int] = {}
    for i, chain in enumerate(chains):
        for h in chain:
            first.setdefault(h, i)
            last[h] = i
    delta = [0] * (len(chains) + 1)
    for h, f in first.items():
        if last[h] > f:
            delta[f] += 1
            delta[last[h]] -= 1
    peak = cur = 0
    for d in delta:
        cur += d
        peak = max(peak, cur)
    return peak


def ideal_hits(trace: list[Request]) -> int:
    """Chunks hit with unbounded capacity (every chunk ever stored still there)."""
    seen: set[bytes] = set()
    hits = 0
    for r in trace:
        hits += next((k for k, h in enumerate(r.hashes) if h not in seen), len(r.hashes))
        seen.update(r.hashes)
    return hits


def hit_rates(trace: list[Request], capacity: int, policy: str) -> int:
    """Chunks hit when the trace is replayed offline through `capacity` chunks with `policy`: lru | oracle |
    workflow (kvstore.policy.workflow, with the trace's hints) | workflow-nohints."""
    if policy.startswith("workflow"):
        return _workflow(trace, capacity, hints=policy == "workflow")
    return (_lru if policy == "lru" else _oracle)(trace, capacity)


def _workflow(trace: list[Request], capacity: int, hints: bool, **kw: object) -> int:
    """The workflow-aware policy, offline, as the daemon applies it to a connector's requests: hints as an engine
    sends them (a call per request, the end after a workflow's last); the get touches the hit prefix head last;
    the put of the whole chain reserves the missing blocks (evicting as it goes), publishes them tail first and
    then refreshes the blocks stored already, tail first: the chain leaves tail first."""
    from kvstore.policy.workflow import WorkflowPolicy
    from kvstore.workflows import Touch, Workflows

    clock = [0.0]
    flows = Workflows(idle_s=float("inf"), clock=lambda: clock[0])
    pol = WorkflowPolicy(flows, **kw)  # type: ignore[arg-type]
    cached: set[bytes] = set()
    hits = 0
    for r in trace:
        clock[0] = r.at
        touch = None
        if hints:
            flows.call(r.workflow, r.agent, r.family)
            touch = Touch(r.workflow, r.agent)
        n = next((k for k, h in enumerate(r.hashes) if h not in cached), len(r.hashes))
        hits += n
        for h in reversed(r.hashes[:n]):
            pol.accessed(h, touch)
        new: list[bytes] = []
        for h in r.hashes[n:]:
            if h in cached or h in new:
                continue
            if len(cached) + len(new) >= capacity:
                v = pol.victim(0)
                if v is None:
                    break
                pol.removed(v)
                cached.discard(v)
            new.append(h)
        for h in reversed(new):
            pol.added(h, 0, touch)
            cached.add(h)
        for h in reversed(r.hashes):
            if h in cached and h not in new:
                pol.accessed(h, touch)
        if hints and r.last:
            flows.end(r.workflow)
    return hits


def _lru(trace: list[Request], capacity: int) -> int:
    cache: OrderedDict[bytes, None] = OrderedDict()
    hits = 0
    for r in trace:
        hits += next((k for k, h in enumerate(r.hashes) if h not in cache), len(r.hashes))
        for h in r.hashes:
            cache[h] = None
            cache.move_to_end(h)
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits


def _oracle(trace: list[Request], capacity: int) -> int:
    """Belady: on a miss with the cache full, drop the chunk whose next use is farthest (the incoming one too)."""
    uses = next_uses(trace)
    when: dict[bytes, int] = {}                 # cached chunk → its next use
    heap: list[tuple[int, bytes]] = []          # (-next use, chunk), lazily cleaned
    hits = 0
    for i, r in enumerate(trace):
        hits += next((k for k, h in enumerate(r.hashes) if h not in when), len(r.hashes))
        for h, nu in zip(r.hashes, uses[i]):
            if h not in when and len(when) >= capacity:
                while heap and when.get(heap[0][1]) != -heap[0][0]:
                    heapq.heappop(heap)
                if not heap or -heap[0][0] <= nu:
                    continue                    # bypass: every cached chunk is used before this one
                del when[heapq.heappop(heap)[1]]
            when[h] = nu
            heapq.heappush(heap, (-nu, h))
    return hits
