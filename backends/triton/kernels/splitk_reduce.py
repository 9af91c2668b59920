"""Split-K's second stage for the INT4 kernels: sum the split programs' fp32 partials on the
device, add the bias, cast. int4_gemm.py (decode on MMA / FMA) and int4_gemv.py (one token on
32-bit words) split K so that a single token fills the GPU, and both end here."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import _common


@triton.jit
def splitk_reduce_kernel(
    part_ptr,     # *fp32 [splits, M * N] the split programs' partial sums
    b_ptr,        # *T [N] bias; read only if HAS_BIAS
    out_ptr,      # *T [M * N] output, contiguous
    MN,           # i32 M * N
    N,            # i32 output features (the bias repeats every N)
    splits,       # i32 partial sums per output
    HAS_BIAS: tl.constexpr,  # add the bias to the fp32 total before the cast
    BLOCK: tl.constexpr,     # outputs per program
):
    """Second stage of split-K: sum the partials in fp32, add the bias, cast, store.

    A kernel rather than torch ops, so the reduction is one launch that reads the
    workspace once (and is captured with the rest of a decode step in a CUDA graph).
    Split-order summation makes the result deterministic, unlike atomics.
    """
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, splits):
        acc += tl.load(part_ptr + s * MN + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


BLOCK, WARPS = 1024, 4  # 8 fp32 per thread of a 32-wide warp: two 128-bit loads per split


def reduce_partials(partial: Tensor, bias: Tensor | None, bias_arg: Tensor, out2: Tensor, splits: int) -> None:
    """``out2`` [M, N] = the sum over ``partial`` [splits, M, N] (+ bias), in one launch."""
    mn, n = out2.numel(), out2.shape[-1]
    block = 128 if _common.interpreting() else BLOCK
    splitk_reduce_kernel[(triton.cdiv(mn, block),)](
        partial, bias_arg, out2, mn, n, splits, HAS_BIAS=bias is not None, BLOCK=block,
        num_warps=WARPS * 32 // _common.warp_size())


def plan(k: int, n: int, groups: int, group_size: int, device: torch.device, split_k: int | None,
         programs_per_sm: int, tile_n: int) -> tuple[int, int]:
    """(splits, K per split) for a decode launch: about ``programs_per_sm`` programs per SM (CU)
    with ``tile_n``-column tiles, each split whole groups, none empty. ``split_k`` overrides the
    count (tests cover the split path with it); off the GPU one split."""
    if split_k:
        splits = split_k
    elif device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        splits = max(1, min(groups, (programs_per_sm * sms) // triton.cdiv(n, tile_n)))
    else:
        splits = 1
    per_split = triton.cdiv(groups, splits) * group_size
    return triton.cdiv(k, per_split), per_split
