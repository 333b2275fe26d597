"""The vLLM connector's GPU path on a real GPU: scattered KV pages gathered into the daemon's slots (save) and
scattered back (load), layer by layer, through `kvstore.connectors.kv_pages.CudaMover`, against a plain pinned
`copy_` of
the same bytes (one contiguous pinned buffer <-> one contiguous GPU buffer: the link's limit) in the same run.

Every figure is checked byte-exact: the slots must hold each page in the engine's memory order (compared with the
physical tensor gathered by torch), and the pages loaded back must equal the saved ones.

    python bench/bench_gpu_copy.py [--blocks 128] [--reps 5] [--quick] [--out DIR]

Layouts (vLLM 0.32's per-layer [blocks, heads, tokens, 2*dim] views over a physical order):
  LBNHC  tokens-major page, one 64 KiB run per block per layer (vLLM's default on CUDA)
  LHBNC  heads outside the blocks: 8 runs of 8 KiB per block per layer
  BLHNC  cross-layer: all layers of a block together, one run per block per layer
Exits 77 (skipped) where there is no CUDA device.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import Daemon, Table, progress, write_json  # noqa: E402

LAYERS, TOKENS, HEADS, DIM = 32, 16, 8, 128          # a Llama-3-8B-like layer: 64 KiB per block per layer (bf16)


def make_kv(torch, layout: str, num_blocks: int, device: str) -> tuple[list, object]:
    """Per-layer logical [B, H, N, C] views over one physical tensor of the given layout, and that tensor."""
    c = 2 * DIM
    if layout == "LBNHC":
        raw = torch.empty(LAYERS, num_blocks, TOKENS, HEADS, c, dtype=torch.bfloat16, device=device)
        return [raw[li].permute(0, 2, 1, 3) for li in range(LAYERS)], raw
    if layout == "LHBNC":
        raw = torch.empty(LAYERS, HEADS, num_blocks, TOKENS, c, dtype=torch.bfloat16, device=device)
        return [raw[li].permute(1, 0, 2, 3) for li in range(LAYERS)], raw
    if layout == "BLHNC":
        raw = torch.empty(num_blocks, LAYERS, HEADS, TOKENS, c, dtype=torch.bfloat16, device=device)
        return [raw[:, li] for li in range(LAYERS)], raw
    raise ValueError(layout)


def page_bytes(torch, layout: str, raw, li: int, ids):
    """Independent of LayerPages: the pages of `ids` in layer li, each in memory order, as [n, page] bytes."""
    if layout == "LBNHC":
        pages = raw[li][ids]                                  # [n, N, H, C], contiguous per block
    elif layout == "LHBNC":
        pages = raw[li][:, ids].transpose(0, 1)               # [n, H, N, C]: head runs in memory order
    else:
        pages = raw[ids, li]                                  # [n, H, N, C]
    return pages.contiguous().view(torch.uint8).reshape(len(ids), -1)


def timed(torch, fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return out


def measure_limit(torch, moved: int, reps: int, dev: str) -> dict[str, float]:
    """One contiguous pinned buffer <-> one contiguous GPU buffer of the same bytes: the link's limit."""
    host = torch.empty(moved, dtype=torch.uint8).pin_memory()
    gpu = torch.empty(moved, dtype=torch.uint8, device=dev)
    d2h = statistics.median(timed(torch, lambda: host.copy_(gpu, non_blocking=True), reps))
    h2d = statistics.median(timed(torch, lambda: gpu.copy_(host, non_blocking=True), reps))
    return {"d2h_GBps": moved / d2h / 1e9, "h2d_GBps": moved / h2d / 1e9}


def run_case(torch, np, c, geo, layout: str, engine: str, kvs: list, raw, n: int, pool_blocks: int, reps: int,
             rng) -> dict:
    """Save n scattered blocks through the mover into reserved slots, commit, acquire and load them into other
    blocks: timings of both directions and whether every byte landed where it should."""
    from kvstore.connectors.kv_pages import CudaMover, LayerPages
    from kvstore.protocol.keys import NamespaceSpec

    pages = [LayerPages(kv, pool_blocks) for kv in kvs]
    mover = CudaMover("cuda:0", engine=engine)
    ns = c.namespace(NamespaceSpec(model=f"bench-{layout}-{engine}", geometry=geo))
    src_ids = rng.choice(pool_blocks, n, replace=False).tolist()
    dst_ids = rng.choice(pool_blocks, n, replace=False).tolist()
    keys = [os.urandom(16) for _ in range(n)]
    starts = [geo.layer_range(li)[0] for li in range(LAYERS)]
    res = ns.reserve(keys)
    assert len(res.reserved) == n, res.status
    mover.pin(c)

    def save() -> None:
        for li in range(LAYERS):
            mover.save_layer(pages[li], src_ids, res.views, starts[li])
        mover.sync()
    save_t = timed(torch, save, reps)
    exact_save = all(np.array_equal(page_bytes(torch, layout, raw, li, src_ids).cpu().numpy(),
                                    np.stack([v[slice(*geo.layer_range(li))] for v in res.views]))
                     for li in range(LAYERS))
    res.commit(crcs=res.checksums())
    lease = ns.acquire(keys)
    assert len(lease) == n and lease.verified_prefix() == n
    mover.pin(c)
    expect = [page_bytes(torch, layout, raw, li, src_ids).clone() for li in range(LAYERS)]
    enqueue: list[float] = []

    def load() -> None:
        t = time.perf_counter()
        for li in range(LAYERS):
            mover.load_layer(li, pages[li], dst_ids, lease.views, starts[li])
        enqueue.append(time.perf_counter() - t)
        for li in range(LAYERS):
            mover.wait_layer(li)
    raw.zero_()                                                  # the loads must really write the pages
    load_t = timed(torch, load, reps)
    exact_load = all(torch.equal(page_bytes(torch, layout, raw, li, dst_ids), expect[li]) for li in range(LAYERS))
    lease.release()
    c.flush()
    mover.close()
    moved = n * geo.full_bytes
    return {"layout": layout, "engine": mover.engine, "runs_per_page": pages[0].chunks,
            "run_bytes": pages[0].chunk_bytes, "save_GBps": moved / statistics.median(save_t) / 1e9,
            "load_GBps": moved / statistics.median(load_t) / 1e9,
            "enqueue_load_ms": statistics.median(enqueue) * 1e3, "save_s": save_t, "load_s": load_t,
            "byte_exact": bool(exact_save and exact_load)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=128, help="blocks moved per transfer (2 MiB each)")
    ap.add_argument("--pool-blocks", type=int, default=2048, help="blocks in the engine's KV tensor")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=os.environ.get("OUT", ""), help="also write the JSON here")
    ap.add_argument("--quick", action="store_true", help="32 blocks, 2 repetitions")
    args = ap.parse_args()
    if args.quick:
        args.blocks, args.reps = 32, 2
    try:
        import numpy as np
        import torch
    except ImportError as e:
        print(f"skipped: {e}")
        return 77
    if not torch.cuda.is_available():
        print("skipped: no CUDA device")
        return 77
    from kvstore.protocol.geometry import Geometry

    n, reps = args.blocks, args.reps
    geo = Geometry(layers=LAYERS, tokens=TOKENS, kv_heads=HEADS, head_dim=DIM, dtype="bfloat16", kv=2,
                   layout="bench-gpu")
    moved = n * geo.full_bytes
    rng = np.random.default_rng(0)
    limit = measure_limit(torch, moved, reps, "cuda:0")
    results: dict = {"device": torch.cuda.get_device_name(0), "blocks": n, "bytes_per_transfer": moved,
                     "geometry": str(geo), "limit": limit, "runs": []}
    progress(f"plain pinned copy_ of {moved >> 20} MiB: D2H {limit['d2h_GBps']:.1f} GB/s, "
             f"H2D {limit['h2d_GBps']:.1f} GB/s")
    table = Table(["layout", "engine", "runs/block/layer", "save GB/s", "load GB/s", "save ÷ limit",
                   "load ÷ limit", "enqueue load ms", "byte-exact"])
    with Daemon(capacity=f"{(8 * moved) >> 20}MiB", segment="256MiB") as daemon, daemon.client() as c:
        for layout in ("LBNHC", "LHBNC", "BLHNC"):
            kvs, raw = make_kv(torch, layout, args.pool_blocks, "cuda:0")
            raw.view(torch.int16).random_()
            for engine in ("kernel", "copy"):
                row = run_case(torch, np, c, geo, layout, engine, kvs, raw, n, args.pool_blocks, reps, rng)
                results["runs"].append(row)
                table.add([layout, row["engine"], row["runs_per_page"], f"{row['save_GBps']:.1f}",
                           f"{row['load_GBps']:.1f}", f"{row['save_GBps'] / limit['d2h_GBps']:.2f}",
                           f"{row['load_GBps'] / limit['h2d_GBps']:.2f}", f"{row['enqueue_load_ms']:.2f}",
                           "yes" if row["byte_exact"] else "NO"])
                progress(f"{layout} {row['engine']}: save {row['save_GBps']:.1f} GB/s, load "
                         f"{row['load_GBps']:.1f} GB/s, byte-exact {row['byte_exact']}")
            kvs.clear()
            raw = None
            torch.cuda.empty_cache()
    print(f"\nGPU path ({results['device']}), {n} scattered blocks of {geo.full_bytes >> 20} MiB "
          f"({LAYERS} layers x {geo.layer_bytes >> 10} KiB), median of {reps}; limit: plain pinned copy_ "
          f"D2H {limit['d2h_GBps']:.1f} GB/s, H2D {limit['h2d_GBps']:.1f} GB/s")
    print(table)
    path = write_json("gpu_copy", results)
    if args.out:
        with open(os.path.join(args.out, os.path.basename(path)), "w") as f:
            json.dump(results, f, indent=2)
    print(f"results in {path}")
    return 0 if all(r["byte_exact"] for r in results["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
