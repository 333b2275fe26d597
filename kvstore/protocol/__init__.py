"""The local control protocol, the one place client and daemon share: length-prefixed msgpack frames, one schema per op, structured errors.

Frame: 4-byte little-endian length, then a msgpack map. A request is `{"v": 1, "op": str, "id": int, ...fields}`;
a reply is `{"v": 1, "id": int, "ok": true, ...}` or `{"v": 1, "id": int, "ok": false, "error": {"code", "message"}}`.
Batched ops carry `keys`: one bin of 16-byte block hashes (tens to a thousand per message).

Decoding accepts only plain msgpack (no ext types: no pickle, no objects), rejects frames over the size limit
before reading them, and checks every field of the op's schema: type, bounds, no unknown fields. Any violation is a
`ProtocolError` with a code and a message that says what was wrong; the server replies with it and, for a frame it
cannot parse, closes the connection.
"""
from kvstore.protocol.codes import Code, ProtocolError, ReserveStatus
from kvstore.protocol.frames import HEADER, VERSION, decode, encode
from kvstore.protocol.schemas import HASH_BYTES, SCHEMAS, check_request, error, ok, split_keys

__all__ = ["HASH_BYTES", "HEADER", "SCHEMAS", "VERSION", "Code", "ProtocolError", "ReserveStatus", "check_request",
           "decode", "encode", "error", "ok", "split_keys"]
