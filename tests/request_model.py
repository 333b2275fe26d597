"""An independent statement of how the daemon validates a request map (field kinds from the schemas, the order of
the checks written out here), shared by the protocol tests and the frame fuzzer: the error code any map must get."""
from __future__ import annotations

from typing import Any

from kvstore.protocol.schemas import SCHEMAS

MAX_KEYS = 1024              # server.max_keys_per_request, default
MAX_INT = (1 << 63) - 1


def is_int(v: Any) -> bool:
    return type(v) is int and 0 <= v <= MAX_INT


def is_id(v: Any) -> bool:
    """A workflow, session or agent id: a string of at most 256 bytes of UTF-8."""
    return type(v) is str and len(v.encode("utf-8", "surrogatepass")) <= 256


def kind_ok(kind: str, v: Any) -> bool:
    """Whether `v` is a valid value of a schema field kind."""
    if kind == "int":
        return is_int(v)
    if kind == "bool":
        return type(v) is bool
    if kind == "str":
        return type(v) is str and len(v) <= 256
    if kind == "map":
        return type(v) is dict
    if kind == "ints":
        return type(v) is list and len(v) <= MAX_KEYS and all(map(is_int, v))
    if kind == "id":
        return is_id(v)
    if kind == "ids":
        return type(v) is list and len(v) <= 16 and all(map(is_id, v))
    if kind == "prio":
        return is_int(v) or is_id(v)
    return type(v) is bytes and len(v) % 16 == 0 and len(v) <= MAX_KEYS * 16


def expected_code(msg: dict[Any, Any]) -> str | None:
    """The error code a map must get; None when it passes the schema (the op itself then decides)."""
    if not is_int(msg.get("id", 0)):
        return "bad_request"
    if type(msg.get("v")) is not int or msg["v"] != 1:
        return "bad_version"
    op = msg.get("op")
    if type(op) is not str:
        return "bad_request"
    if op not in SCHEMAS:
        return "unknown_op"
    schema = SCHEMAS[op]
    if set(msg) - {"v", "op", "id"} - set(schema):
        return "bad_request"
    for name, (kind, required) in schema.items():
        if (name not in msg and required) or (name in msg and not kind_ok(kind, msg[name])):
            return "bad_request"
    return None
