"""INT4 weight-only GEMM / GEMV: ``graphopt.int4_linear`` with the dequantization fused
into the K loop.

Each program owns a BLOCK_M x BLOCK_N tile of the output and walks K in BLOCK_K steps.
A step loads BLOCK_K / 2 packed bytes per output column (the bytes of the MatMulNBits
layout, graphopt/ops/quant.py), splits each byte into its low nibble (even k) and its
high nibble (odd k), dequantizes both halves in registers with the group's scale (and
zero point), and multiplies them against the even and odd columns of x. So the weight
crosses memory once, as 4-bit codes, and no dequantized weight is ever written anywhere.
BLOCK_K divides the group size, so one step reads one scale per column.

Loads are issued ahead of their use by Triton's software pipeliner: with
``num_stages = S`` the loads of the next S - 1 K steps are in flight while the current
step computes (cp.async on NVIDIA, buffered global loads on AMD).

Two shapes, two tunings (``int4_linear`` picks by M):
- decode (M <= 16): few rows and the whole weight to stream. BLOCK_M is M rounded up
  to a power of two, and below 16 rows the tile is multiplied on the FMA units (a
  broadcast product and a reduction over k) instead of 16-row MMA tiles, most of which
  would be padding. K is split over SPLIT programs so that a single token fills the GPU;
  their fp32 partial sums go to a workspace reduced by the launcher.
- prefill (M > 16): 64 / 128-row tiles on the tensor cores (MMA / MFMA).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from graphopt.ops.quant import check_format

from . import _common
from ._device import dot

DECODE_MAX_M = 16


@triton.jit
def _load_step(w_ptr, s_ptr, z_ptr, n64, n_ok, offs_j, k0, k_end, stride_wn, stride_sn, stride_zn,
               GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr):
    """The weight stream of the K step at ``k0``: packed bytes [BLOCK_K / 2, BLOCK_N] (u8),
    and the step's scale and zero point per column (fp32). Masked off past ``k_end``."""
    even_ok = k0 + 2 * offs_j < k_end  # a byte whose low nibble is past the end holds only padding
    packed = tl.load(w_ptr + n64[None, :] * stride_wn + (k0 // 2 + offs_j)[:, None],
                     mask=even_ok[:, None] & n_ok[None, :], other=0)
    group = k0 // GROUP
    live = n_ok & (n64 * 0 + k0 < k_end)  # as a tensor: a scalar mask trips the interpreter
    scale = tl.load(s_ptr + n64 * stride_sn + group, mask=live, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        zbyte = tl.load(z_ptr + n64 * stride_zn + group // 2, mask=live, other=0)
        zero = ((zbyte >> ((group % 2) * 4)) & 0xF).to(tl.float32)
    else:
        zero = tl.full(scale.shape, 8.0, tl.float32)
    return packed, scale, zero


@triton.jit
def _dequantize(packed, scale, zero, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, dtype: tl.constexpr):
    """[BLOCK_K / 2, BLOCK_N] bytes -> the [BLOCK_K, BLOCK_N] weight tile in ``dtype``.

    ``(q - z) * s`` in fp32 is exact and is rounded once to x's dtype: the reference
    op's weight, value for value. Low nibbles are even k, high nibbles odd k: joining
    them on a new last axis and folding it into k restores the order.
    """
    lo = (((packed & 0xF).to(tl.float32) - zero[None, :]) * scale[None, :]).to(dtype)
    hi = (((packed >> 4).to(tl.float32) - zero[None, :]) * scale[None, :]).to(dtype)
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
    K,             # i32 input features (K <= K_pad; the codes past K are padding)
    k_per_split,   # i32 K elements each split program covers, a multiple of GROUP
    stride_xm,     # i32 elements between rows of x
    stride_wn,     # i32 bytes between rows of the packed weight (K_pad / 2)
    stride_sn,     # i32 elements between rows of the scales (G)
    stride_zn,     # i32 bytes between rows of the zero points
    stride_om,     # i32 elements between rows of out (N)
    GROUP: tl.constexpr,      # quantization group size along K (32, 64, 128)
    HAS_ZEROS: tl.constexpr,  # asymmetric: zero points stored; else every zero point is 8
    HAS_BIAS: tl.constexpr,   # add the bias before the cast (only without SPLIT)
    SPLIT: tl.constexpr,      # split-K: write fp32 partials at out_ptr + pid_k * M * N
    BLOCK_M: tl.constexpr,    # rows per program; >= 16 multiplies on MMA, below on FMA
    BLOCK_N: tl.constexpr,    # output columns per program
    BLOCK_K: tl.constexpr,    # k per loop step; divides GROUP, so one scale per step and column
    DOT_F32: tl.constexpr,    # upcast dot operands (only the interpreter with bf16 needs it)
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
        # num_stages - 1 steps of both in flight (cp.async into shared memory on NVIDIA).
        for k0 in range(k_start, k_end, BLOCK_K):
            packed, scale, zero = _load_step(w_ptr, s_ptr, z_ptr, n64, n_ok, offs_j, k0, k_end, stride_wn,
                                             stride_sn, stride_zn, GROUP, HAS_ZEROS)
            w = _dequantize(packed, scale, zero, BLOCK_K, BLOCK_N, dtype)
            x = tl.load(x_rows + (k0 + offs_k)[None, :], mask=m_ok[:, None] & (k0 + offs_k < k_end)[None, :],
                        other=0.0)
            acc += dot(x, w, DOT_F32)
    else:
        # GEMV on the FMA units: nothing feeds a dot, so the pipeliner leaves these loads
        # alone; the loop prefetches by hand, issuing step i + 1's weight loads before
        # step i's multiply (the loads are in flight while it computes).
        packed, scale, zero = _load_step(w_ptr, s_ptr, z_ptr, n64, n_ok, offs_j, k_start, k_end, stride_wn,
                                         stride_sn, stride_zn, GROUP, HAS_ZEROS)
        for k0 in range(k_start, k_end, BLOCK_K):
            next_packed, next_scale, next_zero = _load_step(w_ptr, s_ptr, z_ptr, n64, n_ok, offs_j, k0 + BLOCK_K,
                                                            k_end, stride_wn, stride_sn, stride_zn, GROUP, HAS_ZEROS)
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


def decode_gpu_configs(hip: bool) -> list[triton.Config]:
    """(BLOCK_N, BLOCK_K, warps, stages) for M <= 16; BLOCK_M comes from the launcher.
    Every group size keeps at least two (BLOCK_K = 32 divides them all)."""
    s = 2 if hip else 4  # AMD's stream pipeliner buffers in registers/LDS: two stages fit
    shapes = [(64, 32, 4, s), (128, 32, 4, s), (64, 64, 4, min(s, 3)), (128, 64, 4, 1 if hip else 3),
              (32, 128, 4, min(s, 3))]
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st) for bn, bk, w, st in shapes]


def prefill_gpu_configs(hip: bool) -> list[triton.Config]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) for M > 16, on MMA / MFMA tiles."""
    if hip:  # LDS is 64 KiB: two stages at most for the large tiles
        shapes = [(128, 128, 64, 8, 2), (128, 128, 32, 8, 2), (128, 64, 64, 4, 2), (64, 128, 32, 4, 2),
                  (64, 64, 32, 4, 2)]
    else:
        shapes = [(128, 128, 64, 8, 3), (128, 128, 32, 8, 4), (128, 64, 64, 4, 4), (64, 128, 32, 4, 4),
                  (64, 64, 32, 4, 4)]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
            for bm, bn, bk, w, st in shapes]


def gpu_configs(hip: bool) -> list[triton.Config]:
    """Every config either tuning may pick (registry.tuning_specs builds each of them)."""
    return decode_gpu_configs(hip) + prefill_gpu_configs(hip)


def prune_configs(configs, named_args, warp: int | None = None, **kwargs):
    """Keep the configs whose BLOCK_K divides the group size (one scale per step)."""
    group = {**named_args, **kwargs}["GROUP"]
    kept = [c for c in configs if group % c.kwargs.get("BLOCK_K", group) == 0]
    return kept or configs[:1]


_DECODE_KEY = ["N", "K", "GROUP", "HAS_ZEROS", "SPLIT", "BLOCK_M"]
int4_gemm_decode = triton.autotune(
    configs=_common.pick_configs(decode_gpu_configs, triton.Config({"BLOCK_N": 32, "BLOCK_K": 32},
                                                                   num_warps=1, num_stages=1)),
    key=_DECODE_KEY, prune_configs_by={"early_config_prune": prune_configs})(int4_gemm_kernel)
int4_gemm_prefill = triton.autotune(
    configs=_common.pick_configs(prefill_gpu_configs, triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32},
                                                                    num_warps=1, num_stages=1)),
    key=["N", "K", "GROUP", "HAS_ZEROS"], prune_configs_by={"early_config_prune": prune_configs},
)(int4_gemm_kernel)


def _split_count(m: int, n: int, groups: int, device: torch.device) -> int:
    """K splits for a decode launch: enough programs for two per SM, in whole groups."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    tiles = triton.cdiv(n, 64)  # the decode configs' typical BLOCK_N
    return max(1, min(groups, (2 * sms) // max(1, tiles)))


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
    common = dict(GROUP=group_size, HAS_ZEROS=zeros is not packed, DOT_F32=_common.interpreting()
                  and x.dtype == torch.bfloat16)
    strides = (x2.stride(0), packed.stride(0), scales.stride(0), zeros.stride(0))
    if m > DECODE_MAX_M:
        grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]), 1)  # noqa: E731
        int4_gemm_prefill[grid](x2, packed, scales, zeros, bias_arg, o2, m, n, k, k, *strides, o2.stride(0),
                                HAS_BIAS=bias is not None, SPLIT=False, **common)
        return out
    splits = split_k or _split_count(m, n, groups, x.device)
    per_split = triton.cdiv(groups, splits) * group_size
    splits = triton.cdiv(k, per_split)  # no empty split programs
    block_m = _common.next_pow2(m)
    grid = lambda meta: (1, triton.cdiv(n, meta["BLOCK_N"]), splits)  # noqa: E731
    if splits == 1:
        int4_gemm_decode[grid](x2, packed, scales, zeros, bias_arg, o2, m, n, k, per_split, *strides, o2.stride(0),
                               HAS_BIAS=bias is not None, SPLIT=False, BLOCK_M=block_m, **common)
        return out
    partial = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    int4_gemm_decode[grid](x2, packed, scales, zeros, bias_arg, partial, m, n, k, per_split, *strides, n,
                           HAS_BIAS=False, SPLIT=True, BLOCK_M=block_m, **common)
    total = partial.sum(0)
    if bias is not None:
        total += bias.float()
    o2.copy_(total)
    return out


def aot_specs(name: str, warp: int) -> list[dict]:
    """fp16, group 32, symmetric, K = N = 4096 (a Llama-7B projection) as the JIT sees them:
    prefill on 128x128 MMA tiles (first: registry.tuning_specs builds every config on it),
    decode of 16 rows on MMA, decode of one token (GEMV on FMA) split over K."""
    sig = {"x_ptr": "*fp16", "w_ptr": "*u8", "s_ptr": "*fp16", "z_ptr": "*u8", "b_ptr": "*fp16",
           "out_ptr": "*fp16", "M": "i32", "N": "i32", "K": "i32", "k_per_split": "i32", "stride_xm": "i32",
           "stride_wn": "i32", "stride_sn": "i32", "stride_zn": "i32", "stride_om": "i32"}
    base = {"GROUP": 32, "HAS_ZEROS": False, "HAS_BIAS": False, "DOT_F32": False}
    divisible = ("N", "K", "k_per_split", "stride_xm", "stride_wn", "stride_om")
    hip = warp == 64
    prefill = dict(fn=int4_gemm_kernel, signature=sig, divisible=divisible, num_warps=8, num_stages=2 if hip else 3,
                   constexprs={**base, "SPLIT": False, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32},
                   label="prefill 128x128x32")
    decode16 = dict(fn=int4_gemm_kernel, signature=sig, divisible=divisible, num_warps=4, num_stages=2 if hip else 4,
                    constexprs={**base, "SPLIT": False, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 32},
                    label="decode M=16")
    gemv_sig = {**sig, "out_ptr": "*fp32"}
    gemv = dict(fn=int4_gemm_kernel, signature=gemv_sig, divisible=divisible, num_warps=4,
                num_stages=2 if hip else 4,
                constexprs={**base, "SPLIT": True, "BLOCK_M": 1, "BLOCK_N": 64, "BLOCK_K": 32},
                label="decode M=1 split-K")
    return [prefill, decode16, gemv]
