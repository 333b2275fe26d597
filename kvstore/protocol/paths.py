"""Where the daemon listens by default: shared by the daemon's configuration and the client, which must find the
socket without loading the configuration (or PyYAML)."""
from __future__ import annotations

import os


def default_socket_path() -> str:
    """$XDG_RUNTIME_DIR/kvstore/kvstore.sock, else /tmp/kvstore-<uid>/kvstore.sock."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = os.path.join(runtime, "kvstore") if runtime and os.path.isdir(runtime) else f"/tmp/kvstore-{os.getuid()}"
    return os.path.join(base, "kvstore.sock")
