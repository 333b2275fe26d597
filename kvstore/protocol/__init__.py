"""The local control protocol: the one thing client and daemon share, and all an engine process needs of the daemon.

Frames: a 4-byte little-endian length, then a msgpack map; `FrameReader` cuts a byte stream into frame bodies and
refuses an oversize one from its header, before reading it. A request is `{"v": 1, "op": str, "id": int, ...fields}`;
a reply is `{"v": 1, "id": int, "ok": true, ...}` or `{"v": 1, "id": int, "ok": false, "error": {"code", "message"}}`.
Batched ops carry `keys`: one bin of 16-byte block hashes (tens to a thousand per message).

Decoding accepts plain msgpack only (no ext types: no pickle, no objects), the daemon's with size `Limits` applied
while decoding, and `check_request` checks every field
of the op's schema: type, bounds, no unknown fields. Any violation is a `ProtocolError` whose `code` (a `Code`) says
what kind and whose message says what was wrong; the server replies with it and, for a frame it cannot parse, closes
the connection. A reserve's per-key outcome is a `ReserveStatus`.
"""
from kvstore.protocol.codes import Code, ProtocolError, ReserveStatus
from kvstore.protocol.frames import HEADER, VERSION, FrameReader, Limits, decode, encode
from kvstore.protocol.schemas import HASH_BYTES, SCHEMAS, check_request, error, ok, split_keys

__all__ = ["HASH_BYTES", "HEADER", "SCHEMAS", "VERSION", "Code", "FrameReader", "Limits", "ProtocolError",
           "ReserveStatus", "check_request", "decode", "encode", "error", "ok", "split_keys"]
