"""The model of the daemon's books that tests/daemon/test_fuzz_model.py drives: what every reply must say, which
slots must be live, and what their bytes must be. A cell is one slot's block instance (reserved, then perhaps
stored and pinned); the model predicts each reply when its request is sent, and learns only what it cannot
predict — the slot the daemon picks for a reservation — from the reply."""
from __future__ import annotations

import hashlib
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvstore.checksum import crc32c as block_crc  # the writer's checksum (end-to-end CRC-32C)
from kvstore.client import Client
from kvstore.protocol import VERSION, decode, encode
from kvstore.protocol.geometry import Geometry
from tests.conftest import spec

SMALL = Geometry(layers=1, tokens=16, kv_heads=2, head_dim=32, dtype="float16")      # 4 KiB: the smallest block
SPECS = [spec("seq-a"), spec("seq-b"), spec("seq-c", geometry=SMALL)]
UNIVERSE = 16                  # block hashes per namespace
Key = tuple[int, int]          # (namespace index, block index)


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

    def __init__(self, checker: Client, ns_ids: list[int]) -> None:
        self.checker = checker
        self.ns_ids = ns_ids
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
        status: list[int] = []
        cells: list[Cell | None] = []
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
