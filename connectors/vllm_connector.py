"""kvstore's vLLM connector (KVConnectorBase_V1): vLLM's block hashes become kvstore keys, KV pages move to and
from the daemon's shared-memory slots, one Layer Block at a time. Thin: no cache of its own, and the daemon is
never a reason for the engine to stop (no hits while it is away, one log line, reconnect later).

    vllm serve MODEL --block-size 32 --prefix-caching-hash-algo sha256_cbor --kv-transfer-config \\
      '{"kv_connector": "KVStoreConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"socket": "/run/user/1000/kvstore/kvstore.sock"}}'

(the name is registered by kvstore's vLLM plugin, `vllm_plugin.py`; `kv_connector_module_path`:
"kvstore.connectors.vllm_connector" works too.)

Scheduler side: `get_num_new_matched_tokens` asks the daemon for the longest stored prefix of the request's block
hashes (never the block holding the last prompt token, which vLLM always computes); `build_connector_meta` tells
the worker which blocks to load (hits) and which full blocks were completed this step and must be saved.
Worker side: loads are acquired (pinned) in `start_load_kv` and copied layer by layer in `wait_for_layer_load`;
saves are reserved at the first `save_kv_layer` of a step, written layer by layer, and committed when the last
layer is in, with each block's CRC-32C. A load first checks every block against its CRC-32C; a block that is missing,
altered or could not be loaded is reported by `get_block_ids_with_load_errors`, so vLLM recomputes it (with
`kv_load_failure_policy: recompute`) instead of using bad KV.

extra config: socket (default: $KVSTORE_SERVER_SOCKET or the daemon's default), model / group / salt (namespace
overrides), retry_s (5), timeout_s (5), save (true), load (true), verify (true: blocks carry a CRC-32C, checked
before they are loaded; false trades that proof for less CPU per block), copy_engine (auto: on a GPU one Triton
kernel per layer where it proves byte-exact, else one copy_ per page run; kernel; copy), durable (false: every
save asks the daemon for durability), durable_wait_s (0; below timeout_s), tenant / tenant_secret (the tenant the
engine speaks for, its quota's owner; default $KVSTORE_TENANT / $KVSTORE_TENANT_SECRET, else its user's).

Durability: a request's saves are durable commits when the configuration says `durable: true` or the request asks
for it (`kv_transfer_params: {"kvstore_durable": true}`, e.g. vLLM's `extra_args` of SamplingParams): the daemon
writes those blocks to its SSD tier at once, first in line in the store lane, whether or not its write-through is
on. The worker's step waits for the disk at most `durable_wait_s` (by default it does not: a commit queues its
blocks for the disk and the forward pass goes on; `kvstore flush` or a client's wait_durable is the durability
point). With durable_wait_s > 0 an answer other than durable is logged.

Hints (issue 14): a request may say which workflow, agent and chat session it belongs to, in its
`kv_transfer_params` (vLLM's OpenAI server passes the request body's `kv_transfer_params` through), e.g.
`{"workflow": "w1", "workflow_type": "codegen", "agent": "coder", "step": 3, "next": ["tester"],
"workflow_end": true, "session": "chat-9", "session_end": true, "priority": 2}`, or Dynamo's `nvext.agent_hints` /
`nvext.agent_context` (`connectors/hints.py` says what maps to what). The scheduler side sends a `call` (and a
session turn) when it first sees the request, before its lookup, and the ends it asked for in `request_finished`;
the request's lookups, loads (acquire) and saves (reserve and commit) carry its context (workflow, agent), which
the scheduler hands to the worker in the metadata, per request. Advice only: a request without hints (the common
case) sends nothing more, and a hint that is malformed, refused or ignored by the daemon is logged at debug and
changes nothing for the engine.

Saves: each save reserves the request's whole chain so far (its last CHAIN_KEYS blocks for a longer one), not only
the blocks new since the last: the daemon refreshes the blocks it holds already, tail first, and stores the rest,
so the chain leaves the pool tail first (a put of the new blocks alone would leave them more recent than the loaded
prefix, whose tail would go first and leave them behind a hole), a block evicted since the request loaded it is
stored again, and, without a lower tier, the put never evicts the chain's own head to make room for its tail.

The GPU path: the pool's segments are registered as pinned memory once, loads of every layer are queued on the
connector's stream at `start_load_kv` (each attention layer waits only for its own layer's event), saves are queued
after the layer's compute, and the blocks are committed in `wait_for_save` after one stream sync, so the last layer
never stalls the forward pass. On CPU the same movers copy at once (`kv_pages.py`).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvstore.client import KVStoreError, Lease, Reservation
from kvstore.connectors.daemon_link import DaemonLink
from kvstore.connectors.hints import RequestHints, parse_hints, send_end, send_start, with_context
from kvstore.connectors.kv_pages import COPY_ENGINES, CpuMover, CudaMover, LayerPages
from kvstore.connectors.vllm_layout import engine_identity, layer_order, layout_of_pages, make_spec
from kvstore.protocol.keys import block_key

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("vllm.kvstore")  # under "vllm": shown by vLLM's own log handler


@dataclass
class RequestBlocks:
    """Blocks of one request that the worker loads or saves: their block hashes (16 bytes) and the engine's block
    ids, position by position."""
    req_id: str
    adapter: str
    hashes: list[bytes]
    block_ids: list[int]
    durable: bool = False       # saves: committed durable (the configuration's `durable` or the request's ask)
    context: tuple[str, str] | None = None    # the request's (workflow, agent) hint context, sent with its blocks


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[RequestBlocks] = field(default_factory=list)
    saves: list[RequestBlocks] = field(default_factory=list)


CHAIN_KEYS = 1024                 # the most blocks of a chain one save reserves (the daemon's default max_keys)


@dataclass
class _ReqState:
    request: Any
    block_ids: list[int] = field(default_factory=list)
    stored_upto: int = 0          # blocks [0, stored_upto) are in the daemon or already handed to the worker


@dataclass
class _Move:
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


def _asks_durable(request: Any) -> bool:
    """Whether the request asks for durable saves: `kv_transfer_params: {"kvstore_durable": true}`."""
    params = getattr(request, "kv_transfer_params", None)
    return isinstance(params, dict) and params.get("kvstore_durable") is True


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


def _adapter(request: Any) -> str:
    lora = getattr(request, "lora_request", None)
    return str(lora.lora_name) if lora is not None else ""


class KVStoreConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.block_size = int(vllm_config.cache_config.block_size)
        self.load_enabled = bool(extra.get("load", True))
        self.save_enabled = bool(extra.get("save", True))
        self.verify = bool(extra.get("verify", True))
        self.durable = bool(extra.get("durable", False))
        self.durable_wait_s = _durable_wait(extra)
        who = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "fail")
        if role == KVConnectorRole.SCHEDULER and policy != "recompute":
            log.warning("kvstore: kv_load_failure_policy is %r: a request whose blocks the daemon loses between "
                        "lookup and load (a restart, an eviction, a block failing its CRC) fails instead of being "
                        "recomputed; set \"kv_load_failure_policy\": \"recompute\" in --kv-transfer-config", policy)
        self.disabled: str | None = None
        # scheduler state
        self._reqs: dict[str, _ReqState] = {}
        self._loads: dict[str, RequestBlocks] = {}
        self._hit_start: dict[str, int] = {}
        self._hints: dict[str, RequestHints | None] = {}   # requests seen (their call sent), until finished
        # worker state
        self._layers: dict[str, int] = {}
        self._pages: dict[int, LayerPages] = {}
        self._mover: CpuMover | CudaMover = CpuMover()
        self._cuda = False
        self.copy_engine = str(extra.get("copy_engine", "auto"))
        if self.copy_engine not in COPY_ENGINES:
            log.warning("kvstore: copy_engine %r is not one of %s; using auto", self.copy_engine,
                        ", ".join(COPY_ENGINES))
            self.copy_engine = "auto"
        self._leases: list[tuple[_Move, Lease]] = []
        self._reservations: list[tuple[_Move, Reservation]] | None = None
        self._reserved_at = 0.0                   # when this step's reservations were made or last renewed
        self._to_commit: list[tuple[_Move, Reservation]] = []
        self._load_errors: set[int] = set()
        self.stats = MoveStats()
        tp_rank = 0
        if role == KVConnectorRole.WORKER:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
            try:
                tp_rank = int(get_tensor_model_parallel_rank())
            except (AssertionError, RuntimeError):
                tp_rank = 0
        try:
            self.geometry, fields = engine_identity(vllm_config, kv_cache_config, extra)
        except ValueError as e:
            self.disabled = str(e)
            log.warning("kvstore connector disabled: %s", e)
            self.link = None
            return
        if fields["hash_algo"] not in ("sha256_cbor",):
            log.warning("kvstore: prefix_caching_hash_algo=%s; use sha256_cbor so that engine processes agree on "
                        "block hashes (keys of different algorithms never meet)", fields["hash_algo"])
        geometry = self.geometry
        self.link = DaemonLink(extra.get("socket"), lambda adapter: make_spec(geometry, fields, tp_rank, adapter),
                               log=log, who=who, without="serving without the external KV cache",
                               retry_s=float(extra.get("retry_s", 5.0)), timeout_s=float(extra.get("timeout_s", 5.0)),
                               tenant=extra.get("tenant"), secret=extra.get("tenant_secret"))
        log.info("kvstore connector (%s): model %s, %s, tp %d/%d", who, fields["model"], self.geometry, tp_rank,
                 fields["tp_size"])

    # ======================= scheduler side =======================

    def _hashes(self, request: Request, start: int, end: int) -> list[bytes]:
        """The 16-byte block hashes of the request's blocks [start, end) (vLLM's are folded by block_key)."""
        return [block_key(h) for h in request.block_hashes[start:end]]

    def _context(self, req_id: str) -> tuple[str, str] | None:
        hints = self._hints.get(req_id)
        return None if hints is None else hints.context

    def _first_sight(self, request: Request) -> None:
        """The first time the scheduler sees a request: read its hints and send its `call` (before its lookup, so
        that the lookup's context names an active workflow). Asked again (not scheduled yet, preempted): nothing."""
        if request.request_id in self._hints or self.link is None:
            return
        hints = self._hints[request.request_id] = parse_hints(getattr(request, "kv_transfer_params", None), log)
        ns = None if hints is None else self.link.namespace(_adapter(request))
        if hints is not None and ns is not None:
            self._send(send_start, ns, hints)

    def _send(self, how: Any, ns: Any, hints: RequestHints) -> None:
        try:
            how(ns.client, hints, log)
        except (ConnectionError, OSError) as e:
            if self.link is not None:
                self.link.failed(e)
        except Exception as e:  # noqa: BLE001 - a hint is advice: nothing about it may reach the engine
            log.debug("kvstore: hint not sent: %s: %s", type(e).__name__, e)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.link is None:
            return 0, False
        self._first_sight(request)
        # the last token (of the prompt, or of what a resumed request holds) is always computed by the engine
        usable = min((request.num_tokens - 1) // self.block_size, len(request.block_hashes))
        start = num_computed_tokens // self.block_size
        if not self.load_enabled or usable <= start:
            return 0, False
        ns = self.link.namespace(_adapter(request))
        if ns is None:
            return 0, False
        try:   # chained: a hit at `start` names the prefix
            n = ns.lookup(self._hashes(request, start, usable), **with_context(self._context(request.request_id)))
        except KVStoreError as e:
            log.debug("kvstore lookup refused: %s", e)
            return 0, False
        except (ConnectionError, OSError) as e:
            self.link.failed(e)
            return 0, False
        self._hit_start[request.request_id] = start     # where the external tokens begin (the local hit's end)
        return n * self.block_size, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if self.link is None:
            return
        state = self._reqs.get(request.request_id)
        if state is None:
            state = self._reqs[request.request_id] = _ReqState(request)
        if num_external_tokens <= 0:
            return
        block_ids = list(blocks.get_block_ids()[0])
        start = self._hit_start.pop(request.request_id, request.num_computed_tokens // self.block_size)
        end = start + num_external_tokens // self.block_size
        self._loads[request.request_id] = RequestBlocks(request.request_id, _adapter(request),
                                                        self._hashes(request, start, end), block_ids[start:end],
                                                        context=self._context(request.request_id))
        state.stored_upto = max(state.stored_upto, end)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVStoreConnectorMetadata()
        if self.link is None:
            return meta
        steps: list[tuple[str, int]] = []
        for new in scheduler_output.scheduled_new_reqs:
            state = self._reqs.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            steps.append((new.req_id, new.num_computed_tokens))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._reqs.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                state.block_ids.extend(new_ids[0])
            steps.append((req_id, cached.num_computed_tokens[i]))
        for req_id, computed in steps:
            state = self._reqs[req_id]
            load = self._loads.pop(req_id, None)
            if load is not None:
                meta.loads.append(load)
            if not self.save_enabled:
                continue
            # blocks whose every token has KV once this step has run, and whose hash vLLM has computed
            done = (computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)) // self.block_size
            hi = min(done, len(state.request.block_hashes), len(state.block_ids))
            if hi > state.stored_upto:        # the whole chain so far: see "Saves" in the module docstring
                lo = max(0, hi - CHAIN_KEYS)
                meta.saves.append(RequestBlocks(req_id, _adapter(state.request),
                                                self._hashes(state.request, lo, hi),
                                                state.block_ids[lo:hi],
                                                self.durable or _asks_durable(state.request),
                                                self._context(req_id)))
                state.stored_upto = hi
        self._loads.clear()     # loads of requests not scheduled after all are asked again when they are
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        for d in (self._reqs, self._loads, self._hit_start):
            d.pop(request.request_id, None)
        hints = self._hints.pop(request.request_id, None)
        if hints is not None and (hints.workflow_end or hints.session_end) and self.link is not None:
            ns = self.link.namespace(_adapter(request))   # its saves were committed within its last step
            if ns is not None:
                self._send(send_end, ns, hints)
        return False, None      # saves are synchronous within the step: nothing holds the blocks afterwards

    # ======================= worker side =======================

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if self.link is None:
            return
        names = layer_order(list(kv_caches))
        if len(names) != self.geometry.layers:
            self._disable(f"{len(names)} KV tensors for {self.geometry.layers} attention layers")
            return
        num_blocks = getattr(self._kv_cache_config, "num_blocks", None)
        for i, name in enumerate(names):
            kv = kv_caches[name]
            self._layers[name] = i
            try:
                pages = LayerPages(kv, num_blocks)
            except ValueError as e:
                self._disable(f"layer {name}: {e}")
                return
            if pages.page_bytes != self.geometry.layer_bytes:
                self._disable(f"layer {name}: a page is {pages.page_bytes} bytes (shape {tuple(kv.shape)}), the "
                              f"namespace's geometry expects {self.geometry.layer_bytes}")
                return
            found = layout_of_pages(kv.device.type, pages.page_order)
            if found != self.geometry.layout:     # the scheduler's namespace would name other bytes: never mix
                self._disable(f"layer {name}: pages in the order {found}, the namespace says {self.geometry.layout}")
                return
            self._pages[i] = pages
        device = kv_caches[names[0]].device
        if device.type == "cuda":
            try:
                self._mover = CudaMover(device, engine=self.copy_engine)
            except Exception as e:  # noqa: BLE001 - e.g. copy_engine: kernel without Triton: no cache, no crash
                self._disable(f"the GPU copier could not start: {type(e).__name__}: {e}")
                return
            self._cuda = True
        log.info("kvstore connector: %d layers, %d run(s) of %d bytes per page, %s copies", len(names),
                 self._pages[0].chunks, self._pages[0].chunk_bytes, device.type)

    def _disable(self, why: str) -> None:
        log.warning("kvstore connector disabled: %s", why)
        self.disabled = why
        if self.link is not None:
            self.link.close()
        self.link = None

    def _io_failed(self, exc: BaseException) -> None:
        if isinstance(exc, KVStoreError):
            log.warning("kvstore: request refused: %s", exc)
        elif self.link is not None:
            self.link.failed(exc)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if self.link is None or not isinstance(meta, KVStoreConnectorMetadata):
            return
        for t in meta.loads:
            ns = self.link.namespace(t.adapter)
            if ns is None:
                self._load_errors.update(t.block_ids)
                continue
            try:
                lease = ns.acquire(t.hashes, **with_context(t.context))
            except Exception as e:  # noqa: BLE001 - any failure here means: recompute these blocks
                self._io_failed(e)
                self._load_errors.update(t.block_ids)
                continue
            n = len(lease)
            if self.verify:           # a block committed without a CRC cannot be proven: it ends the load
                n = next((i for i, c in enumerate(lease.crcs) if c is None), n)
                if not self._mover.checksums:      # the device copies: check the slots before it reads them
                    n = self._checked_slots(lease, n, t.req_id)
            if n < len(t.hashes):     # evicted since the scheduler's lookup, or altered: the rest is recomputed
                self._load_errors.update(t.block_ids[n:])
            part = RequestBlocks(t.req_id, t.adapter, t.hashes[:n], t.block_ids[:n], context=t.context)
            move = _Move(part, part.block_ids, crcs=np.zeros(n, np.uint32) if self.verify and self._mover.checksums
                         else None)
            if self._cuda and part.block_ids:
                try:
                    self._enqueue_loads(part, lease)
                    move.done.update(range(self.geometry.layers))
                except Exception as e:  # noqa: BLE001 - a load not queued is a load error, never a crash
                    self._io_failed(e)
                    self._load_errors.update(part.block_ids)
                    part.block_ids = []
            self._leases.append((move, lease))

    def _checked_slots(self, lease: Lease, n: int, req_id: str) -> int:
        """How many of the first n blocks match their CRC-32C in their slots now (the GPU path's check)."""
        m = lease.verified_prefix()
        if m < n:
            log.warning("kvstore: block %d of request %s does not match its checksum: recomputed", m, req_id)
        return min(m, n)

    def _enqueue_loads(self, part: RequestBlocks, lease: Lease) -> None:
        """GPU: every layer's copies queued now on the mover's stream; each attention layer waits for its own."""
        assert self.link is not None and self.link.client is not None
        self._mover.pin(self.link.client)
        for li in range(self.geometry.layers):
            self._mover.load_layer(li, self._pages[li], part.block_ids, lease.views, self.geometry.layer_range(li)[0])

    def wait_for_layer_load(self, layer_name: str) -> None:
        li = self._layers.get(layer_name)
        if li is None or not self._leases:
            return
        if self._cuda:
            self._mover.wait_layer(li)
            return
        a = self.geometry.layer_range(li)[0]
        for move, lease in self._leases:
            t = move.part
            if li in move.done or not t.block_ids:
                continue
            try:
                t0 = time.perf_counter()
                self._mover.load_layer(li, self._pages[li], t.block_ids, lease.views, a, move.crcs)
                self._count(load=True, blocks=len(t.block_ids), layer=li, seconds=time.perf_counter() - t0)
                move.moved(li)
            except Exception as e:  # noqa: BLE001
                self._io_failed(e)
                self._load_errors.update(t.block_ids)
                t.block_ids = []

    def _count(self, load: bool, blocks: int, layer: int, seconds: float) -> None:
        st, nbytes = self.stats, blocks * self._pages[layer].page_bytes
        if load:
            st.load_bytes += nbytes
            st.load_s += seconds
            st.load_blocks += blocks if layer == 0 else 0
        else:
            st.save_bytes += nbytes
            st.save_s += seconds
            st.save_blocks += blocks if layer == 0 else 0

    def _check_loads(self) -> None:
        """After the forward pass: every block loaded in full, and (CPU) its copy equal to its writer's CRC-32C,
        checked on the bytes the engine read, not on the slot. A block that fails, and those after it, are load
        errors: vLLM drops this step's output for the request and recomputes from there. Run by `wait_for_save`, and
        by `get_block_ids_with_load_errors` where vLLM defers the first (a draft model's pass), once per load."""
        for move, lease in self._leases:
            t = move.part
            if not t.block_ids or move.checked:
                continue
            move.checked = True
            if len(move.done) < self.geometry.layers:
                self._load_errors.update(t.block_ids)     # a layer was never loaded
                continue
            if move.crcs is None:
                continue
            if move.in_order:
                bad = next((i for i, (got, want) in enumerate(zip(move.crcs.tolist(), lease.crcs)) if got != want),
                           None)
            else:                     # layers came out of order: the chain is not the slot's CRC; check the slots
                m = lease.verified_prefix()
                bad = m if m < len(t.block_ids) else None
            if bad is not None:
                log.warning("kvstore: block %d of request %s does not match its checksum: recomputed", bad, t.req_id)
                self._load_errors.update(t.block_ids[bad:])

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        li = self._layers.get(layer_name)
        meta = self._connector_metadata
        if li is None or self.link is None or not isinstance(meta, KVStoreConnectorMetadata) or not meta.saves:
            return
        if self._reservations is None:
            self._reservations = self._reserve(meta.saves)
            self._reserved_at = time.monotonic()
        elif self._reservations and time.monotonic() - self._reserved_at > self._lease_s() / 3:
            self._renew()
        a = self.geometry.layer_range(li)[0]
        for move, res in self._reservations:
            if res.done or not move.ids:
                continue
            try:
                if self._cuda and self.link.client is not None:
                    self._mover.pin(self.link.client)
                t0 = time.perf_counter()
                self._mover.save_layer(self._pages[li], move.ids, res.views, a, move.crcs)
                self._count(load=False, blocks=len(move.ids), layer=li, seconds=time.perf_counter() - t0)
                move.moved(li)
                if len(move.done) == self.geometry.layers:
                    if self._cuda:
                        self._to_commit.append((move, res))       # committed in wait_for_save, after a sync
                    else:
                        self._commit(move, res)
            except Exception as e:  # noqa: BLE001
                self._io_failed(e)
                res.done = True

    def _lease_s(self) -> float:
        return self.link.client.lease_s if self.link is not None and self.link.client is not None else 60.0

    def _renew(self) -> None:
        """A forward pass that outlasts a third of the daemon's reservation lease (a long prompt on a slow machine):
        the reservations of this step are extended, else the daemon would abort them mid-pass (and give their
        slots to other writers while this one still copies into them)."""
        self._reserved_at = time.monotonic()
        try:
            assert self.link is not None and self.link.client is not None
            self.link.client.renew()
        except Exception as e:  # noqa: BLE001 - a lease not renewed is a later commit refused, nothing worse
            self._io_failed(e)

    def _reserve(self, saves: list[RequestBlocks]) -> list[tuple[_Move, Reservation]]:
        """This step's reservations, one per request with blocks to save (at the first layer saved)."""
        out: list[tuple[_Move, Reservation]] = []
        assert self.link is not None
        for t in saves:
            ns = self.link.namespace(t.adapter)
            if ns is None:
                continue
            keep = self.link.client.max_keys if self.link.client is not None else CHAIN_KEYS
            if len(t.hashes) > keep:          # a daemon configured for fewer keys a request: the chain's end
                t = replace(t, hashes=t.hashes[-keep:], block_ids=t.block_ids[-keep:])
            try:
                res = ns.reserve(t.hashes, **with_context(t.context))
            except Exception as e:  # noqa: BLE001 - a block not saved is a later miss, nothing worse
                self._io_failed(e)
                continue
            ids = [t.block_ids[p] for p in res.reserved]     # res.views are the reserved slots, in order
            checked = self.verify and self._mover.checksums
            out.append((_Move(t, ids, crcs=np.zeros(len(ids), np.uint32) if checked else None), res))
        return out

    def _commit(self, move: _Move, res: Reservation) -> None:
        """Publish a save with each block's CRC-32C (readers verify): the one computed while copying where the
        layers came in order, else read from the slots."""
        durable = move.part.durable
        crcs: list[int] | None = None
        if self.verify:
            crcs = move.crcs.tolist() if move.crcs is not None and move.in_order else res.checksums()
        try:
            res.commit(crcs=crcs, durable=durable, durable_timeout_s=self.durable_wait_s if durable else None)
        except Exception as e:  # noqa: BLE001 - a block not saved is a later miss, nothing worse
            self._io_failed(e)
            res.done = True
            return
        answer = res.durability
        if durable and self.durable_wait_s > 0 and answer is not None and answer["durability"] != "durable":
            log.info("kvstore: a durable save got %s (%d of %d block(s) pending, %d failed)", answer["durability"],
                     answer["pending"], answer["blocks"], answer["failed"])

    def wait_for_save(self) -> None:
        if self._cuda and self._reservations:
            self._mover.sync()                # every queued copy into a slot is done before it is published or
        if self._to_commit:                   # aborted (an aborted slot goes to another writer at once)
            for move, res in self._to_commit:
                self._commit(move, res)
            self._to_commit = []
        for _, res in self._reservations or []:
            if not res.done:          # some layer never came: publish nothing half-written
                try:
                    res.abort()
                except Exception as e:  # noqa: BLE001
                    self._io_failed(e)
        self._reservations = None
        self._check_loads()
        self._release_leases()

    def _release_leases(self) -> None:
        leases, self._leases = self._leases, []
        if leases:
            self._mover.sync()                # no copy may still read a slot once it is unpinned
        for _, lease in leases:
            try:
                lease.release()
            except Exception as e:  # noqa: BLE001
                self._io_failed(e)
        if leases and self.link is not None and self.link.client is not None:
            try:
                self.link.client.flush()
            except Exception as e:  # noqa: BLE001
                self._io_failed(e)

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._check_loads()
        errors, self._load_errors = self._load_errors, set()
        if errors:
            log.warning("kvstore: %d block(s) could not be loaded; vLLM recomputes them", len(errors))
        return errors

    def shutdown(self) -> None:
        if self.link is not None:
            self._release_leases()
            try:
                self._mover.close()
            except Exception as e:  # noqa: BLE001 - unpinning at exit must not raise into vLLM's shutdown
                log.debug("kvstore: closing the mover: %s", e)
            self.link.close()
