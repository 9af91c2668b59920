"""Fused mixture of experts: ``graphopt.moe`` as two grouped GEMMs over tokens sorted by expert.

1. Routing (``graphopt.ops.moe.route``: softmax, top-k, renormalisation) runs in torch.
2. Alignment, on the device and without a host sync (so a CUDA graph can capture it): the
   T * k (token, slot) pairs are sorted by expert and each expert's run is padded to a
   multiple of BLOCK_M, so every BLOCK_M-row block of the sorted order belongs to one
   expert. ``pairs[p]`` is the pair at padded position p (T * k marks padding), and
   ``block_expert[b]`` the expert of block b. The padded length is bounded by
   T * k + E * (BLOCK_M - 1), which sizes the grid; blocks past the real end return at once.
3. ``moe_gemm_kernel`` with GATED: each program multiplies BLOCK_M gathered token rows of x
   by one expert's gate and up rows (two accumulators over the same x tile) and writes
   ``silu(gate) * up``: the [T * k, 2I] gate/up output never reaches memory.
4. ``moe_gemm_kernel`` without GATED: those rows times the expert's down projection, scaled
   by the pair's routing weight, written in fp32 to the pair's own row (token * k + slot);
   the k rows of a token are then summed in torch, so no atomics and a deterministic sum.

A shared expert (Qwen2-MoE) is a plain dense MLP over every token: torch's GEMMs run it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from graphopt.ops.moe import route

from . import _common
from ._device import dot


@triton.jit
def moe_gemm_kernel(
    a_ptr,             # *T GATED: x [T, K] tokens; else h [P, K] rows in padded sorted order
    w_ptr,             # *T [E, rows, K] expert weights, nn.Linear layout; GATED: gate rows [0, N), up rows [N, 2N)
    out_ptr,           # *T GATED: h [P, N] at padded sorted rows; else *fp32 [T * TOPK, N] at pair rows
    pairs_ptr,         # *i32 [P] (token * TOPK + slot) at each padded sorted position; num_pairs marks padding
    block_expert_ptr,  # *i32 [P / BLOCK_M] the expert every row of a block belongs to
    total_ptr,         # *i32 [1] padded rows in use; blocks at or past it have no work
    weights_ptr,       # *fp32 [T * TOPK] routing weight of each pair; read only when not GATED
    num_pairs,         # i32 T * TOPK
    N,                 # i32 output columns: inter size when GATED, hidden size otherwise
    K,                 # i32 reduction length: hidden size when GATED, inter size otherwise
    stride_am,         # i32 elements between rows of a
    stride_we,         # i32 elements between experts of w
    stride_wn,         # i32 elements between rows of w
    stride_om,         # i32 elements between rows of out
    TOPK: tl.constexpr,      # experts per token: a pair's token is pair // TOPK
    GATED: tl.constexpr,     # True: the gate/up GEMM with SwiGLU; False: the down GEMM with the routing weight
    BLOCK_M: tl.constexpr,   # sorted rows per program; each expert's run is padded to a multiple of it
    BLOCK_N: tl.constexpr,   # output columns per program
    BLOCK_K: tl.constexpr,   # reduction step
    DOT_F32: tl.constexpr,   # upcast dot operands (only the interpreter with bf16 needs it)
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return  # past the last expert's padded run: the grid is sized for the worst case
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + offs_m)
    m_ok = pairs < num_pairs
    a_rows = (pairs // TOPK) if GATED else offs_m  # x is read per token; h per sorted row
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_base = a_ptr + a_rows.to(tl.int64)[:, None] * stride_am
    w_base = w_ptr + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn  # [1, BLOCK_N] row starts
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        a = tl.load(a_base + (k0 + offs_k)[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + (k0 + offs_k)[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [K, N]
        acc += dot(a, w, DOT_F32)
        if GATED:
            up = tl.load(w_base + N * stride_wn + (k0 + offs_k)[:, None], mask=k_ok[:, None] & n_ok[None, :],
                         other=0.0)
            acc_up += dot(a, up, DOT_F32)
    out_mask = m_ok[:, None] & n_ok[None, :]
    if GATED:
        # Round where the reference rounds (each GEMM output and silu's result in x's
        # dtype): in fp16/bf16 the experts' weighted sum can cancel, and a difference of one
        # rounding there becomes many ulps of the result.
        dt = out_ptr.dtype.element_ty
        gate = acc.to(dt).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
        h = silu * acc_up.to(dt).to(tl.float32)
        tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
                 h.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        weight = tl.load(weights_ptr + pairs, mask=m_ok, other=0.0)
        y = acc.to(a_ptr.dtype.element_ty).to(tl.float32)  # the expert's output in x's dtype, as the reference
        tl.store(out_ptr + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
                 y * weight[:, None], mask=out_mask)


def gpu_configs(hip: bool) -> list[triton.Config]:
    """Tiles for the expert GEMMs: 64-row blocks (decode batches pad less) and 128-row ones."""
    # 4 warps (NVIDIA) or wavefronts (AMD) per 64x64 tile; the same count on both vendors.
    return [triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32}, num_warps=4, num_stages=2),
            triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 32}, num_warps=8, num_stages=2)]


# The block size fixes the alignment (each expert's run is padded to BLOCK_M), so BLOCK_M is
# chosen by the launcher, not the autotuner: the configs above share it.
BLOCK_M_GPU, BLOCK_M_INTERPRETER = 64, 16
_INTERPRETER_CONFIG = triton.Config({"BLOCK_M": BLOCK_M_INTERPRETER, "BLOCK_N": 16, "BLOCK_K": 16}, num_warps=1,
                                    num_stages=1)
moe_gemm = triton.autotune(configs=_common.pick_configs(gpu_configs, _INTERPRETER_CONFIG),
                           key=["N", "K", "TOPK", "GATED"])(moe_gemm_kernel)


def align(experts: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(pairs [P] i32, block_expert [P / block_m] i32, total [1] i32)`` for ``experts``
    [T, k]: the (token, slot) pairs sorted by expert, each expert's run padded to a
    multiple of ``block_m``. Only device ops with sizes known on the host: no sync."""
    flat = experts.reshape(-1)
    n = flat.numel()
    device = flat.device
    capacity = triton.cdiv(n + num_experts * (block_m - 1), block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)  # pair ids, grouped by expert
    sorted_experts = flat[order]
    rank = torch.arange(n, device=device) - (torch.cumsum(counts, 0) - counts)[sorted_experts]
    position = (padded_end - padded)[sorted_experts] + rank
    pairs = torch.full((capacity,), n, dtype=torch.int32, device=device)
    pairs[position] = order.to(torch.int32)
    block_start = torch.arange(0, capacity, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True).clamp_(max=num_experts - 1)
    return pairs, block_expert.to(torch.int32), padded_end[-1:].to(torch.int32)


def _buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Scratch the kernels write before anything reads it (tests poison it through here)."""
    return torch.empty(shape, dtype=dtype, device=device)


def moe(x: Tensor, router_weight: Tensor, gate_up: Tensor, down: Tensor, k: int, normalize: bool,
        shared_gate_up: Tensor | None = None, shared_down: Tensor | None = None,
        shared_gate: Tensor | None = None) -> Tensor:
    """``graphopt.moe`` (see graphopt/ops/moe.py) with the routed experts in two Triton kernels."""
    tokens, hidden = x.shape
    num_experts, width, _ = gate_up.shape
    inter = width // 2
    if tuple(down.shape) != (num_experts, hidden, inter):
        raise ValueError(f"moe: down must be [{num_experts}, {hidden}, {inter}], got {tuple(down.shape)}")
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    weights, experts = route(x, router_weight, k, normalize)
    block_m = BLOCK_M_INTERPRETER if _common.interpreting() else BLOCK_M_GPU
    pairs, block_expert, total = align(experts, num_experts, block_m)
    h = _buffer((pairs.numel(), inter), x.dtype, x.device)
    per_pair = _buffer((tokens * k, hidden), torch.float32, x.device)
    flat_weights = weights.reshape(-1).float().contiguous()
    common = dict(TOPK=k, DOT_F32=x.dtype == torch.bfloat16 and _common.interpreting())
    blocks = pairs.numel() // block_m
    moe_gemm[lambda meta: (blocks, triton.cdiv(inter, meta["BLOCK_N"]))](
        x, gate_up, h, pairs, block_expert, total, flat_weights, tokens * k, inter, hidden,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), h.stride(0), GATED=True, **common)
    moe_gemm[lambda meta: (blocks, triton.cdiv(hidden, meta["BLOCK_N"]))](
        h, down, per_pair, pairs, block_expert, total, flat_weights, tokens * k, hidden, inter,
        h.stride(0), down.stride(0), down.stride(1), per_pair.stride(0), GATED=False, **common)
    out = per_pair.view(tokens, k, hidden).sum(dim=1).to(x.dtype)
    if shared_gate_up is not None:
        gate, up = (x @ shared_gate_up.t()).chunk(2, dim=-1)
        shared = (F.silu(gate) * up) @ shared_down.t()
        if shared_gate is not None:
            shared = torch.sigmoid(x @ shared_gate.t()) * shared
        out = out + shared
    return out


def aot_specs(name: str, warp: int) -> list[dict]:
    """fp16 Mixtral-8x7B shapes (hidden 4096, inter 14336, top 2) on the first GPU config:
    the gate/up GEMM with SwiGLU (first: registry.tuning_specs builds every config on it)
    and the down GEMM with the routing weight."""
    config = gpu_configs(warp == 64)[0]
    sig = {"a_ptr": "*fp16", "w_ptr": "*fp16", "out_ptr": "*fp16", "pairs_ptr": "*i32", "block_expert_ptr": "*i32",
           "total_ptr": "*i32", "weights_ptr": "*fp32", "num_pairs": "i32", "N": "i32", "K": "i32",
           "stride_am": "i32", "stride_we": "i32", "stride_wn": "i32", "stride_om": "i32"}
    divisible = ("N", "K", "stride_am", "stride_we", "stride_wn", "stride_om")
    base = dict(num_warps=config.num_warps, num_stages=config.num_stages, divisible=divisible, fn=moe_gemm_kernel)
    constexprs = {"TOPK": 2, "DOT_F32": False, **config.kwargs}
    gated = dict(signature=sig, constexprs={**constexprs, "GATED": True}, label="gate/up + swiglu", **base)
    down = dict(signature={**sig, "out_ptr": "*fp32"}, constexprs={**constexprs, "GATED": False},
                label="down * routing weight", **base)
    return [gated, down]
