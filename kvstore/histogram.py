"""Latency histograms with fixed bounds: what the daemon keeps per op and per lane, what `kvstore stats` and
Prometheus show, and what the CLI turns back into quantiles."""
from __future__ import annotations

import bisect
from typing import Any

# Upper bounds in seconds; the last bucket is +Inf.
BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0, 2.5, 5.0,
           10.0)                # to 10 s: the durable path's lag under load reaches seconds


class Histogram:
    __slots__ = ("count", "counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.total += seconds
        self.count += 1

    def quantile(self, q: float) -> float:
        return bucket_quantile(self.counts, q)

    def to_dict(self) -> dict[str, Any]:
        # a quantile beyond the last bound is null: strict JSON has no Infinity
        p50, p99 = (q if q != float("inf") else None for q in (self.quantile(0.5), self.quantile(0.99)))
        return {"count": self.count, "sum": self.total, "buckets": list(self.counts), "p50": p50, "p99": p99}


def bucket_quantile(counts: list[int], q: float) -> float:
    """Upper bound of the bucket holding the q-quantile of these bucket counts (what a histogram can honestly say):
    inf beyond the last bound, 0.0 with no observation."""
    total = sum(counts)
    if not total:
        return 0.0
    rank, seen = q * total, 0
    for i, c in enumerate(counts):
        seen += c
        if seen >= rank:
            return BUCKETS[i] if i < len(BUCKETS) else float("inf")
    return float("inf")
