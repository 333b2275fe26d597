"""A handler's reply when it is more than fields: file descriptors to pass, a connection to close after it, or a
reply the handler has sent already (a streaming acquire ends its stream itself, kvstore.daemon.stream)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Reply:
    fields: dict[str, Any]
    fds: list[int] = field(default_factory=list)   # duplicated under the lock; the sender closes them
    close: bool = False
    sent: bool = False      # the op's last reply went out already: nothing more to send
