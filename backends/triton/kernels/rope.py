"""Rotary position embedding, rotate-half or interleaved, with partial rotary.

One program takes one token (b, s) and a block of heads, so the token's cos/sin row is
loaded once and reused by every head. Each output channel needs its rotation partner
(d +- R/2 for rotate-half, d ^ 1 for interleaved); the kernel loads it as a second,
shifted view of the same row (an L1 hit) instead of shuffling registers, which the
interpreter and both vendors all support. Channels d >= R pass through unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import _common


@triton.jit
def rotate_rows(
    row,           # [BLOCK_H, 1] pointers to channel 0 of each head's row (unit channel stride)
    hmask,         # [BLOCK_H, 1] heads that exist
    cos_row,       # pointer to this token's cos row (unit channel stride); sin_row likewise
    sin_row,
    d,             # [BLOCK_D] channel indices
    head_dim,      # i32 D
    rot_dim,       # i32 R
    INTERLEAVED: tl.constexpr,
):
    """The rows rotated, [BLOCK_H, BLOCK_D] fp32 (graphopt.ops.rope.apply_rope)."""
    rotary = d < rot_dim
    if INTERLEAVED:
        partner = d ^ 1
        sign = tl.where(d % 2 == 0, -1.0, 1.0)  # (x0, x1) -> (x0 c - x1 s, x1 c + x0 s)
    else:
        half = rot_dim // 2
        partner = tl.where(d < half, d + half, d - half)
        sign = tl.where(d < half, -1.0, 1.0)  # rotate_half = cat(-x2, x1)
    # Past R, cos = 1 and sin = 0 make the formula a pass-through with no branch.
    c = tl.load(cos_row + d, mask=rotary, other=1.0).to(tl.float32)
    sn = tl.load(sin_row + d, mask=rotary, other=0.0).to(tl.float32)
    x = tl.load(row + d[None, :], mask=hmask & (d[None, :] < head_dim), other=0.0).to(tl.float32)
    xp = tl.load(row + partner[None, :], mask=hmask & rotary[None, :], other=0.0).to(tl.float32)
    return x * c[None, :] + sign[None, :] * xp * sn[None, :]


@triton.jit
def rope_kernel(
    x_ptr,         # *T [B, H, S, D] input (any strides)
    cos_ptr,       # *C [B or 1, S, R] cos per rotary channel (duplicated halves or repeated pairs)
    sin_ptr,       # *C [B or 1, S, R] sin, same layout as cos
    out_ptr,       # *O [B, H, S, D] output, contiguous
    stride_xb, stride_xh, stride_xs,  # i32 element strides of x (channel stride is 1)
    stride_cb,     # i32 batch stride of cos/sin: 0 when one table serves the whole batch
    stride_cs,     # i32 position stride of cos/sin (channel stride is 1)
    n_heads,       # i32 H
    seq_len,       # i32 S
    head_dim,      # i32 D
    rot_dim,       # i32 R: rotary channels (even, <= D)
    INTERLEAVED: tl.constexpr,  # pairs (2i, 2i+1) rotate; else halves [0, R/2) and [R/2, R)
    BLOCK_H: tl.constexpr,      # heads per program (power of two, masked)
    BLOCK_D: tl.constexpr,      # power of two >= D
):
    token = tl.program_id(0)
    b = (token // seq_len).to(tl.int64)
    s = (token % seq_len).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    cs = b * stride_cb + s * stride_cs
    row = x_ptr + b * stride_xb + s * stride_xs + heads[:, None].to(tl.int64) * stride_xh
    hmask = heads[:, None] < n_heads
    out = rotate_rows(row, hmask, cos_ptr + cs, sin_ptr + cs, d, head_dim, rot_dim, INTERLEAVED)
    # out is contiguous [B, H, S, D]: token = b * S + s, so its (b, h, s) row starts here.
    dst = out_ptr + ((b * n_heads + heads[:, None].to(tl.int64)) * seq_len + s) * head_dim + d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=hmask & (d[None, :] < head_dim))


def gpu_configs(hip: bool) -> list[triton.Config]:
    """A token's heads x head_dim is 1-8K elements: one or a few programs of 128-256 threads.

    num_stages=1 and no MI300 knobs: see _common (no loop to pipeline, no tl.dot, <= 128 VGPRs).
    """
    warp = 64 if hip else 32
    return [triton.Config({"BLOCK_H": bh}, num_warps=threads // warp, num_stages=1)
            for bh in (4, 8, 16) for threads in (128, 256)]


def prune_configs(configs, named_args, warp: int | None = None, **kwargs):
    """Keep tiles of >= 8 elements (one 128-bit fp16 vector) per thread for this BLOCK_D;
    fewer split each thread's channels into narrower loads. Else the one with the most."""
    block_d, warp = {**named_args, **kwargs}["BLOCK_D"], warp or _common.warp_size()

    def per_thread(c):
        return c.kwargs["BLOCK_H"] * block_d // (c.num_warps * warp)

    kept = [c for c in configs if per_thread(c) >= _common.MIN_ELEMENTS_PER_THREAD]
    return kept or [max(configs, key=per_thread)]


rope_tuned = triton.autotune(
    configs=_common.pick_configs(gpu_configs, triton.Config({"BLOCK_H": 4}, num_warps=1, num_stages=1)),
    key=["n_heads", "head_dim", "rot_dim", "INTERLEAVED"], prune_configs_by={"early_config_prune": prune_configs},
)(rope_kernel)


def rope(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False, *, out: Tensor | None = None) -> Tensor:
    """``graphopt.rope`` of ``x`` [B, H, S, D] with ``cos``/``sin`` [B or 1, S, R]."""
    if x.dim() != 4:
        raise ValueError(f"rope expects x [B, H, S, D], got {tuple(x.shape)}")
    bsz, n_heads, seq_len, head_dim = x.shape
    rot_dim = cos.shape[-1]
    if cos.shape != sin.shape or cos.dim() != 3 or cos.shape[1] != seq_len or cos.shape[0] not in (1, bsz):
        raise ValueError(f"cos/sin must be [{bsz} or 1, {seq_len}, R], got {tuple(cos.shape)}, {tuple(sin.shape)}")
    if rot_dim % 2 or rot_dim > head_dim:
        raise ValueError(f"rotary dim {rot_dim} must be even and <= head dim {head_dim}")
    out = _common.output(out, x.shape, torch.promote_types(x.dtype, cos.dtype), x.device)
    if out.numel() == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    stride_cb = 0 if cos.shape[0] == 1 else cos.stride(0)
    grid = lambda meta: (bsz * seq_len, triton.cdiv(n_heads, meta["BLOCK_H"]))  # noqa: E731
    rope_tuned[grid](x, cos, sin, out, x.stride(0), x.stride(1), x.stride(2), stride_cb, cos.stride(1),
                     n_heads, seq_len, head_dim, rot_dim, INTERLEAVED=bool(interleaved),
                     BLOCK_D=_common.next_pow2(head_dim))
    return out


def aot_specs(name: str, warp: int) -> list[dict]:
    """fp16, head_dim 128 with partial rotary (R = 64), rotate-half, 8 heads per program."""
    signature = {"x_ptr": "*fp16", "cos_ptr": "*fp16", "sin_ptr": "*fp16", "out_ptr": "*fp16",
                 "stride_xb": "i32", "stride_xh": "i32", "stride_xs": "i32", "stride_cb": "i32",
                 "stride_cs": "i32", "n_heads": "i32", "seq_len": "i32", "head_dim": "i32", "rot_dim": "i32"}
    constexprs = {"INTERLEAVED": False, "BLOCK_H": 8, "BLOCK_D": 128}
    return [dict(fn=rope_kernel, signature=signature, constexprs=constexprs, num_warps=128 // warp,
                 num_stages=1, divisible=("stride_xb", "stride_xh", "stride_xs", "stride_cb", "stride_cs",
                                          "head_dim", "rot_dim"))]
