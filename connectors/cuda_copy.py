"""One GPU kernel that copies many equal runs of bytes between addresses given in a table: the scattered pages of a
layer's blocks on the GPU and their places in the pool's pinned slots, in one launch instead of one `copy_` each.

The slots are registered host memory, which the kernel reads and writes through unified addressing (a registered
page has the same address on the GPU). Triton ships with every CUDA build of torch that vLLM and SGLang run on, so
this needs nothing more; `kvstore.connectors.kv_pages.CudaMover` proves it byte-exact once and falls back to `copy_`
if it cannot run. Imported only where CUDA is.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import triton
import triton.language as tl

BLOCK_BYTES = 8192      # bytes one program copies


@triton.jit
def _copy_runs(table, n_runs, run_words, src_shift, dst_shift, WIDE: tl.constexpr, ALIGN16: tl.constexpr,  # type: ignore[no-untyped-def]  # noqa: E501
               BLOCK: tl.constexpr):
    r = tl.program_id(0)
    part = tl.program_id(1)
    src_at = tl.load(table + r) + src_shift
    dst_at = tl.load(table + n_runs + r) + dst_shift
    offs = part * BLOCK + tl.arange(0, BLOCK)
    if ALIGN16:
        offs = tl.max_contiguous(tl.multiple_of(offs, BLOCK), BLOCK)
    mask = offs < run_words
    if WIDE:
        src = src_at.to(tl.pointer_type(tl.int64))
        dst = dst_at.to(tl.pointer_type(tl.int64))
    else:
        src = src_at.to(tl.pointer_type(tl.uint8))
        dst = dst_at.to(tl.pointer_type(tl.uint8))
    if ALIGN16:
        src = tl.multiple_of(src, 16)
        dst = tl.multiple_of(dst, 16)
    tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def chunk_copy_kernel(vectorize: bool = True, block_bytes: int = BLOCK_BYTES,
                      num_warps: int = 4) -> Callable[..., None]:
    """`copy(table, run_bytes, align, src_shift=0, dst_shift=0)`: table is an int64 [2, n] tensor on the GPU
    (sources, then destinations), each address moved by its row's shift (so one table serves every layer of a
    transfer: the layers differ by where their tensor and their slot range start); `align` the alignment every
    address, shift and the run length share (see `alignment`); the copy is queued on the current stream. 8-byte
    words where everything is 8-aligned, else bytes; `vectorize=False` never tells the compiler about 16-byte
    alignment (plain 8-byte accesses). `block_bytes` (a power of two) is what one program copies, with
    `num_warps` warps."""

    def copy(table: Any, run_bytes: int, align: int, src_shift: int = 0, dst_shift: int = 0) -> None:
        n = int(table.shape[1])
        if n == 0:
            return
        wide = align % 8 == 0
        word = 8 if wide else 1
        words = run_bytes // word
        block = max(16, min(block_bytes // word, triton.next_power_of_2(words)))
        grid = (n, triton.cdiv(words, block))
        _copy_runs[grid](table, n, words, src_shift, dst_shift, WIDE=wide, ALIGN16=vectorize and align % 16 == 0,
                         BLOCK=block, num_warps=num_warps)

    return copy


def alignment(run_bytes: int, *addrs: np.ndarray) -> int:
    """The largest of 16, 8 and 1 that divides the run length and every address: what the kernel may assume (a
    word access at an address that is not a multiple of its size faults on a GPU)."""
    bits = run_bytes
    for a in addrs:
        if len(a):
            bits |= int(np.bitwise_or.reduce(a))
    return 16 if not bits & 15 else 8 if not bits & 7 else 1
