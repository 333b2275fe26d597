"""Bad input at the socket (RELIABILITY 11–13): whatever a client sends, it gets a structured error
`{ok: false, error: {code, message}}` with the precise code, or a disconnect — and the daemon keeps serving: after
every example a fresh client's ping succeeds. One daemon serves a whole module's examples."""
from __future__ import annotations

import re
import socket
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.client import Client, KVStoreError
from tests.conftest import GEOM, DaemonProc, hashes, spec
from tests.request_model import MAX_INT, MAX_KEYS, expected_code, kind_ok

MAX_FRAME = 1 << 20          # server.max_frame_bytes, default
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# The wire contract, written out here (not imported) so that a change to it shows up as a failing test.
# op → {field: (kind, required)}
_KEYS = {"ns": ("int", True), "keys": ("keys", True)}
_CONTEXT = {"wf": ("id", False), "agent": ("id", False)}
SCHEMAS: dict[str, dict[str, tuple[str, bool]]] = {
    "ping": {}, "stats": {}, "renew": {}, "tenants": {},
    "hello": {"namespace": ("map", False), "client": ("str", False), "tenant": ("str", False),
              "secret": ("str", False), "admin_secret": ("str", False)},
    "segments": {"ids": ("ints", True)},
    "lookup": {**_KEYS, **_CONTEXT, "residual": ("int", False), "mask": ("bool", False)},
    "reserve": {**_KEYS, **_CONTEXT, "after": ("keys", False), "more": ("bool", False)},
    "commit": {**_KEYS, **_CONTEXT, "crcs": ("ints", False), "durable": ("bool", False),
               "timeout_ms": ("int", False)},
    "abort": _KEYS, "delete": _KEYS,
    "acquire": {**_KEYS, **_CONTEXT, "lane": ("str", False), "stream": ("bool", False), "pieces": ("bool", False),
                "residual": ("int", False)},
    "fork": {**_KEYS, "residual": ("int", True), "parent": ("int", False)},
    "release": {"slots": ("ints", True)},
    "list": {"ns": ("int", False), "limit": ("int", False), "tags": ("bool", False)},
    "resize": {"bytes": ("int", True), "tier": ("str", False)},
    "evict": {"ns": ("int", False), "bytes": ("int", False), "all": ("bool", False)},
    "prefetch": {**_KEYS, "wait": ("bool", False)},
    "flush": {"ns": ("int", False), "keys": ("keys", False), "timeout_ms": ("int", False)},
    "hint": {"kind": ("id", True), "workflow": ("id", False), "session": ("id", False), "type": ("id", False),
             "agent": ("id", False), "step": ("int", False), "next": ("ids", False), "priority": ("prio", False)},
    "workflows": {"limit": ("int", False)},
    "tenant_quota": {"tenant": ("str", True), "host": ("int", False), "ssd": ("int", False)},
}
VALID = {"int": 1, "bool": True, "str": "x", "map": {}, "ints": [1], "keys": bytes(16), "id": "x", "ids": ["x"],
         "prio": 1}


@pytest.fixture(scope="module")
def served() -> Iterator[DaemonProc]:
    d = DaemonProc().start()
    yield d
    d.cleanup()


# ----- talking to the daemon byte by byte -----

def frame(body: bytes) -> bytes:
    return struct.pack("<I", len(body)) + body


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def exchange(path: str, data: bytes, half_close: bool = True) -> list[dict[str, Any]]:
    """Send raw bytes (then half-close), read until the daemon closes; the reply frames, decoded. A hang fails
    (socket timeout); so does a trailing partial frame."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(path)
        try:
            s.sendall(data)
            if half_close:
                s.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass                                    # it closed first, after its error frame: read that
        buf = bytearray()
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:            # it closed with our bytes unread; what it sent is read
                break
            if not chunk:
                break
            buf += chunk
    replies = []
    while buf:
        assert len(buf) >= 4, f"partial header {bytes(buf)!r}"
        (n,) = struct.unpack_from("<I", buf)
        assert len(buf) >= 4 + n, "partial reply frame"
        replies.append(msgpack.unpackb(bytes(buf[4:4 + n]), raw=False))
        del buf[:4 + n]
    return replies


def assert_error(reply: dict[str, Any], code: str, rid: int = 0, *fragments: str) -> None:
    assert set(reply) == {"v", "id", "ok", "error"}, reply
    assert (reply["v"], reply["ok"], reply["id"]) == (1, False, rid), reply
    err = reply["error"]
    assert err["code"] == code, err
    assert isinstance(err["message"], str) and err["message"], err
    for f in fragments:
        assert f in err["message"], (f, err["message"])


def assert_serving(d: DaemonProc) -> None:
    assert d.proc is not None and d.proc.poll() is None, d.read_log()[-2000:]
    with Client(d.socket, timeout=10) as c:
        assert c.ping()["pong"] is True


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError(code)


# ----- strategies -----

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1), st.floats(),
                    st.text(max_size=20), st.binary(max_size=40))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)
field_names = st.one_of(st.sampled_from(["v", "op", "id", "ns", "keys", "ids", "slots", "bytes", "all", "limit",
                                         "namespace", "client"]), st.text(max_size=8))
ops = st.one_of(st.sampled_from(sorted(SCHEMAS)), st.text(max_size=12))


def wrong(kind: str) -> st.SearchStrategy[Any]:
    """Values a field of this kind must refuse."""
    return values.filter(lambda v: not kind_ok(kind, v)) | {
        "int": st.one_of(st.integers(-(1 << 63), -1), st.integers(MAX_INT + 1, (1 << 64) - 1), st.booleans()),
        "bool": st.integers(0, 1),
        "str": st.text(min_size=257, max_size=300),
        "map": st.lists(st.tuples(st.text(max_size=4), st.integers(0, 9)), max_size=3),
        "ints": st.one_of(st.just([0] * (MAX_KEYS + 1)), st.lists(st.booleans(), min_size=1, max_size=3),
                          st.lists(st.integers(-(1 << 63), -1), min_size=1, max_size=3)),
        "keys": st.one_of(st.binary(max_size=100).filter(lambda b: len(b) % 16), st.text(max_size=32),
                          st.lists(st.binary(min_size=16, max_size=16), max_size=3)),
        "id": st.one_of(st.text(min_size=257, max_size=300), st.just("\u00e9" * 129)),   # 258 bytes of UTF-8
        "ids": st.one_of(st.just(["a"] * 17), st.lists(st.integers(0, 9), min_size=1, max_size=3)),
        "prio": st.one_of(st.booleans(), st.integers(-(1 << 63), -1), st.text(min_size=257, max_size=300)),
    }[kind]


def base_request(op: str) -> dict[str, Any]:
    return {"v": 1, "op": op, "id": 7, **{name: VALID[kind] for name, (kind, req) in SCHEMAS[op].items() if req}}


def test_the_contract_written_here_is_the_daemons():
    # every op and field the daemon accepts is written out above, so that the fuzzers know what "unknown" means and
    # a change to the wire contract fails here first, by name
    from kvstore.protocol.schemas import SCHEMAS as DAEMON
    assert sorted(DAEMON) == sorted(SCHEMAS)
    for op, schema in DAEMON.items():
        assert schema == SCHEMAS[op], op


# ----- fuzz -----

@FUZZ
@given(data=st.one_of(st.binary(max_size=300), st.binary(max_size=300).map(frame)))
def test_random_bytes_get_an_error_or_a_disconnect(served, data):
    replies = exchange(served.socket, data)
    if len(data) < 4 or len(data) < 4 + struct.unpack_from("<I", data)[0] <= 4 + MAX_FRAME:
        assert replies == []                          # an incomplete frame: the daemon closes, says nothing
    elif struct.unpack_from("<I", data)[0] > MAX_FRAME:
        assert len(replies) == 1                      # refused by its header alone, then closed
        assert_error(replies[0], "bad_frame", 0, "exceeds the limit")
    else:
        body = data[4:4 + struct.unpack_from("<I", data)[0]]
        try:                                          # what the protocol accepts: plain msgpack, no ext types
            msg = msgpack.unpackb(body, raw=False, strict_map_key=True, max_ext_len=0, ext_hook=_no_ext)
        except Exception:
            msg = None
        if not isinstance(msg, dict):
            assert len(replies) == 1                  # not a msgpack map: an error, then closed
            assert_error(replies[0], "bad_frame", 0)
        else:
            code = expected_code(msg)
            assert code is not None and replies[0]["error"]["code"] == code
    for r in replies:
        assert r["ok"] is False and r["error"]["code"] != "internal"
    assert_serving(served)


@FUZZ
@given(obj=values)
def test_random_msgpack_values_get_the_precise_code(served, obj):
    replies = exchange(served.socket, frame(pack(obj)))
    assert len(replies) == 1
    if not isinstance(obj, dict):
        assert_error(replies[0], "bad_frame", 0, "must be a msgpack map")
    else:
        rid = obj["id"] if type(obj.get("id")) is int else 0
        assert_error(replies[0], expected_code(obj) or "?", rid)
    assert_serving(served)


@FUZZ
@given(msg=st.dictionaries(field_names, st.one_of(values, ops), max_size=6),
       v=st.one_of(st.just(1), values), op=ops)
def test_random_requests_get_the_precise_code(served, msg, v, op):
    msg = {"v": v, "op": op, **msg}
    replies = exchange(served.socket, frame(pack(msg)))
    assert len(replies) == 1
    code = expected_code(msg)
    rid = msg["id"] if type(msg.get("id")) is int else 0
    if code is not None:
        assert_error(replies[0], code, rid)
    else:                                             # schema-valid: the op answers, never with a crash
        assert replies[0]["id"] == rid
        assert replies[0]["ok"] or replies[0]["error"]["code"] not in ("internal", "bad_frame")
    assert_serving(served)


@FUZZ
@given(data=st.data(), op=st.sampled_from(sorted(SCHEMAS)))
def test_each_schema_violation_gets_its_own_code_and_message(served, data, op):
    msg = base_request(op)
    schema = SCHEMAS[op]
    kinds = ["version", "id", "unknown_op", "extra_field"]
    kinds += ["missing"] * any(req for _, req in schema.values()) + ["wrong_type"] * bool(schema)
    kinds += ["keys_ragged", "too_many_keys"] * ("keys" in schema)
    kind = data.draw(st.sampled_from(kinds))
    if kind == "version":
        msg["v"] = data.draw(values.filter(lambda v: not (type(v) is int and v == 1)))
        want = ("bad_version", "protocol version")
    elif kind == "id":
        msg["id"] = data.draw(wrong("int"))
        want = ("bad_request", "field 'id'")
    elif kind == "unknown_op":
        msg["op"] = data.draw(st.text(max_size=30).filter(lambda s: s not in SCHEMAS))
        want = ("unknown_op", "unknown op")
    elif kind == "extra_field":
        name = data.draw(st.text(max_size=10).filter(lambda s: s not in {"v", "op", "id", *schema}))
        msg[name] = data.draw(values)
        want = ("bad_request", "unknown fields")
    elif kind == "missing":
        name = data.draw(st.sampled_from([n for n, (_, req) in schema.items() if req]))
        del msg[name]
        want = ("bad_request", f"field {name!r} is required")
    elif kind == "wrong_type":
        name = data.draw(st.sampled_from(sorted(schema)))
        msg[name] = data.draw(wrong(schema[name][0]))
        want = ("bad_request", "keys" if name == "keys" else f"field {name!r}")
    elif kind == "keys_ragged":
        msg["keys"] = data.draw(st.binary(max_size=200).filter(lambda b: len(b) % 16))
        want = ("bad_request", "not a multiple of 16")
    else:
        msg["keys"] = bytes(16 * data.draw(st.integers(MAX_KEYS + 1, MAX_KEYS + 64)))
        want = ("bad_request", f"above the limit of {MAX_KEYS}")
    replies = exchange(served.socket, frame(pack(msg)))
    assert len(replies) == 1
    rid = msg["id"] if type(msg["id"]) is int else 0
    assert_error(replies[0], want[0], rid, want[1])
    assert_serving(served)


@FUZZ
@given(op=st.sampled_from(sorted(SCHEMAS)), depth=st.one_of(st.integers(1, 1000), st.integers(1100, 4000)),
       mapping=st.booleans())
def test_deep_nesting_is_a_bad_frame_past_the_decoder_limit(served, op, depth, mapping):
    # `deep` nested containers as the value of an unknown field: decodable up to msgpack's stack limit (1024
    # containers, the outer map included), a bad frame beyond it
    level = b"\x81\xa1a" if mapping else b"\x91"
    body = pack(base_request(op))
    body = bytes([body[0] + 1]) + body[1:] + pack("deep") + level * depth + b"\xc0"   # one more fixmap entry
    replies = exchange(served.socket, frame(body))
    assert len(replies) == 1
    if depth < 1024:
        assert_error(replies[0], "bad_request", 7, "unknown fields deep")
    else:
        assert_error(replies[0], "bad_frame", 0, "StackError")
    assert_serving(served)


@FUZZ
@given(op=st.sampled_from(sorted(SCHEMAS)), where=st.sampled_from(["id", "v", "extra", "nested"]),
       ext=st.one_of(st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=20)),
                     st.builds(msgpack.Timestamp, st.integers(-(1 << 33), (1 << 34) - 1), st.integers(0, 10**9 - 1))))
def test_msgpack_extension_types_and_timestamps_are_refused(served, op, where, ext):
    msg = base_request(op)
    if where == "nested":
        msg["x"] = {"a": [1, ext]}
    else:
        msg[{"extra": "x"}.get(where, where)] = ext
    replies = exchange(served.socket, frame(pack(msg)))
    assert len(replies) == 1                          # refused at decoding, then closed
    assert_error(replies[0], "bad_frame", 0, "extension type")
    assert_serving(served)


@FUZZ
@given(op=st.sampled_from(sorted(SCHEMAS)), cut=st.floats(0, 1, exclude_max=True))
def test_truncated_frames_are_dropped_without_a_reply(served, op, cut):
    data = frame(pack(base_request(op)))
    replies = exchange(served.socket, data[:int(len(data) * cut)])
    assert replies == []
    assert_serving(served)


@pytest.mark.parametrize("declared", [MAX_FRAME + 1, 1 << 30, (1 << 32) - 1])
def test_huge_declared_length_is_refused_before_reading_the_body(served, declared):
    # nothing follows the header and the socket stays open for writing: a daemon that tried to read (or allocate)
    # the body would wait, and the 10 s socket timeout would fail the test
    replies = exchange(served.socket, struct.pack("<I", declared), half_close=False)
    assert len(replies) == 1
    assert_error(replies[0], "bad_frame", 0, f"frame of {declared} bytes exceeds the limit of {MAX_FRAME} bytes")
    assert_serving(served)


def test_an_error_keeps_the_connection_and_a_bad_frame_closes_it(served):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(served.socket)
        reader = s.makefile("rb")

        def reply() -> dict[str, Any]:
            (n,) = struct.unpack("<I", reader.read(4))
            return msgpack.unpackb(reader.read(n), raw=False)

        s.sendall(frame(pack({"v": 1, "op": "nope", "id": 1})))
        assert_error(reply(), "unknown_op", 1)
        s.sendall(frame(pack({"v": 1, "op": "ping", "id": 2})))     # the same connection still serves
        assert reply()["ok"] is True
        s.sendall(frame(b"\xc1"))                                    # never valid msgpack
        assert_error(reply(), "bad_frame", 0)
        assert reader.read(1) == b""                                 # and then it is closed
    assert_serving(served)


def test_too_many_keys_reserves_nothing(served):
    with Client(served.socket) as c:
        ns = c.namespace(spec())
        before = c.stats()["reserved"]
        with pytest.raises(KVStoreError) as e:
            c.call("reserve", ns=ns.id, keys=b"".join(hashes(MAX_KEYS + 1)))
        assert e.value.code == "bad_request" and "above the limit of 1024" in e.value.message
        assert c.stats()["reserved"] == before
        assert ns.lookup(hashes(MAX_KEYS)) == 0


# ----- namespaces and geometry -----

NS_OPS = ("lookup", "reserve", "commit", "abort", "acquire", "delete")


@pytest.mark.parametrize("op", NS_OPS)
def test_namespace_of_another_connection_is_unknown_here(served, op):
    with Client(served.socket) as owner, Client(served.socket) as other:
        ns = owner.namespace(spec("isolated-" + op))
        with pytest.raises(KVStoreError) as e:       # never registered by `other`
            other.call(op, ns=ns.id, keys=hashes(1)[0])
        assert e.value.code == "unknown_namespace" and f"namespace {ns.id}" in e.value.message
        other.namespace(spec("another-" + op))       # registering some other namespace does not open this one
        with pytest.raises(KVStoreError) as e:
            other.call(op, ns=ns.id, keys=hashes(1)[0])
        assert e.value.code == "unknown_namespace"
        with pytest.raises(KVStoreError) as e:       # nor does an id nobody registered
            other.call(op, ns=MAX_INT, keys=hashes(1)[0])
        assert e.value.code == "unknown_namespace"
        other.namespace(spec("isolated-" + op))      # its own hello with the same spec does
        assert other.call("lookup", ns=ns.id, keys=hashes(1)[0])["n"] == 0


def test_unknown_namespace_before_any_hello(served):
    with Client(served.socket) as c:
        with pytest.raises(KVStoreError) as e:
            c.call("lookup", ns=1, keys=hashes(1)[0])
        assert e.value.code == "unknown_namespace"
        assert "send hello" in e.value.message


def hello(served: DaemonProc, namespace: Any) -> KVStoreError:
    with Client(served.socket) as c, pytest.raises(KVStoreError) as e:
        c.call("hello", namespace=namespace)
    return e.value


def geometry(**change: Any) -> dict[str, Any]:
    return {"model": "m", "geometry": {**GEOM.to_dict(), **change}}


@pytest.mark.parametrize("field, value", [
    ("layers", 0), ("layers", 5000), ("layers", 2.0), ("layers", "2"), ("layers", True),
    ("tokens", -1), ("kv_heads", None), ("head_dim", 1 << 17),
    ("dtype", "float64"), ("dtype", 2), ("kv", 3), ("layout", "has spaces"), ("layout", ""), ("layout", ["a"]),
])
def test_hello_with_bad_geometry_names_the_field(served, field, value):
    err = hello(served, geometry(**{field: value}))
    assert err.code == "wrong_geometry"
    assert f"geometry.{field}" in err.message


@pytest.mark.parametrize("value", [["float16"], {"a": 1}])
def test_hello_with_unhashable_dtype_names_the_field(served, value):
    err = hello(served, geometry(dtype=value))
    assert (err.code, "geometry.dtype" in err.message) == ("wrong_geometry", True)


def test_hello_with_missing_or_unknown_geometry_fields(served):
    g = GEOM.to_dict()
    del g["head_dim"]
    err = hello(served, {"model": "m", "geometry": g})
    assert err.code == "wrong_geometry" and "head_dim" in err.message
    err = hello(served, geometry(heads=4))
    assert err.code == "wrong_geometry" and "heads" in err.message
    err = hello(served, {"model": "m", "geometry": [2, 16, 2, 32]})
    assert err.code == "wrong_geometry" and "geometry must be a mapping" in err.message


@pytest.mark.parametrize("namespace, fragment", [
    ({"model": "", "geometry": GEOM.to_dict()}, "namespace.model"),
    ({**geometry(), "tp_rank": 2, "tp_size": 2}, "tp_rank"),
    ({**geometry(), "role": "other"}, "namespace.role"),
    ({**geometry(), "color": "red"}, "unknown fields: color"),
    ("llama", "field 'namespace' must be a map"),
])
def test_hello_with_a_bad_namespace_is_a_bad_request(served, namespace, fragment):
    err = hello(served, namespace)
    assert err.code == "bad_request" and fragment in err.message


@pytest.mark.parametrize("namespace", [{"geometry": GEOM.to_dict()}, {**geometry(), "geometry_x": 1}])
def test_hello_namespace_errors_outside_the_geometry_are_bad_requests(served, namespace):
    assert hello(served, namespace).code == "bad_request"


def test_block_larger_than_the_pool_is_wrong_geometry(start_daemon):
    d = start_daemon(capacity="16MiB")                # its own daemon: the fuzz above may have resized the shared one
    # 64 layers × 1 MiB per layer = 64 MiB per block, in a 16 MiB pool
    err = hello(d, geometry(layers=64, tokens=256, kv_heads=8, head_dim=128))
    assert err.code == "wrong_geometry"
    assert f"{64 << 20} bytes, larger than the whole pool ({16 << 20} bytes)" in err.message
    err = hello(d, geometry(layers=4096, tokens=1024, kv_heads=8, head_dim=128))
    assert err.code == "wrong_geometry" and "above the 1 GiB limit" in err.message
    with Client(d.socket) as c:
        assert c.list()["namespaces"] == []         # nothing was registered
        assert c.namespace(spec()).block_bytes == GEOM.full_bytes   # a block that fits is accepted


# ----- no pickle anywhere a request or a file is decoded -----

FORBIDDEN = re.compile(r"pickle\.loads?\(|cloudpickle|recv_pyobj|weights_only\s*=\s*False|marshal\.loads?\(")


def test_no_pickle_in_the_daemon_or_the_connectors():
    root = Path(__file__).resolve().parents[2]
    files = [p for d in ("kvstore", "connectors") for p in (root / d).rglob("*.py")]
    assert any(p.name == "frames.py" for p in files)         # the scan sees the code it guards
    hits = [f"{p.relative_to(root)}:{i}: {line.strip()}" for p in files
            for i, line in enumerate(p.read_text().splitlines(), 1) if FORBIDDEN.search(line)]
    assert hits == []


def test_forbidden_pattern_catches_what_it_should():
    for bad in ("pickle.loads(b)", "pickle.load(f)", "sock.recv_pyobj()", "torch.load(p, weights_only=False)"):
        assert FORBIDDEN.search(bad), bad
    assert not FORBIDDEN.search("torch.load(p, weights_only=True)")



@pytest.mark.parametrize(("value", "text"), [(b"\x00", "field 'after' is 1 bytes, not a multiple of 16"),
                                             (bytes(16 * (MAX_KEYS + 1)), "field 'after' has")])
def test_a_bad_after_is_named_in_its_error(served, value, text):
    """`after` (the chain before a reserve's blocks) is checked as keys are, and its error names it, not `keys`."""
    msg = base_request("reserve")
    msg["after"] = value
    replies = exchange(served.socket, frame(pack(msg)))
    assert len(replies) == 1
    assert_error(replies[0], "bad_request", msg["id"] if type(msg["id"]) is int else 0, text)
    assert_serving(served)
