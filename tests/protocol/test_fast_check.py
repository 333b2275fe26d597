"""The hot ops' quick request check (exact-type tests, no set arithmetic) accepts exactly what the full check accepts,
and a request it turns down gets the full check's own answer: the same code and message."""
from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.protocol import SCHEMAS, ProtocolError, check_request
from kvstore.protocol.schemas import MAX_INT, _check_request

MAX_KEYS = 8
VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2, 3), st.sampled_from([MAX_INT, MAX_INT + 1]),
                   st.binary(max_size=3 * 16 + 1).map(lambda b: b[: len(b) - len(b) % 16] if len(b) % 3 else b),
                   st.lists(st.one_of(st.integers(-1, 3), st.booleans()), max_size=MAX_KEYS + 1),
                   st.text(max_size=3), st.dictionaries(st.text(max_size=2), st.integers(), max_size=2))
FIELDS = st.sampled_from(sorted({f for s in SCHEMAS.values() for f in s} | {"bogus"}))


def outcome(fn: Any, msg: dict[str, Any]) -> tuple[str, Any]:
    try:
        return "ok", fn(msg, MAX_KEYS)
    except ProtocolError as e:
        return e.code, e.message


@st.composite
def requests(draw: st.DrawFn) -> dict[str, Any]:
    op = draw(st.sampled_from([*SCHEMAS, "nope", 7]))
    msg: dict[str, Any] = {"v": draw(st.sampled_from([1, 1, 1, 2, True, 1.0])), "op": op,
                           "id": draw(st.sampled_from([0, 5, MAX_INT, -1, True, "x"]))}
    for name, (_kind, required) in SCHEMAS.get(op, {}).items() if isinstance(op, str) else ():
        if draw(st.booleans()) or (required and draw(st.integers(0, 9))):
            msg[name] = draw(VALUES)
    for name in draw(st.lists(FIELDS, max_size=2)):
        msg[name] = draw(VALUES)
    if draw(st.integers(0, 4)) == 0:
        del msg[draw(st.sampled_from(sorted(msg)))]
    return msg


@settings(max_examples=3000, deadline=None)
@given(requests())
def test_the_quick_check_and_the_full_check_agree(msg):
    assert outcome(check_request, msg) == outcome(_check_request, msg)


def test_a_valid_lookup_passes_and_a_bool_for_an_int_is_refused_as_before():
    good = {"v": 1, "op": "lookup", "id": 3, "ns": 1, "keys": bytes(32)}
    assert check_request(good, MAX_KEYS) == ("lookup", 3)
    for bad in ({**good, "ns": True}, {**good, "keys": bytes(15)}, {**good, "keys": bytes(16 * (MAX_KEYS + 1))},
                {**good, "x": 1}, {k: v for k, v in good.items() if k != "ns"}):
        assert outcome(check_request, bad)[0] == "bad_request"
        assert outcome(check_request, bad) == outcome(_check_request, bad)
