"""Time each graphopt Triton kernel against its torch reference on the GPU here.

    python benchmarks/triton_kernels.py [--dtype fp16|bf16|fp32] [--only NAME ...] [--json PATH]

Reports milliseconds for both, the speedup, and the kernel's achieved bandwidth as a
fraction of this device's measured copy bandwidth (a large device-to-device copy): a
memory-bound kernel near 1.0 has nothing left to gain. Prefill attention is compute
bound, so it also gets TFLOP/s. Then one end-to-end decode step of ``llama-small``
(one new token over a 128-token KV cache) compiled with ``target="triton"`` (with
Inductor, and with ``inductor=False``) against eager PyTorch, checked to match eager.
``int4_gemm`` runs the GEMV (one token) and the 16-row decode at 4096 x 4096 (group 32):
its bytes are the packed weight, the scales, x and the output; a ``copy`` row moves the same
bytes with ``Tensor.copy_``, the ceiling at that size. ``softmax_rms_norm`` also
runs at the seed's width (D = 3584) against unfused torch (softmax, then the RMSNorm ops).
``--json`` writes every row for scripts/gpu_check.sh. Needs a CUDA or ROCm GPU; without
one it prints one line and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import torch

from gpu_timing import ReplayRecorder, graph_ms, host_us, kernel_ms_per_step, replay_ms

# Input copies the device timing rotates over: 12 INT4 weights of 4096 x 4096 are 108 MB,
# about twice the H200's L2, so the weight streams from HBM as a model's layers do.
GRAPH_COPIES = 12

@dataclass
class Case:
    name: str
    shape: str
    triton_fn: Callable[[], object]
    torch_fn: Callable[[], object]
    bytes_moved: int   # compulsory traffic: every input read once, every output written once
    flops: int = 0


_START = time.perf_counter()


def log(msg: str) -> None:
    """A progress line with the seconds since start: a run cut short by a timeout shows where it was."""
    print(f"[triton_kernels {time.perf_counter() - _START:6.1f}s] {msg}", file=sys.stderr, flush=True)


def _nbytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def cases(dtype: torch.dtype) -> list[Case]:
    import graphopt.ops  # noqa: F401  (registers the reference ops)
    from graphopt.backends.triton.kernels import activations, flash_attention, flash_decoding, kv_cache
    from graphopt.backends.triton.kernels import int4_gemm, layer_norm, rms_norm, rope, rope_cache
    from graphopt.quant.groupwise import quantize_int4

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
    q4 = quantize_int4(torch.randn(hidden, hidden, device=dev) * 0.05, 32, True, "float16", "rtn")
    w4 = (q4.packed, q4.scales, None, 32)
    # The same codes 8 bytes off a 16-byte boundary: one token then runs int4_gemm's own FMA
    # GEMV instead of int4_gemv's word kernel, so the two are timed side by side.
    shifted = torch.empty(q4.packed.numel() + 16, dtype=torch.uint8, device=dev)[8:8 + q4.packed.numel()]
    w4_fma = (shifted.view(q4.packed.shape).copy_(q4.packed), q4.scales, None, 32)
    x1, x16 = r(1, hidden), r(16, hidden)
    w4_bytes = _nbytes(q4.packed, q4.scales)
    # A plain copy that moves the GEMV's bytes (half read, half written): what the copy engine's
    # path reaches at this size, in the same graph harness. 9 MB is a few µs, where a kernel's
    # ramp-up and drain weigh against the 1 GiB copy that sets the peak.
    copy_src = torch.empty(w4_bytes // 2, dtype=torch.uint8, device=dev)
    copy_dst = torch.empty_like(copy_src)
    wide = r(tokens, 3584)  # the seed's Softmax+RMSNorm width

    # One decode step's attention inputs for 8 sequences (Llama-3-8B heads) and their caches.
    qs, ks, vs, cs, ss = r(8, 32, 1, 128), r(8, 8, 1, 128), r(8, 8, 1, 128), r(1, 1, 128), r(1, 1, 128)
    k_cache, v_cache = r(8, 8, tokens, 128), r(8, 8, tokens, 128)

    def separate_rope_and_writes():  # what the step launched before fuse_rope_kv_cache_update
        kv_cache.kv_cache_update(k_cache, rope.rope(ks, cs, ss), pos)
        kv_cache.kv_cache_update(v_cache, vs, pos)
        return rope.rope(qs, cs, ss)

    def unfused_softmax_rms_norm():  # what eager runs without the fusion: softmax, then RMSNorm's ops
        p = torch.softmax(wide.float(), -1).to(dtype).float()
        return (p * torch.rsqrt(p.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)

    return [
        Case("int4_gemm", f"GEMV 1 x {hidden} x {hidden}, group 32", lambda: int4_gemm.int4_linear(x1, *w4),
             lambda: ops.int4_linear(x1, *w4), w4_bytes + _nbytes(x1) * 2),
        Case("int4_gemm", f"GEMV 1 x {hidden} x {hidden}, group 32, int4_gemm's FMA tiles (unaligned rows)",
             lambda: int4_gemm.int4_linear(x1, *w4_fma), lambda: ops.int4_linear(x1, *w4),
             w4_bytes + _nbytes(x1) * 2),
        Case("int4_gemm", f"GEMV 1 x {hidden} x {hidden}, group 32, one split",
             lambda: int4_gemm.int4_linear(x1, *w4, split_k=1), lambda: ops.int4_linear(x1, *w4),
             w4_bytes + _nbytes(x1) * 2),
        Case("int4_gemm", f"decode 16 x {hidden} x {hidden}, group 32", lambda: int4_gemm.int4_linear(x16, *w4),
             lambda: ops.int4_linear(x16, *w4), w4_bytes + _nbytes(x16) * 2),
        Case("copy", f"{w4_bytes / 2**20:.1f} MiB moved: the INT4 GEMV's bytes as a plain copy",
             lambda: copy_dst.copy_(copy_src), lambda: copy_dst.copy_(copy_src), 2 * _nbytes(copy_src)),
        Case("softmax_rms_norm", f"[{tokens}, 3584] vs unfused torch",
             lambda: rms_norm.softmax_rms_norm(wide, None, 1e-6), unfused_softmax_rms_norm, 2 * _nbytes(wide)),
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
        Case("rope_kv_cache_update", "decode 8 x 32q/8kv, d128, vs the 4 kernels it replaces",
             lambda: rope_cache.rope_kv_cache_update(qs, ks, vs, cs, ss, k_cache, v_cache, pos),
             separate_rope_and_writes, 2 * _nbytes(qs, ks, vs) + _nbytes(cs, ss)),
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
        log(f"decode step, {label}")
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


def generate_rows(dtype: torch.dtype, record: Callable[[dict], None] = lambda row: None, prompt: int = 128,
                  new_tokens: int = 64, name: str = "llama-small", device: str = "cuda",
                  labels: tuple[str, ...] = ("captured", "not captured")) -> list[dict]:
    """llama-small through graphopt.generate on the triton target, with and without CUDA graph
    capture, against the eager loop: token agreement, prefill ms, median decode ms/token, and
    the peak memory of each decode step (its largest value and its spread over the steps:
    a replayed graph should allocate nothing new per step). The last row divides the captured
    step's time by the sum of its kernels' device time (profiled without capture)."""
    import statistics

    import graphopt
    from graphopt import models
    from graphopt.generation import generate_with_reference

    model = models.build(name).to(device, dtype).eval()
    ids = torch.randint(0, models.config_of(name).vocab_size, (1, prompt), device=device)
    rows = []
    step_replay_ms = float("nan")
    runs = (("captured", {}), ("not captured", {"disable_passes": ["cuda_graphs"]}))
    for label, extra in [(label, extra) for label, extra in runs if label in labels]:
        torch._dynamo.reset()
        graphopt.reset()
        peaks: list[int] = []

        def on_token(token, live):
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()

        log(f"generate, {label}")
        options = {"target": "triton", **extra}
        with ReplayRecorder() as graphs:
            generate_with_reference(model, ids, new_tokens, options=options)  # compile, capture, warm both up
            out, ref = generate_with_reference(model, ids, new_tokens, options=options)
            torch.cuda.reset_peak_memory_stats()
            graphopt.generate(model, ids, new_tokens, options=options, on_token=on_token)
        if label == "captured" and graphs.replays:  # the decode step's graph alone, no generate loop around it
            step_replay_ms = replay_ms(graphs.replays[-1], replays=50)
        steady = peaks[len(peaks) // 4:]  # the first steps compile and warm up
        n = min(out.new_tokens.shape[1], ref.new_tokens.shape[1])  # a row may stop early at its EOS
        same = (out.new_tokens[:, :n] == ref.new_tokens[:, :n]).float().mean().item()
        split = first_divergence(model, ids, out.new_tokens[:, :n], ref.new_tokens[:, :n])
        rows.append(dict(section=f"{name} triton", name=f"decode, {label}", tokens_equal=f"{same:.2f}", **split,
                         prefill_ms=out.prefill_ms, eager_prefill_ms=ref.prefill_ms,
                         ms_per_token=statistics.median(out.ms_per_token),
                         eager_ms_per_token=statistics.median(ref.ms_per_token),
                         peak_mib=max(steady) / 2**20, peak_spread_mib=(max(steady) - min(steady)) / 2**20,
                         cuda_graphs=out.cuda_graphs or "-", graphs_captured=len(graphs.replays)))
        record(rows[-1])
    log("profiling the uncaptured decode step's kernels")
    kernels_ms = kernel_ms_per_step(model, ids, new_tokens)
    rows.append(dict(section=f"{name} triton", name="captured step / sum of its kernels",
                     ratio=step_replay_ms / kernels_ms, step_replay_ms=step_replay_ms, kernels_ms_per_step=kernels_ms,
                     loop_ms_per_token=rows[0]["ms_per_token"]))
    record(rows[-1])
    return rows


def first_divergence(model, ids: torch.Tensor, got: torch.Tensor, want: torch.Tensor) -> dict:
    """Where two greedy continuations of row 0 first differ, and how close eager's own choice
    was there: ``ref_margin`` = (top-1 - top-2 logit) / |top-1| of eager's logits at that step.
    Random weights give near-flat logits, so a margin of ~1e-3 says the split is fp16 rounding
    picking the other of two near-equal tokens; a large one says a kernel computed wrong."""
    differ = (got[0] != want[0]).nonzero()
    if differ.numel() == 0:
        return {"first_divergence": "none"}
    step = int(differ[0])
    with torch.no_grad():
        logits = model(torch.cat([ids[:1], want[:1, :step]], dim=1))[0][0, -1].float()
    top = logits.topk(2).values
    return {"first_divergence": step, "ref_margin": ((top[0] - top[1]) / top[0].abs()).item()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], default="fp16")
    parser.add_argument("--only", nargs="*", help="kernel names to run (default: all)")
    parser.add_argument("--no-decode-step", action="store_true", help="skip the llama-small decode step")
    parser.add_argument("--generate", action="store_true",
                        help="also decode llama-small through graphopt.generate, with and without CUDA graphs")
    parser.add_argument("--ratio-model", action="append", default=[],
                        help="also the captured step / sum of its kernels on this model (llama-medium: "
                             "TinyLlama-1.1B's shape), where kernels are larger against the gaps between them; "
                             "runs after --generate, before the decode-step table")
    parser.add_argument("--json", help="also write every row to this file (scripts/gpu_check.sh reads it)")
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
    device = f"{torch.cuda.get_device_name()} ({vendor})"
    table = Table(title=f"graphopt Triton kernels, {args.dtype}, {device}; copy bandwidth {peak / 1e9:.0f} GB/s; "
                        f"device ms from a CUDA graph over {GRAPH_COPIES} input copies, launched ms from do_bench")
    for col in ("kernel", "shape", "device ms", "launched ms", "host µs", "torch ms", "speedup", "GB/s",
                "of copy BW", "TFLOP/s"):
        table.add_column(col, justify="left" if col in ("kernel", "shape") else "right")
    records = []

    def record(row: dict) -> None:  # written as it comes, so a run cut short by a timeout keeps its rows
        records.append(row)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(records, fh, indent=1, default=str)

    def failed(what: str, exc: Exception) -> None:
        traceback.print_exc()
        record(dict(section="failed", name=what, error=f"{type(exc).__name__}: {exc}"[:300]))

    record(dict(section="device", name=device, copy_gb_s=peak / 1e9))
    copies = [cases(dtype) for _ in range(GRAPH_COPIES)]  # independent inputs, together larger than the L2
    for i, case in enumerate(copies[0]):
        if args.only and case.name not in args.only:
            continue
        try:
            case.triton_fn()  # compile and autotune outside the timed region
            t_ms, ref_ms = do_bench(case.triton_fn), do_bench(case.torch_fn)
            launch_us = host_us(case.triton_fn)
        except Exception as exc:  # one kernel that fails must not hide the others' numbers
            failed(f"{case.name} {case.shape}", exc)
            continue
        try:
            dev_ms = graph_ms([c[i].triton_fn for c in copies])
        except Exception as exc:  # a launcher that cannot be captured: its launched time stands in
            failed(f"{case.name} {case.shape}: CUDA graph timing", exc)
            dev_ms = t_ms
        bw = case.bytes_moved / (dev_ms * 1e-3)
        tflops = f"{case.flops / (dev_ms * 1e-3) / 1e12:.1f}" if case.flops else "-"
        table.add_row(case.name, case.shape, f"{dev_ms:.4f}", f"{t_ms:.4f}", f"{launch_us:.0f}", f"{ref_ms:.3f}",
                      f"{ref_ms / t_ms:.2f}x", f"{bw / 1e9:.0f}", f"{bw / peak:.2f}", tflops)
        config = ""
        if case.name == "int4_gemm":  # which tile won: the word GEMV's tiles have not been timed before
            from graphopt.backends.triton.kernels import int4_gemm, int4_gemv
            tuner = (int4_gemm.int4_gemm_gemv if "FMA tiles" in case.shape else
                     int4_gemv.int4_gemv_tuned if case.shape.startswith("GEMV") else int4_gemm.int4_gemm_decode)
            best = getattr(tuner, "best_config", None)
            config = f"{best.kwargs} w{best.num_warps} s{best.num_stages}" if best is not None else ""
        record(dict(section="kernels", name=case.name, shape=case.shape, device_ms=dev_ms, triton_ms=t_ms,
                    host_us=launch_us, torch_ms=ref_ms, of_copy_bw=bw / peak,
                    launched_of_copy_bw=case.bytes_moved / (t_ms * 1e-3) / peak, config=config))
        log(f"{case.name} {case.shape}: device {dev_ms:.4f} ms ({bw / peak:.2f} of copy bandwidth), "
            f"launched {t_ms:.4f} ms, host {launch_us:.0f} us {config}")
    del copies
    torch.cuda.empty_cache()
    Console().print(table)
    # generate first: its captured-step ratio is the goal a timeout must not cut off
    if args.generate:
        try:
            for row in generate_rows(dtype, record):
                Console().print(row)
        except Exception as exc:
            failed("llama-small generate", exc)
    for name in args.ratio_model:  # before the decode-step table: the ratio is a goal, that table is not
        try:
            for row in generate_rows(dtype, record, new_tokens=16, name=name, labels=("captured",)):
                Console().print(row)
        except Exception as exc:
            failed(f"{name} captured step ratio", exc)
    if not args.no_decode_step:  # last: a timeout may cut it without costing the rows above
        e2e = Table(title=f"llama-small decode step (batch 1, 128-token cache), {args.dtype}")
        for col in ("", "ms", "speedup", "rel err vs eager", "target", "fallbacks"):
            e2e.add_column(col, justify="right" if col in ("ms", "speedup", "rel err vs eager") else "left")
        try:
            for row in decode_step_rows(dtype, do_bench):
                e2e.add_row(*row)
                record(dict(section="llama-small decode step", name=row[0], ms=row[1], rel_err=row[3],
                            fallbacks=row[5]))
        except Exception as exc:
            failed("llama-small decode step", exc)
        Console().print(e2e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
