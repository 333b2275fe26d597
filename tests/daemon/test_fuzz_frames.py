"""Hostile frames at scale (issue 13 part 5, RELIABILITY 11): a seeded generator sends ≥ 100 k hostile frames under
`make stress` (KVSTORE_FUZZ_SCALE=1; 20 k in the normal suite) over several pipelined connections at once:
random bytes, truncated frames, wrong types, huge declared lengths, deep nesting, unknown ops, extra fields,
msgpack ext types and timestamps, bools and floats and negative or oversize integers where integers belong,
oversize key blobs, containers declaring more elements than a request holds, non-UTF-8 strings, integer map
keys, trailing bytes, frames up to exactly the size limit, and schema-valid requests with hostile content
(namespaces not said hello to, slots not held, keys not reserved).

Every frame gets the reply an independent statement of the validation order predicts (the precise code and the
echoed id), or — for a frame that cannot be parsed — a `bad_frame` error and then a disconnect, or for a truncated
frame a silent disconnect. After each batch of connections: no connection, reservation or pin is left behind, the
daemon has answered no request with `internal`, a fresh client's ping succeeds, and a reference client's blocks
round-trip byte-exact. The seed of a failing batch is in the assertion message (KVSTORE_FUZZ_SEED replays a run).
"""
from __future__ import annotations

import hashlib
import os
import random
import socket
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack
import pytest

from kvstore.client import Client
from kvstore.protocol import FrameReader
from kvstore.protocol.schemas import SCHEMAS
from tests.conftest import GEOM, DaemonProc, spec
from tests.request_model import MAX_INT, MAX_KEYS, expected_code

SCALE = float(os.environ.get("KVSTORE_FUZZ_SCALE", "0.1"))
SEED = int(os.environ.get("KVSTORE_FUZZ_SEED", "0")) or random.randrange(1 << 32)
FRAMES = max(20_000, int(100_000 * SCALE))     # cheap: a fifth of them even in the normal suite
CONNECTIONS = 4            # hostile connections open at once in a batch
DEPTH = 24                 # frames a connection sends before it reads their replies
MAX_FRAME = 1 << 20        # server.max_frame_bytes (default)
MAX_ARRAY, MAX_MAP = 2 * MAX_KEYS + 16, 64     # what the daemon decodes at most (protocol.frames.Limits)
SEGMENT = 1 << 20
# codes a schema-valid request must never get (a later cap may refuse it with a code of its own: any other)
FATAL = {"internal", "bad_frame", "bad_version", "unknown_op"}
BASELINE = 2               # the checker's and the reference client's connections

pytestmark = pytest.mark.timeout(int(240 + 2400 * SCALE))


# ----- frames and their expected replies (the validation order: tests.request_model) -----

def reply_id(msg: dict[Any, Any]) -> int:
    return msg["id"] if type(msg.get("id")) is int else 0


def local_decode(body: bytes) -> dict[Any, Any] | None:
    """What the protocol accepts: plain msgpack, one map, str or bin keys, UTF-8 strings, no ext types."""
    def no_ext(code: int, data: bytes) -> Any:
        raise ValueError(code)
    try:
        msg = msgpack.unpackb(body, raw=False, strict_map_key=True, max_ext_len=0, ext_hook=no_ext,
                              max_array_len=MAX_ARRAY, max_map_len=MAX_MAP)
    except Exception:
        return None
    return msg if isinstance(msg, dict) else None


# ----- the generator -----

WRONG = [True, False, -1, -(1 << 63), MAX_INT + 1, (1 << 64) - 1, 1.0, 0.5, float("nan"), float("-inf"), "1",
         "", b"\x01", b"", [1], [], {"a": 1}, {}, None, "x" * 300, [0] * (MAX_KEYS + 1), [-1], [True], [1.5],
         [None], bytes(17), bytes(16 * (MAX_KEYS + 1)), "k" * 16, [bytes(16)], [[1]]]


def frame(body: bytes) -> bytes:
    return struct.pack("<I", len(body)) + body


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


@dataclass
class Frame:
    data: bytes
    rid: int = 0
    code: str | None = None        # expected error code; None: ok, or a refusal by the op (never a FATAL code)
    closes: bool = False           # a bad_frame reply and then a disconnect (no reply at all when `silent`)
    silent: bool = False


@dataclass
class Gen:
    rng: random.Random
    ns_ids: list[int]                           # namespaces the checker registered (known ids)
    ns_dicts: list[dict[str, Any]]
    keys: list[bytes] = field(default_factory=list)   # key blobs this connection sent lately
    ids: Iterator[int] = field(default_factory=lambda: iter(range(1, 1 << 40)))

    def value(self, kind: str) -> Any:
        r = self.rng
        if kind == "int":
            return r.choice([0, 1, r.randrange(1, 64), r.randrange(MAX_INT), MAX_INT, *self.ns_ids])
        if kind == "bool":
            return r.random() < 0.5
        if kind == "str":
            return r.choice(["", "critical", "prefetch", "host", "ssd", "x" * r.randrange(257)])
        if kind in ("id", "prio"):
            return r.choice(["", "w1", "session:s", "é" * r.randrange(100, 130), "x" * r.randrange(257), *(
                [r.randrange(MAX_INT)] if kind == "prio" else [])])
        if kind == "ids":
            return [r.choice(["a", "b", "x" * 257]) for _ in range(r.randrange(18))]
        if kind == "map":
            bad_geometry = {**GEOM.to_dict(), "kv": r.choice([0, 3, 1.0])}
            return r.choice([{}, {"model": "m"}, {"a": [1, {"b": None}]}, *self.ns_dicts,
                             {**r.choice(self.ns_dicts), "geometry": bad_geometry}])
        if kind == "ints":
            return [r.choice([0, r.randrange(1, 8) << 32 | r.randrange(256), r.randrange(MAX_INT)])
                    for _ in range(r.randrange(6))]
        if kind == "keys":
            if self.keys and r.random() < 0.5:
                return r.choice(self.keys)
            blob = r.randbytes(16 * r.randrange(0, 9))
            self.keys = (self.keys + [blob])[-8:]
            return blob
        return None

    def valid(self) -> dict[Any, Any]:
        """A schema-valid request with hostile content; admin ops only in forms that leave the pool's size."""
        op = self.rng.choice(sorted(SCHEMAS))
        msg: dict[Any, Any] = {"v": 1, "op": op, "id": next(self.ids)}
        for name, (kind, required) in SCHEMAS[op].items():
            if required or self.rng.random() < 0.5:
                msg[name] = self.value(kind)
        if op == "resize" and msg.get("tier", "host") == "host":
            msg["bytes"] = self.rng.randrange(SEGMENT)            # below a segment: refused, the pool unchanged
        return msg

    def mutate(self, msg: dict[Any, Any]) -> None:
        r = self.rng
        what = r.choice(["v", "id", "op", "op", "extra", "missing", "wrong", "wrong", "wrong", "keys", "bytes_name"])
        op = msg.get("op")
        schema = SCHEMAS.get(op, {}) if isinstance(op, str) else {}
        if what == "v":
            msg["v"] = r.choice([0, 2, True, 1.0, "1", None, -1, [1]]) if r.random() < 0.9 else msg.pop("v")
        elif what == "id":
            msg["id"] = r.choice(WRONG)
        elif what == "op":
            msg["op"] = r.choice([r.choice(WRONG), "PING", "ping ", "", "x" * 300, "__init__", "HANDLERS",
                                  r.randbytes(4).hex()])
        elif what == "extra":
            msg[r.choice(["x", "ns2", "_emit", "stream ", "tier", "crcs", "all"])] = r.choice(WRONG)
        elif what == "bytes_name":
            msg[r.randbytes(r.randrange(1, 6))] = 1
        elif what == "missing" and schema:
            msg.pop(r.choice(sorted(schema)), None)
        elif what == "wrong" and schema:
            msg[r.choice(sorted(schema))] = r.choice(WRONG)
        elif what == "keys":
            msg["keys"] = r.choice([r.randbytes(r.randrange(1, 64)), bytes(16 * r.randrange(MAX_KEYS + 1, 1200))])

    def soft(self) -> Frame:
        """A frame that decodes to a map: refused with a precise code (or answered) and the connection stays."""
        r = self.rng
        msg = self.valid()
        for _ in range(r.choice([0, 1, 1, 1, 2, 3])):
            self.mutate(msg)
        roll = r.random()
        if roll < 0.01:                 # nested containers, decodable (under msgpack's 1024): an unknown field
            body = pack(msg)
            level = b"\x81\xa1a" if r.random() < 0.5 else b"\x91"
            body = bytes([body[0] + 1]) + body[1:] + pack("deep") + level * r.randrange(1, 1000) + b"\xc0"
            msg["deep"] = None
            return Frame(frame(body), reply_id(msg), expected_code(msg))
        if roll < 0.012:                # a frame of up to exactly the limit: an unknown field
            msg["big"] = ""
            msg["big"] = "b" * (MAX_FRAME - len(pack(msg)) - 4 - r.choice([0, 1, r.randrange(200)]))
        return Frame(frame(pack(msg)), reply_id(msg), expected_code(msg))

    def hard(self) -> Frame:
        """A last frame: unparseable (bad_frame, then closed), truncated or oversize; or random bytes."""
        r = self.rng
        base = pack(self.valid())
        kind = r.randrange(13)
        if kind == 0:
            body = r.randbytes(r.randrange(1, 200))
            msg = local_decode(body)
            if msg is not None:
                return Frame(frame(body), reply_id(msg), expected_code(msg))
            return Frame(frame(body), closes=True)
        if kind == 1:
            not_a_map = r.choice([1, -5, "ping", b"x", [1, 2], None, 1.5, True, [{"v": 1}]])
            return Frame(frame(pack(not_a_map)), closes=True)
        if kind == 2:
            return Frame(frame(bytes([r.choice([0xc1, 0xd9, 0xdb, 0xc7, 0xdd])]) + r.randbytes(3)), closes=True)
        if kind == 3:
            return Frame(frame(base + pack(r.randrange(100))), closes=True)             # trailing data
        if kind == 4:
            ext = r.choice([msgpack.ExtType(r.randrange(128), r.randbytes(r.randrange(20))),
                            msgpack.Timestamp(r.randrange(1 << 33), r.randrange(10**9))])
            return Frame(frame(pack({"v": 1, "op": "ping", "id": 1, "x": [ext]})), closes=True)
        if kind == 5:                   # nested past msgpack's stack limit
            body = b"\x83" + pack("v") + pack(1) + pack("op") + pack("ping") + pack("x")
            return Frame(frame(body + b"\x91" * r.randrange(1100, 5000) + b"\xc0"), closes=True)
        if kind == 6:
            return Frame(frame(b"\x83\xa1v\x01\xa2op\xa4ping\x07\x01"), closes=True)      # an integer map key
        if kind == 7:
            return Frame(frame(b"\x82\xa1v\x01\xa2op\xa4p\xffng"), closes=True)           # not UTF-8
        if kind == 8:
            return Frame(struct.pack("<I", r.choice([MAX_FRAME + 1, 1 << 30, (1 << 32) - 1])) + r.randbytes(8),
                         closes=True)                                                    # refused by its header
        if kind == 10:                  # a container declaring more elements than any request holds
            count = r.choice([MAX_ARRAY + 1, 100_000, (1 << 32) - 1])
            head = b"\xdd" + struct.pack(">I", count) if r.random() < 0.5 else b"\xdf" + struct.pack(">I", count)
            return Frame(frame(b"\x83" + pack("v") + pack(1) + pack("op") + pack("ping") + pack("x") + head),
                         closes=True)
        if kind == 11:                  # a map of more fields than any request has, each of them complete
            fields = {f"f{i}": i for i in range(r.randrange(MAX_MAP + 1, 200))}
            return Frame(frame(pack({"v": 1, "op": "ping", **fields})), closes=True)
        if kind == 9:
            data = frame(base)
            return Frame(data[:r.randrange(len(data))], closes=True, silent=True)       # truncated, then EOF
        return Frame(b"", closes=True, silent=True)                                      # a plain close


# ----- one hostile connection -----

class Hostile:
    def __init__(self, path: str, gen: Gen, nframes: int) -> None:
        self.gen = gen
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(path)
        self.reader = FrameReader()
        self.todo: list[Frame] = []
        if gen.rng.random() < 0.5:                     # said hello: its ns fields are valid on this connection
            self.todo.append(Frame(frame(pack({"v": 1, "op": "hello", "id": 0, "namespace": gen.ns_dicts[0]})),
                                   0, None))
        self.todo += [gen.soft() for _ in range(nframes - 1)]
        self.last = gen.hard() if gen.rng.random() < 0.7 else None
        self.waiting: list[Frame] = []
        self.sent = 0

    @property
    def done(self) -> bool:
        return not self.todo and not self.waiting and self.last is None

    def send_some(self) -> None:
        part, self.todo = self.todo[:DEPTH], self.todo[DEPTH:]
        self.sock.sendall(b"".join(f.data for f in part))
        self.waiting = part
        self.sent += len(part)

    def read_replies(self, where: str) -> None:
        for f in self.waiting:
            check_reply(self.next_reply(), f, where)
        self.waiting = []

    def finish(self, where: str) -> None:
        """Send the last frame, half-close, and read until the daemon closes: a hard frame gets one bad_frame."""
        f, self.last = self.last, None
        if f is None:
            self.sock.close()
            return
        try:
            self.sock.sendall(f.data)
            self.sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass
        self.sent += 1
        replies = list(self.drain())
        self.sock.close()
        if f.silent:
            assert replies == [], f"{where}: a truncated frame got {replies}"
        elif f.closes:
            assert len(replies) == 1 and replies[0]["error"]["code"] == "bad_frame", f"{where}: {replies}"
            assert replies[0]["id"] == 0, f"{where}: {replies}"
        else:
            assert len(replies) == 1, f"{where}: {replies}"
            check_reply(replies[0], f, where)

    def next_reply(self) -> dict[str, Any]:
        while (body := self.reader.next()) is None:
            data = self.sock.recv(1 << 16)
            assert data, "the daemon closed a connection that sent only decodable maps"
            self.reader.feed(data)
        return msgpack.unpackb(body, raw=False)

    def drain(self) -> Iterator[dict[str, Any]]:
        """Every reply until the daemon closes; a partial reply frame fails."""
        while (body := self.reader.next()) is not None:
            yield msgpack.unpackb(body, raw=False)
        rest = bytearray()
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except ConnectionResetError:
                break
            if not data:
                break
            rest += data
        while rest:
            assert len(rest) >= 4 and len(rest) >= 4 + struct.unpack_from("<I", rest)[0], "a partial reply frame"
            n = struct.unpack_from("<I", rest)[0]
            yield msgpack.unpackb(bytes(rest[4:4 + n]), raw=False)
            del rest[:4 + n]


def check_reply(reply: dict[str, Any], f: Frame, where: str) -> None:
    assert reply.get("v") == 1 and reply.get("id") == f.rid, f"{where}: {reply} for {f.data[:120]!r}"
    if f.code is None:
        assert reply["ok"] or reply["error"]["code"] not in FATAL, f"{where}: {reply} for {f.data[:120]!r}"
        if reply.get("more"):               # a streaming acquire's partial replies: never without a lower tier
            raise AssertionError(f"{where}: a partial reply without a lower tier: {reply}")
    else:
        err = reply.get("error") or {}
        assert reply["ok"] is False and err.get("code") == f.code, f"{where}: {reply} for {f.data[:200]!r}"
        assert isinstance(err.get("message"), str) and err["message"], f"{where}: {reply}"


# ----- the run -----

def settle(c: Client, where: str, timeout: float = 30.0) -> dict[str, Any]:
    """Stats once every hostile connection's session has ended (its holdings dropped)."""
    deadline = time.monotonic() + timeout
    while (s := c.stats())["connections"] > BASELINE:
        assert time.monotonic() < deadline, f"{where}: {s['connections']} connections still open"
        time.sleep(0.005)
    return s


def check_serving(d: DaemonProc, checker: Client, ref_ns: Any, batch: int, where: str) -> None:
    s = settle(checker, where)
    assert (s["reserved"], s["pinned"], s["zombies"]) == (0, 0, 0), f"{where}: holdings left behind: {s}"
    assert s["errors"].get("internal", 0) == 0, f"{where}: the daemon answered `internal`; see {d.log_path}"
    with Client(d.socket, timeout=10) as fresh:
        assert fresh.ping()["pong"] is True
    hs = [hashlib.blake2b(f"reference {batch} {i}".encode(), digest_size=16).digest() for i in range(8)]
    blocks = [random.Random(batch * 8 + i).randbytes(GEOM.full_bytes) for i in range(8)]
    assert ref_ns.put(hs, blocks, checksum=True).stored == 8, where
    outs = [bytearray(GEOM.full_bytes) for _ in hs]
    assert ref_ns.get(hs, outs) == 8, where
    assert [bytes(o) for o in outs] == blocks, f"{where}: the reference client's blocks came back altered"
    assert ref_ns.delete(hs) == 8, where
    checker.evict(everything=True)                    # what hostile connections committed goes
    s = checker.stats()
    assert (s["blocks"], s["reserved"], s["pinned"]) == (0, 0, 0), f"{where}: {s}"


def test_hostile_frames_get_precise_errors_and_the_daemon_serves_on(start_daemon):
    d = start_daemon(capacity="64MiB", segment="1MiB", env={"KVSTORE_LOG_LEVEL": "info"})
    rng = random.Random(SEED)
    specs = [spec("fuzz-a"), spec("fuzz-b")]
    with d.client() as checker, d.client() as ref:
        ns_ids = [checker.namespace(s).id for s in specs]
        ref_ns = ref.namespace(spec("reference"))
        sent = batch = 0
        while sent < FRAMES:
            batch += 1
            seed = rng.randrange(1 << 32)
            brng = random.Random(seed)
            where = f"batch {batch} (seed {SEED}, batch seed {seed})"
            conns = [Hostile(d.socket, Gen(brng, ns_ids, [s.to_dict() for s in specs]), brng.randrange(1, 200))
                     for _ in range(CONNECTIONS)]
            while any(c.todo or c.waiting for c in conns):
                for c in conns:
                    if c.todo:
                        c.send_some()
                for c in conns:
                    c.read_replies(where)
            for c in conns:
                c.finish(where)
            sent += sum(c.sent for c in conns)
            check_serving(d, checker, ref_ns, batch, where)
    assert d.proc is not None and d.proc.poll() is None
    print(f"\n{sent} hostile frames in {batch} batches of {CONNECTIONS} connections (seed {SEED})")
