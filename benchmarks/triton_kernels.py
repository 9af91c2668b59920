"""Time each graphopt Triton kernel against its torch reference on the GPU here.

    python benchmarks/triton_kernels.py [--dtype fp16|bf16|fp32] [--only NAME ...]

Reports milliseconds for both, the speedup, and the kernel's achieved bandwidth as a
fraction of this device's measured copy bandwidth (a large device-to-device copy): a
memory-bound kernel near 1.0 has nothing left to gain. Prefill attention is compute
bound, so it also gets TFLOP/s. Then one end-to-end decode step of ``llama-small``
(one new token over a 128-token KV cache) compiled with ``target="triton"`` (with
Inductor, and with ``inductor=False``) against eager PyTorch, checked to match eager.
Needs a CUDA or ROCm GPU; without one it prints one line and exits 0.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class Case:
    name: str
    shape: str
    triton_fn: Callable[[], object]
    torch_fn: Callable[[], object]
    bytes_moved: int   # compulsory traffic: every input read once, every output written once
    flops: int = 0


def _nbytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def cases(dtype: torch.dtype) -> list[Case]:
    import graphopt.ops  # noqa: F401  (registers the reference ops)
    from graphopt.backends.triton.kernels import activations, flash_attention, flash_decoding, kv_cache
    from graphopt.backends.triton.kernels import layer_norm, rms_norm, rope

    ops = torch.ops.graphopt
    dev = "cuda"
    r = lambda *s: torch.randn(*s, device=dev, dtype=dtype)  # noqa: E731
    tokens, hidden, inter = 4096, 4096, 14336
    x, res, w, b = r(tokens, hidden), r(tokens, hidden), r(hidden), r(hidden)
    scores = r(tokens, 1024)
    gate_up, act_in, bias = r(tokens, 2 * inter), r(tokens, inter), r(inter)
    q, cos, sin = r(1, 32, tokens, 128), r(1, tokens, 128), r(1, tokens, 128)
    qa, ka, va = r(1, 32, tokens, 128), r(1, 8, tokens, 128), r(1, 8, tokens, 128)
    qd, kd, vd = r(8, 32, 1, 128), r(8, 8, tokens, 128), r(8, 8, tokens, 128)
    cache, new, pos = r(8, 8, tokens, 128), r(8, 8, 512, 128), torch.tensor(1024, device=dev)
    row = f"[{tokens}, {hidden}]"
    return [
        Case("rms_norm", row, lambda: rms_norm.rms_norm(x, w, 1e-6), lambda: ops.rms_norm(x, w, 1e-6),
             2 * _nbytes(x) + _nbytes(w)),
        Case("add_rms_norm", row, lambda: rms_norm.add_rms_norm(x, res, w, 1e-6),
             lambda: ops.add_rms_norm(x, res, w, 1e-6), 4 * _nbytes(x) + _nbytes(w)),
        Case("softmax_rms_norm", f"[{tokens}, 1024]", lambda: rms_norm.softmax_rms_norm(scores, None, 1e-6),
             lambda: ops.softmax_rms_norm(scores, None, 1e-6), 2 * _nbytes(scores)),
        Case("layer_norm", row, lambda: layer_norm.layer_norm(x, w, b, 1e-5), lambda: ops.layer_norm(x, w, b, 1e-5),
             2 * _nbytes(x) + _nbytes(w, b)),
        Case("add_layer_norm", row, lambda: layer_norm.add_layer_norm(x, res, w, b, 1e-5),
             lambda: ops.add_layer_norm(x, res, w, b, 1e-5), 4 * _nbytes(x) + _nbytes(w, b)),
        Case("swiglu", f"[{tokens}, 2x{inter}]", lambda: activations.swiglu(gate_up), lambda: ops.swiglu(gate_up),
             _nbytes(gate_up) * 3 // 2),
        Case("geglu", f"[{tokens}, 2x{inter}]", lambda: activations.geglu(gate_up, "tanh"),
             lambda: ops.geglu(gate_up, "tanh"), _nbytes(gate_up) * 3 // 2),
        Case("bias_gelu", f"[{tokens}, {inter}]", lambda: activations.bias_gelu(act_in, bias),
             lambda: ops.bias_gelu(act_in, bias), 2 * _nbytes(act_in) + _nbytes(bias)),
        Case("rope", "q [1, 32, 4096, 128]", lambda: rope.rope(q, cos, sin), lambda: ops.rope(q, cos, sin),
             2 * _nbytes(q) + _nbytes(cos, sin)),
        Case("flash_attention", "causal 32q/8kv x 4096, d128",
             lambda: flash_attention.flash_attention(qa, ka, va, None, None, True),
             lambda: ops.attention(qa, ka, va, None, None, True), 2 * _nbytes(qa) + _nbytes(ka, va),
             flops=2 * 2 * 32 * tokens * tokens * 128 // 2),  # QK^T and PV, half masked
        Case("flash_attention", "causal 32q/8kv x 4096, d128, softcap 50 (Gemma2)",
             lambda: flash_attention.flash_attention(qa, ka, va, None, None, True, 50.0),
             lambda: ops.attention(qa, ka, va, None, None, True, 50.0), 2 * _nbytes(qa) + _nbytes(ka, va),
             flops=2 * 2 * 32 * tokens * tokens * 128 // 2),  # the tanh per score rides on the softmax's exp2
        Case("flash_decoding", "8 x 32q/8kv, cache 4096, d128",
             lambda: flash_decoding.flash_decoding(qd, kd, vd), lambda: ops.attention(qd, kd, vd),
             2 * _nbytes(qd) + _nbytes(kd, vd)),
        Case("kv_cache_update", "512 rows into [8, 8, 4096, 128]", lambda: kv_cache.kv_cache_update(cache, new, pos),
             lambda: ops.kv_cache_update(cache, new, pos), 2 * _nbytes(new)),
    ]


def copy_bandwidth(do_bench) -> float:
    """Bytes/s of a 1 GiB device-to-device copy: the practical ceiling for these kernels."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3)


def decode_step_rows(dtype: torch.dtype, do_bench, past: int = 128, name: str = "llama-small",
                     device: str = "cuda") -> list[list[str]]:
    """Batch 1: one token over a ``past``-token cache, eager vs graphopt's triton target.

    ``name``/``device`` exist for a smoke run on the CPU under TRITON_INTERPRET=1.
    """
    import graphopt
    from graphopt import models

    model = models.build(name).to(device, dtype)
    ids = torch.randint(0, models.config_of(name).vocab_size, (1, past + 1), device=device)
    with torch.no_grad():
        _, cache = model(ids[:, :past])
        token = ids[:, past:]
        want = model(token, past_key_values=cache)[0]
        eager_ms = do_bench(lambda: model(token, past_key_values=cache))
    rows = [["eager", f"{eager_ms:.3f}", "1.00x", "-", "-", "-"]]
    for label, options in (("triton + inductor", {}), ("triton, inductor=False", {"inductor": False})):
        torch._dynamo.reset()
        graphopt.reset()
        compiled = torch.compile(model, backend="graphopt", options={"target": "triton", **options})
        with torch.no_grad():
            got = compiled(token, past_key_values=cache)[0]  # compile and autotune outside the timed region
            ms = do_bench(lambda: compiled(token, past_key_values=cache))
        rel = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        reports = graphopt.reports()
        fell_back = "; ".join(f["reason"] for r in reports for f in r.fallbacks) or "-"
        targets = ",".join(sorted({r.target for r in reports}))
        rows.append([label, f"{ms:.3f}", f"{eager_ms / ms:.2f}x", f"{rel:.1e}", targets, fell_back])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], default="fp16")
    parser.add_argument("--only", nargs="*", help="kernel names to run (default: all)")
    parser.add_argument("--no-decode-step", action="store_true", help="skip the llama-small decode step")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("triton_kernels: no CUDA or ROCm GPU here; nothing to benchmark.")
        return 0
    try:
        from triton.testing import do_bench
    except ImportError:
        print("triton_kernels: triton is not installed; nothing to benchmark.")
        return 0
    from rich.console import Console
    from rich.table import Table

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    peak = copy_bandwidth(do_bench)
    vendor = "ROCm" if torch.version.hip else "CUDA"
    table = Table(title=f"graphopt Triton kernels, {args.dtype}, {torch.cuda.get_device_name()} ({vendor}); "
                        f"copy bandwidth {peak / 1e9:.0f} GB/s")
    for col in ("kernel", "shape", "triton ms", "torch ms", "speedup", "GB/s", "of copy BW", "TFLOP/s"):
        table.add_column(col, justify="left" if col in ("kernel", "shape") else "right")
    for case in cases(dtype):
        if args.only and case.name not in args.only:
            continue
        case.triton_fn()  # compile and autotune outside the timed region
        t_ms, ref_ms = do_bench(case.triton_fn), do_bench(case.torch_fn)
        bw = case.bytes_moved / (t_ms * 1e-3)
        tflops = f"{case.flops / (t_ms * 1e-3) / 1e12:.1f}" if case.flops else "-"
        table.add_row(case.name, case.shape, f"{t_ms:.3f}", f"{ref_ms:.3f}", f"{ref_ms / t_ms:.2f}x",
                      f"{bw / 1e9:.0f}", f"{bw / peak:.2f}", tflops)
    Console().print(table)
    if not args.no_decode_step:
        e2e = Table(title=f"llama-small decode step (batch 1, 128-token cache), {args.dtype}")
        for col in ("", "ms", "speedup", "rel err vs eager", "target", "fallbacks"):
            e2e.add_column(col, justify="right" if col in ("ms", "speedup", "rel err vs eager") else "left")
        for row in decode_step_rows(dtype, do_bench):
            e2e.add_row(*row)
        Console().print(e2e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
