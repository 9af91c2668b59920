"""Calibrated group-wise quantization: GPTQ-style error feedback, for 4 and 8 bits.

Round-to-nearest minimises each weight's own error, but what a model feels is the error
of the layer's *output* on real activations: ``||(W - Q) X||^2 = tr((W - Q) H (W - Q)^T)``
with ``H = X^T X`` over calibration tokens. GPTQ (Frantar et al., 2022) quantizes the
columns of W one at a time along K and spreads each column's rounding error over the
columns not yet quantized, in proportion to how the activations correlate (the inverse
Hessian's Cholesky factor), so later columns absorb what earlier ones lost.

Here each group of ``group_size`` columns gets its scale (and zero point) from the
weights as they stand when the group is reached (error already fed into them): symmetric
as ONNX Runtime's recipe (``scale = extreme / -(2 ** (bits - 1))``) or asymmetric over
[min, max]. Groups stay contiguous and aligned with K, so the output is the MatMulNBits
format.

``act_order=True`` visits the columns by descending Hessian diagonal (the inputs with the
most energy first, while the most columns are left to absorb their error), as GPTQ's
"act-order" does. The groups stay static: every group's scale comes from the weight
before any feedback, so the format is unchanged (block-contiguous along K) and nothing
has to be reordered at run time.

``output_error(w, q, h)`` is the activation-weighted error ``tr(E H E^T) / tr(W H W^T)``
the pass reports per layer and ranks layers by when it spends a byte budget.
"""

from __future__ import annotations

import torch
from torch import Tensor

from graphopt.quant.rounding import one_thread, round_scale, round_ties_even

# Added to H's diagonal, as a fraction of its mean: keeps H invertible when some input
# channels are (almost) never active in the calibration text. GPTQ's paper default.
DAMPING = 0.01
# Damping per (K / tokens)^2 when the calibration is short (see gptq).
SCARCE = 0.1
# Columns processed before the rest of the matrix is updated at once: the lazy batch update
# that makes the method a few GEMMs. Inside a block, each column's error goes at once only to
# the columns of its SUB_BLOCK, and to the rest of the block by one GEMM per sub-block: the
# per-column update then touches N x 32 values, not N x 128 (a LM head's block is 25 MB).
# Both are rounded to whole groups (_blocking), so a group never straddles either.
BLOCK = 128
SUB_BLOCK = 32


def hessian(x: Tensor) -> Tensor:
    """``X^T X`` in float64 of the activations ``x`` [..., K] (sum over tokens)."""
    x2 = x.detach().reshape(-1, x.shape[-1]).double()
    return x2.T @ x2


def gptq(weight: Tensor, h: Tensor, group_size: int, bits: int, scale_dtype: torch.dtype,
         symmetric: bool = True, tokens: int | None = None, act_order: bool = False,
         damping: float = DAMPING) -> tuple[Tensor, Tensor, Tensor | None]:
    """Codes uint8 ``[N, K_pad]`` (0 .. 2**bits - 1), scales ``[N, G]`` and zero points uint8
    ``[N, G]`` (None when symmetric: 2**(bits-1)) of ``weight`` [N, K], given the
    calibration Hessian ``h`` [K, K] summed over ``tokens`` rows.

    Fewer tokens than K leave H rank-deficient: the feedback then pushes error into
    directions the calibration never saw, and the weight drifts (measured on 4 tokens: 3x
    RTN's weight error). The damping grows as ``SCARCE * (K / tokens)^2``: past H's few
    large eigenvalues (about ``K / tokens`` times its mean diagonal), which moves the
    result toward round-to-nearest."""
    n, k = weight.shape
    if h.shape != (k, k):
        raise ValueError(f"the Hessian is {tuple(h.shape)}, the weight needs ({k}, {k})")
    groups = -(-k // group_size)
    k_pad = groups * group_size
    w = torch.zeros(n, k_pad, dtype=torch.float32)
    w[:, :k] = weight.detach().float()
    hp = torch.eye(k_pad, dtype=torch.float64)
    hp[:k, :k] = h.double()
    # A channel the calibration never excites gets a neutral diagonal: quantized as RTN would,
    # not zeroed (GPTQ's paper zeroes it, but a short calibration text misses channels that
    # real inputs use: ReLU units silent on 4 tokens cost a 4x weight error that way).
    dead = hp.diagonal() == 0
    live = hp.diagonal()[~dead]
    hp[dead, dead] = live.mean() if live.numel() else 1.0
    damping = max(damping, SCARCE * (k / tokens) ** 2) if tokens else damping
    hp += damping * hp.diagonal().mean() * torch.eye(k_pad, dtype=torch.float64)
    groups_of = torch.arange(k_pad) // group_size
    scales = zeros = None
    if act_order:  # static groups: each group's grid from the weight as it is, before feedback
        order = torch.argsort(hp.diagonal(), descending=True, stable=True)
        scales, zeros = _group_grid(w.view(n, groups, group_size).transpose(0, 1).reshape(groups * n, group_size),
                                    bits, symmetric, scale_dtype)
        scales, zeros = scales.view(groups, n).T.contiguous(), zeros.view(groups, n).T.contiguous()
        w, hp, groups_of = w[:, order], hp[order][:, order], groups_of[order]
    # One thread for the factorisations too: on a loaded 2-core machine two threads made the
    # 1536 x 1536 float64 inverse Cholesky 25x slower (31.7 s vs 1.26 s), and it ran per layer.
    with one_thread():  # small per-column steps: threads cost more than they give (rounding.py)
        hinv = _inverse_cholesky(hp).float()
        codes, scales, zeros = _columns(w, hinv, group_size, groups_of, bits, scale_dtype, symmetric, scales, zeros)
    if act_order:
        codes = codes[:, torch.argsort(order)]
    return codes, scales.to(scale_dtype), None if symmetric else zeros.to(torch.uint8)


def _columns(w: Tensor, hinv: Tensor, group_size: int, groups_of: Tensor, bits: int, scale_dtype: torch.dtype,
             symmetric: bool, scales: Tensor | None, zeros: Tensor | None):
    """Codes of ``w``'s columns in their order here (``groups_of[i]``: column i's group).
    With ``scales``/``zeros`` given the grid is fixed; else each group's grid is set when
    its first column is reached (columns then come in K order).

    It works on W transposed, [K, N]: a column of W is then a contiguous row, so each
    column's dozen small ops read N adjacent floats instead of N floats a block's width apart
    (one cache line each)."""
    n, k_pad = w.shape
    groups = k_pad // group_size
    top = 2 ** bits - 1
    codes = torch.zeros(k_pad, n, dtype=torch.uint8)
    static = scales is not None
    if not static:
        scales = torch.zeros(n, groups, dtype=torch.float32)
        zeros = torch.full((n, groups), float(2 ** (bits - 1)))
    scales, zeros = scales.T.contiguous(), zeros.T.contiguous()  # [groups, N]
    wt = w.T.contiguous()
    groups_of = groups_of.tolist()
    block_cols, sub_cols = _blocking(group_size)
    for start in range(0, k_pad, block_cols):
        stop = min(start + block_cols, k_pad)
        block = wt[start:stop].clone()
        errors = torch.zeros_like(block)
        hb = hinv[start:stop, start:stop]
        for sub in range(0, stop - start, sub_cols):
            sub_stop = min(sub + sub_cols, stop - start)
            for i in range(sub, sub_stop):
                col = start + i
                g = groups_of[col]
                if not static and col % group_size == 0:  # the group lies in this sub-block, fully updated
                    scales[g], zeros[g] = _group_grid(block[i:i + group_size].T, bits, symmetric, scale_dtype)
                s, z = scales[g], zeros[g]
                q = (round_ties_even(block[i] / s) + z).clamp(0, top)
                codes[col] = q.to(torch.uint8)
                err = (block[i] - (q - z) * s) / hb[i, i]
                block[i:sub_stop] -= hb[i, i:sub_stop].unsqueeze(1) * err.unsqueeze(0)
                errors[i] = err
            block[sub_stop:] -= hb[sub:sub_stop, sub_stop:].T @ errors[sub:sub_stop]
        wt[stop:] -= hinv[start:stop, stop:].T @ errors
    return codes.T.contiguous(), scales.T.contiguous(), zeros.T.contiguous()


def _blocking(group_size: int) -> tuple[int, int]:
    """(block, sub-block) column counts near BLOCK and SUB_BLOCK: the sub-block a multiple of
    the group (so a group's grid is set from columns that have every earlier error in them),
    the block a multiple of the sub-block. Group 48: (144, 48); group 128: (128, 128)."""
    sub = group_size * max(1, SUB_BLOCK // group_size)
    return sub * max(1, round(BLOCK / sub)), sub


def _group_grid(group: Tensor, bits: int, symmetric: bool, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Scale and zero point of each row of ``group`` [N, g]: symmetric puts the extreme on
    the lone negative level (ORT's recipe), asymmetric maps [min, max] (with 0) onto the codes."""
    if symmetric:
        extreme = group.gather(1, group.abs().argmax(dim=1, keepdim=True)).squeeze(1)
        return round_scale(extreme / -(2 ** (bits - 1)), dtype), torch.full_like(extreme, 2.0 ** (bits - 1))
    lo, hi = group.amin(dim=1).clamp(max=0), group.amax(dim=1).clamp(min=0)
    scale = round_scale((hi - lo) / (2 ** bits - 1), dtype)
    return scale, round_ties_even(-lo / scale).clamp(0, 2 ** bits - 1)


def _inverse_cholesky(h: Tensor) -> Tensor:
    """Upper Cholesky factor ``U`` of ``H^-1`` (``U^T U = H^-1``); more damping where H is
    numerically singular.

    With P the reversal permutation and ``P H P = L L^T``, ``U = P L^-1 P`` is upper
    triangular and ``U^T U = P L^-T L^-1 P = H^-1``: one factorization and one triangular
    inverse, where inverting H and factoring the inverse took two factorizations and an
    inverse (a third faster: 206 against 303 ms at K = 1536, once per layer)."""
    eye = torch.eye(h.shape[0], dtype=h.dtype)
    for extra in (0.0, 0.1, 1.0, 10.0):
        lower, info = torch.linalg.cholesky_ex((h + extra * h.diagonal().mean() * eye).flip(0, 1))
        if info == 0:
            return torch.linalg.solve_triangular(lower, eye, upper=False).flip(0, 1)
    raise ValueError("the calibration Hessian is not positive definite even after damping")


def output_error(weight: Tensor, dequantized: Tensor, h: Tensor) -> float:
    """``tr(E H E^T) / tr(W H W^T)``: the share of the layer's output energy on the
    calibration activations that quantization changes (0 when exact)."""
    # float32 products, float64 sums: a reported ratio (and a ranking of layers) needs a few
    # digits, and float64 GEMMs took 8% of a SmolLM2 INT4 export (half of that now).
    w = weight.detach().float()
    e = dequantized.float()[:, :w.shape[1]] - w
    hf = h.float()
    with one_thread():
        num = ((e @ hf) * e).sum(dtype=torch.float64).item()
        den = ((w @ hf) * w).sum(dtype=torch.float64).item()
    return num / den if den > 0 else (0.0 if num == 0 else float("inf"))
