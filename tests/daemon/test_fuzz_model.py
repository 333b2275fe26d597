"""Random operation sequences against a live daemon, its books compared with a model (issue 13 part 5).

A seeded generator runs ≥ 10 k sequences under `make stress` (KVSTORE_FUZZ_SCALE=1; a tenth in the normal suite).
Each sequence opens a few connections and mixes hello, reserve, write (into the shared slot), commit (with and
without CRCs, sometimes unwritten, sometimes with the wrong CRC count or a key twice), abort, acquire, release (also
of slots the connection does not hold), lookup, delete (also of pinned blocks), evict (operator), and requests on
namespaces the connection never said hello to. Steps are either one request, or a burst: several connections each
pipeline a few requests at once over disjoint keys, so that every order the daemon may take gives the same
outcome. Connections are dropped mid-sequence, some with requests still unanswered (only requests whose effect the
drop undoes: reserve, acquire, release, abort, lookup).

The model predicts every reply when its request is generated (statuses, counts, prefixes, the slot of every pinned
block, its CRC), checks every pinned slot's bytes after each step (a pinned block is never overwritten, even when
deleted and stored again), that no two live blocks or reservations share a slot, and the daemon's books (blocks,
pinned slots, reservations) at sync points and at the end of each sequence; then every key of the universe is
looked up and every stored block read back byte-exact. The pool is sized so that nothing is ever evicted for space
(blocks of 4 and 8 KiB, a few dozen at most, far under half the pool per connection).
"""
from __future__ import annotations

import hashlib
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvstore.client import Client
from kvstore.protocol import VERSION, decode, encode
from kvstore.protocol.geometry import Geometry
from tests.conftest import DaemonProc, spec

try:
    from kvstore.checksum import crc32c as block_crc  # the writer's checksum, once end-to-end CRCs are in
except ImportError:  # pragma: no cover - before them
    from zlib import crc32 as block_crc

SCALE = float(os.environ.get("KVSTORE_FUZZ_SCALE", "0.1"))
SEED = int(os.environ.get("KVSTORE_FUZZ_SEED", "0")) or random.randrange(1 << 32)
SEQUENCES = max(200, int(10_000 * SCALE))
SMALL = Geometry(layers=1, tokens=16, kv_heads=2, head_dim=32, dtype="float16")      # 4 KiB: the smallest block
SPECS = [spec("seq-a"), spec("seq-b"), spec("seq-c", geometry=SMALL)]
UNIVERSE = 16                  # block hashes per namespace
Key = tuple[int, int]          # (namespace index, block index)

pytestmark = pytest.mark.timeout(int(240 + 3000 * SCALE))


def block_hash(k: Key) -> bytes:
    """The same hashes in every namespace: only the namespace keeps their blocks apart."""
    return hashlib.blake2b(f"block {k[1]}".encode(), digest_size=16).digest()


def content(k: Key, version: int) -> bytes:
    seed = hashlib.blake2b(f"{k}/{version}".encode(), digest_size=64).digest()
    return seed * (SPECS[k[0]].geometry.full_bytes // 64)


class Cell:
    """One slot's block instance: reserved, then maybe stored; its gid is learnt from the reserve's reply."""
    __slots__ = ("content", "crc", "gid", "key")

    def __init__(self, key: Key) -> None:
        self.key = key
        self.gid: int | None = None
        self.content: bytes | None = None      # what was written into the slot (None: not written)
        self.crc: int | None = None            # the CRC committed with it


@dataclass
class Expect:
    what: str
    code: str | None = None                    # the refusal's code; None: ok with `fields`
    fields: dict[str, Any] = field(default_factory=dict)
    slots: list[Cell | None] | None = None     # reserve: a new cell per RESERVED position, learnt from the reply


@dataclass(eq=False)
class Conn:
    name: str
    client: Client
    ns: set[int] = field(default_factory=set)                 # namespace indices said hello to
    reserved: dict[Key, Cell] = field(default_factory=dict)
    pins: Counter[Cell] = field(default_factory=Counter)
    waiting: list[Expect] = field(default_factory=list)

    def send(self, op: str, e: Expect, **fields: Any) -> None:
        self.client.sock.sendall(encode({"v": VERSION, "op": op, "id": len(self.waiting) + 1, **fields}))
        self.waiting.append(e)

    def read_all(self, where: str) -> None:
        for i, e in enumerate(self.waiting):
            body, _ = self.client._recv_frame(False)
            check(decode(body), i + 1, e, f"{where}, {self.name}: {e.what}")
        self.waiting = []


def gid_of(v: Any) -> Any:
    if isinstance(v, Cell):
        assert v.gid is not None
        return v.gid
    if isinstance(v, list):
        return [gid_of(x) for x in v]
    return v


def check(reply: dict[str, Any], rid: int, e: Expect, where: str) -> None:
    assert reply["id"] == rid, f"{where}: reply {reply} out of order"
    if e.code is not None:
        assert not reply["ok"] and reply["error"]["code"] == e.code, f"{where}: want {e.code}, got {reply}"
        return
    assert reply["ok"], f"{where}: {reply}"
    if e.slots is not None:                                    # reserve: learn the new cells' slots
        for cell, gid in zip(e.slots, reply["slots"], strict=True):
            if cell is None:
                assert gid == 0, f"{where}: a slot for a key not reserved: {reply}"
            else:
                assert gid > 0, f"{where}: no slot for a reserved key: {reply}"
                cell.gid = gid
    for name, want in e.fields.items():
        assert reply.get(name) == gid_of(want), f"{where}: {name} {reply.get(name)!r}, the model says {want!r}"


class Model:
    """The daemon's books as they must be: stored blocks, reservations and pins (a cell per slot instance)."""

    def __init__(self, checker: Client, ns_ids: list[int], rng: random.Random) -> None:
        self.checker = checker
        self.ns_ids = ns_ids
        self.rng = rng
        self.table: dict[Key, Cell] = {}
        self.pending: dict[Key, Cell] = {}
        self.pins: Counter[Cell] = Counter()
        self.version = 0

    # ----- requests: the model's prediction first, then the request -----
    def hello(self, c: Conn, si: int) -> None:
        c.ns.add(si)
        c.send("hello", Expect(f"hello {si}", fields={"ns": self.ns_ids[si]}), namespace=SPECS[si].to_dict())

    def _ns(self, c: Conn, op: str, si: int, keys: list[Key], **extra: Any) -> bool:
        """A keyed request on a namespace this connection never said hello to: sent, to be refused; True."""
        if si in c.ns:
            return False
        c.send(op, Expect(f"{op} on ns {si} without hello", "unknown_namespace"), ns=self.ns_ids[si],
               keys=b"".join(map(block_hash, keys)), **extra)
        return True

    def lookup(self, c: Conn, si: int, keys: list[Key]) -> None:
        if self._ns(c, "lookup", si, keys):
            return
        n = next((i for i, k in enumerate(keys) if k not in self.table), len(keys))
        c.send("lookup", Expect(f"lookup {keys}", fields={"n": n, "host": n}), ns=self.ns_ids[si],
               keys=b"".join(map(block_hash, keys)))

    def reserve(self, c: Conn, si: int, keys: list[Key]) -> None:
        if self._ns(c, "reserve", si, keys):
            return
        status, cells = [], []
        for k in keys:
            if k in self.table:
                status.append(1)
                cells.append(None)
            elif k in self.pending:
                status.append(2)
                cells.append(None)
            else:
                cell = c.reserved[k] = self.pending[k] = Cell(k)
                status.append(0)
                cells.append(cell)
        c.send("reserve", Expect(f"reserve {keys}", fields={"status": status}, slots=cells), ns=self.ns_ids[si],
               keys=b"".join(map(block_hash, keys)))

    def write(self, c: Conn, k: Key) -> None:
        """Fill a reserved slot (resolved and mapped) with the key's next content."""
        cell = c.reserved[k]
        self.version += 1
        cell.content = content(k, self.version)
        assert cell.gid is not None
        c.client.slot(cell.gid)[:] = memoryview(cell.content)

    def commit(self, c: Conn, si: int, keys: list[Key], crcs: str) -> None:
        """crcs: "none", "right" (one per key, of what was written), or "short" (one missing: refused)."""
        keys = [(si, i) for _, i in keys]
        values = [block_crc(c.reserved[k].content or b"") if k in c.reserved else 0 for k in keys]
        extra: dict[str, Any] = {"crcs": values[:-1] if crcs == "short" else values} if crcs != "none" else {}
        if self._ns(c, "commit", si, keys, **extra):
            return
        if crcs == "short" and keys:
            code: str | None = "bad_request"
        elif len(set(keys)) < len(keys):
            code = "bad_request"
        elif any(k not in c.reserved for k in keys):
            code = "not_found"
        else:
            code = None
            for k, crc in zip(keys, values):
                cell = c.reserved.pop(k)
                del self.pending[k]
                cell.crc = crc if crcs == "right" else None
                self.table[k] = cell
        c.send("commit", Expect(f"commit {keys} crcs {crcs}", code, fields={"n": len(keys)}), ns=self.ns_ids[si],
               keys=b"".join(map(block_hash, keys)), **extra)

    def abort(self, c: Conn, si: int, keys: list[Key]) -> None:
        if self._ns(c, "abort", si, keys):
            return
        n = 0
        for k in keys:
            if c.reserved.pop(k, None) is not None:
                del self.pending[k]
                n += 1
        c.send("abort", Expect(f"abort {keys}", fields={"n": n}), ns=self.ns_ids[si],
               keys=b"".join(map(block_hash, keys)))

    def acquire(self, c: Conn, si: int, keys: list[Key]) -> None:
        if self._ns(c, "acquire", si, keys):
            return
        cells = []
        for k in keys:
            if k not in self.table:
                break
            cell = self.table[k]
            c.pins[cell] += 1
            self.pins[cell] += 1
            cells.append(cell)
        c.send("acquire", Expect(f"acquire {keys}", fields={"slots": cells, "crcs": [x.crc for x in cells]}),
               ns=self.ns_ids[si], keys=b"".join(map(block_hash, keys)))

    def release(self, c: Conn, cells: list[Cell], stray: int | None) -> None:
        """Release pinned cells (resolved ones); with `stray`, also a slot this connection does not hold: refused,
        nothing released."""
        gids = [gid_of(x) for x in cells] + ([stray] if stray is not None else [])
        held = Counter(gids)
        ok = all(sum(n for x, n in c.pins.items() if x.gid == g) >= m for g, m in held.items())
        if ok:
            for x in cells:
                self._unpin(c, x)
        c.send("release", Expect(f"release {gids}", None if ok else "not_found", fields={"n": len(gids)}),
               slots=gids)

    def _unpin(self, c: Conn, cell: Cell) -> None:
        c.pins[cell] -= 1
        self.pins[cell] -= 1
        for counter in (c.pins, self.pins):
            if counter[cell] == 0:
                del counter[cell]

    def delete(self, c: Conn, si: int, keys: list[Key]) -> None:
        if self._ns(c, "delete", si, keys):
            return
        n = sum(self.table.pop(k, None) is not None for k in keys)
        c.send("delete", Expect(f"delete {keys}", fields={"n": n}), ns=self.ns_ids[si],
               keys=b"".join(map(block_hash, keys)))

    def evict(self, si: int | None) -> None:
        """The operator evicts every unpinned block (of one namespace): pinned ones stay."""
        gone = [k for k, cell in self.table.items() if cell not in self.pins and (si is None or k[0] == si)]
        for k in gone:
            del self.table[k]
        r = self.checker.evict(everything=True, ns=None if si is None else self.ns_ids[si])
        assert r["blocks"] == len(gone), f"evict {si}: {r}, the model says {len(gone)}"

    def drop(self, c: Conn) -> None:
        """The connection ends: its reservations are freed and its pins released."""
        for k in c.reserved:
            del self.pending[k]
        c.reserved.clear()
        for cell, n in list(c.pins.items()):
            for _ in range(n):
                self._unpin(c, cell)

    # ----- checks -----
    def live(self) -> set[Cell]:
        """Cells whose slot is allocated: stored, pinned (a deleted block until its last release) or reserved."""
        return set(self.table.values()) | set(self.pins) | set(self.pending.values())

    def check_books(self, where: str) -> None:
        s = self.checker.stats()
        live = self.live()
        got = (s["blocks"], s["pinned"], s["reserved"], s["tiers"][0]["used_bytes"])
        want = (len(self.table), len(self.pins), len(self.pending),
                sum(SPECS[cell.key[0]].geometry.full_bytes for cell in live))
        assert got == want, f"{where}: (blocks, pinned, reserved, used bytes) {got}, the model says {want}"
        gids = [cell.gid for cell in live if cell.gid is not None]
        assert len(gids) == len(set(gids)), f"{where}: two live blocks or reservations share a slot"

    def check_pinned_bytes(self, conns: list[Conn], where: str) -> None:
        for c in conns:
            for cell in c.pins:
                if cell.content is not None:
                    assert bytes(c.client.slot(gid_of(cell))) == cell.content, \
                        f"{where}: pinned block {cell.key} (slot {cell.gid:#x}) altered"

    def check_everything(self, where: str) -> None:
        """Each namespace's stored blocks listed (hash and slot) and looked up; every stored block acquired, read
        byte-exact and released."""
        for si, nid in enumerate(self.ns_ids):
            listed = {bytes(h): gid for h, gid in self.checker.list(ns=nid, limit=10 * UNIVERSE)["keys"]}
            want = {block_hash(k): gid_of(cell) for k, cell in self.table.items() if k[0] == si}
            assert listed == want, f"{where}: namespace {si} lists {listed}, the model says {want}"
        probe = Conn("checker", self.checker, set(range(len(SPECS))))
        for si, nid in enumerate(self.ns_ids):
            stored = [k for k in self.table if k[0] == si]
            absent = [(si, i) for i in range(UNIVERSE) if (si, i) not in self.table]
            probe.send("lookup", Expect(f"lookup ns {si}", fields={"n": len(stored)}), ns=nid,
                       keys=b"".join(map(block_hash, stored + absent[:1])))
            probe.send("lookup", Expect(f"lookup ns {si} absent", fields={"n": 0}), ns=nid,
                       keys=b"".join(map(block_hash, absent)))
            cells = [self.table[k] for k in stored]
            probe.send("acquire", Expect(f"acquire ns {si}", fields={"slots": cells, "crcs": [x.crc for x in cells]}),
                       ns=nid, keys=b"".join(map(block_hash, stored)))
        probe.read_all(where)
        for k, cell in self.table.items():
            if cell.content is not None:
                assert bytes(self.checker.slot(gid_of(cell))) == cell.content, f"{where}: block {k} altered"
        if self.table:
            self.checker.call("release", slots=[gid_of(cell) for cell in self.table.values()])


def settle(checker: Client, conns: int, where: str) -> None:
    """Until the daemon has ended the sessions of dropped connections (their holdings released)."""
    deadline = time.monotonic() + 30
    while checker.stats()["connections"] != conns + 1:
        assert time.monotonic() < deadline, f"{where}: the daemon did not end a dropped connection"
        time.sleep(0.002)


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
        model = Model(checker, [checker.namespace(s).id for s in SPECS], rng)
        for n in range(SEQUENCES):
            seed = rng.randrange(1 << 32)
            Sequence(d, model, random.Random(seed), f"sequence {n} (run seed {SEED})").run()
        s = checker.stats()
        assert s["errors"].get("internal", 0) == 0, f"the daemon answered `internal`; see {d.log_path}"
    assert d.proc is not None and d.proc.poll() is None
    print(f"\n{SEQUENCES} sequences, {len(model.table)} blocks stored at the end (seed {SEED})")
