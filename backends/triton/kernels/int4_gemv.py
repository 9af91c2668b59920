"""INT4 GEMV (one token): ``graphopt.int4_linear`` at M = 1 in about 5 instructions per weight.

At one token the weight stream is all there is, and on an H200 the first kernels were bound
by instruction issue, not memory: 7.4-9.4 SASS instructions per weight element (byte
permutes, an int -> float convert or its replacement, an fp16 round trip to reproduce the
reference's rounded weight, the dot in fp32) against some 4.3 TB/s of codes. This kernel
keeps three per element:

- **Codes as 32-bit words.** A thread loads 16 bytes (four words, 32 codes: k = 8w + i
  is nibble i of word w) of each of its columns. Nibble i of the low half is masked in
  place and OR-ed under the exponent of 1.0 (one LOP3): the float ``1 + q * 2^(4i - 23)``.
  The high half takes one shift per word first (``w >> 16``), shared by its four nibbles.
- **The zero point in the same subtraction.** Subtracting ``1 + z * 2^(4i - 23)`` (one FADD,
  exact: both lie in [1, 2) with the same exponent) leaves ``(q - z) * 2^(4i - 23)``.
- **The scale of 2^(4i - 23) moved onto x.** Each x is multiplied once by 2^(23 - 4i)
  (exact, a power of two) and shared by all the thread's columns, so one FFMA per element
  accumulates ``(q - z) * x`` exactly as an fp32 dot would.

Each 32-k sub-group lies in one quantization group (GROUP % 32 == 0); its fp32 dot is
multiplied by the group's scale once, at the end of the step. So the kernel computes the
exact quantized weight ``(q - z) * s`` times x in fp32, where the reference rounds that
weight to x's dtype first: the two differ by at most half an ulp of the weight in x's dtype
per element (the MMA paths of int4_gemm.py keep the rounded weight, as tl.dot needs it).

Each thread holds COLS = BLOCK_N / threads columns, so one x (load, cast, scale) serves
COLS codes; the next step's words are loaded before the current step's math. K is split
over SPLIT programs to fill the GPU; their fp32 partials go to a workspace that
splitk_reduce.py's kernel sums (bias and cast fused there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import _common, splitk_reduce

SUB = tl.constexpr(32)  # codes per thread-column a step: four 32-bit words, one 128-bit load


@triton.jit
def _load_words(w32, s_ptr, z_ptr, n64, n_ok, k0, k_end, stride_w32, stride_sn, stride_zn,
                GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr):
    """Step ``k0``'s codes [4, BLOCK_N] (u32 words), scale [BLOCK_N] (fp32) and zero point
    [BLOCK_N] (fp32). A step at or past ``k_end`` (the prefetch after the last) loads nothing."""
    offs_w = tl.arange(0, 4)
    live = n_ok & (n64 * 0 + k0 < k_end)  # as a tensor: a scalar mask trips the interpreter
    word0 = tl.multiple_of(k0 // 8, 4)  # k0 is a multiple of 32: four aligned words
    words = tl.load(w32 + n64[None, :] * stride_w32 + (word0 + offs_w)[:, None], mask=live[None, :], other=0)
    group = k0 // GROUP
    scale = tl.load(s_ptr + n64 * stride_sn + group, mask=live, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        zbyte = tl.load(z_ptr + n64 * stride_zn + group // 2, mask=live, other=0)
        zero = ((zbyte >> ((group % 2) * 4)) & 0xF).to(tl.float32)  # once per group and column
    else:
        zero = tl.full(scale.shape, 8.0, tl.float32)
    return words, scale, zero


@triton.jit
def _nibble_dot(half, zero, xk, k_left, I0: tl.constexpr, EVEN_K: tl.constexpr, dot):
    """``dot += (q - z) * x`` over nibbles 0-3 of ``half`` [4, BLOCK_N] (u32, codes in bits
    0-15); ``xk`` [4] points at each word's first x, ``k_left`` [4] counts the x left in K
    from there; nibble i's x is at ``xk + I0 + i``. See the module docstring."""
    for i in tl.static_range(4):
        bits = (half & (0xF << (4 * i))) | 0x3F800000  # 1 + q * 2^(4i - 23)
        q = bits.to(tl.float32, bitcast=True) - (1.0 + zero[None, :] * (2.0 ** (4 * i - 23)))
        if EVEN_K:  # every step lies inside K: no mask, and the offset folds into the load
            x = tl.load(xk + (I0 + i))
        else:
            x = tl.load(xk + (I0 + i), mask=I0 + i < k_left, other=0.0)
        dot += q * (x.to(tl.float32) * (2.0 ** (23 - 4 * i)))[:, None]
    return dot


@triton.jit
def int4_gemv_kernel(
    x_ptr,         # *T [K] the token's activations
    w_ptr,         # *u8 [N, K_pad / 2] packed 4-bit codes (int4_gemm's layout), 4-byte aligned
    s_ptr,         # *S [N, G] scales, one per GROUP consecutive k of a row
    z_ptr,         # *u8 [N, ceil(G / 2)] packed 4-bit zero points; read only if HAS_ZEROS (else 8)
    b_ptr,         # *T [N] bias; read only if HAS_BIAS (never when SPLIT)
    out_ptr,       # *T [N] output, or *fp32 [splits, N] partial sums when SPLIT
    N,             # i32 output features
    K,             # i32 input features (the codes past K are padding and meet x = 0)
    k_per_split,   # i32 K elements each split program covers, a multiple of GROUP
    stride_wn,     # i32 bytes between rows of the packed weight, a multiple of 16
    stride_sn,     # i32 elements between rows of the scales
    stride_zn,     # i32 bytes between rows of the zero points
    GROUP: tl.constexpr,      # quantization group along K, a multiple of 32
    HAS_ZEROS: tl.constexpr,  # asymmetric: zero points stored; else every zero point is 8
    HAS_BIAS: tl.constexpr,   # add the bias before the cast (only without SPLIT)
    SPLIT: tl.constexpr,      # split-K: write fp32 partials at out_ptr + pid_k * N
    EVEN_K: tl.constexpr,     # K % 32 == 0: no step crosses K, so x loads need no mask
    BLOCK_N: tl.constexpr,    # output columns per program: a multiple of the thread count
):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    n64 = offs_n.to(tl.int64)
    w32 = w_ptr.to(tl.pointer_type(tl.uint32))
    stride_w32 = stride_wn // 4
    offs_w = tl.arange(0, 4)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    words, scale, zero = _load_words(w32, s_ptr, z_ptr, n64, n_ok, k_start, k_end, stride_w32, stride_sn,
                                     stride_zn, GROUP, HAS_ZEROS)
    for k0 in range(k_start, k_end, SUB):
        next_words, next_scale, next_zero = _load_words(w32, s_ptr, z_ptr, n64, n_ok, k0 + SUB, k_end, stride_w32,
                                                        stride_sn, stride_zn, GROUP, HAS_ZEROS)
        k = k0 + offs_w * 8  # word w's nibble i is k + i
        dot = tl.zeros(words.shape, tl.float32)
        dot = _nibble_dot(words, zero, x_ptr + k, k_end - k, 0, EVEN_K, dot)
        dot = _nibble_dot(words >> 16, zero, x_ptr + k, k_end - k, 4, EVEN_K, dot)
        acc += tl.sum(dot, axis=0) * scale
        words, scale, zero = next_words, next_scale, next_zero
    if SPLIT:
        tl.store(out_ptr + pid_k.to(tl.int64) * N + offs_n, acc, mask=n_ok)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


def gpu_configs(hip: bool) -> list[triton.Config]:
    """(columns per thread, warps): BLOCK_N = columns x threads. Each column is 16 bytes of codes
    a step (twice that with the prefetch); more columns share each x but hold more registers.
    sm_90: 4 columns x 2 warps is 80 registers (25 warps an SM), 8 x 2 is 128 (16 warps).
    gfx942: a 64-lane wave holds 2-4 columns a lane (104-184 VGPRs); 8 needs 330, a single
    wave per SIMD, so AMD stops at 4. Not yet timed on a device; the autotuner picks."""
    shapes = [(2, 2), (4, 1), (2, 4), (1, 4)] if hip else [(4, 2), (8, 2), (4, 4), (2, 4)]
    lanes = 64 if hip else 32
    return [triton.Config({"BLOCK_N": cols * w * lanes}, num_warps=w, num_stages=1) for cols, w in shapes]


def prune_configs(configs, named_args, **kwargs):
    """Zero points add a per-column subtrahend per nibble: 8 columns a thread then spills on
    sm_90 (255 registers), so asymmetric weights keep the tiles of at most 4."""
    if not {**named_args, **kwargs}.get("HAS_ZEROS"):
        return configs
    lanes = _common.warp_size()
    kept = [c for c in configs if c.kwargs["BLOCK_N"] // (c.num_warps * lanes) <= 4]
    return kept or configs


int4_gemv_tuned = triton.autotune(
    configs=_common.pick_configs(gpu_configs, triton.Config({"BLOCK_N": 32}, num_warps=1, num_stages=1)),
    key=["N", "K", "GROUP", "HAS_ZEROS", "SPLIT", "EVEN_K"],
    prune_configs_by={"early_config_prune": prune_configs},
)(int4_gemv_kernel)


def int4_gemv(x2: Tensor, packed: Tensor, scales: Tensor, zeros: Tensor, group_size: int, bias: Tensor | None,
              bias_arg: Tensor, out2: Tensor, split_k: int | None = None) -> None:
    """``out2`` [1, N] = x2 [1, K] times the INT4 weight, for int4_gemm.int4_linear (which has
    checked the format; ``zeros`` is ``packed`` when symmetric, ``bias_arg`` a dummy without
    bias). ``split_k`` overrides the K split (tests cover the split path with it)."""
    k, n = x2.shape[1], out2.shape[1]
    # About four 2-warp programs per SM with 256-column tiles (the configs' typical width).
    splits, per_split = splitk_reduce.plan(k, n, scales.shape[1], group_size, x2.device, split_k, 4, 256)
    flags = dict(GROUP=group_size, HAS_ZEROS=zeros is not packed, EVEN_K=k % SUB.value == 0)
    args = (x2, packed, scales, zeros, bias_arg)
    sizes = (n, k, per_split, packed.stride(0), scales.stride(0), zeros.stride(0))
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), splits)  # noqa: E731
    if splits == 1:
        int4_gemv_tuned[grid](*args, out2, *sizes, HAS_BIAS=bias is not None, SPLIT=False, **flags)
        return
    partial = torch.empty((splits, 1, n), dtype=torch.float32, device=x2.device)
    int4_gemv_tuned[grid](*args, partial, *sizes, HAS_BIAS=False, SPLIT=True, **flags)
    splitk_reduce.reduce_partials(partial, bias, bias_arg, out2, splits)


def fits(packed, group_size: int) -> bool:
    """The word loads need groups of whole 32-k sub-groups and 16-byte aligned rows."""
    return group_size % SUB.value == 0 and packed.data_ptr() % 16 == 0 and packed.stride(0) % 16 == 0
