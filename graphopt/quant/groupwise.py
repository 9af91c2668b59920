"""Group-wise INT4 weight quantization: round-to-nearest, and a per-group scale search.

``quantize_int4(w, group_size, symmetric, scale_dtype, search)`` turns an nn.Linear
weight [N, K] into the ``graphopt.int4_linear`` format (graphopt/ops/quant.py).

Round-to-nearest (``search="rtn"``) is the floor: symmetric RTN is ONNX Runtime's
``MatMulNBitsQuantizer`` recipe (scale = the group's largest-magnitude value / -8, so
that value lands exactly on the lone -8 level), asymmetric RTN maps [min, max] onto
0..15. It wastes levels on one outlier per group.

``search="mse"`` picks, for every group on its own, the scale (and zero
point) that minimise the squared reconstruction error ``||w - dequant(quant(w))||^2``:

1. a clipping grid: candidate ranges shrunk by factors in ``CLIP_GRID`` (clipping an
   outlier buys finer steps for every other value of the group), each scored with
   the scale rounded to ``scale_dtype`` exactly as it will be stored;
2. a least-squares refit: with the codes fixed, the error is a quadratic in the scale,
   minimised by ``s = <w, q - z> / <q - z, q - z>``; requantize with it and keep it
   where it lowers the error (a few rounds, as the better INT4 recipes do).

Each group keeps its best candidate, so the search is never worse than RTN in weight
error. But weight error is the wrong objective on a trained model: on SmolLM2-135M it
raised perplexity more than RTN did, since it spends accuracy where activations are small.

``search="gptq"`` (graphopt/quant/gptq.py) minimises the layer's output error on
calibration activations instead (``hessian`` = X^T X).

The default (``DEFAULT_SEARCH``, ``DEFAULT_SYMMETRIC``: asymmetric round-to-nearest) was picked
by perplexity on three texts no method was tuned on (benchmarks/int4_study.py): it never lost
more than ONNX Runtime's symmetric round-to-nearest on the same export (perplexity increase
SmolLM2-135M +3.00/+2.09/+2.17 against +3.27/+2.29/+3.32; Qwen2.5-Coder-0.5B +0.77/+0.57/+0.46
against +1.97/+1.03/+1.09, and against ORT's asymmetric +0.96/+0.71/+0.77), needs no calibration
run, so a checkpoint's weights stream from the file, and takes seconds. GPTQ on the 32 example
token ids (the default before) lost more than ORT on two of SmolLM2's three texts, in 202 s
against 8; calibrated on 2048 tokens of another text it lost more on two (406 s): it stays
opt-in (``--calibration-text``).

``quantize_int8`` is the same format at 8 bits (one code a byte, zero point 128), for
the layers 4 bits cost too much (graphopt.int8_linear).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import Tensor

from graphopt.ops.quant import INT8_ZERO, SYMMETRIC_ZERO, dequantize_int4, dequantize_int8, pack_int4
from graphopt.quant.gptq import gptq
from graphopt.quant.rounding import one_thread, round_scale, round_ties_even

SEARCHES = ("rtn", "mse", "gptq")
DEFAULT_SEARCH, DEFAULT_SYMMETRIC = "rtn", False  # --int4's method: see the module docstring
SCALE_DTYPE_NAMES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# Fractions of the group's full range tried by the search (1.0 = no clipping = RTN). A finer
# or wider grid (21 steps down to 0.6) changed the error by under 0.1%: the refit does the rest.
CLIP_GRID = tuple(1.0 - 0.03 * i for i in range(11))  # 1.00, 0.97, ..., 0.70
REFIT_ROUNDS = 3
# Weights quantized at once: 1 MiB fp32 temporaries stay in cache, and memory stays
# bounded whatever the layer's size.
_CHUNK_ELEMENTS = 1 << 18
# Weights read from a checkpoint at once when one is quantized as it is written
# (``quantize_blocks``): 16 MiB of fp32, so the largest weight is never in memory whole.
BLOCK_ELEMENTS = 1 << 22


@dataclass
class Int4Weight:
    """One weight in the ``graphopt.int4_linear`` format, or ``int8_linear``'s when
    ``bits`` is 8 (see graphopt/ops/quant.py)."""

    packed: Tensor  # uint8 [N, K_pad / 2] (bits 4), [N, K_pad] (bits 8)
    scales: Tensor  # [N, G]
    zeros: Tensor | None  # uint8 [N, ceil(G / 2)], None when symmetric (always at 8 bits)
    group_size: int
    in_features: int  # K
    bits: int = 4

    @property
    def nbytes(self) -> int:
        """Bytes of packed codes + scales + zero points, as stored."""
        total = self.packed.numel() + self.scales.numel() * self.scales.element_size()
        return total + (self.zeros.numel() if self.zeros is not None else 0)

    def dequantize(self) -> Tensor:
        if self.bits == 8:
            return dequantize_int8(self.packed, self.scales, self.group_size, self.in_features)
        return dequantize_int4(self.packed, self.scales, self.zeros, self.group_size, self.in_features)


def scale_dtype_of(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        if name not in SCALE_DTYPE_NAMES.values():
            raise ValueError(f"scale dtype {name} is not one of {', '.join(SCALE_DTYPE_NAMES)}")
        return name
    if name not in SCALE_DTYPE_NAMES:
        raise ValueError(f"scale_dtype {name!r} is not valid; choose one of: {', '.join(SCALE_DTYPE_NAMES)}")
    return SCALE_DTYPE_NAMES[name]


def quantize_int4(weight: Tensor, group_size: int = 32, symmetric: bool = True,
                  scale_dtype: str | torch.dtype = "float16", search: str = "rtn",
                  hessian: Tensor | None = None, tokens: int | None = None, act_order: bool = False) -> Int4Weight:
    """Quantize an [N, K] weight group-wise along K (see the module docstring); ``hessian``
    (X^T X of ``tokens`` calibration activations, [K, K]) is what ``search="gptq"`` needs,
    ``act_order`` its column order (graphopt/quant/gptq.py)."""
    _check(weight, group_size, search, hessian)
    dtype = scale_dtype_of(scale_dtype)
    n, k = weight.shape
    if search == "gptq":
        codes, scales, zeros = gptq(weight, hessian, group_size, 4, dtype, symmetric, tokens, act_order)
        return Int4Weight(pack_int4(codes), scales, pack_int4(zeros) if zeros is not None else None, group_size, k)
    groups = -(-k // group_size)
    rows = max(1, _CHUNK_ELEMENTS // (groups * group_size))
    packed = torch.empty(n, groups * group_size // 2, dtype=torch.uint8)  # group_size is even
    scales = torch.empty(n, groups, dtype=dtype)
    zeros = None if symmetric else torch.empty(n, -(-groups // 2), dtype=torch.uint8)
    with one_thread():  # packed chunk by chunk: the codes of the whole weight, one a byte, never exist
        for r in range(0, n, rows):
            codes, scales[r:r + rows], zero = _quantize_rows(weight[r:r + rows], group_size, groups, symmetric,
                                                             dtype, search)
            packed[r:r + rows] = pack_int4(codes.reshape(codes.shape[0], -1))
            if zeros is not None:
                zeros[r:r + rows] = pack_int4(zero)
    return Int4Weight(packed, scales, zeros, group_size, k)


def quantize_int8(weight: Tensor, group_size: int = 32, scale_dtype: str | torch.dtype = "float32",
                  hessian: Tensor | None = None, tokens: int | None = None, act_order: bool = False) -> Int4Weight:
    """Symmetric 8-bit group-wise quantization (``graphopt.int8_linear``'s format): GPTQ
    when ``hessian`` is given, else round-to-nearest with the group's extreme on -128."""
    _check(weight, group_size, "gptq" if hessian is not None else "rtn", hessian)
    dtype = scale_dtype_of(scale_dtype)
    n, k = weight.shape
    if hessian is not None:
        codes, scales, _ = gptq(weight, hessian, group_size, 8, dtype, tokens=tokens, act_order=act_order)
        return Int4Weight(codes, scales, None, group_size, k, bits=8)
    groups = -(-k // group_size)
    codes = torch.empty(n, groups * group_size, dtype=torch.uint8)
    scales = torch.empty(n, groups, dtype=dtype)
    rows = max(1, _CHUNK_ELEMENTS // (groups * group_size))
    with one_thread():  # chunk by chunk: a 151936 x 896 LM head whole made 0.5 GB fp32 temporaries each
        for r in range(0, n, rows):
            codes[r:r + rows], scales[r:r + rows] = _int8_rows(weight[r:r + rows], group_size, groups, dtype)
    return Int4Weight(codes, scales, None, group_size, k, bits=8)


def quantize_blocks(blocks: Iterable[tuple[int, Tensor]], n: int,
                    quantize: Callable[[Tensor], Int4Weight]) -> Int4Weight:
    """``quantize`` of an [n, K] weight that comes as row blocks (``(first row, rows)``, in
    order, e.g. ``graphopt.lazy_weights.row_blocks`` of a checkpoint's tensor), into outputs
    allocated once. Every search here quantizes each row on its own (its groups lie along K),
    so the result is the whole weight's bit for bit, while only one block's float rows and
    its temporaries are in memory."""
    out: Int4Weight | None = None
    for start, rows in blocks:
        q = quantize(rows)
        if out is None:
            parts = [None if t is None else t.new_empty((n, *t.shape[1:])) for t in (q.packed, q.scales, q.zeros)]
            out = Int4Weight(*parts, q.group_size, q.in_features, q.bits)
        stop = start + rows.shape[0]
        out.packed[start:stop], out.scales[start:stop] = q.packed, q.scales
        if q.zeros is not None:
            out.zeros[start:stop] = q.zeros
    if out is None:
        raise ValueError("quantize_blocks: the weight came as no rows")
    return out


def _check(weight: Tensor, group_size: int, search: str, hessian: Tensor | None) -> None:
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"quantization takes a 2-D floating weight, got {weight.dtype} {tuple(weight.shape)}")
    if search not in SEARCHES:
        raise ValueError(f"search {search!r} is not valid; choose one of: {', '.join(SEARCHES)}")
    if group_size < 2 or group_size % 2:
        raise ValueError(f"group_size must be even and >= 2, got {group_size}")
    if search == "gptq" and hessian is None:
        raise ValueError("search 'gptq' needs the calibration Hessian (hessian=X^T X of the layer's inputs)")


def _quantize_rows(w: Tensor, group_size: int, groups: int, symmetric: bool, dtype: torch.dtype,
                   search: str) -> tuple[Tensor, Tensor, Tensor]:
    """Codes uint8 [R, G, g], scales [R, G] (``dtype``), zero points uint8 [R, G] for rows ``w``."""
    w = w.detach().float()
    pad = groups * group_size - w.shape[1]
    if pad:  # padding with zeros: 0 is always exactly representable, so it adds no error
        w = torch.nn.functional.pad(w, (0, pad))
    w = w.view(w.shape[0], groups, group_size)
    grid = _symmetric_grid(w) if symmetric else _asymmetric_grid(w)
    # Candidates are per-group (scale, zero) pairs; only the winner's codes are ever kept.
    best = None
    for clip in (CLIP_GRID if search == "mse" else CLIP_GRID[:1]):
        for scale, zero in grid(clip, dtype):
            best = _keep_better(best, (scale, zero, _error(w, scale, zero)))
            if search == "rtn":
                break  # RTN: the unclipped, sign-flipped candidate only (ORT's recipe)
    if search == "mse":
        for _ in range(REFIT_ROUNDS):
            scale = _refit_scale(w, best, dtype)
            best = _keep_better(best, (scale, best[1], _error(w, scale, best[1])))
    scale, zero, _ = best
    return _codes(w, scale, zero).to(torch.uint8), scale.to(dtype), zero.to(torch.uint8)


def _int8_rows(w: Tensor, group_size: int, groups: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Codes uint8 [R, G * g] and scales [R, G] (``dtype``) of rows ``w``, the group's signed
    extreme on -128."""
    w = torch.nn.functional.pad(w.detach().float(), (0, groups * group_size - w.shape[1]))
    w = w.view(w.shape[0], groups, group_size)
    extreme = w.gather(-1, w.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)
    scales = round_scale(extreme / -INT8_ZERO, dtype)
    codes = (round_ties_even(w / scales.unsqueeze(-1)) + INT8_ZERO).clamp(0, 255).to(torch.uint8)
    return codes.reshape(w.shape[0], -1), scales.to(dtype)


def _symmetric_grid(w: Tensor):
    """Candidates with zero point 8 from the group's signed largest-magnitude value e:
    ``s = -clip * e / 8`` (e lands on the lone -8 level, a sign flip when e > 0, as ORT's
    MLAS quantizer does) and ``s = clip * e / 7`` (e lands on +7)."""
    extreme = w.gather(-1, w.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)
    zero = torch.full_like(extreme, float(SYMMETRIC_ZERO))

    def candidates(clip: float, dtype: torch.dtype):
        yield round_scale(extreme * clip / -SYMMETRIC_ZERO, dtype), zero
        yield round_scale(extreme * clip / (15 - SYMMETRIC_ZERO), dtype), zero

    return candidates


def _asymmetric_grid(w: Tensor):
    """[min, max] (widened to include 0) shrunk by ``clip``, mapped onto codes 0..15."""
    lo, hi = w.amin(dim=-1).clamp(max=0), w.amax(dim=-1).clamp(min=0)

    def candidates(clip: float, dtype: torch.dtype):
        scale = round_scale((hi - lo) * clip / 15, dtype)
        yield scale, round_ties_even(-lo * clip / scale).clamp(0, 15)

    return candidates


def _codes(w: Tensor, scale: Tensor, zero: Tensor) -> Tensor:
    return round_ties_even(w / scale.unsqueeze(-1) + zero.unsqueeze(-1)).clamp(0, 15)


def _error(w: Tensor, scale: Tensor, zero: Tensor) -> Tensor:
    """Squared reconstruction error per group of quantizing ``w`` with ``scale``/``zero``."""
    centred = _codes(w, scale, zero) - zero.unsqueeze(-1)
    return (centred * scale.unsqueeze(-1) - w).pow(2).sum(-1)


def _keep_better(best, new):
    """Per group, whichever (scale, zero, error) of ``best`` and ``new`` has the smaller error."""
    if best is None:
        return new
    better = new[2] < best[2]
    return tuple(torch.where(better, n, b) for n, b in zip(new, best))


def _refit_scale(w: Tensor, best, dtype: torch.dtype) -> Tensor:
    """Least-squares scale for the current codes: argmin_s ||w - (q - z) s||^2."""
    scale, zero, _ = best
    centred = _codes(w, scale, zero) - zero.unsqueeze(-1)
    denom = centred.pow(2).sum(-1)
    fitted = (w * centred).sum(-1) / denom.clamp(min=1e-30)
    return round_scale(torch.where(denom > 0, fitted, scale), dtype)


def relative_error(weight: Tensor, q: Int4Weight) -> float:
    """``||W - dequant(Q)||_F / ||W||_F`` (0 for an all-zero weight quantized exactly)."""
    w = weight.detach().float()
    err = (q.dequantize() - w).norm().item()
    ref = w.norm().item()
    return err / ref if ref > 0 else (0.0 if err == 0 else float("inf"))
