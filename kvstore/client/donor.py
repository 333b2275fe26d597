"""The donor's side of the donated tier: a process with idle memory lends it to the local daemon, and takes it back.

    donor = Donor("/run/kvstore/donate.sock")
    region = donor.donate_memfd(1 << 30, "engine-a idle KV")   # the daemon may keep blocks there from now on
    ...
    reply = donor.reclaim(region, deadline_s=0.5)              # blocks moved to the SSD (or dropped) ...
    mem = donor.memory(region)                                 # ... and the memory is the donor's again
    ...
    donor.release(region)                                      # done with it: unmapped, its pages freed

`donate_memfd` makes the memory: a memfd sealed against shrinking and growing (the daemon maps it, and a truncated
mapping would crash it), its pages allocated here (so they are charged to the donor, not to the daemon that first
writes them), mapped in the donor too. Until `reclaim` returns, the daemon may read and write it at any time:
the donor must not touch it (what it writes there turns the daemon's blocks into misses, never into wrong bytes
served, but it is the daemon's to use). Closing the connection (or exiting) gives every region back at once: the
daemon drops their blocks and never reads them again.

A region given back stays mapped in the donor (its mapping is all that keeps the memory: the memfd is closed once
lent) until `release` — or at once, with `reclaim(..., keep=False)` — or `close`: a long-lived donor that lends
region after region releases each when it is done with it, or its mappings pile up.

`donate_cuda` lends GPU memory by CUDA IPC handle (CuPy, imported only there) — untested: written on machines
without a GPU.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import socket
from typing import Any

from kvstore.client.connection import KVStoreError
from kvstore.protocol.frames import FrameReader, decode, encode, send_frame

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
RECLAIM_MARGIN_S = 30.0     # how much longer than its deadline a reclaim's reply may take (copies in flight)


class Donor:
    def __init__(self, socket_path: str, timeout: float = 10.0) -> None:
        self.path = socket_path
        self.timeout = timeout
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(socket_path)
        self._frames = FrameReader()
        self._ids = 0
        self._lent: dict[int, mmap.mmap] = {}       # regions the daemon may use now
        self._back: dict[int, mmap.mmap] = {}       # regions given back: the donor's again

    def __enter__(self) -> Donor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def donate_memfd(self, nbytes: int, name: str = "") -> int:
        """Lend `nbytes` of new shared memory; the region's id. KVStoreError if the daemon refuses it."""
        fd = os.memfd_create(name or "kvstore-donated", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, nbytes)
            os.posix_fallocate(fd, 0, nbytes)       # the pages are the donor's, charged here
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            try:
                reply = self._call("donate", {"name": name, "bytes": nbytes, "kind": "memfd"}, [fd])
            except BaseException:
                mm.close()
                raise
        finally:
            os.close(fd)                            # the mappings keep the memory
        region = int(reply["region"])
        self._lent[region] = mm
        return region

    def donate_cuda(self, ptr: int, nbytes: int, device: int = 0, name: str = "", offset: int = 0) -> int:
        """(Untested.) Lend `nbytes` of GPU memory at `ptr` + `offset`, where `ptr` is the base of a device
        allocation (cudaMalloc, a CuPy array's data pointer; a handle names a whole allocation)."""
        import cupy  # only here: a CPU donor never imports CUDA
        with cupy.cuda.Device(device):
            handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(ptr))
        reply = self._call("donate", {"name": name, "bytes": nbytes, "kind": "cuda", "handle": handle,
                                      "device": device, "offset": offset}, [])
        return int(reply["region"])

    def reclaim(self, region: int, deadline_s: float, keep: bool = True) -> dict[str, Any]:
        """Take a region back: the daemon moves its blocks down (or drops them) within `deadline_s`, lets go of
        the memory, and answers {migrated, dropped, seconds, deadline_passed, unmapped}; the memory is the
        donor's again when this returns (`memory`), until `release`. `keep=False`: the donor wants the memory
        freed, not reused: its mapping is released at once."""
        reply = self._call("reclaim", {"region": region, "deadline_ms": int(deadline_s * 1000)}, [],
                           timeout=deadline_s + RECLAIM_MARGIN_S)
        if region in self._lent:
            self._back[region] = self._lent.pop(region)
            if not keep:
                self.release(region)
        return {k: v for k, v in reply.items() if k not in ("v", "id", "ok")}

    def release(self, region: int) -> None:
        """Unmap a memfd region given back, once the donor is done with its memory: the last mapping gone (the
        daemon's went with the reclaim), its pages go back to the system. KeyError if the donor holds no such
        region, ValueError if it is still lent (reclaim it first); BufferError if a view of its memory (a
        memoryview, a numpy array over `memory(region)`) is still alive — the region stays, release it later."""
        if region in self._lent:
            raise ValueError(f"region {region} is still lent to the daemon: reclaim it first")
        self._back[region].close()
        del self._back[region]

    def memory(self, region: int) -> mmap.mmap:
        """A memfd region's mapping in the donor (lent, or given back and not released)."""
        return self._lent.get(region) or self._back[region]

    def regions(self) -> list[int]:
        """The regions lent now."""
        return sorted(self._lent)

    def close(self) -> None:
        """End the connection (the daemon gives every region lent back at once, dropping their blocks), then
        unmap. The daemon may still be finishing a copy from a memfd region when this unmaps: the pages stay
        until its mapping goes too, so neither side faults."""
        self.sock.close()
        for mm in [*self._lent.values(), *self._back.values()]:
            mm.close()
        self._lent.clear()
        self._back.clear()

    def _call(self, op: str, fields: dict[str, Any], fds: list[int], timeout: float | None = None) -> dict[str, Any]:
        self._ids += 1
        data = encode({"op": op, "id": self._ids, **fields})
        self.sock.settimeout(timeout or self.timeout)
        try:
            send_frame(self.sock, data, fds)
            body = self._frames.next()
            while body is None:
                chunk = self.sock.recv(1 << 16)
                if not chunk:
                    raise ConnectionError(f"the kvstore daemon at {self.path} closed the donors' connection")
                self._frames.feed(chunk)
                body = self._frames.next()
        finally:
            self.sock.settimeout(self.timeout)
        reply = decode(body)
        if not reply.get("ok"):
            err = reply.get("error") or {}
            raise KVStoreError(err.get("code", "?"), err.get("message", "?"))
        return reply
