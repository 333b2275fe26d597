"""kvstore's vLLM connector (KVConnectorBase_V1): vLLM's block hashes become kvstore keys, KV pages move to and
from the daemon's shared-memory slots, one Layer Block at a time. Thin: no cache of its own, and the daemon is
never a reason for the engine to stop (no hits while it is away, one log line, reconnect later).

    vllm serve MODEL --block-size 32 --prefix-caching-hash-algo sha256_cbor --kv-transfer-config \\
      '{"kv_connector": "KVStoreConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"socket": "/run/user/1000/kvstore/kvstore.sock"}}'

(the name is registered by kvstore's vLLM plugin, `vllm_plugin.py`; `kv_connector_module_path`:
"kvstore.connectors.vllm_connector" works too.)

Built the way vLLM's own connectors are: vLLM makes one connector per role, and `KVStoreConnector` is a facade that
builds the side of its role and forwards each method of KVConnectorBase_V1 to the side that owns it:
- `KVStoreConnectorScheduler` (`vllm_scheduler.py`), in the scheduler process: lookups, which blocks the worker
  loads and saves, the requests' hints;
- `KVStoreConnectorWorker` (`vllm_worker.py`), in each worker: the KV pages, loads and saves layer by layer, checks;
- `vllm_common.py`: what both share, the metadata the scheduler hands to the worker each step, the extra config
  below, and the link to the daemon that each side holds.
A method vLLM calls on the other role's connector finds no side there and does nothing (as a disabled side does).

extra config: socket (default: $KVSTORE_SERVER_SOCKET or the daemon's default), model / group / salt (namespace
overrides), retry_s (5), timeout_s (5), save (true), load (true), verify (true: blocks carry a CRC-32C, checked
before they are loaded; false trades that proof for less CPU per block), copy_engine (auto: on a GPU one Triton
kernel per layer where it proves byte-exact, else one copy_ per page run; kernel; copy), durable (false: every
save asks the daemon for durability), durable_wait_s (0; below timeout_s), tenant / tenant_secret (the tenant the
engine speaks for, its quota's owner; default $KVSTORE_TENANT / $KVSTORE_TENANT_SECRET, else its user's),
window_checkpoint_blocks (0: hybrid models' sliding windows are kept at step ends and where a prompt left the
daemon's chains; K > 0: also before every K-th block, for prompts that share part of an earlier one without a
third request ever having shared it; kv_groups.py).

Durability: a request's saves are durable commits when the configuration says `durable: true` or the request asks
for it (`kv_transfer_params: {"kvstore_durable": true}`, e.g. vLLM's `extra_args` of SamplingParams): the daemon
writes those blocks to its SSD tier at once, first in line in the store lane, whether or not its write-through is
on. The worker's step waits for the disk at most `durable_wait_s` (by default it does not: a commit queues its
blocks for the disk and the forward pass goes on; `kvstore flush` or a client's wait_durable is the durability
point). With durable_wait_s > 0 an answer other than durable is logged.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvstore.connectors.vllm_common import (
    CHAIN_KEYS,
    KVStoreConnectorMetadata,
    RequestBlocks,
    parse_config,
)
from kvstore.connectors.vllm_scheduler import KVStoreConnectorScheduler
from kvstore.connectors.vllm_worker import KVStoreConnectorWorker, MoveStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["CHAIN_KEYS", "KVStoreConnector", "KVStoreConnectorMetadata", "KVStoreConnectorScheduler",
           "KVStoreConnectorWorker", "MoveStats", "RequestBlocks"]


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """Supports vLLM's hybrid KV cache manager (SupportsHMA): every prefix-cacheable KV group is stored and restored
    under its own rule (kv_groups.py), and a hit is reported only where every group can be restored."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        scheduler = role == KVConnectorRole.SCHEDULER
        config = parse_config(self._kv_transfer_config, vllm_config, scheduler)
        self.connector_scheduler: KVStoreConnectorScheduler | None = None
        self.connector_worker: KVStoreConnectorWorker | None = None
        if scheduler:
            self.connector_scheduler = KVStoreConnectorScheduler(config, vllm_config, kv_cache_config)
        else:
            self.connector_worker = KVStoreConnectorWorker(config, vllm_config, kv_cache_config)

    @property
    def disabled(self) -> str | None:
        """Why this side stores nothing (the engine's KV cannot be stored, or the worker's pages do not fit)."""
        side = self.connector_scheduler or self.connector_worker
        return side.disabled if side is not None else None

    @property
    def stats(self) -> MoveStats:
        """The worker's copy counters (bench_vllm_ttft reads them); zeros on the scheduler, which copies nothing."""
        return self.connector_worker.stats if self.connector_worker is not None else MoveStats()

    # ======================= scheduler side =======================

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.connector_scheduler is None:
            return 0, False
        return self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if self.connector_scheduler is not None:
            self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self.connector_scheduler is not None:
            self.connector_scheduler.update_connector_output(connector_output)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self.connector_scheduler is None:
            return KVStoreConnectorMetadata()
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.connector_scheduler is None:
            return False, None
        return self.connector_scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        if self.connector_scheduler is None:
            return False, None
        return self.connector_scheduler.request_finished(request, block_ids)

    # ======================= worker side =======================

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if self.connector_worker is not None:
            self.connector_worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self.connector_worker is not None:
            self.connector_worker.start_load_kv(self._connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.connector_worker is not None:
            self.connector_worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        if self.connector_worker is not None:
            self.connector_worker.save_kv_layer(layer_name, self._connector_metadata)

    def wait_for_save(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.wait_for_save(self._connector_metadata)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Hybrid models' loads (vLLM's asynchronous protocol): the requests whose KV is in place, and those whose
        load failed (in both sets: vLLM recomputes them). kvstore's saves never outlive their step: none sending."""
        if self.connector_worker is None:
            return KVConnectorTransferResults()
        done, failed = self.connector_worker.received()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.connector_worker is None:
            return set()
        return self.connector_worker.get_block_ids_with_load_errors()

    # ======================= both =======================

    def shutdown(self) -> None:
        if self.connector_scheduler is not None:
            self.connector_scheduler.shutdown()
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
