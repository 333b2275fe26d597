"""Workarounds that let SGLang 0.5.23's engine run HiCache on a CPU-only machine, for the tests only.

The backend needs none of this; an SGLang engine on CPU does (../shared/ENGINES.md):
1. `sgl_kernel` has no CPU build on PyPI: a stub module whose attributes import fine and raise when called (a CPU
   without AMX takes the plain-torch attention path and never calls them).
2. The host pool pins its memory with cudaHostRegister: on CPU it is allocated unpinned.
3. The device<->host copy for `hicache_io_backend=direct` with `layer_first` (`transfer_kv_direct`) is only
   imported on CUDA/HIP/XPU: a plain-torch one is supplied.

`apply()` installs them in this process (2 and 3 as each SGLang module is first imported); SGLang's scheduler runs
in spawned processes, so tests/sglang_engine_run.py gives them a `sitecustomize` that calls it. Pinned to 0.5.23:
other versions are left alone.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

SGLANG_VERSION = "0.5.23"


def _stub_sgl_kernel() -> None:
    if "sgl_kernel" in sys.modules or importlib.util.find_spec("sgl_kernel") is not None:
        return
    mod = types.ModuleType("sgl_kernel")
    mod.__version__ = "0.0.0+kvstore-cpu-stub"  # type: ignore[attr-defined]

    def missing(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def call(*args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError(f"sgl_kernel.{name}: no CPU build of sgl_kernel (kvstore test stub)")
        return call

    mod.__getattr__ = missing  # type: ignore[method-assign,assignment]
    sys.modules["sgl_kernel"] = mod


def transfer_kv_direct(src_layers: Sequence[Any], dst_layers: Sequence[Any], src_indices: Any, dst_indices: Any,
                       page_size: int) -> None:
    """Plain-torch stand-in for sgl_kernel.kvcacheio.transfer_kv_direct: token rows, layer by layer."""
    for src, dst in zip(src_layers, dst_layers):
        dst[dst_indices.to(dst.device)] = src[src_indices.to(src.device)].to(dst.device)


def _patch_common(mod: types.ModuleType) -> None:
    pinned = mod.ALLOC_MEMORY_FUNCS["cpu"]

    def unpinned(dims: tuple, dtype: Any, device: str, pin_memory: bool, allocator: Any,
                 registration_granularity_bytes: int | None = None) -> Any:
        return pinned(dims, dtype, device, False, allocator, registration_granularity_bytes)

    mod.ALLOC_MEMORY_FUNCS["cpu"] = unpinned


def _patch_mha(mod: types.ModuleType) -> None:
    if not hasattr(mod, "transfer_kv_direct"):
        mod.transfer_kv_direct = transfer_kv_direct  # type: ignore[attr-defined]


PATCHES: dict[str, Callable[[types.ModuleType], None]] = {
    "sglang.srt.mem_cache.pool_host.common": _patch_common,
    "sglang.srt.mem_cache.pool_host.mha": _patch_mha,
}


def _then_patch(run: Callable[[types.ModuleType], None], patch: Callable[[types.ModuleType], None]
                ) -> Callable[[types.ModuleType], None]:
    def exec_module(module: types.ModuleType) -> None:
        run(module)
        patch(module)
    return exec_module


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a patch right after the named module has executed (before anyone uses it)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name not in PATCHES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                loader = spec.loader
                loader.exec_module = _then_patch(loader.exec_module, PATCHES[name])  # type: ignore[method-assign,assignment]
                return spec
        return None


def apply() -> bool:
    """Install the workarounds when SGLang 0.5.23 runs without CUDA; True if installed."""
    try:
        from importlib.metadata import version

        if version("sglang") != SGLANG_VERSION:
            return False
        import torch

        if torch.cuda.is_available():
            return False
    except Exception:  # noqa: BLE001 - no SGLang or no torch: nothing to patch
        return False
    _stub_sgl_kernel()
    for name, patch in PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
    return True
