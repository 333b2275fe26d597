"""Agent-trace families written apart from bench/workflows.py (issue 34 part 2): four call graphs with four gap
distributions, each a seeded, deterministic stream of events a node's engine and its agent framework see.

A prompt is a chain of blocks (one block = CHUNK tokens), prefix-shared as real prompts are: whatever comes first in
the prompt (a family's system prompt, an agent's role prompt, a shared document, the conversation so far, tool
outputs) is the same blocks for every prompt that starts the same way. A block's id is a hash of its parent's id
and its own content, so two prompts share exactly their common leading pieces — never a block after they differ.

Families (the gap between two calls of one workflow: the engine's decode plus whatever the agent waits on):
- `toolloop`  an assistant calls tools in a loop (geometric number of rounds), each tool's output appended to the
  conversation; sometimes a summarizer closes. Tool waits are heavy-tailed (lognormal, σ = 1.4: most tools answer
  in a second or two, some in minutes). Reuse: the conversation, by the next call of the same agent.
- `mapreduce` a planner fans out to 2..8 workers, each over one document of a shared corpus (Zipf popularity), each
  worker calls twice (read, then check); a reducer continues the planner's conversation with every worker's
  notes. Gaps are memoryless (exponential). Reuse: documents across workflows, the planner's prefix by the reducer
  after the whole map phase, a worker's prompt by its own second call.
- `debate`    2..4 agents take turns for 2..6 rounds; each agent's prompt is its own role prompt, then the topic and
  the transcript so far, so an agent reuses only its own earlier prompts (a later agent does not inherit).
  Between turns a decode's short wait; between rounds a human's think time, bimodal (a few seconds, or a minute).
- `retrieval` multi-hop question answering over a shared corpus: a retriever picks documents (Zipf popularity), a
  reader reads [reader prompt][the top documents][question][notes], 1..3 hops, each hop adding documents after
  the ones before. Gaps are gamma (shape 2). Reuse: reader prompt + popular leading documents across workflows,
  the hop's prompt by the next hop.
- `pipeline`  a static pipeline of four stages over one input document (Zipf popularity); each stage's prompt is
  its own role prompt, then the document, then the outputs of the stages before — so no stage rereads another's
  blocks (issue 34: the convention that later agents inherit does not hold). Gaps are Weibull (shape 0.7: a batch
  job's queueing, many short waits and a long tail). Reuse: a stage's role prompt, and a popular document under
  it, across workflows only.
- `coding`    a coding agent over shared repository files (1..4, Zipf): a planner, then attempts (geometric, up to
  6), each a coder's fresh attempt from the plan and a tester's run of it; a failed attempt is dropped, the next
  starts from the plan again. Gaps: a test suite's run (exponential, 8 s) between coder and tester, a decode
  between attempts. Reuse: the system prompt and popular files across workflows, the plan by every attempt, an
  attempt by its test.
- `factcheck` (session 26, held out) a claim checked by branching sub-queries: a decomposer splits the claim, then
  2..5 sub-queries run side by side, each a searcher's call branching from the claim and a verifier's over the
  evidence (the evidence's leading document shared across workflows, Zipf), retried with a refined search when the
  evidence is thin (up to 2 retries, each extending the sub-query's own chain); an aggregator extends the
  decomposer's chain with every verdict. Search waits are Pareto (α = 1.5: heavy-tailed, unlike the lognormal).
- `chat` (session 26, held out) multi-turn chat sessions: a system prompt, sometimes a shared document, then turns
  (geometric, mean 5, up to 30); between turns the user reads and types (exponential, 6 s) or leaves and comes back
  (uniform, 2 to 6 minutes, one turn in four). Reuse: the conversation, by its next turn; the document across
  sessions.

Hints are what a framework knows at call time only (`Event.hint()`): a workflow's begin, each call with its
workflow, type, agent, step and the family's possible next agents (`GRAPH`, the static call graph — never which
one comes), and its end once its last call returned (after the last request, never announced with it); never
timing. HELD_OUT names the families kept aside while the workflow policy was designed (judged only at the end):
debate until session 24 (it has been in the design loop since), factcheck and chat since session 26.

    from agent_families import trace
    events = trace("toolloop", workflows=60, seed=3)     # begin / call / end events in time order
"""
from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

CHUNK = 256                                  # tokens a block
HELD_OUT = ("factcheck", "chat")             # kept aside while the policy was designed (issue 34 part 2)
END = "<end>"
GRAPH: dict[str, dict[str, tuple[str, ...]]] = {      # family → agent → the agents that may come next (or END)
    "toolloop": {"assistant": ("assistant", "summarizer", END), "summarizer": (END,)},
    "mapreduce": {"planner": ("worker",), "worker": ("worker", "reducer"), "reducer": (END,)},
    "debate": {"proposer": ("opponent", "judge", "proposer"), "opponent": ("proposer", "judge", "critic"),
               "critic": ("proposer", "judge"), "judge": ("proposer", END)},
    "retrieval": {"retriever": ("reader",), "reader": ("retriever", END)},
    "pipeline": {"extract": ("classify",), "classify": ("summarize",), "summarize": ("format",), "format": (END,)},
    "coding": {"planner": ("coder",), "coder": ("tester",), "tester": ("coder", END)},
    "factcheck": {"decomposer": ("searcher",), "searcher": ("verifier",), "verifier": ("searcher", "aggregator"),
                  "aggregator": (END,)},
    "chat": {"assistant": ("assistant", END)},
}
PIPELINE = ("extract", "classify", "summarize", "format")
FAMILIES = tuple(GRAPH)


@dataclass
class Event:
    """One thing the node sees, at `at` seconds: a workflow's begin, a call (a request: its prompt's `blocks`),
    or its end."""
    at: float
    kind: str                                # begin | call | end
    workflow: str
    family: str
    agent: str = ""
    step: int = 0
    blocks: list[int] = field(default_factory=list)

    def hint(self) -> dict[str, Any]:
        """What the framework tells the daemon (call-time knowledge only: no timing, no future)."""
        if self.kind != "call":
            return {"kind": self.kind, "workflow": self.workflow, "type": self.family}
        return {"kind": "call", "workflow": self.workflow, "type": self.family, "agent": self.agent,
                "step": self.step, "next": [a for a in GRAPH[self.family][self.agent] if a != END]}


# ----- prompts as chains of blocks -----
def _h(*parts: object) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


class Prompt:
    """A growing prompt: pieces of whole blocks, each block's id hashed from its parent's and its content."""

    def __init__(self, chain: list[int] | None = None) -> None:
        self.chain = list(chain or [])

    def add(self, content: object, n: int) -> Prompt:
        for j in range(max(0, n)):
            self.chain.append(_h(self.chain[-1] if self.chain else 0, content, j))
        return self

    def fork(self) -> Prompt:
        return Prompt(self.chain)


@dataclass
class Ctx:
    """What a family's workflow draws from: its own rng, the family's shared pieces, its id."""
    wid: str
    rng: random.Random
    corpus: list[int]                        # shared documents: their sizes in blocks (id = index)
    zipf: list[float]                        # cumulative popularity of the corpus' documents

    def doc(self) -> int:
        return min(len(self.corpus) - 1, _bisect(self.zipf, self.rng.random()))

    def new(self, n: int) -> tuple[str, int]:
        """A fresh piece of n blocks (this workflow's own content)."""
        return (f"{self.wid}/{self.rng.random()}", n)


def _bisect(cum: list[float], x: float) -> int:
    lo, hi = 0, len(cum)
    while lo < hi:
        mid = (lo + hi) // 2
        if cum[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


# A family's workflow yields (delay since its previous call, agent, prompt); its end comes after its last call's
# reply (DECODE_S). Parallel branches (map-reduce's workers) are yielded in their own time order.
Step = tuple[float, str, list[int]]
DECODE_S = 1.0


def toolloop(c: Ctx) -> Iterator[Step]:
    r = c.rng
    p = Prompt().add("toolloop/system", 6).add("toolloop/tools", 4).add(*c.new(r.randint(1, 4)))
    rounds = 1 + min(int(r.expovariate(1 / 5)), 24)
    delay = 0.0
    for _ in range(rounds):
        yield delay, "assistant", p.fork().chain
        p.add(*c.new(1))                                        # the assistant's tool call
        p.add(*c.new(r.choice((1, 1, 2, 3, 6))))               # the tool's output
        delay = DECODE_S + r.lognormvariate(math.log(2.0), 1.4)  # heavy-tailed tool wait
    if r.random() < 0.4:
        yield delay, "summarizer", p.add("toolloop/summarize", 1).chain


def mapreduce(c: Ctx) -> Iterator[Step]:
    r = c.rng
    plan = Prompt().add("mapreduce/planner", 5).add(*c.new(r.randint(1, 3)))
    yield 0.0, "planner", plan.chain
    plan.add(*c.new(1))
    mean = 3.0
    start = r.expovariate(1 / mean)
    calls: list[tuple[float, int, list[int]]] = []
    notes = []
    for i in range(r.randint(2, 8)):
        d = c.doc()
        w = Prompt().add("mapreduce/worker", 3).add(("doc", d), c.corpus[d]).add(*c.new(1))
        t1 = start + r.expovariate(1 / mean)
        calls.append((t1, i, w.fork().chain))
        w.add(*c.new(1)).add("mapreduce/check", 1)
        t2 = t1 + DECODE_S + r.expovariate(1 / mean)
        calls.append((t2, i, w.chain))
        notes.append((t2, c.new(1)))
    t = 0.0
    for at, _, chain in sorted(calls):
        yield at - t, "worker", chain
        t = at
    done = max(at for at, _ in notes)
    for _, piece in sorted(notes):
        plan.add(*piece)
    yield done + DECODE_S + r.expovariate(1 / mean) - t, "reducer", plan.add("mapreduce/reduce", 1).chain


def debate(c: Ctx) -> Iterator[Step]:
    r = c.rng
    agents = ["proposer", "opponent", "critic"][:r.randint(2, 3)]
    topic = c.new(r.randint(1, 3))
    transcript: list[tuple[str, int]] = []      # each agent's prompt: its role, the topic, then these

    def prompt(role: str, n: int) -> list[int]:
        p = Prompt().add(f"debate/{role}", n).add(*topic)
        for piece in transcript:
            p.add(*piece)
        return p.chain

    delay = 0.0
    for _ in range(r.randint(2, 6)):
        for a in agents:
            yield delay, a, prompt(a, 4)
            transcript.append(c.new(1))
            delay = DECODE_S * r.uniform(0.5, 1.5)
        delay = r.uniform(1, 4) if r.random() < 0.6 else r.uniform(40, 90)     # the human thinks (bimodal)
    yield delay, "judge", prompt("judge", 3)


def retrieval(c: Ctx) -> Iterator[Step]:
    r = c.rng
    question = c.new(1)
    docs: list[int] = []
    notes: list[tuple[str, int]] = []
    delay = 0.0
    for hop in range(r.choice((1, 1, 2, 2, 3))):
        yield delay, "retriever", Prompt().add("retrieval/retriever", 2).add(*question).add(*c.new(hop)).chain
        for _ in range(r.randint(2, 3)):
            d = c.doc()
            if d not in docs:
                docs.append(d)
        delay = DECODE_S + r.gammavariate(2.0, 1.5)
        p = Prompt().add("retrieval/reader", 3)
        for d in docs:
            p.add(("doc", d), c.corpus[d])
        p.add(*question)
        for n in notes:
            p.add(*n)
        yield delay, "reader", p.chain
        notes.append(c.new(1))
        delay = DECODE_S + r.gammavariate(2.0, 1.5)


def pipeline(c: Ctx) -> Iterator[Step]:
    r = c.rng
    doc = c.doc()
    outputs: list[tuple[str, int]] = []
    delay = 0.0
    for stage in PIPELINE:
        p = Prompt().add(f"pipeline/{stage}", 3).add(("doc", doc), c.corpus[doc])
        for out in outputs:
            p.add(*out)
        yield delay, stage, p.chain
        outputs.append(c.new(r.randint(1, 2)))
        delay = DECODE_S + r.weibullvariate(2.0, 0.7)       # a batch job's queueing: many short, a long tail


def coding(c: Ctx) -> Iterator[Step]:
    r = c.rng
    base = Prompt().add("coding/system", 4)
    for _ in range(r.randint(1, 4)):
        d = c.doc()
        base.add(("file", d), c.corpus[d])
    base.add(*c.new(1))                                         # the issue
    yield 0.0, "planner", base.chain
    base.add(*c.new(1))                                         # the plan
    delay = DECODE_S + r.uniform(0.5, 2.0)
    for _ in range(1 + min(int(r.expovariate(1 / 1.5)), 5)):
        attempt_p = base.fork().add(*c.new(2))                  # a fresh attempt from the plan
        yield delay, "coder", attempt_p.chain
        attempt_p.add(*c.new(1))
        delay = DECODE_S + r.expovariate(1 / 8.0)               # the test suite runs
        yield delay, "tester", attempt_p.add("coding/test", 1).chain
        delay = DECODE_S * r.uniform(0.5, 1.5)
        if r.random() < 0.35:
            break


def factcheck(c: Ctx) -> Iterator[Step]:
    r = c.rng
    claim = Prompt().add("factcheck/system", 4).add(*c.new(r.randint(1, 2)))
    yield 0.0, "decomposer", claim.chain
    claim.add(*c.new(1))                                        # the sub-queries
    start = DECODE_S * r.uniform(0.5, 1.5)
    calls: list[tuple[float, str, list[int]]] = []
    verdicts = []
    for _ in range(r.randint(2, 5)):
        sub = c.new(1)
        q = claim.fork().add(*sub)                              # a sub-query branches from the claim
        d = c.doc()
        verify = Prompt().add("factcheck/verifier", 2).add(("doc", d), c.corpus[d]).add(*sub)
        t = start + r.uniform(0.0, 1.0)
        for _ in range(1 + (r.random() < 0.35) + (r.random() < 0.15)):
            calls.append((t, "searcher", q.fork().chain))
            q.add(*c.new(1))                                    # the search call
            t += DECODE_S + r.paretovariate(1.5)               # the search engine answers (heavy-tailed)
            evidence = c.new(r.randint(1, 2))
            q.add(*evidence)
            calls.append((t, "verifier", verify.add(*evidence).fork().chain))
            t += DECODE_S * r.uniform(0.5, 1.5)
        verdicts.append((t, c.new(1)))
    at = 0.0
    for when, agent, chain in sorted(calls, key=lambda x: x[0]):
        yield when - at, agent, chain
        at = when
    for _, piece in sorted(verdicts):
        claim.add(*piece)
    yield max(t for t, _ in verdicts) + DECODE_S - at, "aggregator", claim.add("factcheck/aggregate", 1).chain


def chat(c: Ctx) -> Iterator[Step]:
    r = c.rng
    p = Prompt().add("chat/system", 5)
    if r.random() < 0.5:
        d = c.doc()
        p.add(("doc", d), c.corpus[d])                          # a shared document the session is about
    p.add(*c.new(r.randint(1, 3)))
    delay = 0.0
    for _ in range(1 + min(int(r.expovariate(1 / 4)), 29)):
        yield delay, "assistant", p.fork().chain
        p.add(*c.new(1)).add(*c.new(r.randint(1, 2)))          # the reply, the user's next message
        delay = DECODE_S + (r.expovariate(1 / 6.0) if r.random() < 0.75 else r.uniform(120, 360))


FAMILY: dict[str, Callable[[Ctx], Iterator[Step]]] = {
    "toolloop": toolloop, "mapreduce": mapreduce, "debate": debate, "retrieval": retrieval, "pipeline": pipeline,
    "coding": coding, "factcheck": factcheck, "chat": chat}
CONCURRENCY = {"toolloop": 12, "mapreduce": 6, "debate": 10, "retrieval": 10, "pipeline": 12, "coding": 8,
               "factcheck": 6, "chat": 16}


def trace(family: str, workflows: int, seed: int = 1, concurrency: int | None = None) -> list[Event]:
    """`workflows` workflows of one family, arriving as a Poisson process at the rate that keeps `concurrency` of
    them live on average (from their own mean duration): begin, call and end events in time order."""
    rng = random.Random(f"{family}/{seed}")
    corpus = [rng.randint(2, 12) for _ in range(200)]
    weights = [1 / (i + 1) for i in range(len(corpus))]              # Zipf(1)
    total = sum(weights)
    zipf = list(_cumulate([w / total for w in weights]))
    runs = []
    for i in range(workflows):
        c = Ctx(f"{family}-{i}", random.Random(rng.random()), corpus, zipf)
        t, steps = 0.0, []
        for delay, agent, chain in FAMILY[family](c):
            t += delay
            steps.append((t, agent, chain))
        runs.append((c.wid, steps))
    mean = sum(steps[-1][0] + DECODE_S for _, steps in runs) / len(runs)
    gap = mean / (concurrency or CONCURRENCY[family])
    out: list[tuple[float, int, Event]] = []
    at, seq = 0.0, 0
    for wid, steps in runs:
        at += rng.expovariate(1 / gap)
        out.append((at, seq, Event(at, "begin", wid, family)))
        for n, (t, agent, chain) in enumerate(steps, 1):
            out.append((at + t, seq + n, Event(at + t, "call", wid, family, agent, n, chain)))
        end = at + steps[-1][0] + DECODE_S
        out.append((end, seq + len(steps) + 1, Event(end, "end", wid, family)))
        seq += len(steps) + 2
    return [e for _, _, e in sorted(out, key=lambda x: (x[0], x[1]))]


def _cumulate(xs: list[float]) -> Iterator[float]:
    s = 0.0
    for x in xs:
        s += x
        yield s


def calls(events: list[Event]) -> list[Event]:
    return [e for e in events if e.kind == "call"]


def peak_live(events: list[Event]) -> int:
    """The most blocks live at once (stored already and used again later): the working set the pool is sized by."""
    from workflows import peak_of  # a measurement shared with bench_workflows' generator, nothing else

    return peak_of([e.blocks for e in calls(events)])
