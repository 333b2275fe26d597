"""GPU memory donated by CUDA IPC handle — UNTESTED: no machine this was written on has a GPU.

Imported only when a `donate` of kind "cuda" arrives (kvstore.tiers.donated.memory.open_memory), so the CPU build
never imports CUDA. It uses CuPy's runtime bindings (cudaIpcOpenMemHandle, cudaMemcpy, cudaIpcCloseMemHandle),
which map one to one onto the CUDA runtime; install `cupy-cuda12x` beside the daemon on a GPU node.

The donor sends `handle` (the 64-byte cudaIpcMemHandle_t of its allocation, from cudaIpcGetMemHandle), `device`
(the ordinal, as this daemon numbers it) and `offset` (where the donated bytes start in that allocation: a handle
names a whole allocation, whatever pointer inside it was given). Copies are synchronous cudaMemcpy calls from and
to pageable host memory (the host pool's slots are not cudaHostRegister-ed): correct, not fast; pinning the host
pool and asynchronous copies on a stream are the next step once this runs on a GPU. The CRC-32C of a write is that
of its host source, and of a read that of the host copy; the GPU never computes one.

What CUDA does not promise: when the exporting process dies, the memory behind an opened handle may be freed. The
tier therefore never reads a region whose donor is gone (its blocks are dropped, deadline 0), only unmaps it.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from kvstore.checksum import crc32c
from kvstore.tiers.donated.memory import MIN_REGION_BYTES, Refused

IPC_HANDLE_BYTES = 64


def _host_address(buf: Any) -> int:
    return int(np.frombuffer(buf, np.uint8).ctypes.data)


class CudaMemory:
    kind = "cuda"
    outlives_mapping = False    # closed before the reclaim's answer: after it the donor may free the allocation

    def __init__(self, handle: bytes, size: int, device: int, offset: int = 0) -> None:
        import cupy  # lazily: a GPU node's extra, never the CPU build's
        self._cupy = cupy
        self._rt = cupy.cuda.runtime
        self.device = device
        self.size = size
        with cupy.cuda.Device(device):
            self._base = int(self._rt.ipcOpenMemHandle(handle, self._rt.cudaIpcMemLazyEnablePeerAccess))
        self._ptr = self._base + offset

    @classmethod
    def from_message(cls, size: int, fields: dict[str, Any]) -> CudaMemory:
        handle, device, offset = fields.get("handle"), fields.get("device", 0), fields.get("offset", 0)
        if not isinstance(handle, bytes) or len(handle) != IPC_HANDLE_BYTES:
            raise Refused(f"a cuda donation carries `handle`: the {IPC_HANDLE_BYTES}-byte cudaIpcMemHandle_t")
        if type(device) is not int or device < 0 or type(offset) is not int or offset < 0:
            raise Refused("a cuda donation's `device` and `offset` are integers >= 0")
        if size < MIN_REGION_BYTES:
            raise Refused(f"a region must hold at least {MIN_REGION_BYTES} bytes, got {size}")
        return cls(handle, size, device, offset)

    def _copy(self, dst: int, src: int, nbytes: int, kind: int) -> None:
        with self._cupy.cuda.Device(self.device):
            self._rt.memcpy(dst, src, nbytes, kind)

    def write(self, offset: int, data: memoryview) -> int:
        crc = crc32c(data)
        self._copy(self._ptr + offset, _host_address(data), len(data), self._rt.memcpyHostToDevice)
        return crc

    def read(self, offset: int, out: memoryview) -> int:
        self._copy(_host_address(out), self._ptr + offset, len(out), self._rt.memcpyDeviceToHost)
        return crc32c(out)

    def close(self) -> bool:
        with self._cupy.cuda.Device(self.device):
            self._rt.ipcCloseMemHandle(self._base)
        return True
