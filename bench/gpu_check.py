"""`make gpu-check`: every GPU path of kvstore that needs no engine, in one command, into one JSON.

GPU time is rare (a lent machine comes with minutes, not hours), so this is the one prepared script that runs there:
each step is independent (one that fails or times out is recorded and the next one runs), and the JSON is rewritten
after every step, so even a run cut short brings back what it did. Steps:

1. `environment`: the device, the versions of torch / CUDA / Triton / CuPy, the CPU's vector extensions, whether
   kvstore's native modules loaded.
2. `cuda_tests`: the test suite's CUDA tests, through pytest against real daemons: the vLLM layouts' device <-> slot
   round trips with both copy engines (tests/connectors/test_kv_pages.py) and the donated tier over CUDA IPC with a
   reclaim under reads (tests/tiers/test_donated_cuda.py). Their CPU siblings run too (a baseline that must pass).
3. `sglang_layouts`: SGLang's device KV (per-layer K and V buffers of [tokens, heads, dim], MLA's one latent
   buffer) moved page by page into the daemon's slots in the byte order of its namespace, by `CudaMover` (kernel and
   copy_), then back into zeroed buffers: byte-exact both ways, and the CRC-32C the daemon keeps for each slot equal
   to that of the page's bytes computed on the host.
4. `copy_kernel`: the Triton page kernel between registered host memory and the device at 16-, 8- and 1-byte
   alignment (odd run lengths, misaligned starts), byte-exact, nothing written past a run.
5. `gpu_copy`: bench/bench_gpu_copy.py — the connector's layer-by-layer save/load of 128 scattered 2 MiB blocks
   against a plain pinned `copy_` of the same bytes in the same run (target: >= 0.9x its GB/s).
6. `donated_cuda`: bench/bench_donated.py --kind cuda --quick — gets served from a donor's GPU memory and its
   reclaims, against host hits, SSD hits and memcpy in the same run.

Without CUDA every GPU step reports "skipped: no CUDA" (the dry run `make test` runs, so this script keeps working).

    python bench/gpu_check.py --out DIR [--skip STEP ...]
Exit status: 0 when no step failed (skipped steps are not failures), 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from functools import partial
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.append(ROOT)            # after an installed kvstore: bench.* and tests.* come from the tree

Step = Callable[["Check"], dict[str, Any]]


class Skipped(Exception):
    """A step that cannot run here (no CUDA, no CuPy): reported as skipped with the reason."""


class Check:
    """The run: where results go, and the JSON rewritten after each step."""

    def __init__(self, out: str) -> None:
        self.out = out
        os.makedirs(out, exist_ok=True)
        self.path = os.path.join(out, "gpu_check.json")
        self.result: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "host": platform.node(),
                                       "steps": {}}
        self.cuda = _cuda_available()

    def need_cuda(self) -> None:
        if not self.cuda:
            raise Skipped("no CUDA")

    def run(self, name: str, step: Step) -> None:
        t = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            row = {"status": "ok", **step(self)}
        except Skipped as e:
            row = {"status": "skipped", "reason": f"skipped: {e}"}
        except Exception as e:  # noqa: BLE001 - a step that breaks is recorded; the next one runs
            row = {"status": "failed", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        row["seconds"] = round(time.perf_counter() - t, 2)
        self.result["steps"][name] = row
        print(f"   {row['status']} in {row['seconds']} s" + (f": {row.get('error') or row.get('reason')}"
                                                            if row["status"] != "ok" else ""), flush=True)
        self.save()

    def save(self) -> None:
        with open(self.path + ".tmp", "w") as f:
            json.dump(self.result, f, indent=2, default=str)
        os.replace(self.path + ".tmp", self.path)

    def subprocess(self, argv: list[str], timeout: float, log_name: str) -> subprocess.CompletedProcess[str]:
        """Run a child from the tree's root; its output goes to OUT/log_name and the tail comes back in the row."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        out = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        with open(os.path.join(self.out, log_name), "w") as f:
            f.write(out.stdout + "\n--- stderr ---\n" + out.stderr)
        return out


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


# ----- 1. environment -----
def environment(check: Check) -> dict[str, Any]:
    row: dict[str, Any] = {"python": sys.version.split()[0], "cuda": check.cuda}
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
        row["cpu_avx512f"] = "avx512f" in flags
        row["cpu_avx2"] = "avx2" in flags
    except OSError:
        pass
    for mod in ("torch", "triton", "cupy", "numpy"):
        try:
            row[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001
            row[mod] = f"missing ({type(e).__name__})"
    import kvstore
    from kvstore import checksum

    row["kvstore"] = os.path.dirname(kvstore.__file__)
    row["native"] = {name: _imports(f"kvstore.{name}") for name in ("_kvindex", "_kvcopy", "_kvuring")}
    row["fused_copy_crc"] = bool(checksum.FUSED)
    if check.cuda:
        import torch

        p = torch.cuda.get_device_properties(0)
        row.update(device=torch.cuda.get_device_name(0), torch_cuda=torch.version.cuda,
                   gpu_memory_gib=round(p.total_memory / 2**30, 1), sms=p.multi_processor_count)
    return row


def _imports(name: str) -> bool:
    try:
        __import__(name)
        return True
    except ImportError:
        return False


# ----- 2. the test suite's CUDA tests -----
CUDA_TESTS = ["tests/connectors/test_kv_pages.py", "tests/tiers/test_donated_cuda.py"]


def cuda_tests(check: Check) -> dict[str, Any]:
    check.need_cuda()
    xml = os.path.join(check.out, "cuda_tests.xml")
    out = check.subprocess([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                            f"--junitxml={xml}", *CUDA_TESTS], timeout=300, log_name="cuda_tests.log")
    cases = junit_cases(xml)
    failed = {k: v for k, v in cases.items() if v.startswith("failed")}
    on_gpu = {k: v for k, v in cases.items() if "test_cuda_mover" in k or "test_donated_cuda" in k}
    row = {"pytest_rc": out.returncode, "passed": sum(v == "passed" for v in cases.values()), "failed": failed,
           "skipped": {k: v for k, v in cases.items() if v.startswith("skipped")},
           "gpu_tests": on_gpu, "tail": out.stdout[-1500:]}
    if failed or out.returncode != 0 or len(on_gpu) < 7 or any(v != "passed" for v in on_gpu.values()):
        raise RuntimeError(f"pytest rc {out.returncode}: {len(failed)} failed; GPU tests {on_gpu}; "
                           f"{out.stdout[-2000:]}")
    return row


def junit_cases(path: str) -> dict[str, str]:
    """test id -> passed / failed: message / skipped: reason, from pytest's JUnit XML."""
    cases: dict[str, str] = {}
    for tc in ET.parse(path).getroot().iter("testcase"):
        name = f"{tc.get('classname')}::{tc.get('name')}"
        bad = tc.find("failure") if tc.find("failure") is not None else tc.find("error")
        if bad is not None:
            cases[name] = f"failed: {(bad.get('message') or '')[:500]}"
        elif tc.find("skipped") is not None:
            cases[name] = f"skipped: {(tc.find('skipped').get('message') or '')[:300]}"  # type: ignore[union-attr]
        else:
            cases[name] = "passed"
    return cases


# ----- 3. SGLang's device layouts through the CUDA mover -----
def sglang_layouts(check: Check) -> dict[str, Any]:
    check.need_cuda()
    from bench.common import Daemon

    rows = []
    with Daemon(capacity="256MiB", segment="64MiB") as daemon, daemon.client() as c:
        for kind in ("mha", "mla"):
            for engine in ("kernel", "copy"):
                rows.append(_sglang_round_trip(c, kind, engine))
    bad = [r for r in rows if not (r["slots_exact"] and r["crcs_match"] and r["load_exact"] and r["verified"])]
    if bad:
        raise RuntimeError(f"not byte-exact: {bad}")
    return {"cases": rows}


def _sglang_round_trip(c: Any, kind: str, engine: str, device: str = "cuda") -> dict[str, Any]:
    """SGLang's device pool: MHA keeps per-layer K and V buffers of [tokens, heads, dim] (token 0..page-1 is its
    padding page), MLA one [tokens, 1, kv_lora_rank + rope] buffer per layer; a page is `page` consecutive tokens.
    The namespace's byte order is the host layouts' `layers,kv,tokens,heads,dim` (MLA `layers,tokens,latent`), so
    a block's layer range holds the K page then the V page. `device="cpu"` runs the same with the CPU mover (the
    test of this step's own logic: tests/test_gpu_check.py)."""
    import numpy as np
    import torch

    from kvstore.checksum import crc32c
    from kvstore.connectors.kv_pages import CpuMover, CudaMover, LayerPages
    from kvstore.protocol.geometry import Geometry
    from kvstore.protocol.keys import NamespaceSpec

    layers, page, pages_total, n = 4, 16, 40, 9
    heads, dim, kv = (8, 128, 2) if kind == "mha" else (1, 576, 1)
    order = "sglang:layers,kv,tokens,heads,dim" if kind == "mha" else "sglang-mla:layers,tokens,latent"
    geo = Geometry(layers=layers, tokens=page, kv_heads=heads, head_dim=dim, dtype="bfloat16", kv=kv, layout=order)
    size = (pages_total + 1) * page
    bufs = [[torch.empty(size, heads, dim, dtype=torch.bfloat16, device=device) for _ in range(kv)]
            for _ in range(layers)]
    for layer in bufs:
        for t in layer:
            t.view(torch.int16).random_()
    # page p of a buffer: tokens (p + 1) * page ... (p + 2) * page - 1 (page 0 is SGLang's padding)
    views = [[t[page:].view(pages_total, page, heads, dim) for t in layer] for layer in bufs]
    pages = [[LayerPages(v, pages_total) for v in layer] for layer in views]
    piece = page * heads * dim * 2
    rng = np.random.default_rng(7)
    src = rng.choice(pages_total, n, replace=False).tolist()
    dst = rng.choice(pages_total, n, replace=False).tolist()

    def page_bytes(p: int) -> bytes:
        return b"".join(views[li][j][p].contiguous().view(torch.uint8).cpu().numpy().tobytes()
                        for li in range(layers) for j in range(kv))

    expect = [page_bytes(p) for p in src]
    mover = CudaMover("cuda:0", engine=engine) if device == "cuda" else CpuMover()
    ns = c.namespace(NamespaceSpec(model=f"gpu-check-sglang-{kind}-{engine}-{device}", geometry=geo))
    keys = [os.urandom(16) for _ in src]
    res = ns.reserve(keys)
    assert len(res.reserved) == n, res.status
    mover.pin(c)
    for li in range(layers):
        a = geo.layer_range(li)[0]
        for j in range(kv):
            mover.save_layer(pages[li][j], src, res.views, a + j * piece)
    mover.sync()
    slots_exact = [bytes(v) for v in res.views] == expect
    crcs = [int(x) for x in res.checksums()]
    crcs_match = crcs == [crc32c(e) for e in expect]
    res.commit(crcs=res.checksums())
    for layer in bufs:
        for t in layer:
            t.zero_()
    with ns.acquire(keys) as lease:
        verified = lease.verified_prefix() == n
        mover.pin(c)
        for li in range(layers):
            a = geo.layer_range(li)[0]
            for j in range(kv):
                mover.load_layer(li * kv + j, pages[li][j], dst, lease.views, a + j * piece)
        for i in range(layers * kv):
            mover.wait_layer(i)
        mover.sync()
    load_exact = [page_bytes(p) for p in dst] == expect
    untouched = sorted(set(range(pages_total)) - set(dst))
    load_exact = load_exact and not any(page_bytes(p).strip(b"\0") for p in untouched)
    used = mover.engine
    mover.close()
    return {"kind": kind, "engine": used, "asked": engine, "page_bytes": geo.full_bytes, "pages": n,
            "slots_exact": slots_exact, "crcs_match": crcs_match, "verified": verified, "load_exact": load_exact}


# ----- 4. the Triton page kernel at every alignment -----
def copy_kernel(check: Check) -> dict[str, Any]:
    check.need_cuda()
    import mmap

    import numpy as np
    import torch

    from kvstore.connectors.cuda_copy import alignment, chunk_copy_kernel
    from kvstore.connectors.kv_pages import REGISTER_FLAGS

    cudart = torch.cuda.cudart()
    rng = np.random.default_rng(0)
    cases = []
    for run_bytes, vectorize, off in [(65536, True, 0), (65536, False, 0), (8192, True, 8), (4104, True, 3),
                                      (1001, True, 0), (16, True, 0)]:
        runs = 6
        span = run_bytes + 64
        buf = mmap.mmap(-1, -(-runs * span // mmap.PAGESIZE) * mmap.PAGESIZE)       # whole pages, registered
        whole = np.frombuffer(buf, dtype=np.uint8)
        host = whole[:runs * span]
        err = int(cudart.cudaHostRegister(whole.ctypes.data, whole.nbytes, REGISTER_FLAGS))
        if err:
            raise RuntimeError(f"cudaHostRegister failed: {err}")
        try:
            host[:] = rng.integers(0, 256, host.nbytes, dtype=np.uint8)
            dev = torch.zeros(runs * span, dtype=torch.uint8, device="cuda")
            h_at = np.array([host.ctypes.data + i * span + off for i in range(runs)], dtype=np.int64)
            d_at = np.array([dev.data_ptr() + i * span for i in range(runs)], dtype=np.int64)
            align = alignment(run_bytes, h_at, d_at)
            kernel = chunk_copy_kernel(vectorize)
            kernel(torch.from_numpy(np.stack([h_at, d_at])).cuda(), run_bytes, align)      # host -> device
            torch.cuda.synchronize()
            got = dev.cpu().numpy().reshape(runs, span)
            want = host.reshape(runs, span)[:, off:off + run_bytes]
            to_device = bool((got[:, :run_bytes] == want).all() and not got[:, run_bytes:].any())
            sent = host.reshape(runs, span)[:, off:off + run_bytes].copy()
            host[:] = 0
            kernel(torch.from_numpy(np.stack([d_at, h_at])).cuda(), run_bytes, align)      # device -> host
            torch.cuda.synchronize()
            back = host.reshape(runs, span)
            to_host = bool((back[:, off:off + run_bytes] == sent).all() and not back[:, off + run_bytes:].any()
                           and not back[:, :off].any())
            cases.append({"run_bytes": run_bytes, "vectorize": vectorize, "offset": off, "alignment": align,
                          "to_device_exact": to_device, "to_host_exact": to_host})
        finally:
            cudart.cudaHostUnregister(whole.ctypes.data)      # the mapping goes with its last view
    if not all(c["to_device_exact"] and c["to_host_exact"] for c in cases):
        raise RuntimeError(f"not byte-exact: {cases}")
    return {"cases": cases}


def kernel_sweep(check: Check) -> dict[str, Any]:
    """The kernel alone (GPU time, CUDA events) moving 256 MiB as scattered runs between registered host memory
    and the device, per program size and warps, against torch's `copy_` of 256 MiB from pinned memory: what the
    kernel can reach, apart from the mover's per-layer work (bench_gpu_copy measures both together)."""
    check.need_cuda()
    import mmap
    import statistics

    import numpy as np
    import torch

    from kvstore.connectors.cuda_copy import chunk_copy_kernel
    from kvstore.connectors.kv_pages import REGISTER_FLAGS

    total = 256 << 20
    cudart = torch.cuda.cudart()
    buf = mmap.mmap(-1, total)
    host = np.frombuffer(buf, dtype=np.uint8)
    if int(cudart.cudaHostRegister(host.ctypes.data, total, REGISTER_FLAGS)):
        raise RuntimeError("cudaHostRegister failed")
    dev = torch.empty(total, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    rng = np.random.default_rng(3)

    def gpu_ms(fn: Callable[[], None], reps: int = 5) -> float:
        times = []
        for _ in range(reps + 1):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times[1:])

    try:
        host[:] = 1
        rows = []
        limit = {"h2d_GBps": total / gpu_ms(lambda: dev.copy_(pinned, non_blocking=True)) / 1e6,
                 "d2h_GBps": total / gpu_ms(lambda: pinned.copy_(dev, non_blocking=True)) / 1e6}
        for run_bytes in (65536, 8192):
            n = total // run_bytes
            h_at = host.ctypes.data + rng.permutation(n).astype(np.int64) * run_bytes
            d_at = dev.data_ptr() + np.arange(n, dtype=np.int64) * run_bytes
            to_dev = torch.from_numpy(np.stack([h_at, d_at])).cuda()
            to_host = torch.from_numpy(np.stack([d_at, h_at])).cuda()
            for block_bytes in (8192, 16384, 32768):
                for warps in (4, 8):
                    k = chunk_copy_kernel(True, block_bytes, warps)
                    h2d = total / gpu_ms(partial(k, to_dev, run_bytes, 16)) / 1e6
                    d2h = total / gpu_ms(partial(k, to_host, run_bytes, 16)) / 1e6
                    rows.append({"run_bytes": run_bytes, "block_bytes": block_bytes, "warps": warps,
                                 "h2d_GBps": round(h2d, 2), "d2h_GBps": round(d2h, 2),
                                 "h2d_vs_copy": round(h2d / limit["h2d_GBps"], 3),
                                 "d2h_vs_copy": round(d2h / limit["d2h_GBps"], 3)})
                    print(f"   runs {run_bytes >> 10} KiB, {block_bytes >> 10} KiB x {warps} warps: "
                          f"H2D {h2d:.1f} GB/s, D2H {d2h:.1f} GB/s", flush=True)
        return {"limit": limit, "rows": rows}
    finally:
        torch.cuda.synchronize()
        cudart.cudaHostUnregister(host.ctypes.data)


# ----- 5. and 6. the GPU benchmarks -----
def gpu_copy(check: Check) -> dict[str, Any]:
    check.need_cuda()
    out = check.subprocess([sys.executable, "bench/bench_gpu_copy.py", "--out", check.out],
                           timeout=240, log_name="gpu_copy.log")
    if out.returncode == 77:
        raise Skipped(out.stdout.strip()[-300:])
    found = sorted(f for f in os.listdir(check.out) if f.startswith("gpu_copy-") and f.endswith(".json"))
    if out.returncode != 0 or not found:
        raise RuntimeError(f"bench_gpu_copy exited {out.returncode}: {out.stderr[-1500:]}")
    with open(os.path.join(check.out, found[-1])) as f:
        res = json.load(f)
    lim = res["limit"]
    rows = [{"layout": r["layout"], "engine": r["engine"], "save_GBps": round(r["save_GBps"], 2),
             "load_GBps": round(r["load_GBps"], 2), "save_vs_pinned_copy": round(r["save_GBps"] / lim["d2h_GBps"], 3),
             "load_vs_pinned_copy": round(r["load_GBps"] / lim["h2d_GBps"], 3), "byte_exact": r["byte_exact"]}
            for r in res["runs"]]
    best = {}
    for r in rows:
        b = best.setdefault(r["layout"], r)
        if min(r["save_vs_pinned_copy"], r["load_vs_pinned_copy"]) > min(b["save_vs_pinned_copy"],
                                                                         b["load_vs_pinned_copy"]):
            best[r["layout"]] = r
    return {"limit": lim, "rows": rows, "table": out.stdout[-2500:],
            "target_0.9x_met_per_layout": {k: min(v["save_vs_pinned_copy"], v["load_vs_pinned_copy"]) >= 0.9
                                           for k, v in best.items()},
            "all_byte_exact": all(r["byte_exact"] for r in rows)}


def donated_cuda(check: Check) -> dict[str, Any]:
    check.need_cuda()
    try:
        import cupy  # noqa: F401
    except ImportError as e:
        raise Skipped(f"no CuPy ({e})") from e
    out = check.subprocess([sys.executable, "bench/bench_donated.py", "--kind", "cuda", "--quick"],
                           timeout=240, log_name="donated_cuda.log")
    if out.returncode == 77:
        raise Skipped(out.stdout.strip()[-300:])
    if out.returncode != 0:
        raise RuntimeError(f"bench_donated exited {out.returncode}: {out.stderr[-1500:]}")
    wrote = [line.split("wrote", 1)[1].strip() for line in out.stdout.splitlines() if line.startswith("wrote")]
    row: dict[str, Any] = {"table": out.stdout[-3000:]}
    if wrote:
        with open(wrote[-1]) as f:
            row["results"] = json.load(f)
    return row


STEPS: dict[str, Step] = {"environment": environment, "cuda_tests": cuda_tests, "sglang_layouts": sglang_layouts,
                          "copy_kernel": copy_kernel, "kernel_sweep": kernel_sweep, "gpu_copy": gpu_copy,
                          "donated_cuda": donated_cuda}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "bench", "results", "gpu-check"))
    ap.add_argument("--skip", nargs="*", default=[], choices=sorted(STEPS), help="steps not to run")
    args = ap.parse_args()
    check = Check(args.out)
    for name, step in STEPS.items():
        if name not in args.skip:
            check.run(name, step)
    check.result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    statuses = {k: v["status"] for k, v in check.result["steps"].items()}
    check.result["summary"] = statuses
    check.save()
    print(json.dumps(statuses))
    print(f"results in {check.path}")
    return 1 if "failed" in statuses.values() else 0


if __name__ == "__main__":
    sys.exit(main())
