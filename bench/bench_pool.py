"""The host pool through the daemon, against the machine's own baselines measured in the same run.

- put / get of 2 MiB blocks, batches of 32, from this process (the daemon is another one it starts), with 1 and 2
  copy threads, against numpy memcpy of the same blocks with 1 and 2 threads — with end-to-end checksums (the
  default: the writer's CRC-32C with each commit, the reader's copy checked) and without;
- lookup of 32 present keys, p50 and p99, against a raw round trip of the same sizes (the lookup's request and its
  reply, frames included) over a Unix stream socket to a server in a child process (the daemon's `ping` is shown
  too: it splits the gap into protocol and index; and the smallest Python msgpack RPC of the same sizes, the floor of
  any daemon and client written in Python);
- resize of a full pool (release 256 MiB, then grow back) at 1 GiB and 8 GiB.

Every figure is a median over timed repetitions taken after an untimed warm-up (a shared page's first touch is a
page fault in the daemon's memfd and in the client's mapping, so the warm-up fills and empties the very slots the
timed runs reuse), with its spread (IQR, min, max) in the JSON. Each baseline takes turns with what it is compared
to, repetition by repetition, so that both see the same machine, and every ratio is computed within the run.

Targets: put and get ≥ 0.9× one-thread memcpy with one copy thread, ≥ 0.8× two-thread memcpy with two, and
≥ 0.85× memcpy with checksums on; lookup
p50 ≤ 2× the raw round trip; resize at 8 GiB ≤ 1.2× resize at 1 GiB.

With checksums, the client copies and checksums each block in one pass where the native copy is built
(`kvstore.checksum.FUSED`, in the JSON as `fused_copy_crc`); else a copy, then the CRC.

    python bench/bench_pool.py [--quick] [--reps N] [--blocks N] [--profile] [--put-get-only]
"""
from __future__ import annotations

import argparse
import cProfile
import ctypes
import ctypes.util
import io
import mmap
import os
import pstats
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgpack
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Daemon, Table, busy_cpus, progress, summary, warn_if_busy, write_json  # noqa: E402

from kvstore.checksum import FUSED  # noqa: E402
from kvstore.protocol import HEADER, VERSION, encode, ok  # noqa: E402
from kvstore.protocol.geometry import Geometry  # noqa: E402
from kvstore.protocol.keys import NamespaceSpec  # noqa: E402

GEOM = Geometry(layers=32, tokens=16, kv_heads=8, head_dim=128, dtype="float16")   # 32·2·16·8·128·2 B = 2 MiB
BLOCK = GEOM.full_bytes
BATCH = 32
MiB, GiB = 1 << 20, 1 << 30
SEGMENT = 64 * MiB
SHRINK = 256 * MiB          # what a resize releases: 4 segments of 32 blocks
DAEMON_OPS = ("reserve", "commit", "acquire", "release")

assert BLOCK == 2 * MiB


def hashes(n: int, start: int) -> list[bytes]:
    return [(start + i).to_bytes(16, "big") for i in range(n)]


def spec(model: str = "bench") -> NamespaceSpec:
    return NamespaceSpec(model, GEOM)


# ----- baselines -----
class Memcpy:
    """numpy copyto of whole blocks between private buffers: on the calling thread, or split in two halves with one
    helper thread (copyto releases the GIL), the same split the client's copier makes."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.pool = ThreadPoolExecutor(threads - 1) if threads > 1 else None

    def __call__(self, dsts: list[np.ndarray], srcs: list[np.ndarray]) -> None:
        pairs = list(zip(dsts, srcs))
        if self.pool is None:
            _copy(pairs)
            return
        k = len(pairs) // self.threads
        futures = [self.pool.submit(_copy, pairs[i * k:(i + 1) * k]) for i in range(1, self.threads)]
        _copy(pairs[:k])
        for f in futures:
            f.result()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


def _copy(pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for d, s in pairs:
        np.copyto(d, s)


ECHO_SERVER = """
import socket, struct, sys
path, ask, answer = sys.argv[1], int(sys.argv[2]), b"y" * int(sys.argv[3])
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(path)
srv.listen(1)
print("ready", flush=True)
conn, _ = srv.accept()
if sys.argv[4] == "rpc":
    import msgpack
    header, packer = struct.Struct("<I"), msgpack.Packer(use_bin_type=True)
    while m := conn.recv(65536):
        msg = msgpack.unpackb(memoryview(m)[4:], raw=False)
        body = packer.pack({"v": 1, "id": msg["id"], "ok": True, "n": 32, "host": 32})
        conn.sendall(header.pack(len(body)) + body)
    sys.exit(0)
while True:
    got = 0
    while got < ask:
        m = conn.recv(65536)
        if not m:
            sys.exit(0)
        got += len(m)
    conn.sendall(answer)
"""


def lookup_sizes() -> tuple[int, int]:
    """Bytes on the wire of a 32-key lookup and of its reply (frames included): what the raw round trip sends."""
    keys = b"".join(hashes(BATCH, 7 * 10**9))
    ask = encode({"v": VERSION, "op": "lookup", "id": 1 << 20, "ns": 1, "keys": keys})
    answer = encode(ok(1 << 20, n=BATCH, host=BATCH))
    return len(ask), len(answer)


class EchoServer:
    """A request and a reply of the sizes of a 32-key lookup's (`lookup_sizes`) over a Unix stream socket, served by
    a child process that reads the request whole before it answers: the raw round trip a request to the daemon
    cannot beat. `rpc` is the same exchange as the smallest Python msgpack RPC, with a second child: the lookup's
    request packed and unpacked, its reply packed and unpacked, nothing else — what any daemon and client written in
    Python pay before they do any work."""

    def __init__(self, path: str) -> None:
        self.path = path
        ask, self.answer = lookup_sizes()
        self.procs, socks = [], []
        for mode in ("raw", "rpc"):
            where = f"{path}-{mode}"
            proc = subprocess.Popen([sys.executable, "-c", ECHO_SERVER, where, str(ask), str(self.answer), mode],
                                    stdout=subprocess.PIPE)
            assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(where)
            self.procs.append(proc)
            socks.append(sock)
        self.sock, self.rpc_sock = socks
        self.msg = b"x" * ask
        self.keys = b"".join(hashes(BATCH, 7 * 10**9))
        self.packer = msgpack.Packer(use_bin_type=True)
        self.ids = 0

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def roundtrip(self) -> None:
        self.sock.sendall(self.msg)
        got = 0
        while got < self.answer:
            got += len(self.sock.recv(65536))

    def rpc(self) -> None:
        self.ids += 1
        body = self.packer.pack({"v": VERSION, "op": "lookup", "id": self.ids, "ns": 1, "keys": self.keys})
        self.rpc_sock.sendall(HEADER.pack(len(body)) + body)
        if msgpack.unpackb(memoryview(self.rpc_sock.recv(65536))[4:])["n"] != BATCH:
            raise RuntimeError("rpc floor: a wrong reply")

    def close(self) -> None:
        self.sock.close()
        self.rpc_sock.close()
        for proc, mode in zip(self.procs, ("raw", "rpc")):
            proc.wait(5)
            try:
                os.unlink(f"{self.path}-{mode}")
            except FileNotFoundError:
                pass


def timed(fn: Callable[[], Any], n: int) -> list[float]:
    out = []
    clock = time.perf_counter
    for _ in range(n):
        t0 = clock()
        fn()
        out.append(clock() - t0)
    return out


# ----- put and get -----
def put_get(d: Daemon, threads: int, blocks: int, reps: int, warm: int, profile: cProfile.Profile | None,
            fused: bool = FUSED) -> dict[str, list[float]]:
    """GB/s of memcpy, put and get of the same `blocks` blocks, in turns within each repetition. `fused`: checked
    copies in one pass (else a copy, then the CRC)."""
    rng = np.random.default_rng(threads)
    srcs = [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(blocks)]
    dsts = [np.ones(BLOCK, np.uint8) for _ in range(blocks)]           # touched: no page faults in the timing
    check = np.empty(BLOCK, np.uint8)
    memcpy = Memcpy(threads)
    out: dict[str, list[float]] = {k: [] for k in ("memcpy", "put", "get", "put_crc", "get_crc", "memcpy_batch")}
    out.update({f"daemon_{op}": [] for op in DAEMON_OPS})
    gb = blocks * BLOCK / 1e9
    try:
        with d.client(copy_threads=threads) as c:
            c.copier.fused = fused
            ns = c.namespace(spec())
            for rep in range(warm + reps):
                hs = hashes(blocks, (threads * 1000 + rep) * blocks)
                t0 = time.perf_counter()
                memcpy(dsts, srcs)
                t1 = time.perf_counter()
                before = c.stats()["latency"]
                if profile and rep >= warm:
                    profile.enable()
                r = ns.put(hs, srcs, batch=BATCH, checksum=False)
                t2 = time.perf_counter()
                n = ns.get(hs, dsts, batch=BATCH, verify=False)
                t3 = time.perf_counter()
                if profile:
                    profile.disable()
                after = c.stats()["latency"]
                if r.stored != blocks or n != blocks:
                    raise RuntimeError(f"put {r}, got {n} of {blocks}: is the pool big enough?")
                ns.delete(hs)
                t4 = time.perf_counter()           # the same with checksums, as users run it by default
                r = ns.put(hs, srcs, batch=BATCH)
                t5 = time.perf_counter()
                n = ns.get(hs, dsts, batch=BATCH)
                t6 = time.perf_counter()
                if r.stored != blocks or n != blocks:
                    raise RuntimeError(f"checksummed put {r}, verified get {n} of {blocks}")
                for i in (0, blocks - 1):               # the bytes went through the slots (fresh buffer, untimed)
                    check[:] = 0
                    if ns.get([hs[i]], [check]) != 1 or not np.array_equal(check, srcs[i]):
                        raise RuntimeError(f"block {i} came back different")
                ns.delete(hs)                           # frees the same slots for the next repetition (LIFO)
                if rep >= warm:
                    out["memcpy"].append(gb / (t1 - t0))
                    out["put"].append(gb / (t2 - t1))
                    out["get"].append(gb / (t3 - t2))
                    out["put_crc"].append(gb / (t5 - t4))
                    out["get_crc"].append(gb / (t6 - t5))
                    for op in DAEMON_OPS:       # the daemon's own time in this put+get, per batch of 32
                        spent = after.get(op, {}).get("sum", 0.0) - before.get(op, {}).get("sum", 0.0)
                        out[f"daemon_{op}"].append(spent * BATCH / blocks)
                    out["memcpy_batch"].append((t1 - t0) * BATCH / blocks)
    finally:
        memcpy.close()
    return out


# ----- lookup -----
def _tasks(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        return []


def _pin(pids: list[int], cpus: set[int]) -> None:
    """Set the CPU affinity of every thread of these processes (threads they start later inherit it)."""
    for pid in pids:
        for tid in _tasks(pid):
            try:
                os.sched_setaffinity(tid, cpus)
            except (ProcessLookupError, PermissionError):
                pass


def placements() -> dict[str, tuple[set[int], set[int]] | None]:
    """Where the client and its peer (the daemon, the echo server) run: the round trip depends on it more than on
    anything either side does (on a VM, waking an idle vCPU costs tens of µs), so both are measured the same way.
    `as scheduled` leaves it to the kernel, whose choice differs between the echo server and the daemon."""
    cpus = sorted(os.sched_getaffinity(0))
    out: dict[str, tuple[set[int], set[int]] | None] = {"same core": ({cpus[0]}, {cpus[0]})}
    if len(cpus) > 1:
        out["cores apart"] = ({cpus[0]}, {cpus[1]})
    out["as scheduled"] = None
    return out


def lookups(d: Daemon, rounds: int, per_round: int, profile: cProfile.Profile | None
            ) -> dict[str, dict[str, list[float]]]:
    """Seconds per round trip, per placement: raw echo, daemon ping, lookup of 32 present keys. Placements and
    kinds take turns, `per_round` calls each after 100 untimed ones (a placement change migrates threads)."""
    assert d.proc is not None
    echo = EchoServer(os.path.join(d.dir, "echo"))
    places = placements()
    out = {p: {"raw": [], "rpc": [], "ping": [], "lookup": []} for p in places}  # type: dict[str, dict[str, list[float]]]
    mine, theirs = os.sched_getaffinity(0), os.sched_getaffinity(d.proc.pid)
    try:
        with d.client() as c:
            ns = c.namespace(spec())
            hs = hashes(BATCH, 7 * 10**9)
            zero = np.zeros(BLOCK, np.uint8)
            if ns.put(hs, [zero] * BATCH).stored != BATCH or ns.lookup(hs) != BATCH:
                raise RuntimeError("lookup setup: the 32 blocks were not stored")

            def lookup() -> None:
                ns.lookup(hs)

            kinds = {"raw": echo.roundtrip, "rpc": echo.rpc, "ping": c.ping, "lookup": lookup}
            for _ in range(rounds):
                for place, cpus in places.items():
                    if cpus is None:
                        _pin([os.getpid()], mine)
                        _pin([d.proc.pid, *echo.pids], theirs)
                    else:
                        _pin([os.getpid()], cpus[0])
                        _pin([d.proc.pid, *echo.pids], cpus[1])
                    for kind, fn in kinds.items():
                        timed(fn, 100)
                        if profile and kind == "lookup":
                            profile.enable()
                        out[place][kind] += timed(fn, per_round)
                        if profile:
                            profile.disable()
            if ns.lookup(hs) != BATCH:
                raise RuntimeError("lookup: keys went missing")
    finally:
        _pin([os.getpid()], mine)
        _pin([d.proc.pid], theirs)
        echo.close()
    return out


# ----- resize -----
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def punch_floor(src: np.ndarray) -> float:
    """The kernel's part of a shrink, without the daemon: 4 memfds of 64 MiB, written through a mapping that stays
    open (as a client's does), then their pages punched out (FALLOC_FL_PUNCH_HOLE | KEEP_SIZE). Seconds."""
    fds = [os.memfd_create("bench-floor", os.MFD_CLOEXEC) for _ in range(SHRINK // SEGMENT)]
    maps = []
    try:
        for fd in fds:
            os.ftruncate(fd, SEGMENT)
            m = mmap.mmap(fd, SEGMENT, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            a = np.frombuffer(m, np.uint8).reshape(-1, BLOCK)
            a[:] = src
            del a
            maps.append(m)
        t0 = time.perf_counter()
        for fd in fds:
            if _libc.fallocate(fd, 0x02 | 0x01, 0, SEGMENT) != 0:
                raise OSError(ctypes.get_errno(), "fallocate(PUNCH_HOLE)")
        return time.perf_counter() - t0
    finally:
        for m in maps:
            m.close()
        for fd in fds:
            os.close(fd)


class Watcher:
    """Another client that looks up 32 keys back to back on its own connection (in a thread), to see how long a
    resize keeps every other client waiting."""

    def __init__(self, d: Daemon) -> None:
        self.client = d.client()
        self.ns = self.client.namespace(spec())
        self.hs = hashes(BATCH, 0)
        self.calls: list[tuple[float, float]] = []
        self.running = threading.Event()
        self.thread: threading.Thread | None = None

    def _run(self) -> None:
        clock = time.perf_counter
        while self.running.is_set():
            t0 = clock()
            self.ns.lookup(self.hs)
            self.calls.append((t0, clock()))

    def start(self) -> None:
        self.calls = []
        self.running.set()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        time.sleep(0.005)

    def stop(self, t0: float, t1: float) -> float:
        """The longest lookup that overlapped [t0, t1]."""
        time.sleep(0.002)
        self.running.clear()
        assert self.thread is not None
        self.thread.join()
        return max((b - a for a, b in self.calls if a < t1 and b > t0), default=0.0)

    def close(self) -> None:
        self.client.close()


def resize(sizes: list[int], reps: int) -> dict[int, dict[str, Any]]:
    """Release 256 MiB of a full pool and grow it back, for each pool size, sizes taking turns with each other and
    with the kernel's floor (punching the same bytes out of memfds directly). Between repetitions the released
    room is filled again (untimed, but its time is kept: new segments fault in)."""
    src = [np.random.default_rng(9).integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(BATCH)]
    refill_blocks = SHRINK // BLOCK
    out: dict[int, dict[str, Any]] = {s: {"shrink_daemon": [], "shrink_client": [], "grow_daemon": [],
                                          "grow_client": [], "refill": [], "stall": [], "fill_s": 0.0}
                                     for s in sizes}
    floor: list[float] = []
    daemons = {s: Daemon(str(s), "64MiB") for s in sizes}
    try:
        for dm in daemons.values():
            dm.start()
        clients = {s: dm.client() for s, dm in daemons.items()}
        spaces = {s: c.namespace(spec()) for s, c in clients.items()}
        watchers = {s: Watcher(dm) for s, dm in daemons.items()}
        nxt = 0

        def fill(s: int) -> None:
            nonlocal nxt
            c, ns = clients[s], spaces[s]
            while True:
                host = c.stats()["tiers"][0]
                room = (s - host["used_bytes"]) // BLOCK
                if room <= 0:
                    break
                for i in range(0, room, BATCH):
                    k = min(BATCH, room - i)
                    r = ns.put(hashes(k, nxt), src[:k], batch=BATCH)
                    nxt += k
                    if r.stored != k:
                        raise RuntimeError(f"fill {s >> 30} GiB: {r}")
            host = c.stats()["tiers"][0]
            if host["mapped_bytes"] != s or host["used_bytes"] != s:
                raise RuntimeError(f"fill {s >> 30} GiB: pool not full: {host}")

        for s in sizes:
            progress(f"  filling the {s // GiB} GiB pool with {s // BLOCK} blocks")
            t0 = time.perf_counter()
            fill(s)
            out[s]["fill_s"] = time.perf_counter() - t0
        for rep in range(reps + 1):                              # repetition 0 is the warm-up
            f = punch_floor(src[0])
            if rep:
                floor.append(f)
            for s in (sizes if rep % 2 else sizes[::-1]):
                c = clients[s]
                watchers[s].start()
                t0 = time.perf_counter()
                r = c.resize(s - SHRINK)
                shrink = time.perf_counter() - t0
                stall = watchers[s].stop(t0, t0 + shrink)
                if r["released_segments"] != SHRINK // SEGMENT or r["evicted"] != refill_blocks:
                    raise RuntimeError(f"shrink {s >> 30} GiB: {r}")
                t0 = time.perf_counter()
                g = c.resize(s)
                grow = time.perf_counter() - t0
                fill(s)
                refill = time.perf_counter() - t0 - grow
                if rep:
                    o = out[s]
                    o["shrink_daemon"].append(r["seconds"])
                    o["shrink_client"].append(shrink)
                    o["grow_daemon"].append(g["seconds"])
                    o["grow_client"].append(grow)
                    o["refill"].append(refill)
                    o["stall"].append(stall)
        for c in clients.values():
            c.close()
        for w in watchers.values():
            w.close()
    finally:
        for dm in daemons.values():
            dm.stop()
    for s in sizes:
        out[s]["kernel_punch"] = floor
    return out


# ----- report -----
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer repetitions, no 8 GiB pool (a smoke run)")
    p.add_argument("--reps", type=int, help="timed repetitions of put/get (default 40, quick 5)")
    p.add_argument("--blocks", type=int, default=128, help="blocks per put/get repetition (default 128)")
    p.add_argument("--profile", action="store_true", help="cProfile the client during timed put/get/lookup "
                                                           "(slows them; for finding hot spots, not for figures)")
    p.add_argument("--put-get-only", action="store_true", help="only the put/get rows (no lookup, no resize)")
    p.add_argument("--lookup-only", action="store_true", help="only the lookup rows (no put/get, no resize)")
    p.add_argument("--two-pass", action="store_true", help="checked copies as a copy, then the CRC, even where the "
                                                            "one-pass copy is built (for comparison)")
    args = p.parse_args()
    reps = args.reps or (5 if args.quick else 40)
    rounds, per_round = (4, 500) if args.quick else (10, 1000)
    sizes = [GiB] if args.quick else [GiB, 8 * GiB]
    rz_reps = 3 if args.quick else 21
    prof = cProfile.Profile() if args.profile else None
    started = time.perf_counter()
    load_before = warn_if_busy()

    pg: dict[int, dict[str, list[float]]] = {}
    with Daemon("1GiB", "64MiB") as d:
        for threads in (() if args.lookup_only else (1, 2)):
            progress(f"put/get, {threads} copy thread{'s' * (threads > 1)}: {args.blocks} × 2 MiB, {reps} reps")
            pg[threads] = put_get(d, threads, args.blocks, reps, 2, prof, FUSED and not args.two_pass)
        if not args.put_get_only:
            progress(f"lookup of 32 keys / daemon ping / raw socket: {rounds} × {per_round} each, in turns")
            lk = lookups(d, rounds, per_round, prof)
    if not args.put_get_only and not args.lookup_only:
        progress(f"resize at {' and '.join(f'{s // GiB} GiB' for s in sizes)}: fill, then "
                 f"{rz_reps} reps of −256 MiB and back")
        rz = resize(sizes, rz_reps)

    t = Table(["figure", "kvstore: median (IQR)", "baseline: median (IQR)", "ratio", "target", "result"])
    verdicts: dict[str, dict[str, Any]] = {}

    def fmt(x: dict[str, float], unit: str, digits: int, key: str) -> str:
        if key != "median":
            return f"{x[key]:.{digits}f} {unit}"
        return f"{x['median']:.{digits}f} {unit} ({x['p25']:.{digits}f}–{x['p75']:.{digits}f})"

    def row(name: str, ours: dict[str, float], base: dict[str, float] | None, unit: str, target: str = "",
            ok: bool | None = None, key: str = "median", digits: int = 2) -> None:
        ratio = ours[key] / base[key] if base else None
        t.add([name, fmt(ours, unit, digits, key), fmt(base, unit, digits, key) if base else "",
               "" if ratio is None else f"{ratio:.2f}", target, "" if ok is None else ("PASS" if ok else "FAIL")])
        verdicts[name] = {"value": ours[key], "baseline": base[key] if base else None, "ratio": ratio,
                          "unit": unit, "stat": key, "target": target, "pass": ok}

    res: dict[str, Any] = {"block_bytes": BLOCK, "batch": BATCH, "blocks_per_rep": args.blocks, "reps": reps,
                           "quick": args.quick, "fused_copy_crc": FUSED and not args.two_pass}
    for threads, limit in ((1, 0.9), (2, 0.8)) if pg else ():
        raw = pg[threads]
        o: dict[str, Any] = {k: summary(raw[k]) for k in ("memcpy", "put", "get", "put_crc", "get_crc")}
        for op in ("put", "get", "put_crc", "get_crc"):   # per-repetition ratios: each against the memcpy before it
            o[f"{op}_over_memcpy"] = summary([a / b for a, b in zip(raw[op], raw["memcpy"])])
        res[f"copy_threads_{threads}_gbps"] = o
        res[f"copy_threads_{threads}_per_batch_us"] = {k: summary(v, 1e6) for k, v in raw.items()
                                                        if k.startswith(("daemon_", "memcpy_batch"))}
        for op in ("put", "get"):
            ratio = o[op]["median"] / o["memcpy"]["median"]
            row(f"{op}, {threads} copy thread{'s' * (threads > 1)}", o[op], o["memcpy"], "GB/s",
                f"≥ {limit}× memcpy {threads}t", ratio >= limit)
        for op in ("put", "get"):
            ratio = o[f"{op}_crc"]["median"] / o["memcpy"]["median"]
            row(f"{op} with CRC-32C, {threads} copy thread{'s' * (threads > 1)}", o[f"{op}_crc"], o["memcpy"],
                "GB/s", f"≥ 0.85× memcpy {threads}t", ratio >= 0.85)
    both = {k: pg[1][k] + pg[2][k] for k in pg[1] if k.startswith(("daemon_", "memcpy_batch"))} if pg else {}
    copy_batch = summary(pg[1]["memcpy_batch"], 1e6) if pg else {}
    for op, (a, b) in (("put", ("reserve", "commit")), ("get", ("acquire", "release"))) if pg else ():
        spent = summary([x + y for x, y in zip(both[f"daemon_{a}"], both[f"daemon_{b}"])], 1e6)
        row(f"daemon time per {op} batch ({a}+{b}) vs memcpy 1t", spent, copy_batch, "µs",
            digits=0)
    if not args.put_get_only:
        res["roundtrip_us"] = {}
        for place, kinds in lk.items():
            us = {k: summary(v, 1e6) for k, v in kinds.items()}
            res["roundtrip_us"][place] = us
            pinned = place != "as scheduled"
            row(f"lookup 32 keys p50, {place}", us["lookup"], us["raw"], "µs",
                "≤ 2× raw socket" if pinned else "(placement differs)",
                us["lookup"]["median"] <= 2 * us["raw"]["median"] if pinned else None, digits=1)
            row(f"lookup 32 keys p99, {place}", us["lookup"], us["raw"], "µs", key="p99", digits=1)
            row(f"daemon ping p50, {place}", us["ping"], us["raw"], "µs", digits=1)
            row(f"smallest Python msgpack RPC p50, {place}", us["rpc"], us["raw"], "µs", digits=1)
    if not args.put_get_only and not args.lookup_only:
        res["resize_ms"] = {}
        for size in sizes:
            o = rz[size]
            res["resize_ms"][f"{size // GiB}GiB"] = {k: (summary(v, 1e3) if isinstance(v, list) else v)
                                                     for k, v in o.items()}
        r1 = res["resize_ms"]["1GiB"]
        r8 = res["resize_ms"].get("8GiB")
        big, base = (r8, r1) if r8 else (r1, None)
        at = "8 GiB" if r8 else "1 GiB"
        row(f"resize −256 MiB at {at}, daemon", big["shrink_daemon"], base and base["shrink_daemon"], "ms",
            "≤ 1.2× at 1 GiB" if r8 else "(8 GiB skipped)",
            big["shrink_daemon"]["median"] <= 1.2 * r1["shrink_daemon"]["median"] if r8 else None)
        row(f"resize −256 MiB at {at}, client", big["shrink_client"], base and base["shrink_client"], "ms")
        row(f"resize −256 MiB at {at}, daemon, vs kernel punch of 256 MiB", big["shrink_daemon"], big["kernel_punch"],
            "ms")
        row(f"resize +256 MiB at {at}, client", big["grow_client"], base and base["grow_client"], "ms", digits=3)
        row(f"other client's longest lookup during the shrink, {at}", big["stall"], base and base["stall"], "ms")
        row(f"refill 256 MiB after the grow, {at}", big["refill"], base and base["refill"], "ms")
    print(t)
    res["verdicts"] = verdicts
    res["load_average"] = {"before": load_before, "after": busy_cpus()}
    res["seconds"] = time.perf_counter() - started
    if prof is not None:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
        print("\nclient profile (timed put/get/lookup; tottime):\n" + buf.getvalue())
    print(f"\nwrote {write_json('pool', res)}  ({res['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
