"""Where a Triton kernel's host time goes, layer by layer (issue 18): the H200 measured 66-240
µs of host time per launch against ~12 µs for a ``Tensor.copy_``, so an uncaptured decode
step on the triton target is slower than eager. This script times one decode-sized call at
each layer of graphopt's launch stack, each layer adding one thing to the one above it:

  torch.empty_like        the floor: one torch op that allocates and launches nothing
  torch F.rms_norm        torch's own eager op (its kernels)
  kernel[grid] (fixed)    the raw ``@triton.jit`` launch at one config: Triton's binder,
                          specialization and cache lookup, the driver launch
  autotuned[grid]         + triton.autotune's key and config lookup
  launcher                + graphopt's Python: checks, output allocation, strides
  torch.ops op            + the torch custom op (dispatcher, graphopt_triton's fallback check)

and the same for the INT4 GEMV (launcher and op only: its launcher picks the split count
and runs the split-K reduce, two launches) and the fused rope + KV-cache write. Then a
cProfile of the rms_norm op names the Python functions that take the time.

On a machine without a GPU it runs under ``TRITON_INTERPRET=1`` with every Triton launch
replaced by a no-op, so only graphopt's own layers (launcher, op) are timed: what graphopt
adds, whatever Triton's launch costs. A script, not a test: it asserts nothing.

    python benchmarks/launch_overhead.py [--calls 2000] [--json PATH]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
from typing import Callable

import torch

GPU = torch.cuda.is_available()
if not GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: launchers take CPU tensors

from gpu_timing import host_us  # noqa: E402  (the benchmarks' one host-time timer)
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402


def no_triton_launches() -> None:
    """Without a GPU: every autotuned launch returns at once (the launchers' own work still runs)."""
    from triton.runtime.autotuner import Autotuner

    Autotuner.run = lambda self, *args, **kwargs: None


def ladders(dev: str) -> dict[str, list[tuple[str, Callable[[], object]]]]:
    from graphopt.backends.triton import ops as triton_ops
    from graphopt.backends.triton.kernels import int4_gemm, rms_norm, rope_cache
    from graphopt.quant.groupwise import quantize_int4

    dtype = torch.float16 if GPU else torch.float32
    hidden = 4096
    x = torch.randn(1, hidden, device=dev, dtype=dtype)
    w = torch.randn(hidden, device=dev, dtype=dtype)
    out = torch.empty_like(x)
    rms_op = triton_ops.triton_op("graphopt.rms_norm")
    block = 1 << (hidden - 1).bit_length()

    def raw(kernel):
        args = (x, x, w, out, out, x.stride(0), x.stride(0), out.stride(0), out.stride(0), hidden, 1e-6, 0.0)
        flags = dict(HAS_RESIDUAL=False, HAS_WEIGHT=True, SOFTMAX=False, BLOCK=block)
        if kernel is rms_norm.rms_norm_kernel:
            return lambda: kernel[(1,)](*args, **flags, num_warps=4, num_stages=1)
        return lambda: kernel[(1,)](*args, **flags)

    rms = [("torch.empty_like", lambda: torch.empty_like(x)),
           ("torch F.rms_norm", lambda: torch.nn.functional.rms_norm(x, (hidden,), w, 1e-6))]
    if GPU:  # the raw kernels only launch on a device
        rms += [("kernel[grid] (fixed config)", raw(rms_norm.rms_norm_kernel)),
                ("autotuned[grid]", raw(rms_norm.rms_norm_tuned))]
    rms += [("launcher rms_norm.rms_norm", lambda: rms_norm.rms_norm(x, w, 1e-6)),
            ("torch.ops.graphopt_triton.rms_norm", lambda: rms_op(x, w, 1e-6))]

    q4 = quantize_int4(torch.randn(hidden, hidden, device=dev) * 0.05, 32, True,
                       "float16" if GPU else "float32", "rtn")
    w4 = (q4.packed, q4.scales, q4.zeros, 32, None)
    int4_op = triton_ops.triton_op("graphopt.int4_linear")
    gemv = [("launcher int4_gemm.int4_linear", lambda: int4_gemm.int4_linear(x, *w4)),
            ("torch.ops.graphopt_triton.int4_linear", lambda: int4_op(x, *w4))]

    batch, heads, kv_heads, dim, capacity = 8, 32, 8, 128, 4096
    q = torch.randn(batch, heads, 1, dim, device=dev, dtype=dtype)
    k = torch.randn(batch, kv_heads, 1, dim, device=dev, dtype=dtype)
    cos, sin = (torch.randn(1, 1, dim, device=dev, dtype=dtype) for _ in range(2))
    k_cache = torch.zeros(batch, kv_heads, capacity, dim, device=dev, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    pos = torch.full((1,), 7, device=dev, dtype=torch.long)
    rope_op = triton_ops.triton_op("graphopt.rope_kv_cache_update")
    rope_args = (q, k, k.clone(), cos, sin, k_cache, v_cache, pos, "bhsd", False)
    rope = [("launcher rope_cache", lambda: rope_cache.rope_kv_cache_update(*rope_args)),
            ("torch.ops.graphopt_triton.rope_kv_cache_update", lambda: rope_op(*rope_args))]
    return {"rms_norm [1, 4096]": rms, "int4 GEMV 1 x 4096 x 4096, group 32": gemv,
            "rope + KV-cache write, decode 8 x 32q/8kv, d128": rope}


def profile_top(fn: Callable[[], object], calls: int, top: int = 12) -> str:
    fn()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    if GPU:
        torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls timed per layer")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    if not GPU:
        no_triton_launches()
    dev = "cuda" if GPU else "cpu"
    where = torch.cuda.get_device_name() if GPU else "no GPU: Triton launches replaced by no-ops, graphopt's layers only"
    table = Table(title=f"host µs per call, layer by layer ({where})", title_justify="left")
    for col in ("call", "layer", "host µs", "+ over the layer above"):
        table.add_column(col, justify="right" if "µs" in col else "left")
    rows, ladder_fns = [], ladders(dev)
    for call, ladder in ladder_fns.items():
        previous = None
        for layer, fn in ladder:
            us = host_us(fn, args.calls)
            added = "" if previous is None else f"{us - previous:+.1f}"
            table.add_row(call, layer, f"{us:.1f}", added)
            rows.append({"call": call, "layer": layer, "host_us": us, "gpu": GPU})
            previous = us
        table.add_section()
    console = Console(width=160)
    console.print(table)
    op_layer = ladder_fns["rms_norm [1, 4096]"][-1][1]
    console.print(f"cProfile of {args.calls} rms_norm op calls, by own time:")
    console.print(profile_top(op_layer, args.calls), markup=False, highlight=False)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
