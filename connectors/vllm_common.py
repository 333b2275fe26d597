"""What both sides of kvstore's vLLM connector share: the metadata the scheduler hands to the worker each step, the
extra config (parsed the same way in both processes), and the link to the daemon that each side opens for itself.

vLLM builds the connector twice, once per role: in the scheduler process (`vllm_scheduler.py`) and in each worker
(`vllm_worker.py`); the two never share memory. What passes from one to the other is `KVStoreConnectorMetadata`,
which vLLM pickles from the scheduler's `build_connector_meta` to the worker's `bind_connector_metadata`, once per
step. Each side connects to the daemon on its own (`ConnectorSide`): the scheduler to look up and to send hints, the
worker to load and to save. Both derive the same namespace from the configuration alone (`vllm_layout.py`), so that
the blocks one looks up are the blocks the other loads.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvstore.connectors.daemon_link import DaemonLink
from kvstore.connectors.kv_pages import COPY_ENGINES
from kvstore.connectors.vllm_layout import KVGroup, engine_identity, make_spec

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger("vllm.kvstore")  # under "vllm": shown by vLLM's own log handler

CHAIN_KEYS = 1024                 # the most blocks of a chain one save reserves (the daemon's default max_keys)


@dataclass
class RequestBlocks:
    """Blocks of one request and one KV group that the worker loads or saves: their block hashes (16 bytes) and the
    engine's block ids, position by position (a window or state group's positions need not be consecutive)."""
    req_id: str
    adapter: str
    hashes: list[bytes]
    block_ids: list[int]
    durable: bool = False       # saves: committed durable (the configuration's `durable` or the request's ask)
    context: tuple[str, str] | None = None    # the request's (workflow, agent) hint context, sent with its blocks
    group: int = 0              # which of the side's `groups` (a model with one KV group: 0)
    whole: bool = False         # loads: copied whole before the request runs (vLLM's asynchronous loads)


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[RequestBlocks] = field(default_factory=list)
    saves: list[RequestBlocks] = field(default_factory=list)


@dataclass
class ConnectorConfig:
    """The extra config (`kv_connector_extra_config`) as both sides read it; `extra` keeps the rest (socket,
    namespace overrides, tenant, retry_s, timeout_s) for the link and the namespace."""
    extra: dict[str, Any]
    block_size: int
    load_enabled: bool
    save_enabled: bool
    verify: bool
    durable: bool
    durable_wait_s: float
    copy_engine: str
    window_checkpoint_blocks: int = 0    # hybrid models: a sliding window kept every this many blocks too (0: none)


def _durable_wait(extra: dict[str, Any]) -> float:
    """`durable_wait_s` of the extra config: 0..timeout_s (a wait the client's socket timeout would cut is
    lowered below it, with a warning)."""
    wait, limit = float(extra.get("durable_wait_s", 0.0)), float(extra.get("timeout_s", 5.0))
    if wait < 0:
        log.warning("kvstore: durable_wait_s %g is negative; using 0 (no wait)", wait)
        return 0.0
    if wait >= limit:
        log.warning("kvstore: durable_wait_s %g is not below timeout_s %g; using %g", wait, limit, limit * 0.9)
        return limit * 0.9
    return wait


def parse_config(kv_transfer_config: Any, vllm_config: VllmConfig, scheduler: bool) -> ConnectorConfig:
    """The extra config, read alike on both sides (each logs what it corrects, as each always has). The scheduler,
    which decides what is loaded, also warns about a `kv_load_failure_policy` that fails requests on a lost block."""
    extra = dict(kv_transfer_config.kv_connector_extra_config or {})
    block_size = int(vllm_config.cache_config.block_size)
    load_enabled = bool(extra.get("load", True))
    save_enabled = bool(extra.get("save", True))
    verify = bool(extra.get("verify", True))
    durable = bool(extra.get("durable", False))
    durable_wait_s = _durable_wait(extra)
    policy = getattr(kv_transfer_config, "kv_load_failure_policy", "fail")
    if scheduler and policy != "recompute":
        log.warning("kvstore: kv_load_failure_policy is %r: a request whose blocks the daemon loses between "
                    "lookup and load (a restart, an eviction, a block failing its CRC) fails instead of being "
                    "recomputed; set \"kv_load_failure_policy\": \"recompute\" in --kv-transfer-config", policy)
    copy_engine = str(extra.get("copy_engine", "auto"))
    if copy_engine not in COPY_ENGINES:
        log.warning("kvstore: copy_engine %r is not one of %s; using auto", copy_engine, ", ".join(COPY_ENGINES))
        copy_engine = "auto"
    checkpoints = int(extra.get("window_checkpoint_blocks", 0))
    if checkpoints < 0:
        log.warning("kvstore: window_checkpoint_blocks %d is negative; using 0 (none)", checkpoints)
        checkpoints = 0
    return ConnectorConfig(extra, block_size, load_enabled, save_enabled, verify, durable, durable_wait_s,
                           copy_engine, checkpoints)


class ConnectorSide:
    """What each side holds of its own: the config, the engine's KV groups (each a namespace of its own, part k of
    the link: kv_groups) and the link to the daemon (None where the engine's KV cannot be stored, `disabled` then
    says why; the worker may disable itself later too)."""

    link: DaemonLink | None
    groups: list[KVGroup]        # set where the link is (unset while disabled, as nothing reads it then)

    def __init__(self, config: ConnectorConfig, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                 who: str, tp_rank: int = 0) -> None:
        self.config = config
        self.disabled: str | None = None
        extra = config.extra
        try:
            self.groups, fields = engine_identity(vllm_config, kv_cache_config, extra)
        except ValueError as e:
            self.disabled = str(e)
            log.warning("kvstore connector disabled: %s", e)
            self.link = None
            return
        if fields["hash_algo"] not in ("sha256_cbor",):
            log.warning("kvstore: prefix_caching_hash_algo=%s; use sha256_cbor so that engine processes agree on "
                        "block hashes (keys of different algorithms never meet)", fields["hash_algo"])
        groups = self.groups
        self.link = DaemonLink(extra.get("socket"),
                               lambda adapter, part=0: make_spec(groups[part], fields, tp_rank, adapter),
                               log=log, who=who, without="serving without the external KV cache",
                               retry_s=float(extra.get("retry_s", 5.0)), timeout_s=float(extra.get("timeout_s", 5.0)),
                               tenant=extra.get("tenant"), secret=extra.get("tenant_secret"))
        log.info("kvstore connector (%s): model %s, %s, tp %d/%d", who, fields["model"],
                 "; ".join(f"{g.rule.kind} group {g.index}: {g.geometry}" for g in groups), tp_rank,
                 fields["tp_size"])

    @property
    def hybrid(self) -> bool:
        """Whether the engine's KV has several groups (a hybrid model: kv_groups)."""
        return len(self.groups) > 1
