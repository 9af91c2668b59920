"""Launch-side helpers shared by the kernel modules: vendor, warp counts, configs, buffers.

Nothing here is ``@triton.jit`` code (shared device helpers are in _device); each kernel
file keeps the device helpers only it uses, so a kernel reads whole in one file.
"""

from __future__ import annotations

from typing import Callable

import torch
import triton
from torch import Tensor
from triton import knobs


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1``: the switch ``triton.jit`` itself reads."""
    return bool(knobs.runtime.interpret)


def is_hip() -> bool:
    return torch.version.hip is not None


def warp_size() -> int:
    """Threads per warp on the vendor torch was built for: a wavefront is 64 lanes on AMD."""
    return 64 if is_hip() else 32


def max_warps(warp: int) -> int:
    # Both vendors cap a block (workgroup) at 1024 threads.
    return 1024 // warp


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def row_warps(block: int, warp: int) -> int:
    """Warps for a program that holds one ``block``-long row in registers.

    Aim at about 8 elements per thread: enough for 128-bit vector loads of fp16,
    few enough that a 16K-element fp32 row stays in registers.
    """
    threads = max(warp, block // 8)
    return max(1, min(max_warps(warp), threads // warp))


def pick_configs(gpu_configs: Callable[[bool], list[triton.Config]],
                 interpreter_config: triton.Config) -> list[triton.Config]:
    """Autotune configs for this process: the vendor's list, or one config when interpreting.

    Under the interpreter warps mean nothing and every extra config is a full extra
    run; with one config the autotuner skips benchmarking altogether.
    """
    return [interpreter_config] if interpreting() else gpu_configs(is_hip())


# Vendor knobs of the kernels without tl.dot (norms, activations, rope), the same on both vendors:
# - num_stages=1: one row (or block) per program and no loop over K, so there is nothing for
#   the software pipeliner to overlap; more stages would only reserve shared memory / LDS.
# - num_warps: at least 8 elements (one 128-bit fp16 vector) per thread; more threads than that
#   split the row into 64-bit or narrower loads (`graphopt kernels --tuning` showed 64-bit loads
#   for the 2x-too-many-warps configs). A 64-wide wavefront takes half the warps of a 32-wide one.
# - MI300 waves_per_eu left to the compiler: every config stays at or under 128 VGPRs on gfx942
#   (>= 4 of the 8 waves per SIMD resident; test_aot checks it), and a cap would spend registers'
#   worth of unrolled loads to buy occupancy a one-row-per-program grid already has.
#   matrix_instr_nonkdim and kpack only shape tl.dot (MFMA), which these kernels do not use.
MIN_ELEMENTS_PER_THREAD = 8
ROW_MAX_VGPRS = 128


def row_gpu_configs(hip: bool) -> list[triton.Config]:
    """num_warps candidates for one-row-per-program kernels (BLOCK is set by the launcher);
    prune_row_configs keeps those that suit the row."""
    warp = 64 if hip else 32
    return [triton.Config({}, num_warps=w, num_stages=1) for w in (1, 2, 4, 8, 16, 32) if w <= max_warps(warp)]


ROW_INTERPRETER_CONFIG = triton.Config({}, num_warps=1, num_stages=1)


def prune_row_configs(configs, named_args, warp: int | None = None, **kwargs):
    """Keep :func:`row_warps` for this BLOCK and half of it (16 elements per thread); twice
    as many would cut each thread's share of the row below one 128-bit vector.

    The autotuner passes the launch's arguments; ``warp`` is for sizing another
    vendor's configs ahead of time (registry.tuning_specs).
    """
    block = {**named_args, **kwargs}["BLOCK"]
    best = row_warps(block, warp or warp_size())
    kept = [c for c in configs if best // 2 <= c.num_warps <= best]
    return kept or configs[:1]


def rows_view(t: Tensor, n_cols: int) -> Tensor:
    """``t`` as [rows, n_cols] with unit column stride, copying only when it has to."""
    t = t if t.stride(-1) == 1 or t.numel() == 0 else t.contiguous()
    return t.reshape(-1, n_cols)


def output(out: Tensor | None, shape, dtype: torch.dtype, device, name: str = "out") -> Tensor:
    """A fresh contiguous output, or the caller's ``out`` after checking it fits."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    shape = torch.Size(shape)
    if out.shape != shape or out.dtype != dtype or out.device != torch.device(device):
        raise ValueError(f"{name} must be {tuple(shape)} {dtype} on {device}, "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device}")
    if not out.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return out


def check_row_fits(n_cols: int, element_size: int, what: str) -> int:
    """BLOCK for a row kept whole in registers; refuse rows over 64 KiB.

    A larger row would spill; the op's reference implementation covers it instead.
    """
    block = next_pow2(n_cols)
    if block * element_size > 65536:
        raise ValueError(f"{what}: a row of {n_cols} elements does not fit one block (64 KiB)")
    return block


def mask_args(mask: Tensor | None, shape, dummy: Tensor) -> tuple[Tensor, int, tuple[int, int, int, int]]:
    """An attention mask as (pointer tensor, kind, 4 strides) for shape [B, Hq, Sq, Skv].

    kind is 0 (no mask), 1 (boolean, True = attend) or 2 (additive). Broadcast dims
    get stride 0 through ``expand``, so no mask is ever materialised at full size; a
    boolean mask is reinterpreted as uint8 in place (same bytes) because pointers
    to int1 are not portable across backends.
    """
    if mask is None:
        return dummy, 0, (0, 0, 0, 0)
    m = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)) if mask.dim() < 4 else mask
    m = m.expand(*shape)
    if m.dtype == torch.bool:
        return m.view(torch.uint8), 1, tuple(m.stride())
    if not m.is_floating_point():
        raise ValueError(f"attention mask must be bool or floating point, got {m.dtype}")
    return m, 2, tuple(m.stride())
