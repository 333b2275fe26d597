"""What a refusal says: error codes (one per kind of failure, stable across versions) and per-key outcomes."""
from __future__ import annotations

from enum import IntEnum


class Code:
    BAD_FRAME = "bad_frame"                  # not a msgpack map, oversize, truncated
    BAD_VERSION = "bad_version"
    BAD_REQUEST = "bad_request"              # a field missing, of the wrong type, out of bounds, or unknown
    UNKNOWN_OP = "unknown_op"
    UNKNOWN_NAMESPACE = "unknown_namespace"  # ns id not registered by this connection's hello
    WRONG_GEOMETRY = "wrong_geometry"
    NOT_FOUND = "not_found"
    NO_SPACE = "no_space"                    # the pool is full of pinned or reserved blocks
    CONFLICT = "conflict"                    # e.g. a key another client is storing right now
    BUSY = "busy"                            # a bounded queue is full: try again later
    TOO_MANY_CONNECTIONS = "too_many_connections"
    FORBIDDEN = "forbidden"                  # not this connection's to do: admin role or tenant (server.admin_uids)
    OVER_LIMIT = "over_limit"                # a per-connection limit of the configuration (named in the message)
    SHUTTING_DOWN = "shutting_down"
    INTERNAL = "internal"


class ProtocolError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class ReserveStatus(IntEnum):
    """A reserve's outcome for one key, as the wire carries it (`status` list): only RESERVED gets a slot."""
    RESERVED = 0        # a slot is yours: write it, then commit (or abort)
    EXISTS = 1          # stored already: nothing to write
    IN_PROGRESS = 2     # another client is storing it right now
    NO_SPACE = 3        # no slot could be freed (the pool is full of pinned or reserved blocks)
