"""The traffic manager: every byte the daemon moves goes through a path's arbiter, in a lane (DualPath §5).

- `lanes`: what a transfer is for, in priority order: critical (a read an engine waits on) > store > prefetch >
  background, each with a minimum share of a contended path and a bounded queue (a full one answers `Busy`).
- `path`: one physical path (the SSD; later a NIC, a GPU link) with its workers, its weighted fair queueing over
  bytes and checkpoints at which long lower-lane transfers step aside for critical ones; `knowledge`: what a path
  knows of itself (per-lane statistics, its measured bandwidth, a transfer's expected time), from which `choose`
  sends a read by the path that will finish first.
- `manager`: the daemon's paths, built from the `traffic` configuration; `slow`: a seeded slow device for tests.
"""
from kvstore.traffic.lanes import DEFAULT_QUEUE, DEFAULT_SHARES, LANES, Lane, parse_lane
from kvstore.traffic.path import Busy, Path, Transfer, choose

__all__ = ["DEFAULT_QUEUE", "DEFAULT_SHARES", "LANES", "Busy", "Lane", "Path", "Transfer", "choose", "parse_lane"]
