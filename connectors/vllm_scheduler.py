"""The scheduler side of kvstore's vLLM connector (`KVStoreConnectorScheduler`), built by `KVStoreConnector` in
vLLM's scheduler process. It owns what is decided per request before a step runs: how many of its tokens the daemon
holds, which blocks the worker loads, which it saves, and the request's hints; it moves no KV itself.

Scheduler side: `get_num_new_matched_tokens` asks the daemon for the longest stored prefix of the request's block
hashes (never the block holding the last prompt token, which vLLM always computes); `build_connector_meta` tells
the worker which blocks to load (hits) and which full blocks were completed this step and must be saved.

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
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstore.client import KVStoreError
from kvstore.connectors.hints import RequestHints, parse_hints, send_end, send_start, with_context
from kvstore.connectors.vllm_common import (
    CHAIN_KEYS,
    ConnectorConfig,
    ConnectorSide,
    KVStoreConnectorMetadata,
    RequestBlocks,
    log,
)
from kvstore.protocol.keys import block_key

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


@dataclass
class _ReqState:
    request: Any
    block_ids: list[int] = field(default_factory=list)
    stored_upto: int = 0          # blocks [0, stored_upto) are in the daemon or already handed to the worker


def _asks_durable(request: Any) -> bool:
    """Whether the request asks for durable saves: `kv_transfer_params: {"kvstore_durable": true}`."""
    params = getattr(request, "kv_transfer_params", None)
    return isinstance(params, dict) and params.get("kvstore_durable") is True


def _adapter(request: Any) -> str:
    lora = getattr(request, "lora_request", None)
    return str(lora.lora_name) if lora is not None else ""


class KVStoreConnectorScheduler(ConnectorSide):
    def __init__(self, config: ConnectorConfig, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
        self.block_size = config.block_size
        self.load_enabled = config.load_enabled
        self.save_enabled = config.save_enabled
        self.durable = config.durable
        self._reqs: dict[str, _ReqState] = {}
        self._loads: dict[str, RequestBlocks] = {}
        self._hit_start: dict[str, int] = {}
        self._hints: dict[str, RequestHints | None] = {}   # requests seen (their call sent), until finished
        super().__init__(config, vllm_config, kv_cache_config, "scheduler")

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

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVStoreConnectorMetadata:
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

    def shutdown(self) -> None:
        if self.link is not None:
            self.link.close()
