"""INT4 weight-only GEMM / GEMV: ``graphopt.int4_linear`` with the dequantization fused
into the K loop.

Each program owns a BLOCK_M x BLOCK_N tile of the output and walks K in BLOCK_K steps.
A step loads BLOCK_K / 2 packed bytes per output column (the bytes of the MatMulNBits
layout, graphopt/ops/quant.py), splits each byte into its low nibble (even k) and its
high nibble (odd k), dequantizes both halves in registers with the group's scale (and
zero point), and multiplies them against the even and odd columns of x. So the weight
crosses memory once, as 4-bit codes, and no dequantized weight is ever written anywhere.

The weight bytes of a step are loaded without a per-k mask whenever BLOCK_K divides the
group (every config the autotuner keeps for groups of 32, 64, 128; then one step reads
one scale per column): each column's BLOCK_K / 2 bytes are contiguous and 16-byte
aligned, so they move as 128-bit vector loads. Other groups (16, 48, ...) take a masked
per-byte fallback. ``graphopt kernels --json`` shows the load widths per variant.

On the MMA paths Triton's software pipeliner issues the loads ahead of their use: with
``num_stages = S`` the weight bytes and x of the next S - 1 K steps are in flight while
the current step unpacks and multiplies (cp.async into shared memory on NVIDIA; on
gfx942 triton 3.9 stages them through registers into LDS, since its direct-to-LDS copy
is 32 bits wide there). The GEMV prefetches the next step's weights by hand.

Two shapes, two tunings (``int4_linear`` picks by M):
- decode (M <= 16): few rows and the whole weight to stream. One token is a GEMV on
  the FMA units: int4_gemv.py's word kernel when the groups hold whole 32-k sub-groups and
  the rows are 16-byte aligned (the usual case; about 5 instructions per weight element
  where this kernel's GEMV takes 7.4-9.4), else this kernel with its own tuning
  (``int4_gemm_gemv``), whose widest tiles step over whole groups (BLOCK_K = 4-8 groups of
  32: four 128-bit loads of codes per thread a step, with the next step's in flight), split
  x into even and odd k rather than interleave the nibbles, and keep each column's sum in
  one thread; 2-16 rows use one 16-row
  MMA tile (the rows past M are masked: the kernel is bound by the weight stream, so the
  padding costs no time, and an FMA product of 8 rows would not fit in registers). K is
  split over SPLIT programs so that a single token fills the GPU; their fp32 partial
  sums go to a workspace that a second kernel reduces (bias and cast fused into it).
- prefill (M > 16): 64 / 128-row tiles on the tensor cores (MMA / MFMA).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from graphopt.ops.quant import check_format

from . import _common, int4_gemv, splitk_reduce
from ._device import dot
from .int4_gemm_configs import (  # noqa: F401  (registry.tuning_specs and the tests read them here)
    GEMV_BYTES_PER_THREAD, decode_gpu_configs, gemv_bytes_per_thread, gemv_gpu_configs, gemv_sub_group,
    gpu_configs, grouped_gemv_configs, prefill_gpu_configs, prune_configs)

DECODE_MAX_M = 16


@triton.jit
def _load_step(w_ptr, s_ptr, z_ptr, n64, n_ok, offs_j, k0, k_end, stride_wn, stride_sn, stride_zn,
               GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, BLOCK_K: tl.constexpr):
    """The weight stream of the K step at ``k0``: packed bytes [BLOCK_K / 2, BLOCK_N] (u8),
    and the scales (in their own dtype) and zero points (fp32) as [1, BLOCK_N] when the
    step lies in one group, else [BLOCK_K / 2, BLOCK_N] (one per byte: GROUP is even, so a
    byte's two codes share a group). ``n_ok`` masks columns; it is all false for a step
    past the end (the GEMV's last prefetch).
    """
    if GROUP % BLOCK_K == 0:
        # The common path. k0 is a multiple of BLOCK_K (splits start on group boundaries)
        # and k0 + BLOCK_K <= K_pad, so every byte of the step is inside the buffer: the
        # codes past K are padding and meet x = 0. No mask varies along k, so each
        # column's BLOCK_K / 2 contiguous, 16-byte aligned bytes load as 128-bit vectors
        # (and go through cp.async on the MMA paths).
        j0 = tl.multiple_of(k0 // 2, BLOCK_K // 2)
        packed = tl.load(w_ptr + n64[None, :] * stride_wn + (j0 + offs_j)[:, None],
                         mask=n_ok[None, :], other=0)
        group = (k0 + n64[None, :] * 0) // GROUP  # as a tensor: a scalar index trips the interpreter
        s_mask = n_ok[None, :]
    else:
        # Masked fallback (a group smaller than, or not a multiple of, BLOCK_K): per-byte
        # masks and per-byte groups; correct for any even GROUP, byte-wide loads.
        k_byte = k0 + 2 * offs_j
        byte_ok = (k_byte < k_end)[:, None] & n_ok[None, :]
        packed = tl.load(w_ptr + n64[None, :] * stride_wn + (k0 // 2 + offs_j)[:, None], mask=byte_ok, other=0)
        group = (k_byte // GROUP)[:, None] + n64[None, :] * 0
        s_mask = byte_ok
    scale = tl.load(s_ptr + n64[None, :] * stride_sn + group, mask=s_mask, other=0.0)
    if HAS_ZEROS:
        zbyte = tl.load(z_ptr + n64[None, :] * stride_zn + group // 2, mask=s_mask, other=0)
        zero = ((zbyte >> ((group % 2) * 4)) & 0xF).to(tl.float32)
    else:
        zero = tl.full(scale.shape, 8.0, tl.float32)
    return packed, scale, zero


@triton.jit
def _load_groups(w_ptr, s_ptr, z_ptr, n64, n_ok, offs_g, offs_jj, k0, k_end, stride_wn, stride_sn, stride_zn,
                 GROUP: tl.constexpr, SUB: tl.constexpr, HAS_ZEROS: tl.constexpr):
    """The GEMV's weight stream for a step of G sub-groups of SUB k (SUB divides GROUP, so
    each lies in one group): codes [G, SUB / 2, BLOCK_N] (u8), scales (their own dtype) and
    zero points (fp32) [G, 1, BLOCK_N], one per sub-group and column.

    Each column's SUB / 2 bytes of a sub-group are contiguous and 16-byte aligned, so each
    thread moves them as 128-bit loads, G of them per step (SUB is at most 32: a thread
    holding a whole group of 128 would need twice the registers and spills). The mask is
    per sub-group (one past ``k_end``, as in the prefetch past the end, loads nothing),
    constant along its bytes, so it does not narrow the loads. A sub-group that starts
    before K ends inside K_pad; its codes past K are padding and meet x = 0.
    """
    start = k0 + offs_g * SUB  # [G]
    group = start // GROUP
    ok = (start < k_end)[:, None, None] & n_ok[None, None, :]  # [G, 1, BLOCK_N]
    j = (tl.multiple_of(k0 // 2, SUB // 2) + offs_g * (SUB // 2))[:, None, None] + offs_jj[None, :, None]
    cols = n64[None, None, :]
    packed = tl.load(w_ptr + cols * stride_wn + j, mask=ok, other=0)
    scale = tl.load(s_ptr + cols * stride_sn + group[:, None, None], mask=ok, other=0.0)
    if HAS_ZEROS:
        zbyte = tl.load(z_ptr + cols * stride_zn + group[:, None, None] // 2, mask=ok, other=0)
        zero = ((zbyte >> ((group[:, None, None] % 2) * 4)) & 0xF).to(tl.float32)
    else:
        zero = tl.full(scale.shape, 8.0, tl.float32)
    return packed, scale, zero


@triton.jit
def _weights(codes, scale, zero, dtype: tl.constexpr):
    """4-bit codes (u8, 0..15) -> ``(q - z) * s`` rounded once to ``dtype``: the reference
    op's weight, value for value, with no integer-to-float conversion.

    An int -> float convert runs on the GPU's conversion pipe at an eighth of the FMA rate
    (16 a clock per SM on sm_80/sm_90), and one per weight element made the first H200 GEMV
    conversion-bound (0.14-0.17 of copy bandwidth). Instead a code is OR-ed into the
    mantissa of a power of two, 2^m + q, whose bits reinterpret as that float: 1024 for
    fp16 (0x6400), 2^23 for fp32 (0x4B000000), each with an ulp of 1, so the subtraction of
    2^m + z is exact. The product with the scale is exact in fp32 and rounded once, as the
    reference rounds it: in fp16 itself when x and the scales are fp16 (the common case:
    half-precision pairs, no cast at all), else in fp32 and cast (bf16: a bf16 <-> fp32
    cast is a shift, not a convert; Triton's interpreter also miscomputes bf16 arithmetic
    on a bitcast tensor).
    """
    if dtype == scale.dtype and dtype == tl.float16:
        q = (codes.to(tl.int16) | 0x6400).to(tl.float16, bitcast=True)
        return (q - (zero + 1024.0).to(tl.float16)) * scale
    else:
        q = (codes.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True)
        return ((q - (zero + 8388608.0)) * scale.to(tl.float32)).to(dtype)


@triton.jit
def _dequantize(packed, scale, zero, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, dtype: tl.constexpr):
    """[BLOCK_K / 2, BLOCK_N] bytes -> the [BLOCK_K, BLOCK_N] weight tile in ``dtype``
    (``_weights``: the reference's weight, value for value). Low nibbles are even k, high
    nibbles odd k: joining them on a new last axis and folding it into k restores the order.
    """
    lo = _weights(packed & 0xF, scale, zero, dtype)
    hi = _weights(packed >> 4, scale, zero, dtype)
    return tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (BLOCK_K, BLOCK_N))


@triton.jit
def int4_gemm_kernel(
    x_ptr,         # *T [M, K] activations, unit column stride
    w_ptr,         # *u8 [N, K_pad / 2] packed 4-bit codes: k = 2j in the low nibble of byte j, 2j + 1 high
    s_ptr,         # *S [N, G] scales (fp16 / bf16 / fp32), one per GROUP consecutive k of a row
    z_ptr,         # *u8 [N, ceil(G / 2)] packed 4-bit zero points; read only if HAS_ZEROS (else 8)
    b_ptr,         # *T [N] bias; read only if HAS_BIAS (and never when SPLIT)
    out_ptr,       # *T [M, N] output, or *fp32 [splits, M, N] partial sums when SPLIT
    M,             # i32 rows of x
    N,             # i32 output features
    K,             # i32 input features (K <= K_pad = G * GROUP; the codes past K are padding)
    k_per_split,   # i32 K elements each split program covers, a multiple of GROUP
    stride_xm,     # i32 elements between rows of x
    stride_wn,     # i32 bytes between rows of the packed weight (K_pad / 2)
    stride_sn,     # i32 elements between rows of the scales (G)
    stride_zn,     # i32 bytes between rows of the zero points
    stride_om,     # i32 elements between rows of out (N)
    GROUP: tl.constexpr,      # quantization group size along K (any even size; 32, 64, 128 are fast)
    HAS_ZEROS: tl.constexpr,  # asymmetric: zero points stored; else every zero point is 8
    HAS_BIAS: tl.constexpr,   # add the bias before the cast (only without SPLIT)
    SPLIT: tl.constexpr,      # split-K: write fp32 partials at out_ptr + pid_k * M * N
    BLOCK_M: tl.constexpr,    # rows per program: 1 is the GEMV on FMA units, >= 16 multiplies on MMA
    BLOCK_N: tl.constexpr,    # output columns per program
    BLOCK_K: tl.constexpr,    # k per loop step; when it divides GROUP (the fast path) one scale per step
    DOT_F32: tl.constexpr,    # upcast dot operands (only the interpreter with bf16 needs it)
    SUB: tl.constexpr,        # the GEMV's sub-group: 32 for groups that are multiples of 32, else GROUP
):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_j = tl.arange(0, BLOCK_K // 2)
    m_ok, n_ok = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    n64 = offs_n.to(tl.int64)
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    if BLOCK_M >= 16:
        # MMA tiles: the weight bytes and x feed tl.dot, so Triton's pipeliner keeps
        # num_stages - 1 steps of both in flight (cp.async into shared memory on NVIDIA;
        # on gfx942 global loads into registers, written to LDS a step ahead).
        for k0 in range(k_start, k_end, BLOCK_K):
            packed, scale, zero = _load_step(w_ptr, s_ptr, z_ptr, n64, n_ok, offs_j, k0, k_end, stride_wn,
                                             stride_sn, stride_zn, GROUP, HAS_ZEROS, BLOCK_K)
            w = _dequantize(packed, scale, zero, BLOCK_K, BLOCK_N, dtype)
            x = tl.load(x_rows + (k0 + offs_k)[None, :], mask=m_ok[:, None] & (k0 + offs_k < k_end)[None, :],
                        other=0.0)
            acc += dot(x, w, DOT_F32)
    elif BLOCK_K % SUB == 0:
        # GEMV on G sub-groups a step (BLOCK_K = G x SUB): G 128-bit loads of codes per
        # thread per step, the next step's issued before this one's math (a hand prefetch:
        # nothing feeds a dot, so the pipeliner leaves these loads alone). x is split into
        # its even and odd k instead of interleaving the low and high nibbles of the weight,
        # and each thread holds a group's codes of one column, so the sum over k stays in
        # the thread: no shuffles per step, one reduction-free accumulator per column.
        offs_g = tl.arange(0, BLOCK_K // SUB)
        offs_jj = tl.arange(0, SUB // 2)
        x_row = x_ptr + pid_m.to(tl.int64) * stride_xm
        col_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        packed, scale, zero = _load_groups(w_ptr, s_ptr, z_ptr, n64, n_ok, offs_g, offs_jj, k_start, k_end,
                                           stride_wn, stride_sn, stride_zn, GROUP, SUB, HAS_ZEROS)
        for k0 in range(k_start, k_end, BLOCK_K):
            next_packed, next_scale, next_zero = _load_groups(w_ptr, s_ptr, z_ptr, n64, n_ok, offs_g, offs_jj,
                                                              k0 + BLOCK_K, k_end, stride_wn, stride_sn, stride_zn,
                                                              GROUP, SUB, HAS_ZEROS)
            xk = tl.load(x_row + k0 + offs_k, mask=k0 + offs_k < k_end, other=0.0).to(tl.float32)
            x_even, x_odd = tl.split(tl.reshape(xk, (BLOCK_K // SUB, SUB // 2, 2)))
            # (q - z) * s rounded to x's dtype once, as _dequantize does: the reference's weight.
            lo = _weights(packed & 0xF, scale, zero, dtype).to(tl.float32)
            hi = _weights(packed >> 4, scale, zero, dtype).to(tl.float32)
            col_acc += tl.sum(tl.sum(lo * x_even[:, :, None] + hi * x_odd[:, :, None], axis=1), axis=0)
            packed, scale, zero = next_packed, next_scale, next_zero
        acc = col_acc[None, :]
    else:
        # GEMV with a group that is neither a multiple of 32 nor a divisor of the step
        # (48, say): the masked per-byte fallback of _load_step. Nothing feeds a dot, so the
        # loop prefetches by hand, issuing step i + 1's loads before step i's math.
        packed, scale, zero = _load_step(w_ptr, s_ptr, z_ptr, n64, n_ok, offs_j, k_start, k_end, stride_wn,
                                         stride_sn, stride_zn, GROUP, HAS_ZEROS, BLOCK_K)
        for k0 in range(k_start, k_end, BLOCK_K):
            k_next = k0 + BLOCK_K
            live = n_ok & (n64 * 0 + k_next < k_end)  # as a tensor: a scalar mask trips the interpreter
            next_packed, next_scale, next_zero = _load_step(w_ptr, s_ptr, z_ptr, n64, live, offs_j, k_next, k_end,
                                                            stride_wn, stride_sn, stride_zn, GROUP, HAS_ZEROS,
                                                            BLOCK_K)
            w = _dequantize(packed, scale, zero, BLOCK_K, BLOCK_N, dtype).to(tl.float32)
            x = tl.load(x_rows + (k0 + offs_k)[None, :], mask=m_ok[:, None] & (k0 + offs_k < k_end)[None, :],
                        other=0.0).to(tl.float32)
            acc += tl.sum(x[:, :, None] * w[None, :, :], axis=1)
            packed, scale, zero = next_packed, next_scale, next_zero
    out_mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT:
        part = out_ptr + pid_k.to(tl.int64) * M * N
        tl.store(part + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :], acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=out_mask)


_DECODE_KEY = ["N", "K", "GROUP", "HAS_ZEROS", "SPLIT", "BLOCK_M"]
# The interpreter's GEMV tile steps over two sub-groups of 32 (of one group of 64 or 128, or
# of two groups of 32) or four groups of 16; groups like 48 take the masked fallback.
int4_gemm_gemv = triton.autotune(
    configs=_common.pick_configs(gemv_gpu_configs, triton.Config({"BLOCK_N": 32, "BLOCK_K": 64},
                                                                 num_warps=1, num_stages=1)),
    key=_DECODE_KEY, prune_configs_by={"early_config_prune": prune_configs})(int4_gemm_kernel)
int4_gemm_decode = triton.autotune(
    configs=_common.pick_configs(decode_gpu_configs, triton.Config({"BLOCK_N": 32, "BLOCK_K": 32},
                                                                   num_warps=1, num_stages=1)),
    key=_DECODE_KEY, prune_configs_by={"early_config_prune": prune_configs})(int4_gemm_kernel)
int4_gemm_prefill = triton.autotune(
    configs=_common.pick_configs(prefill_gpu_configs, triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32},
                                                                    num_warps=1, num_stages=1)),
    key=["N", "K", "GROUP", "HAS_ZEROS"], prune_configs_by={"early_config_prune": prune_configs},
)(int4_gemm_kernel)


def int4_linear(x: Tensor, packed: Tensor, scales: Tensor, zeros: Tensor | None, group_size: int,
                bias: Tensor | None = None, *, out: Tensor | None = None, split_k: int | None = None) -> Tensor:
    """``graphopt.int4_linear`` for x [..., K]: the decode kernel for M <= 16 rows, prefill above.

    ``split_k`` overrides the decode path's K split (tests use it to cover the split path).
    """
    k = x.shape[-1]
    n, groups, _ = check_format(packed, scales, zeros, group_size, k)
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"int4_linear bias must be ({n},), got {tuple(bias.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"int4_linear needs a floating input, got {x.dtype}")
    out = _common.output(out, (*x.shape[:-1], n), x.dtype, x.device)
    x2 = _common.rows_view(x, k)
    m = x2.shape[0]
    if out.numel() == 0:
        return out
    o2 = out.view(m, n)
    packed, scales = packed.contiguous(), scales.contiguous()
    zeros = zeros.contiguous() if zeros is not None else packed  # a dummy pointer when symmetric
    bias_arg = bias.contiguous() if bias is not None else x2  # never read without HAS_BIAS
    common = dict(GROUP=group_size, SUB=gemv_sub_group(group_size), HAS_ZEROS=zeros is not packed,
                  DOT_F32=_common.interpreting()
                  and x.dtype == torch.bfloat16)
    strides = (x2.stride(0), packed.stride(0), scales.stride(0), zeros.stride(0))
    if m > DECODE_MAX_M:
        grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]), 1)  # noqa: E731
        int4_gemm_prefill[grid](x2, packed, scales, zeros, bias_arg, o2, m, n, k, k, *strides, o2.stride(0),
                                HAS_BIAS=bias is not None, SPLIT=False, **common)
        return out
    if m == 1 and int4_gemv.fits(packed, group_size):
        int4_gemv.int4_gemv(x2, packed, scales, zeros, group_size, bias, bias_arg, o2, split_k)
        return out
    # Two programs per SM (CU) with the decode configs' typical 128-column tiles.
    splits, per_split = splitk_reduce.plan(k, n, groups, group_size, x.device, split_k, 2, 128)
    block_m = 1 if m == 1 else 16  # GEMV on FMA, else one MMA tile (see the module docstring)
    decode = int4_gemm_gemv if m == 1 else int4_gemm_decode
    grid = lambda meta: (1, triton.cdiv(n, meta["BLOCK_N"]), splits)  # noqa: E731
    if splits == 1:
        decode[grid](x2, packed, scales, zeros, bias_arg, o2, m, n, k, per_split, *strides, o2.stride(0),
                               HAS_BIAS=bias is not None, SPLIT=False, BLOCK_M=block_m, **common)
        return out
    # fp32 partials reduced on the device by a second kernel (bias and cast fused into it).
    partial = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    decode[grid](x2, packed, scales, zeros, bias_arg, partial, m, n, k, per_split, *strides, n,
                           HAS_BIAS=False, SPLIT=True, BLOCK_M=block_m, **common)
    splitk_reduce.reduce_partials(partial, bias, bias_arg, o2, splits)
    return out


GEMV_SPEC = "decode M=1 split-K, 4 groups a step"
WORD_GEMV_SPEC = "GEMV M=1 on 32-bit words, split-K"


def tuning_groups(hip: bool) -> list[tuple[str, list[triton.Config]]]:
    """registry.tuning_specs builds each MMA config on the prefill spec, each grouped GEMV
    tile on the GEMV spec and each word-GEMV tile on its spec: every config an autotuner may
    pick at group 32."""
    return [("prefill 128x128x32", gpu_configs(hip)), (GEMV_SPEC, grouped_gemv_configs(hip)),
            (WORD_GEMV_SPEC, int4_gemv.gpu_configs(hip))]


def aot_specs(name: str, warp: int) -> list[dict]:
    """fp16, group 32, symmetric, K = N = 4096 (a Llama-7B projection) as the JIT sees them:
    prefill on 128x128 MMA tiles (first: registry.tuning_specs builds every config on it),
    decode of 16 rows on MMA with the vendor's first decode config, one token (GEMV on FMA,
    split over K) with the first grouped tile and with the first one-group tile, the
    split-K reduction, and int4_gemv's word GEMV (what one token runs on aligned rows)."""
    sig = {"x_ptr": "*fp16", "w_ptr": "*u8", "s_ptr": "*fp16", "z_ptr": "*u8", "b_ptr": "*fp16",
           "out_ptr": "*fp16", "M": "i32", "N": "i32", "K": "i32", "k_per_split": "i32", "stride_xm": "i32",
           "stride_wn": "i32", "stride_sn": "i32", "stride_zn": "i32", "stride_om": "i32"}
    base = {"GROUP": 32, "SUB": 32, "HAS_ZEROS": False, "HAS_BIAS": False, "DOT_F32": False}
    divisible = ("N", "K", "k_per_split", "stride_xm", "stride_wn", "stride_om")
    hip = warp == 64
    first_prefill = prefill_gpu_configs(hip)[1]  # the BLOCK_K = 32 128x128 tile: fits group 32
    prefill = dict(fn=int4_gemm_kernel, signature=sig, divisible=divisible, num_warps=first_prefill.num_warps,
                   num_stages=first_prefill.num_stages,
                   constexprs={**base, "SPLIT": False, **first_prefill.kwargs}, label="prefill 128x128x32")
    dec = prune_configs(decode_gpu_configs(hip), {"GROUP": 32, "BLOCK_M": 16}, warp=warp)[0]  # group 32, one group a step
    decode16 = dict(fn=int4_gemm_kernel, signature=sig, divisible=divisible, num_warps=dec.num_warps,
                    num_stages=dec.num_stages, constexprs={**base, "SPLIT": False, "BLOCK_M": 16, **dec.kwargs},
                    label="decode M=16")
    grouped = gemv_gpu_configs(hip)[0]  # the GEMV's first tile: whole groups a step
    gemv = dict(fn=int4_gemm_kernel, signature={**sig, "out_ptr": "*fp32"}, divisible=divisible,
                num_warps=grouped.num_warps, num_stages=grouped.num_stages,
                constexprs={**base, "SPLIT": True, "BLOCK_M": 1, **grouped.kwargs},
                label=GEMV_SPEC)
    in_group = dict(gemv, num_warps=dec.num_warps, num_stages=dec.num_stages,
                    constexprs={**base, "SPLIT": True, "BLOCK_M": 1, **dec.kwargs}, label="decode M=1 split-K")
    reduce = dict(fn=splitk_reduce.splitk_reduce_kernel,
                  signature={"part_ptr": "*fp32", "b_ptr": "*fp16", "out_ptr": "*fp16", "MN": "i32", "N": "i32",
                             "splits": "i32"},
                  divisible=("MN", "N"), num_warps=splitk_reduce.WARPS * 32 // warp, num_stages=1,
                  constexprs={"HAS_BIAS": False, "BLOCK": splitk_reduce.BLOCK}, label="split-K reduce")
    first_words = int4_gemv.gpu_configs(hip)[0]
    words = dict(fn=int4_gemv.int4_gemv_kernel,
                 signature={k: v for k, v in sig.items() if k not in ("M", "stride_xm", "stride_om")} | {
                     "out_ptr": "*fp32"},
                 divisible=("N", "K", "k_per_split", "stride_wn"), num_warps=first_words.num_warps, num_stages=1,
                 constexprs={"GROUP": 32, "HAS_ZEROS": False, "HAS_BIAS": False, "SPLIT": True, "EVEN_K": True,
                             **first_words.kwargs}, label=WORD_GEMV_SPEC)
    return [prefill, decode16, gemv, in_group, reduce, words]
