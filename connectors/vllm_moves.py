"""What the worker side of kvstore's vLLM connector (`vllm_worker.py`) keeps per move and per layer: one request's
load or save of one KV group in a step (`Move`), where a layer's pages go (`LayerPlace`), and the copy counters
(`MoveStats`). Plain data, no engine import."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvstore.connectors.vllm_common import RequestBlocks


@dataclass
class Move:
    """One request's load (a lease) or save (a reservation) on the worker in this step: the layers moved so far and,
    where the mover checksums as it copies, each block's CRC-32C continued layer by layer. The chain holds only if
    the layers come in order 0, 1, ...; `in_order` says whether they did."""
    part: RequestBlocks
    ids: list[int]                # the engine's blocks moved, in slot order
    done: set[int] = field(default_factory=set)
    crcs: np.ndarray | None = None
    in_order: bool = True
    checked: bool = False         # a load's blocks were checked once after the forward pass

    def moved(self, layer: int) -> None:
        self.in_order = self.in_order and layer == len(self.done)
        self.done.add(layer)


@dataclass
class MoveStats:
    """The worker's copies since start: blocks and bytes moved, and seconds spent in the copies themselves (CPU
    movers; a GPU mover's queued copies are not timed). Benchmarks read them (bench_vllm_ttft: load GB/s)."""
    load_blocks: int = 0
    load_bytes: int = 0
    load_s: float = 0.0
    save_blocks: int = 0
    save_bytes: int = 0
    save_s: float = 0.0

    def count(self, load: bool, blocks: int, nbytes: int, layer: int, seconds: float) -> None:
        """One layer's copy of `blocks` blocks (`nbytes` in all); blocks are counted at layer 0 only."""
        if load:
            self.load_bytes += nbytes
            self.load_s += seconds
            self.load_blocks += blocks if layer == 0 else 0
        else:
            self.save_bytes += nbytes
            self.save_s += seconds
            self.save_blocks += blocks if layer == 0 else 0


@dataclass(frozen=True)
class LayerPlace:
    """Where an attention (or state) layer's pages go: its KV group (`part`, an index into the side's groups), its
    Layer Block within that group's blocks (`li`), and its index among all the engine's layers (`gi`: the GPU
    mover's per-layer events)."""
    part: int
    li: int
    gi: int
