"""Frames: a 4-byte little-endian length, then one msgpack map. Plain msgpack only (no ext types: no pickle, no
objects); `FrameReader` is the one reader of a byte stream into frames, on both sides of the socket."""
from __future__ import annotations

import struct
from typing import Any

import msgpack

from kvstore.protocol.codes import Code, ProtocolError

VERSION = 1
HEADER = struct.Struct("<I")


def _reject_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(Code.BAD_FRAME, f"msgpack extension type {code} is not accepted")


def encode(msg: dict[str, Any]) -> bytes:
    body = msgpack.packb(msg, use_bin_type=True)
    return HEADER.pack(len(body)) + body


def decode(body: bytes) -> dict[str, Any]:
    # max_ext_len=0: msgpack decodes timestamps (ext -1) itself, without the hook; a zero limit refuses them too.
    try:
        msg = msgpack.unpackb(body, raw=False, strict_map_key=True, ext_hook=_reject_ext, max_ext_len=0)
    except ProtocolError:
        raise
    except ValueError as e:
        what = ("msgpack extension types (timestamps included) are not accepted" if "max_ext_len" in str(e)
                else f"not a valid msgpack message: {type(e).__name__}")
        raise ProtocolError(Code.BAD_FRAME, what) from None
    except Exception as e:  # msgpack raises several types (ExtraData, StackError, ValueError, ...)
        raise ProtocolError(Code.BAD_FRAME, f"not a valid msgpack message: {type(e).__name__}") from None
    if not isinstance(msg, dict):
        raise ProtocolError(Code.BAD_FRAME, f"a message must be a msgpack map, got {type(msg).__name__}")
    return msg
