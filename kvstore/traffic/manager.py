"""The daemon's set of paths, built from the `traffic` configuration section."""
from __future__ import annotations

from typing import Any

from kvstore.traffic.config import TrafficConfig
from kvstore.traffic.lanes import Lane
from kvstore.traffic.path import Path
from kvstore.traffic.slow import from_env


def lane_shares(cfg: TrafficConfig) -> dict[Lane, float]:
    low = {Lane.STORE: cfg.share_store, Lane.PREFETCH: cfg.share_prefetch, Lane.BACKGROUND: cfg.share_background}
    return {Lane.CRITICAL: 1.0 - sum(low.values()), **low}


def lane_queues(cfg: TrafficConfig) -> dict[Lane, int]:
    return {Lane.CRITICAL: cfg.queue_critical, Lane.STORE: cfg.queue_store, Lane.PREFETCH: cfg.queue_prefetch,
            Lane.BACKGROUND: cfg.queue_background}


class TrafficManager:
    def __init__(self, cfg: TrafficConfig) -> None:
        self.cfg = cfg
        self.paths: dict[str, Path] = {}

    def path(self, name: str, workers: int | None = None, nominal_bps: float = 1e9) -> Path:
        """The path called `name`, made on first use with `workers` transfers at once (None: traffic.ssd_in_flight,
        the section's setting for a disk's path)."""
        if workers is None:
            workers = self.cfg.ssd_in_flight
        p = self.paths.get(name)
        if p is None:
            p = self.paths[name] = Path(name, workers, lane_shares(self.cfg), lane_queues(self.cfg),
                                        self.cfg.policy, nominal_bps, from_env(name))
        return p

    def stats(self) -> list[dict[str, Any]]:
        return [p.stats() for p in self.paths.values()]

    def close(self) -> None:
        for p in self.paths.values():
            p.close()
