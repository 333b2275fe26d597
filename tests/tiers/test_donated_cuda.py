"""The donated tier with GPU memory (`donated.kind: cuda`, kvstore.tiers.donated.cuda) inside a real daemon: the
protocol of test_donated_daemon.py's main test, with a donor process that allocates GPU memory with CuPy and lends
it by CUDA IPC handle (Donor.donate_cuda). Blocks evicted from the host pool land in the donor's GPU memory and come
back byte-exact; the donor writing over part of it turns those blocks into misses, never wrong bytes; a reclaim
under a concurrent reader moves the rest to the SSD without a wrong byte.

Skipped unless CuPy imports and sees a CUDA device: the CUDA path has no other test, and none that runs on a
machine without a GPU (a skip here means it has not run)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from kvstore.client import Client
from tests.conftest import GEOM, DaemonProc, spec
from tests.tiers.test_donated_tier import ROOT, DonorProc
from tests.workers import content, key

cupy = pytest.importorskip("cupy", reason="CuPy is not installed: the CUDA donated tier test needs CuPy "
                                          "(cupy-cuda12x) and a CUDA GPU")


def _why_no_gpu() -> str | None:
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:          # no driver or no device: CUDARuntimeError
        return f"CuPy imports but CUDA finds no device ({type(e).__name__}: {e})"
    return None if n > 0 else "CuPy imports but CUDA finds no device (getDeviceCount() == 0)"


_NO_GPU = _why_no_gpu()
if _NO_GPU is not None:
    pytest.skip(_NO_GPU, allow_module_level=True)

HOST_BLOCKS = 128                   # a 1 MiB host pool of 8 KiB blocks
DONATED_BLOCKS = 64
SCRIBBLED = 16                      # slots the donor writes over (slot i at i × block size: one block each)

# The donor: one JSON command a line on stdin, one JSON reply a line on stdout (as tests/tiers/donor_proc.py), its
# memory one cudaMalloc per region (an IPC handle names a whole allocation: no CuPy pool block inside a larger one).
DONOR = r"""
import json, sys
import cupy
from kvstore.client.connection import KVStoreError
from kvstore.client.donor import Donor

rt = cupy.cuda.runtime
donor = Donor(sys.argv[1])
mem = {}                                         # region -> (device pointer, bytes)


def handle(cmd):
    op = cmd["cmd"]
    if op == "donate":
        ptr = rt.malloc(cmd["bytes"])
        region = donor.donate_cuda(ptr, cmd["bytes"], 0, "test")
        mem[region] = (ptr, cmd["bytes"])
        return {"region": region}
    if op == "scribble":                         # the donor writes its lent memory: blocks there become misses
        ptr, _ = mem[cmd["region"]]
        rt.memset(ptr + cmd["offset"], cmd.get("byte", 0xAA), cmd["nbytes"])
        rt.deviceSynchronize()
        return {"ok": True}
    if op == "reclaim":                          # then the memory is the donor's again: it uses it at once
        reply = donor.reclaim(cmd["region"], cmd["deadline_ms"] / 1000)
        ptr, n = mem.pop(cmd["region"])
        rt.memset(ptr, 0x55, n)
        rt.deviceSynchronize()
        rt.free(ptr)
        return reply
    raise ValueError(op)


print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["cmd"] == "exit":
        break
    try:
        out = handle(cmd)
    except KVStoreError as e:
        out = {"error": e.code, "message": e.message}
    print(json.dumps(out), flush=True)
donor.close()
"""


class CudaDonorProc(DonorProc):
    """A donor of GPU memory in a process of its own (CUDA IPC cannot open a handle in the process that made it)."""

    def __init__(self, sock: str) -> None:
        self.p = subprocess.Popen([sys.executable, "-c", DONOR, sock], cwd=ROOT, text=True,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.call_raw() == {"ready": True}


def start(tmp_path, daemons: list[DaemonProc]) -> DaemonProc:
    d = DaemonProc(capacity="1MiB", segment="1MiB",
                   env={"KVSTORE_SSD_DIR": str(tmp_path / "ssd"), "KVSTORE_SSD_CAPACITY": "64MiB",
                        "KVSTORE_DONATED_ENABLED": "true", "KVSTORE_DONATED_KIND": "cuda"})
    daemons.append(d)
    return d.start()


def settled(c: Client, timeout: float = 30.0) -> dict:
    """Stats once the SSD tier has written everything staged and the copy paths (the donated tier's is "gpu" for
    CUDA memory, which tests.conftest.ssd_settled does not watch) are idle."""
    deadline = time.monotonic() + timeout
    while True:
        s = c.stats()
        ssd = tier_row(s, "ssd")
        lanes = [r for p in s["traffic"] if p["path"] in ("ssd", "mem", "gpu") for r in p["lanes"].values()]
        if ssd["staged_blocks"] == 0 and s["pinned"] == 0 and not any(r["queued"] or r["in_flight"] for r in lanes):
            return s
        assert time.monotonic() < deadline, f"the daemon did not settle in {timeout} s: {ssd}, {s['traffic']}"
        time.sleep(0.01)


def tier_row(s: dict, name: str) -> dict:
    return next(t for t in s["tiers"] if t["tier"] == name)


def put(c: Client, ids: range) -> None:
    hs = [key(i) for i in ids]
    assert c.namespace(spec()).put(hs, [content(h) for h in hs]).stored == len(hs)


def read(c: Client, i: int) -> bytes | None:
    buf = bytearray(GEOM.full_bytes)
    return bytes(buf) if c.namespace(spec()).get([key(i)], [buf]) == 1 else None


def below_host(c: Client, ids: range) -> list[int]:
    """The blocks of `ids` the host pool does not hold (one put is one chain, and the pool evicts a chain's tail
    first: the blocks put last, not first, are the ones evicted)."""
    ns = c.namespace(spec())
    return [i for i in ids if c.call("lookup", ns=ns.id, keys=key(i))["host"] == 0]


def read_all(c: Client, ids: list[int] | range) -> tuple[list[int], list[int]]:
    """(missed, wrong) among `ids`; every byte of every hit checked."""
    got = {i: read(c, i) for i in ids}
    return [i for i, g in got.items() if g is None], [i for i, g in got.items() if g not in (None, content(key(i)))]


def reclaim_while_reading(d: DaemonProc, donor: CudaDonorProc, region: int,
                          ids: list[int]) -> tuple[dict, list[int], int]:
    """Reclaim the region while another client reads `ids` (from its first read on: the reads overlap the
    reclaim): (the reply, blocks read wrong, reads)."""
    wrong: list[int] = []
    reads = [0]
    started, stop = threading.Event(), threading.Event()

    def reader() -> None:
        with Client(d.socket) as rc:
            while not stop.is_set():
                for i in ids:
                    got = read(rc, i)
                    reads[0] += 1
                    started.set()
                    if got is not None and got != content(key(i)):
                        wrong.append(i)

    t = threading.Thread(target=reader)
    t.start()
    try:
        assert started.wait(30), "the reader did not read"
        reply = donor.call("reclaim", region=region, deadline_ms=10_000)
    finally:
        stop.set()
        t.join(60)
    return reply, wrong, reads[0]


def served(c: Client) -> tuple[int, int]:
    """(blocks the donated tier has read out, promotions from the SSD) so far."""
    s = c.stats()
    return int(tier_row(s, "donated")["counters"].get("reads", 0)), int(s["counters"]["reads_ssd"])


def test_evictions_land_in_donated_gpu_memory_and_move_to_the_ssd_when_the_donor_reclaims(tmp_path, daemons):
    d = start(tmp_path, daemons)
    donor = CudaDonorProc(os.path.join(os.path.dirname(d.socket), "donate.sock"))
    try:
        region = donor.donate(DONATED_BLOCKS * GEOM.full_bytes)
        assert isinstance(region, int)
        with d.client() as c:
            put(c, range(HOST_BLOCKS + DONATED_BLOCKS))     # 64 are evicted: into the donor's GPU memory
            s = settled(c)
            assert tier_row(s, "donated")["blocks"] == DONATED_BLOCKS and tier_row(s, "ssd")["blocks"] == 0
            assert tier_row(s, "donated")["regions"][0]["kind"] == "cuda"
            assert s["counters"]["dropped"] == 0
            donated = below_host(c, range(HOST_BLOCKS + DONATED_BLOCKS))
            assert len(donated) == DONATED_BLOCKS

            # the donor writes over its first 16 slots (one block each, whichever): those are misses, not wrong
            # bytes; the other 48 come back byte-exact, promoted from GPU memory (or from the SSD: each promotion
            # evicts a host block into the full region, which moves its least recently used block down)
            donor.call("scribble", region=region, offset=0, nbytes=SCRIBBLED * GEOM.full_bytes)
            gpu0, ssd0 = served(c)
            missed, wrong = read_all(c, donated)
            assert wrong == []
            assert len(missed) == SCRIBBLED, missed
            gpu, ssd = served(c)
            assert gpu - gpu0 >= 1 and (gpu - gpu0) + (ssd - ssd0) >= DONATED_BLOCKS - SCRIBBLED, (gpu, ssd)
            assert tier_row(settled(c), "donated")["counters"].get("crc_mismatch", 0) >= 1

            # the donor takes its memory back while a reader keeps reading the blocks below the host pool (the
            # region's, and those it moved to the SSD; the ones just read are host hits now); then the donor uses
            # its memory at once (memset)
            still = below_host(c, range(HOST_BLOCKS + DONATED_BLOCKS))
            reply, wrong, reads = reclaim_while_reading(d, donor, region, still)
            assert "error" not in reply, reply
            assert reply["unmapped"] and reply["migrated"] >= 1, reply
            assert wrong == [] and reads > 0
            assert tier_row(settled(c), "donated")["blocks"] == 0

            # what moved is on the SSD and reads back byte-exact; nothing else was lost
            lost, wrong = read_all(c, range(HOST_BLOCKS + DONATED_BLOCKS))
            assert wrong == []
            assert set(missed) <= set(lost) and len(lost) <= len(missed) + reply["dropped"], (lost, missed, reply)
    finally:
        donor.stop()
