"""`kvstore serve`: the daemon in the foreground (kvstore.daemon.server)."""
from __future__ import annotations

import argparse
import logging
import os
import sys


def cmd_serve(args: argparse.Namespace) -> int:

    from kvstore.daemon.config import load_config
    from kvstore.daemon.server import Daemon, StartupError

    if args.socket:
        os.environ["KVSTORE_SERVER_SOCKET"] = args.socket
    if args.capacity:
        os.environ["KVSTORE_POOL_CAPACITY"] = args.capacity
    cfg = load_config(args.config or os.environ.get("KVSTORE_CONFIG"))
    if cfg.remote.master and cfg.remote.bind_address not in ("0.0.0.0", "::"):   # Mooncake's ports bind there
        from kvstore.tiers.remote.address import reexec_with_bind_guard
        reexec_with_bind_guard()
    logging.basicConfig(level=cfg.log.level.upper(), format="%(asctime)s kvstore %(levelname)s %(message)s")
    try:
        Daemon(cfg).serve()
    except StartupError as e:
        print(f"kvstore: {e}", file=sys.stderr)
        return 1
    return 0
