"""The traffic manager: every byte the daemon moves goes through a path's arbiter, in a lane (DualPath §5)."""
from kvstore.traffic.lanes import DEFAULT_QUEUE, DEFAULT_SHARES, LANES, Lane, parse_lane
from kvstore.traffic.path import Busy, Path, Transfer, choose

__all__ = ["DEFAULT_QUEUE", "DEFAULT_SHARES", "LANES", "Busy", "Lane", "Path", "Transfer", "choose", "parse_lane"]
