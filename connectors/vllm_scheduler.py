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

Hybrid models (several KV groups, `kv_groups.py`): the lookup asks every group which of the blocks past the local
hit it holds (`held`), answers the longest end at which every group can be restored (`usable_end`), and counts that
hit with one chained lookup; a load moves exactly what each group needs there; a save stores every new block of the
full groups and, of the others, what the ends a later request may resume from need (this step's end, and where the
prompt left the chains the daemon held at its lookup: kv_groups). A hybrid model's loads use vLLM's asynchronous
protocol: the request waits one step while the worker copies and checks every group's blocks whole, then is reported
loaded or failed (vLLM recomputes a failed one from its start). vLLM maps a load error reported by block id back to
its request only for models with one KV group; for the others, only a request-level failure is safe.

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
from kvstore.connectors.kv_groups import FULL, STATE, usable_end
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
    block_ids: list[list[int]] = field(default_factory=list)     # per vLLM KV cache group, position by position
    stored_upto: int = 0          # blocks [0, stored_upto) are in the daemon or already handed to the worker
    diverged: int = 0             # where the prompt left the chains the daemon held at its lookup (hybrid models)


def _asks_durable(request: Any) -> bool:
    """Whether the request asks for durable saves: `kv_transfer_params: {"kvstore_durable": true}`."""
    params = getattr(request, "kv_transfer_params", None)
    return isinstance(params, dict) and params.get("kvstore_durable") is True


def _run(mask: list[bool]) -> int:
    """How many leading entries of `mask` are true."""
    return next((i for i, there in enumerate(mask) if not there), len(mask))


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
        self._loads: dict[str, list[RequestBlocks]] = {}
        self._hit_start: dict[str, int] = {}
        self._diverged: dict[str, int] = {}   # hybrid: where each prompt left the stored chains, at its lookup
        self.checkpoint_blocks = config.window_checkpoint_blocks
        align = getattr(kv_cache_config, "cache_hit_alignment_tokens", None) or config.block_size
        self.align = max(1, int(align) // config.block_size)     # a hit ends on a multiple of this many blocks
        self._hints: dict[str, RequestHints | None] = {}   # requests seen (their call sent), until finished
        self._failed: set[str] = set()        # requests whose load failed: computed by the engine from here on
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
        if not self.load_enabled or usable <= start or request.request_id in self._failed:
            return 0, False
        try:
            end, self._diverged[request.request_id] = self._restorable_end(request, start, usable)
        except KVStoreError as e:
            log.debug("kvstore lookup refused: %s", e)
            return 0, False
        except (ConnectionError, OSError) as e:
            self.link.failed(e)
            return 0, False
        if end <= start:
            return 0, False
        self._hit_start[request.request_id] = start     # where the external tokens begin (the local hit's end)
        return (end - start) * self.block_size, self.hybrid    # hybrid: vLLM's asynchronous loads (see above)

    def _restorable_end(self, request: Request, start: int, usable: int) -> tuple[int, int]:
        """(The longest prefix end, in blocks past `start` (the local hit), at which every KV group can be
        restored, `start` where none is or a namespace is away; where the prompt leaves the chains the daemon
        holds). One chained lookup for a model with one group. A hybrid model's groups are first asked which
        blocks past the local hit they hold (`held`: no hit counted; the engine holds those before it), which
        gives both answers; then the first full group's chained lookup up to the end counts the hit the engine
        gets (and checks it once more)."""
        assert self.link is not None
        adapter, ctx = _adapter(request), with_context(self._context(request.request_id))
        hashes = self._hashes(request, start, usable)
        if not self.hybrid:
            ns = self.link.namespace(adapter)
            n = ns.lookup(hashes, **ctx) if ns is not None else 0
            return start + n, start + n
        held: list[list[bool]] = []
        for part in range(len(self.groups)):
            ns = self.link.namespace(adapter, part)
            if ns is None:
                return start, start
            held.append([True] * start + ns.held(hashes, **ctx))
        rules = [g.rule for g in self.groups]
        masks = [None if r.kind == FULL else h for r, h in zip(rules, held)]
        full = min((_run(h) for r, h in zip(rules, held) if r.kind == FULL), default=usable)
        end = usable_end(rules, full, masks, self.align)
        first = next((part for part, r in enumerate(rules) if r.kind == FULL), None)
        ns = self.link.namespace(adapter, first) if first is not None else None
        if end > start and ns is not None:
            n = ns.lookup(hashes[:end - start], **ctx)
            if n < end - start:           # gone since `held` (an eviction between the two): the shorter end
                end = usable_end(rules, start + n, masks, self.align)
        return max(start, end), full

    def update_connector_output(self, connector_output: Any) -> None:
        """A hybrid model's failed loads: vLLM asks again for the request, which would find the same blocks and
        fail the same way; it is computed by the engine instead."""
        self._failed.update(getattr(connector_output, "failed_recving", None) or ())

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if self.link is None:
            return
        state = self._reqs.get(request.request_id)
        if state is None:
            state = self._reqs[request.request_id] = _ReqState(request)
        state.diverged = self._diverged.pop(request.request_id, state.diverged)
        if num_external_tokens <= 0:
            return
        ids = blocks.get_block_ids()
        start = self._hit_start.pop(request.request_id, request.num_computed_tokens // self.block_size)
        end = start + num_external_tokens // self.block_size
        loads = self._loads[request.request_id] = []
        context = self._context(request.request_id)
        for part, group in enumerate(self.groups):     # exactly what each group needs to resume at `end`
            where = [p for p in group.rule.needed(end) if p >= start]
            loads.append(self._blocks(request, part, where, ids[group.index], context=context))
            loads[-1].whole = self.hybrid
        state.stored_upto = max(state.stored_upto, end)

    def _blocks(self, request: Request, part: int, where: list[int], group_ids: list[int],
                durable: bool = False, context: tuple[str, str] | None = None) -> RequestBlocks:
        """The request's blocks of KV group `part` at positions `where`, as the worker moves them. Positions whose
        engine block is the null block (id 0: a sliding-window block the engine already let go) are left out."""
        keep = [p for p in where if p < len(group_ids) and group_ids[p] != 0]
        hashes = [block_key(request.block_hashes[p]) for p in keep]
        return RequestBlocks(request.request_id, _adapter(request), hashes, [group_ids[p] for p in keep], durable,
                             context, group=part)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVStoreConnectorMetadata:
        meta = KVStoreConnectorMetadata()
        if self.link is None:
            return meta
        steps: list[tuple[str, int]] = []
        for new in scheduler_output.scheduled_new_reqs:
            state = self._reqs.get(new.req_id)
            if state is None:
                continue
            state.block_ids = [list(ids) for ids in new.block_ids]
            steps.append((new.req_id, new.num_computed_tokens))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._reqs.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = [list(ids) for ids in new_ids] if new_ids else []
            elif new_ids:
                if not state.block_ids:
                    state.block_ids = [[] for _ in new_ids]
                for mine, more in zip(state.block_ids, new_ids):
                    mine.extend(more or ())
            steps.append((req_id, cached.num_computed_tokens[i]))
        for req_id, computed in steps:
            state = self._reqs[req_id]
            meta.loads.extend(self._loads.pop(req_id, ()))
            if self.save_enabled:
                upto = computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
                self._save(meta, req_id, state, upto // self.block_size, upto % self.block_size == 0)
        for req_id in list(self._loads) if self.hybrid else ():   # waiting for their KV: not scheduled this step
            meta.loads.extend(self._loads.pop(req_id))
        self._loads.clear()     # loads of requests not scheduled after all are asked again when they are
        return meta

    def _save(self, meta: KVStoreConnectorMetadata, req_id: str, state: _ReqState, done: int, aligned: bool) -> None:
        """Blocks whose every token has KV once this step has run (`done` of them), and whose hash vLLM has
        computed: of full groups the whole chain so far (see "Saves" in the module docstring), of window groups
        what this step's end and the checkpoints it passed need (kv_groups.GroupRule.keep). A state group's block
        holds the state where the step ended, so it is kept only where the step ends on that block's end
        (`aligned`, as vLLM's align mode schedules prefills): never a state from another position under its key."""
        if not state.block_ids:
            return
        hi = min([done, len(state.request.block_hashes)] + [len(state.block_ids[g.index]) for g in self.groups])
        if hi <= state.stored_upto:
            return
        durable = self.durable or _asks_durable(state.request)
        for part, group in enumerate(self.groups):
            if group.rule.kind == FULL:
                where = list(range(max(0, hi - CHAIN_KEYS), hi))
            elif group.rule.kind == STATE:
                where = [hi - 1] if aligned and hi == done else []
            else:       # this step's end, and where the prompt left what the daemon held: a prefix others share
                where = group.rule.keep(state.stored_upto, hi, [hi, state.diverged], self.checkpoint_blocks)
            part_blocks = self._blocks(state.request, part, where, state.block_ids[group.index], durable,
                                       self._context(req_id))
            if part_blocks.hashes:
                meta.saves.append(part_blocks)
        state.stored_upto = hi

    def request_finished(self, request: Request, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's `request_finished` and, for hybrid models, `request_finished_all_groups` (block ids per group):
        the request's saves were all made within its steps, so nothing holds its blocks afterwards."""
        for d in (self._reqs, self._loads, self._hit_start, self._diverged):
            d.pop(request.request_id, None)
        self._failed.discard(request.request_id)
        hints = self._hints.pop(request.request_id, None)
        if hints is not None and (hints.workflow_end or hints.session_end) and self.link is not None:
            ns = self.link.namespace(_adapter(request))   # its saves were committed within its last step
            if ns is not None:
                self._send(send_end, ns, hints)
        return False, None      # saves are synchronous within the step: nothing holds the blocks afterwards

    def shutdown(self) -> None:
        if self.link is not None:
            self.link.close()
