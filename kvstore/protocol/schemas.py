"""One schema per op: every field's kind and bounds, no unknown fields; and the reply envelopes."""
from __future__ import annotations

from typing import Any

from kvstore.protocol.codes import Code, ProtocolError
from kvstore.protocol.frames import VERSION
from kvstore.protocol.keys import HASH_BYTES

MAX_INT = (1 << 63) - 1
MAX_ID_BYTES = 256          # a workflow, session or agent id, UTF-8
MAX_NAMES = 16              # agents a hint may name as expected next


# ----- schemas -----
# field → (kind, required). Kinds: int (0..2**63-1), bool, str, map, keys (bin of 16-byte hashes), ints (list of int),
# id (a string of at most MAX_ID_BYTES bytes), ids (a list of at most MAX_NAMES of them), prio (an int or an id).
Schema = dict[str, tuple[str, bool]]
_KEYS: Schema = {"ns": ("int", True), "keys": ("keys", True)}
_CONTEXT: Schema = {"wf": ("id", False), "agent": ("id", False)}     # a request's hint context (daemon.hints)
_HINT: Schema = {"kind": ("id", True), "workflow": ("id", False), "session": ("id", False), "type": ("id", False),
                 "agent": ("id", False), "step": ("int", False), "next": ("ids", False), "priority": ("prio", False)}
SCHEMAS: dict[str, Schema] = {
    "ping": {},
    "hello": {"namespace": ("map", False), "client": ("str", False), "tenant": ("str", False),
              "secret": ("str", False), "admin_secret": ("str", False)},
    "segments": {"ids": ("ints", True)},
    "lookup": {**_KEYS, **_CONTEXT, "residual": ("int", False), "mask": ("bool", False)},
    "reserve": {**_KEYS, **_CONTEXT, "after": ("keys", False), "more": ("bool", False)},
    "commit": {**_KEYS, **_CONTEXT, "crcs": ("ints", False), "durable": ("bool", False),
               "timeout_ms": ("int", False)},
    "abort": _KEYS,
    "acquire": {**_KEYS, **_CONTEXT, "lane": ("str", False), "stream": ("bool", False), "pieces": ("bool", False),
                "residual": ("int", False)},
    "fork": {**_KEYS, "residual": ("int", True), "parent": ("int", False)},
    "release": {"slots": ("ints", True)},
    "renew": {},
    "delete": _KEYS,
    "stats": {},
    "list": {"ns": ("int", False), "limit": ("int", False), "tags": ("bool", False)},
    "resize": {"bytes": ("int", True), "tier": ("str", False)},
    "evict": {"ns": ("int", False), "bytes": ("int", False), "all": ("bool", False)},
    "prefetch": {"ns": ("int", True), "keys": ("keys", True), "wait": ("bool", False)},
    "flush": {"ns": ("int", False), "keys": ("keys", False), "timeout_ms": ("int", False)},
    "hint": _HINT,
    "workflows": {"limit": ("int", False)},
    "tenants": {},
    "tenant_quota": {"tenant": ("str", True), "host": ("int", False), "ssd": ("int", False)},
}
_COMMON = {"v", "op", "id"}


def _fast_int(v: Any, max_keys: int) -> bool:
    return type(v) is int and 0 <= v <= MAX_INT


def _fast_keys(v: Any, max_keys: int) -> bool:
    return type(v) is bytes and not len(v) % HASH_BYTES and len(v) <= max_keys * HASH_BYTES


def _fast_ints(v: Any, max_keys: int) -> bool:
    return type(v) is list and len(v) <= max_keys and all(type(x) is int and 0 <= x <= MAX_INT for x in v)


def _fast_bool(v: Any, max_keys: int) -> bool:
    return v is True or v is False


_FAST = {"int": _fast_int, "keys": _fast_keys, "ints": _fast_ints, "bool": _fast_bool}
# op → ({field: its fast check, or None for the full one}, required fields): the hot ops' requests (a lookup, an
# acquire, a release) are checked with exact-type tests and no set arithmetic; only a request that fails them takes
# the full check, which names what is wrong. Both accept the same requests.
_COMPILED = {op: ({name: _FAST.get(kind) for name, (kind, _) in schema.items()},
                  [name for name, (_, required) in schema.items() if required]) for op, schema in SCHEMAS.items()}


def check_request(msg: dict[str, Any], max_keys: int) -> tuple[str, int]:
    """Validate a request against its op's schema; returns (op, request id)."""
    op = msg.get("op")
    compiled = _COMPILED.get(op) if type(op) is str else None
    if compiled is not None and _fast_ok(msg, compiled, max_keys):
        return op, msg.get("id", 0)  # type: ignore[return-value]
    return _check_request(msg, max_keys)


def _fast_ok(msg: dict[str, Any], compiled: tuple[dict[str, Any], list[str]], max_keys: int) -> bool:
    """Whether the request passes every check, by the quick path (False: let the full check decide and say why)."""
    rid, v = msg.get("id", 0), msg.get("v")
    if type(rid) is not int or not 0 <= rid <= MAX_INT or type(v) is not int or v != VERSION:
        return False
    checks, required = compiled
    for name in required:
        if name not in msg:
            return False
    for name, value in msg.items():
        if name in _COMMON:
            continue
        if name not in checks:
            return False
        check = checks[name]
        if check is None:
            try:
                _check_field(msg["op"], name, SCHEMAS[msg["op"]][name][0], value, max_keys)
            except ProtocolError:
                return False
        elif not check(value, max_keys):
            return False
    return True


def _check_request(msg: dict[str, Any], max_keys: int) -> tuple[str, int]:
    rid = msg.get("id", 0)
    if not _is_int(rid):
        raise ProtocolError(Code.BAD_REQUEST, "field 'id' must be a non-negative integer")
    if type(msg.get("v")) is not int or msg["v"] != VERSION:   # not True, not 1.0
        raise ProtocolError(Code.BAD_VERSION, f"protocol version {msg.get('v')!r} not supported; this daemon "
                                              f"speaks version {VERSION}")
    op = msg.get("op")
    if not isinstance(op, str):
        raise ProtocolError(Code.BAD_REQUEST, "field 'op' must be a string")
    schema = SCHEMAS.get(op)
    if schema is None:
        raise ProtocolError(Code.UNKNOWN_OP, f"unknown op {op[:64]!r}; known: {', '.join(SCHEMAS)}")
    extra = set(msg) - _COMMON - set(schema)
    if extra:
        raise ProtocolError(Code.BAD_REQUEST, f"{op}: unknown fields {', '.join(sorted(map(str, extra)))[:200]}")
    for name, (kind, required) in schema.items():
        if name not in msg:
            if required:
                raise ProtocolError(Code.BAD_REQUEST, f"{op}: field {name!r} is required")
            continue
        _check_field(op, name, kind, msg[name], max_keys)
    return op, rid


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_INT


def _is_id(v: Any) -> bool:
    return isinstance(v, str) and len(v) <= MAX_ID_BYTES and len(v.encode("utf-8", "surrogatepass")) <= MAX_ID_BYTES


def _check_field(op: str, name: str, kind: str, v: Any, max_keys: int) -> None:
    bad = None
    if kind == "int" and not _is_int(v):
        bad = "a non-negative integer"
    elif kind == "bool" and not isinstance(v, bool):
        bad = "true or false"
    elif kind == "str" and not (isinstance(v, str) and len(v) <= 256):
        bad = "a string of at most 256 characters"
    elif kind == "id" and not _is_id(v):
        bad = f"a string of at most {MAX_ID_BYTES} bytes"
    elif kind == "ids" and not (isinstance(v, list) and len(v) <= MAX_NAMES and all(_is_id(x) for x in v)):
        bad = f"a list of at most {MAX_NAMES} strings of at most {MAX_ID_BYTES} bytes"
    elif kind == "prio" and not (_is_int(v) or _is_id(v)):
        bad = "a non-negative integer or a word (low, normal, high)"
    elif kind == "map" and not isinstance(v, dict):
        bad = "a map"
    elif kind == "ints" and not (isinstance(v, list) and len(v) <= max_keys and all(_is_int(x) for x in v)):
        bad = f"a list of at most {max_keys} non-negative integers"
    elif kind == "keys":
        if not isinstance(v, bytes):
            bad = "a bin of 16-byte block hashes"
        elif len(v) % HASH_BYTES:
            raise ProtocolError(Code.BAD_REQUEST, f"{op}: field {name!r} is {len(v)} bytes, not a multiple of 16")
        elif len(v) > max_keys * HASH_BYTES:
            n = len(v) // HASH_BYTES
            raise ProtocolError(Code.BAD_REQUEST, f"{op}: field {name!r} has {n} keys, above the limit of {max_keys}")
    if bad:
        raise ProtocolError(Code.BAD_REQUEST, f"{op}: field {name!r} must be {bad}, got {type(v).__name__}")


def split_keys(blob: bytes) -> list[bytes]:
    return [blob[i:i + HASH_BYTES] for i in range(0, len(blob), HASH_BYTES)]


def ok(rid: int, **fields: Any) -> dict[str, Any]:
    return {"v": VERSION, "id": rid, "ok": True, **fields}


def error(rid: int, code: str, message: str) -> dict[str, Any]:
    return {"v": VERSION, "id": rid, "ok": False, "error": {"code": code, "message": message}}
