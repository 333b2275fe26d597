"""Helpers of the vLLM connector that do not depend on vLLM's connector interface: the namespace derived from the
engine's configuration, the link to the daemon (lazy connect, one log line per outage, retry later), and the page
movers that copy Layer Blocks between the engine's KV pages and the daemon's slots.

Kept apart from `vllm_connector.py` so that the connector stays thin and these parts can be read (and tested) alone.
"""
from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvstore.client import Client, KVStoreError, Namespace
from kvstore.geometry import Geometry
from kvstore.keys import NamespaceSpec

log = logging.getLogger("vllm.kvstore")  # under "vllm": shown by vLLM's own log handler

# torch dtype name -> kvstore Geometry dtype
TORCH_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16",
                "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2", "int8": "int8", "uint8": "uint8"}

# The page layout of one block of one layer, per platform. On CPU vLLM's KV tensor per layer is
# [num_blocks, num_kv_heads, block_size, 2*head_size] and kv[block] is one contiguous page (per head: K rows, then
# V rows), copied as it is.
CPU_LAYOUT = "vllm-cpu:heads,tokens,2*dim"


def layer_order(layer_names: Sequence[str]) -> list[str]:
    """Attention layers in model order (by the number in their name, e.g. model.layers.3.self_attn.attn)."""
    def index(name: str) -> tuple[int, str]:
        nums = re.findall(r"\.(\d+)\.", f".{name}.")
        return (int(nums[0]) if nums else 1 << 30, name)
    return sorted(layer_names, key=index)


def torch_dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def engine_identity(vllm_config: Any, kv_cache_config: Any, extra: dict[str, Any]) -> tuple[Geometry, dict[str, Any]]:
    """The block geometry and the namespace fields (except the adapter) of this engine, computed the same way by the
    scheduler and the worker from the configuration alone. Raises ValueError when the engine's KV cannot be stored
    (several KV cache groups, a non-attention spec, an unsupported dtype)."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(f"{len(groups)} KV cache groups (hybrid or sliding-window models) are not supported yet")
    spec = groups[0].kv_cache_spec
    for attr in ("num_kv_heads", "head_size", "dtype", "block_size"):
        if not hasattr(spec, attr):
            raise ValueError(f"KV cache spec {type(spec).__name__} is not an attention spec")
    if getattr(spec, "head_size_v", spec.head_size) not in (None, spec.head_size):
        raise ValueError("K and V head sizes differ")
    dtype = TORCH_DTYPES.get(torch_dtype_name(spec.dtype))
    if dtype is None:
        raise ValueError(f"KV dtype {spec.dtype} is not supported")
    device = str(getattr(vllm_config.device_config, "device_type", "cpu") or "cpu")
    if device == "cpu":
        layout = CPU_LAYOUT
    else:
        backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
        layout = f"vllm-{device}:{getattr(backend, 'name', backend) or 'auto'}"[:64]
    geometry = Geometry(layers=len(groups[0].layer_names), tokens=int(spec.block_size),
                        kv_heads=int(spec.num_kv_heads), head_dim=int(spec.head_size), dtype=dtype, kv=2,
                        layout=layout)
    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    algo = str(cache.prefix_caching_hash_algo)
    # Everything else that changes the bytes of a page or the meaning of a block hash goes into the salt: the hash
    # algorithm (keys of two algorithms never meet), the KV quantisation, the pipeline stage (its layers).
    salt = "|".join([f"hash={algo}", f"kv_quant={getattr(spec, 'kv_quant_mode', 'none')}",
                     f"cache_dtype={cache.cache_dtype}", f"pp={parallel.pipeline_parallel_size}",
                     f"revision={model_config.revision or ''}", str(extra.get("salt", ""))])
    fields = {"model": str(extra.get("model") or model_config.model)[:256], "group": str(extra.get("group", "")),
              "tp_size": int(parallel.tensor_parallel_size), "salt": salt[:256], "hash_algo": algo}
    return geometry, fields


def make_spec(geometry: Geometry, fields: dict[str, Any], tp_rank: int, adapter: str) -> NamespaceSpec:
    return NamespaceSpec(model=fields["model"], geometry=geometry, group=fields["group"], adapter=adapter[:256],
                         tp_rank=tp_rank, tp_size=fields["tp_size"], salt=fields["salt"])


class DaemonLink:
    """A connection to the daemon that is never a reason for the engine to stop or wait long.

    Connects lazily; every operation is bounded by the client's socket timeout. A failure closes the client, logs
    one warning for the whole outage, and the next attempt is made `retry_s` later (a restarted daemon is found
    again, with fresh namespaces and segment mappings). Namespaces are opened per adapter on first use.
    """

    def __init__(self, path: str | None, spec_for: Callable[[str], NamespaceSpec], who: str,
                 retry_s: float = 5.0, timeout_s: float = 5.0) -> None:
        self.path = path
        self.spec_for = spec_for
        self.who = who
        self.retry_s = retry_s
        self.timeout_s = timeout_s
        self.client: Client | None = None
        self._ns: dict[str, Namespace] = {}
        self._retry_at = 0.0
        self._down_since: float | None = None
        self.outages = 0

    def namespace(self, adapter: str = "") -> Namespace | None:
        """The namespace for `adapter`, or None while the daemon is unreachable."""
        if self.client is None:
            if time.monotonic() < self._retry_at:
                return None
            try:
                self.client = Client(self.path, timeout=self.timeout_s)
            except (ConnectionError, OSError) as e:
                self.failed(e)
                return None
        ns = self._ns.get(adapter)
        if ns is None:
            try:
                ns = self._ns[adapter] = self.client.namespace(self.spec_for(adapter))
            except KVStoreError as e:          # the daemon refuses this namespace: no cache for it, no outage
                log.warning("kvstore (%s): namespace refused: %s", self.who, e)
                return None
            except (ConnectionError, OSError, ValueError) as e:
                self.failed(e)
                return None
            if self._down_since is not None:
                log.warning("kvstore (%s): daemon at %s is back after %.1f s", self.who, self.client.path,
                            time.monotonic() - self._down_since)
                self._down_since = None
        return ns

    def failed(self, exc: BaseException) -> None:
        """The daemon did not answer (or the connection broke): drop the client, retry later, log once."""
        if self.client is not None:
            try:
                self.client.close()
            except Exception:  # noqa: BLE001 - closing a broken client must not raise into the engine
                pass
        self.client = None
        self._ns.clear()
        self._retry_at = time.monotonic() + self.retry_s
        if self._down_since is None:
            self._down_since = time.monotonic()
            self.outages += 1
            log.warning("kvstore (%s): daemon unavailable (%s: %s); serving without the external KV cache, "
                        "retrying every %.1f s", self.who, type(exc).__name__, exc, self.retry_s)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        self.client = None
        self._ns.clear()


# ----- page movers: engine pages <-> daemon slots -----

class CpuPages:
    """Byte views of one layer's KV pages on CPU: `page(b)` is block b's page as a contiguous uint8 array (a view of
    the engine's tensor, no copy), handed to Reservation.write_layer / Lease.read_layer."""

    def __init__(self, kv: Any) -> None:
        import torch

        page = kv[0]
        if not page.is_contiguous():
            raise ValueError(f"a KV page is not contiguous (shape {tuple(kv.shape)}, strides {kv.stride()})")
        self.page_bytes = page.numel() * page.element_size()
        self.num_blocks = int(kv.shape[0])
        # a uint8 view of the whole layer keeps every page's bytes where they are (bfloat16 has no numpy type)
        self.arr: np.ndarray = kv.view(torch.uint8).numpy() if kv.stride(-1) == 1 else None  # type: ignore
        if self.arr is None:
            raise ValueError("the KV tensor's last dimension is not contiguous")

    def page(self, block_id: int) -> np.ndarray:
        return self.arr[block_id]


class CudaMover:
    """The GPU path (not runnable on this CPU-only machine): the pool's segments are registered once as pinned host
    memory (cudaHostRegister through torch), and Layer Blocks move device<->slot with asynchronous copies on the
    connector's own stream, with no staging buffer. `load_layer` enqueues host->device copies and records an event
    per layer (waited in `wait_for_layer_load`); `save_layer` waits for the compute stream, enqueues device->host
    copies, and `sync()` is called before a commit so the daemon never publishes a slot still being written."""

    def __init__(self, device: Any) -> None:
        import torch

        self.torch = torch
        self.stream = torch.cuda.Stream(device=device)
        self.registered: set[int] = set()
        self.events: dict[int, Any] = {}

    def register_segments(self, client: Client) -> None:
        """Pin every segment the client has mapped (once each)."""
        cudart = self.torch.cuda.cudart()
        for sid, arr in client.mapped_segments().items():
            if sid in self.registered:
                continue
            err = cudart.cudaHostRegister(arr.ctypes.data, arr.nbytes, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of segment {sid} failed: {err}")
            self.registered.add(sid)

    def _host(self, view: np.ndarray) -> Any:
        return self.torch.from_numpy(view)

    def load_layer(self, layer: int, kv: Any, block_ids: Sequence[int], slots: Sequence[np.ndarray],
                   a: int, b: int) -> None:
        torch = self.torch
        with torch.cuda.stream(self.stream):
            for bid, slot in zip(block_ids, slots):
                dst = kv[bid].view(torch.uint8).view(-1)
                dst.copy_(self._host(slot[a:b]), non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        self.events[layer] = ev

    def wait_layer(self, layer: int) -> None:
        ev = self.events.pop(layer, None)
        if ev is not None:
            self.torch.cuda.current_stream().wait_event(ev)

    def save_layer(self, kv: Any, block_ids: Sequence[int], slots: Sequence[np.ndarray], a: int, b: int) -> None:
        torch = self.torch
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for bid, slot in zip(block_ids, slots):
                self._host(slot[a:b]).copy_(kv[bid].view(torch.uint8).view(-1), non_blocking=True)

    def sync(self) -> None:
        self.stream.synchronize()
