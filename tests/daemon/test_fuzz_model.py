"""Random operation sequences against a live daemon, its books compared with a model (issue 13 part 5).

A seeded generator runs ≥ 10 k sequences under `make stress` (KVSTORE_FUZZ_SCALE=1; a tenth in the normal suite).
Each sequence opens a few connections and mixes hello, reserve, write (into the shared slot), commit (with and
without CRCs, sometimes unwritten, sometimes with the wrong CRC count or a key twice), abort, acquire, release (also
of slots the connection does not hold), lookup, delete (also of pinned blocks), evict (operator), and requests on
namespaces the connection never said hello to. Steps are either one request, or a burst: several connections each
pipeline a few requests at once over disjoint keys, so that every order the daemon may take gives the same
outcome. Connections are dropped mid-sequence, some with requests still unanswered (only requests whose effect the
drop undoes: reserve, acquire, release, abort, lookup).

The model (tests/daemon/books_model.py) predicts every reply when its request is generated (statuses, counts,
prefixes, the slot of every pinned block, its CRC), checks every pinned slot's bytes after each step (a pinned block
is never overwritten, even when deleted and stored again), that no two live blocks or reservations share a slot, and
the daemon's books (blocks, pinned slots, reservations, host bytes in use) at sync points and at the end of each
sequence; then each namespace's listing (hashes and slots) and lookups must equal the model's, and every stored
block is read back byte-exact. The run's seed is in every assertion message (KVSTORE_FUZZ_SEED replays a run).
The pool is sized so that nothing is ever evicted for space (blocks of 4 and 8 KiB, a few dozen at most, far under
half the pool per connection).
"""
from __future__ import annotations

import os
import random
from typing import Any

import pytest

from kvstore.client import Client
from tests.conftest import DaemonProc
from tests.daemon.books_model import SPECS, UNIVERSE, Cell, Conn, Key, Model, settle

SCALE = float(os.environ.get("KVSTORE_FUZZ_SCALE", "0.1"))
SEED = int(os.environ.get("KVSTORE_FUZZ_SEED", "0")) or random.randrange(1 << 32)
SEQUENCES = max(200, int(10_000 * SCALE))

pytestmark = pytest.mark.timeout(int(240 + 3000 * SCALE))


# ----- the generator -----

HOLDING_ONLY = ("lookup", "reserve", "acquire", "release", "abort")     # what a drop undoes whatever the daemon did
OPS = {"lookup": 2, "reserve": 3, "write": 2, "commit": 3, "abort": 1, "acquire": 2, "release": 2, "delete": 1,
       "hello": 0.5}


class Sequence:
    def __init__(self, d: DaemonProc, model: Model, rng: random.Random, where: str) -> None:
        self.d = d
        self.m = model
        self.rng = rng
        self.where = where
        self.conns: list[Conn] = []
        self.made = 0

    def connect(self) -> Conn:
        self.made += 1
        c = Conn(f"conn {self.made}", Client(self.d.socket, timeout=30))
        self.conns.append(c)
        for si in self.rng.sample(range(len(SPECS)), self.rng.randint(0, len(SPECS))):
            self.m.hello(c, si)
        c.read_all(self.where)
        return c

    def run(self) -> None:
        r = self.rng
        for _ in range(r.randint(1, 4)):
            self.connect()
        for step in range(r.randint(2, 12)):
            where = f"{self.where}, step {step}"
            roll = r.random()
            if roll < 0.45:
                c = r.choice(self.conns)
                self.op(c, None, OPS)
                c.read_all(where)
            elif roll < 0.75:
                self.burst(where)
            elif roll < 0.83:
                self.drop(r.choice(self.conns), where)
                if not self.conns or r.random() < 0.7:
                    self.connect()
            elif roll < 0.87:
                self.m.evict(r.choice([None, *range(len(SPECS))]))
            else:
                self.m.check_books(where)
            self.after_step(where)
        self.m.check_books(f"{self.where}, end")
        self.m.check_everything(f"{self.where}, end")
        for c in list(self.conns):
            self.drop(c, f"{self.where}, closing")
        self.m.check_books(f"{self.where}, closed")

    def burst(self, where: str) -> None:
        """Several connections pipeline requests at once, each on its own keys: any interleaving, one outcome."""
        m = len(self.conns)
        offset = self.rng.randrange(UNIVERSE)
        todo = {id(c): self.rng.randint(1, 6) for c in self.conns}
        while any(todo.values()):
            for j, c in enumerate(self.conns):
                if todo[id(c)]:
                    todo[id(c)] -= 1
                    self.op(c, {i for i in range(UNIVERSE) if (i + offset) % m == j}, OPS)
        for c in self.conns:
            c.read_all(where)

    def drop(self, c: Conn, where: str) -> None:
        """Close a connection, sometimes with requests it never reads the replies of."""
        if self.rng.random() < 0.5:
            for _ in range(self.rng.randint(1, 5)):
                self.op(c, None, {op: OPS[op] for op in HOLDING_ONLY})
        c.client.close()
        self.conns.remove(c)
        self.m.drop(c)
        settle(self.m.checker, len(self.conns), where)

    def after_step(self, where: str) -> None:
        for c in self.conns:
            for cell in [*c.reserved.values(), *c.pins]:
                if cell.gid is not None:
                    c.client.slot(cell.gid)           # mapped now: writes in a burst need no round trip
        self.m.check_pinned_bytes(self.conns, where)

    # ----- one request -----
    def keys(self, si: int, part: set[int] | None) -> list[Key]:
        r = self.rng
        allowed = sorted(part if part is not None else range(UNIVERSE))
        if r.random() < 0.8:
            start = r.randrange(len(allowed))
            idx = allowed[start:start + r.randint(1, 5)]
        else:
            idx = r.sample(allowed, min(len(allowed), r.randint(1, 4)))
        if r.random() < 0.05:
            idx.append(r.choice(idx))                          # a key twice in one request
        return [(si, i) for i in idx]

    def op(self, c: Conn, part: set[int] | None, weights: dict[str, float]) -> None:
        r, m = self.rng, self.m
        kind = r.choices(list(weights), list(weights.values()))[0]
        si = r.choice(sorted(c.ns)) if c.ns and r.random() < 0.9 else r.randrange(len(SPECS))

        def mine(cells: Any) -> list[Cell]:
            return [x for x in cells if x.gid is not None and (part is None or x.key[1] in part)]
        if kind == "write" and (ready := mine(c.reserved.values())):
            m.write(c, r.choice(ready).key)
        elif kind == "commit" and (ready := mine(c.reserved.values())):
            si = r.choice(ready).key[0]
            ready = [x for x in ready if x.key[0] == si or r.random() < 0.05]      # rarely: another namespace's
            keys = [x.key for x in r.sample(ready, r.randint(1, min(4, len(ready))))]
            if r.random() < 0.1:
                keys.append(r.choice(keys) if r.random() < 0.5 else self.keys(si, part)[0])
            for k in keys:
                cell = c.reserved.get(k)
                if cell is not None and cell.gid is not None and cell.content is None and r.random() < 0.8:
                    m.write(c, k)
            m.commit(c, si, keys, r.choices(["right", "none", "short"], [7, 2, 1])[0])
        elif kind == "abort" and (ready := mine(c.reserved.values())):
            m.abort(c, si, [x.key for x in ready if x.key[0] == si] or self.keys(si, part))
        elif kind == "release" and (ready := mine(c.pins.elements())):
            cells = r.sample(ready, r.randint(1, len(ready)))
            m.release(c, cells, r.choice([None] * 9 + [0x7FFF_0000_0000 | r.randrange(64)]))
        elif kind == "hello":
            m.hello(c, r.randrange(len(SPECS)))
        elif kind in ("lookup", "reserve", "acquire", "delete"):
            getattr(m, kind)(c, si, self.keys(si, part))
        else:
            m.reserve(c, si, self.keys(si, part))


def test_random_sequences_match_the_model(start_daemon):
    d = start_daemon(capacity="64MiB", segment="1MiB", env={"KVSTORE_LOG_LEVEL": "info"})
    rng = random.Random(SEED)
    with d.client() as checker:
        model = Model(checker, [checker.namespace(s).id for s in SPECS])
        for n in range(SEQUENCES):
            seed = rng.randrange(1 << 32)
            Sequence(d, model, random.Random(seed), f"sequence {n} (run seed {SEED})").run()
        s = checker.stats()
        assert s["errors"].get("internal", 0) == 0, f"the daemon answered `internal`; see {d.log_path}"
    assert d.proc is not None and d.proc.poll() is None
    print(f"\n{SEQUENCES} sequences, {len(model.table)} blocks stored at the end (seed {SEED})")
