"""Prefill latency and decode ms/token of a Llama on the CPU: eager, Inductor, ONNX Runtime
three ways in fp32 (plain torch.onnx.export, the same after ORT's transformer optimizer,
graphopt) and two ways in INT4 (ORT's own recipe: the optimizer, then MatMulNBitsQuantizer;
graphopt's export with --int4), and graphopt.generate's own onnxruntime decoder (one model
whose attentions write the KV cache in place; fp32 with --generate-fp32, INT4 by default).

    python benchmarks/ort_llama.py                      # llama-small, 128-token prompt, 64 new tokens
    python benchmarks/ort_llama.py --model llama-tiny --repeat 2 --profile
    python benchmarks/ort_llama.py --skip inductor --skip int4
    python benchmarks/ort_llama.py --skip inductor --int4-search rtn --head-rows   # INT4 prefill, both head lowerings

Every variant runs the same greedy generation: a prefill of the prompt (batch 1), then one
decode step per new token with the KV cache. Measurements are interleaved step by step (every
variant's prefill, then every variant's first decode step, ...) so load from other processes
hits them alike. ``--interleave generation`` takes turns by whole generations instead (one
variant's prefill and all its steps, then the next variant's): each step then finds the caches
as its own previous step left them, as when one model serves alone, where stepping in lockstep
runs every other variant's weights through the caches between two steps. The table shows
medians (of 3 prefills per repeat, and of single decode steps) and their ratios to eager (< 1 is faster), the best prefill (the least disturbed
one), the logits' error against eager and the share of prompt positions whose top-1 token
equals eager's, and whether the generated tokens equal eager's (INT4 is not expected to).
"weight MB/token" is what one decode step reads (embedding tables left out: a step gathers
one row); the floor rows divide it by the read bandwidth measured in the same run, the
fastest any runtime could decode. ORT and torch get the same number of threads. ``--profile`` adds a table of
ORT's kernel ms per decode step by op kind for the ORT variants (SessionOptions.enable_profiling;
ort_profile.py), the weight GEMMs by layer kind (qkv, o, gate/up, down, head) and bits.
A script, not a test: it takes minutes and asserts nothing.
"""

from __future__ import annotations

import os

# OpenMP's wait policy decides how fairly interleaved runtimes are measured. ORT's sessions
# do not spin (session.create_session), except graphopt.generate's decoder's and, with
# --ort-spin, the other ORT variants' (torch then on one thread while each decodes). torch
# keeps OpenMP's default unless the caller sets one: a short spin after each parallel
# region, then sleep. That default is what an eager
# user gets, and it is eager's best here: PASSIVE (sleep at once) made eager llama-small
# decode 33 ms/token instead of 25 (the wake-up after every small op), and ACTIVE (spin on)
# took the cores from the ORT variants (decode 35 instead of 21 ms/token).
if os.environ.get("OMP_WAIT_POLICY"):
    print(f"note: OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']} from the environment", flush=True)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable  # noqa: E402

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from graphopt import models  # noqa: E402
from graphopt.backends.onnxruntime.decoder.generate import decode_path, export_kv_cache  # noqa: E402
from graphopt.backends.onnxruntime.runtime.session import SessionRunner, create_session  # noqa: E402
from graphopt.backends.onnxruntime.lower.translations import int4 as int4_translation  # noqa: E402
from graphopt.config import Options  # noqa: E402
from graphopt.threads import torch_threads  # noqa: E402
from ort_recipes import export_plain, optimize_with_ort, quantize_with_ort  # noqa: E402
from graphopt.generation import Sampler, drive  # noqa: E402
from graphopt.quant.report import logits_metrics  # noqa: E402
from weight_traffic import onnx_decode_bytes, read_bandwidth, torch_decode_bytes  # noqa: E402

console = Console(stderr=True)


class Variant:
    """A step runner for graphopt.generation's loop (prepare/prefill/prepare_step/step) built from
    ``prefill(ids) -> (logits, cache)`` and ``decode(token, cache) -> (logits, cache)``; it
    keeps its cache, and the prefill's logits for the error columns."""

    pads = False
    compiles = prefill_compiles = 0
    compile_s = 0.0
    cuda_graphs = ""
    reports: list = []

    def __init__(self, name: str, prefill: Callable, decode: Callable, setup_s: float, sessions=()) -> None:
        self.name = self.target = name
        self.prefill_fn, self.decode_fn, self.setup_s = prefill, decode, setup_s
        self.sessions = list(sessions)
        self.weight_bytes = 0  # read by one decode step
        self.prefill_ms: list[float] = []
        self.decode_ms: list[float] = []
        self.cache, self.first_logits = None, None

    def prepare(self, ids, mask) -> None:
        pass

    def prefill(self, ids, mask=None):
        self.first_logits, self.cache = self.prefill_fn(ids)
        return self.first_logits[:, -1]

    def prepare_step(self, token, position) -> None:
        pass

    def step(self, token, position):
        logits, self.cache = self.decode_fn(token, self.cache)
        return logits[:, -1]


def torch_variant(name: str, model, setup_s: float = 0.0) -> Variant:
    def prefill(ids):
        out = model(ids)
        return out[0], [t for kv in out[1] for t in kv]

    def decode(token, cache):
        pairs = tuple((cache[i], cache[i + 1]) for i in range(0, len(cache), 2))
        out = model(token, pairs)
        return out[0], [t for kv in out[1] for t in kv]

    variant = Variant(name, prefill, decode, setup_s)
    variant.weight_bytes = torch_decode_bytes(model)
    return variant


def ort_variant(name: str, prefill_path: str, decode_path_: str, threads: int, setup_s: float,
                profile_dir: str | None = None, spin: bool = False) -> Variant:
    """``spin``: its sessions' workers spin between ops and torch computes on one thread while it
    decodes alone, as graphopt.generate's decoder runs (``--ort-spin``)."""
    def session(path, tag):
        prefix = os.path.join(profile_dir, f"{name}-{tag}".replace(" ", "_")) if profile_dir else None
        return create_session(path, "cpu", threads=threads, profile_prefix=prefix, spin=spin)

    prefill_session, decode_session = session(prefill_path, "prefill"), session(decode_path_, "decode")
    prefill_run, decode_run = SessionRunner(prefill_session), SessionRunner(decode_session)

    def prefill(ids):
        out = prefill_run(ids)
        return out[0], out[1:]

    def decode(token, cache):
        out = decode_run(token, *cache)
        return out[0], out[1:]

    variant = Variant(name, prefill, decode, setup_s, [prefill_session, decode_session])
    variant.paths = (prefill_path, decode_path_)
    variant.weight_bytes = onnx_decode_bytes(decode_path_)
    variant.profiled = lambda directory: ort_variant(name, prefill_path, decode_path_, threads, 0.0, directory, spin)
    if spin:
        variant.decoding = lambda: torch_threads(1)
    return variant


def inplace_variant(name: str, model, example, config: Options, threads: int, folder: Path, start: float,
                    unfolded: bool = False, spin: bool = True) -> Variant:
    """graphopt.generate's onnxruntime decoder (generate_variant.py); ``unfolded``: its rotary left
    as RotaryEmbedding nodes before attention (as before rotary_fold.fold_rotary_into_attention);
    ``spin``: as graphopt.generate runs it (off in lockstep)."""
    from generate_variant import in_place

    return in_place(Variant, name, model, example, config, threads, folder, start, unfolded=unfolded, spin=spin)


def generate(variant: Variant, prompt: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy generation with graphopt.generation's loop, untimed: (the prefill's logits, the new tokens)."""
    out = drive([variant], prompt, None, new_tokens, [Sampler()])[0]
    return variant.first_logits, out.new_tokens


def measure_lockstep(variants: list[Variant], prompt: torch.Tensor, new_tokens: int, reverse: bool,
                     prefills: int = 3, lockstep: bool = True) -> None:
    """One greedy generation per variant, in lockstep (graphopt.generation.drive: every
    variant's prefill, then each decode step of every variant before the next step), so that
    load from other processes lands on all of them alike. A prefill is one sample against
    many decode steps, so ``prefills - 1`` more are timed before it. ``lockstep=False``: one
    whole generation per variant in turn instead, its extra prefills just before it, under the
    threads its generation gets (``decoding()``, as drive holds it)."""
    order = variants[::-1] if reverse else variants
    for group in [order] if lockstep else [[v] for v in order]:
        with torch.no_grad():
            for _ in range(prefills - 1):
                for v in group:
                    with v.decoding() if hasattr(v, "decoding") else contextlib.nullcontext():
                        start = time.perf_counter()
                        v.prefill(prompt)
                        v.prefill_ms.append((time.perf_counter() - start) * 1e3)
        for v, result in zip(group, drive(group, prompt, None, new_tokens, [Sampler() for _ in group])):
            v.prefill_ms.append(result.prefill_ms)
            v.decode_ms.extend(result.ms_per_token)


def main() -> None:
    folder = Path(tempfile.mkdtemp(prefix="graphopt-bench-"))
    try:
        run(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # four copies of the weights per ONNX variant


def run(folder: Path) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-small")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens (batch 1)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5, help="interleaved measurements per variant")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--interleave", default="step", choices=["step", "generation"],
                        help="take turns every decode step (lockstep, the default) or every whole generation "
                             "(each variant's steps back to back, as when one model serves alone)")
    parser.add_argument("--ort-spin", action="store_true",
                        help="ORT's own variants (plain, optimizer, recipe, graphopt's pairs) with spinning workers "
                             "and torch on one thread while each decodes, as graphopt.generate's decoder always "
                             "runs; meaningful with --interleave generation (in lockstep torch needs its threads). "
                             "ORT's INT4 recipe then runs both ways, and graphopt's INT4 is compared with its faster one")
    parser.add_argument("--skip", action="append", default=[],
                        help="leave a variant out: inductor, plain, ortopt, graphopt, ortint4, graphoptint4, "
                             "generate (graphopt.generate's in-place decoder), int4 (all INT4 ones); eager always runs")
    parser.add_argument("--group-size", type=int, default=32, help="INT4 block size, the same for both INT4 variants")
    parser.add_argument("--int4-search", default="gptq", choices=["gptq", "rtn"],
                        help="graphopt's INT4 scale search; rtn exports in a fraction of the time and gives the "
                             "same kernels and bytes, so the same speed")
    parser.add_argument("--head-rows", action="store_true",
                        help="add graphopt INT4 with its 8-bit head as MatMulNBits at every row count (the lowering "
                             "before the per-row-count choice), to compare prefill in the same run")
    parser.add_argument("--generate-head-bits", type=int, action="append",
                        help="graphopt.generate's in-place INT4 decoder with this LM head bits (repeatable; "
                             "8 unless given)")
    parser.add_argument("--generate-fp32", action="store_true", help="also graphopt.generate's fp32 decoder")
    parser.add_argument("--generate-unfolded", action="store_true",
                        help="also the INT4 decoder with RotaryEmbedding nodes and unpacked q/k/v (as before "
                             "rotary_fold.fold_rotary_into_attention), 8-bit head")
    parser.add_argument("--profile-rounds", type=int, default=3, help="profiled generations per variant")
    parser.add_argument("--profile", action="store_true",
                        help="print ORT's kernel ms per decode step by op kind for the ORT variants")
    args = parser.parse_args()
    if "int4" in args.skip:
        args.skip += ["ortint4", "graphoptint4", "generate"]
    args.generate_head_bits = args.generate_head_bits or [8]
    # graphopt.generate's decoder spins (backends/onnxruntime/decoder/decoder.py); in lockstep its
    # workers would take the cores from the torch variants stepped between its steps.
    by_generation = args.interleave == "generation"
    if args.ort_spin and not by_generation:
        parser.error("--ort-spin needs --interleave generation: in lockstep the spinning workers take the cores "
                     "from the torch variants")
    torch.set_num_threads(args.threads)

    model = models.build(args.model)
    (prompt,) = models.example_inputs(model, batch=1, seq_len=args.prompt, seed=1)
    (example,) = models.example_inputs(model, batch=2, seq_len=16)  # export: sizes of 1 would be fixed
    variants = [torch_variant("eager", model)]

    def setup(name, build):
        if name in args.skip:
            return
        console.print(f"setting up {name} ...")
        start = time.perf_counter()
        variants.append(build(start))

    setup("inductor", lambda start: _inductor(model, prompt, args.new_tokens, start))
    plain: tuple[str, str] = ("", "")

    def plain_variant(start):
        nonlocal plain
        plain = export_plain(model, example, folder)
        return ort_variant("torch.onnx.export + ORT", *plain, args.threads, time.perf_counter() - start,
                           spin=args.ort_spin)

    setup("plain", plain_variant)
    optimized: tuple[str, str] = ("", "")

    def ortopt_variant(start):
        nonlocal optimized
        optimized = optimize_with_ort(plain, model.config, folder)
        return ort_variant("+ ORT transformer optimizer", *optimized, args.threads,
                           time.perf_counter() - start + variants[-1].setup_s, spin=args.ort_spin)

    if "plain" not in args.skip:
        setup("ortopt", ortopt_variant)

    def graphopt_variant(name, file, int4, head_gemm_rows=int4_translation.HEAD_GEMM_ROWS):
        def build(start):
            path = folder / file
            default_rows, int4_translation.HEAD_GEMM_ROWS = int4_translation.HEAD_GEMM_ROWS, head_gemm_rows
            try:
                export_kv_cache(model, example, path, config=Options(pass_options={"quantize_int4": {
                    "group_size": args.group_size, "search": args.int4_search}}), int4=int4, validate_model=False)
            finally:
                int4_translation.HEAD_GEMM_ROWS = default_rows
            return ort_variant(name, str(path), str(decode_path(path)), args.threads, time.perf_counter() - start,
                               spin=args.ort_spin)
        return build

    setup("graphopt", graphopt_variant("graphopt -> ORT", "graphopt.onnx", int4=False))
    if optimized[0]:
        # With --ort-spin the recipe runs both ways, and graphopt is compared with its faster
        # one: spinning workers helped it by 12% in one session and cost it 43% in the next.
        recipe = f"ORT INT4 recipe (optimizer + MatMulNBitsQuantizer g{args.group_size})"
        recipe_files: list = []

        def recipe_variant(spin: bool, name: str):
            def build(start):
                if not recipe_files:
                    recipe_files.extend(quantize_with_ort(optimized, args.group_size, folder))
                return ort_variant(name, *recipe_files, args.threads, time.perf_counter() - start, spin=spin)
            return build

        if args.ort_spin:
            setup("ortint4", recipe_variant(False, f"{recipe}, workers sleep"))
            setup("ortint4", recipe_variant(True, f"{recipe}, workers spin"))
        else:
            setup("ortint4", recipe_variant(False, recipe))
    setup("graphoptint4", graphopt_variant(f"graphopt -> ORT INT4 (g{args.group_size})", "graphopt_int4.onnx",
                                           int4=True))
    if args.generate_fp32:
        setup("generate", lambda start: inplace_variant("graphopt.generate fp32", model, example, Options(),
                                                        args.threads, folder, start, spin=by_generation))
    int4_decoders = [(bits, False) for bits in args.generate_head_bits] + [(8, True)] * args.generate_unfolded
    for head_bits, unfolded in int4_decoders:
        unfolded_note = ", rotary unfolded" if unfolded else ""
        setup("generate", lambda start: inplace_variant(
            f"graphopt.generate INT4 (g{args.group_size}, head {head_bits}-bit{unfolded_note})",
            model, example, Options(int4=True, pass_options={"quantize_int4": {
                "group_size": args.group_size, "search": args.int4_search, "head_bits": head_bits}}),
            args.threads, folder, start, unfolded, spin=by_generation))
    if args.head_rows:
        setup("graphoptint4", graphopt_variant(f"graphopt -> ORT INT4 (g{args.group_size}), 8-bit head MatMulNBits "
                                               "at every row count", "graphopt_int4_nbits_head.onnx", int4=True,
                                               head_gemm_rows=None))
    console.print("measuring memory bandwidth ...")
    bandwidth = read_bandwidth()

    results = {}
    for v in variants:  # warm up (ORT plans memory, Inductor compiles), and keep the outputs
        results[v.name] = generate(v, prompt, args.new_tokens)
    for r in range(args.repeat):
        console.print(f"measuring {r + 1}/{args.repeat} ...")
        measure_lockstep(variants, prompt, args.new_tokens, reverse=r % 2 == 1, lockstep=args.interleave == "step")
    print_table(args, variants, results, bandwidth)
    if args.profile:
        from ort_profile import print_profiles

        print_profiles(variants, lambda v: generate(v, prompt, args.new_tokens), args.new_tokens, model.config,
                       str(folder), args.profile_rounds)


def _inductor(model, prompt, new_tokens, start) -> Variant:
    compiled = torch.compile(model)
    variant = torch_variant("inductor (torch.compile)", compiled)
    generate(variant, prompt, new_tokens)  # compiles prefill and the (dynamic) decode step
    variant.setup_s = time.perf_counter() - start
    return variant


def print_table(args, variants: list[Variant], results: dict, bandwidth: float) -> None:
    eager = variants[0]
    eager_prefill, eager_decode = statistics.median(eager.prefill_ms), statistics.median(eager.decode_ms)
    ref_logits, ref_tokens = results["eager"]
    table = Table(title=f"{args.model}: prefill of {args.prompt} tokens (batch 1), decode of {args.new_tokens} tokens, "
                        f"{args.threads} threads, median of {args.repeat}, interleaved by {args.interleave}; "
                        f"read bandwidth {bandwidth / 1e9:.1f} GB/s",
                  title_justify="left")
    for col in ("variant", "prefill ms", "x eager", "best prefill ms", "decode ms/token", "x eager",
                "weight MB/token", "logits rel err", "top-1 = eager", "tokens = eager", "setup s"):
        table.add_column(col, justify="left" if col in ("variant", "tokens = eager") else "right")
    for v in variants:
        prefill, decode = statistics.median(v.prefill_ms), statistics.median(v.decode_ms)
        logits, tokens = results[v.name]
        # graphopt.generate's decoder returns the prompt's last position only
        metrics = logits_metrics(logits, ref_logits[:, ref_logits.shape[1] - logits.shape[1]:])
        err, top1 = metrics["rel_error"], metrics["top1_agreement"]
        positions = logits.shape[0] * logits.shape[1]
        top1_cell = f"{top1:.1%}" if positions > 1 else f"{'same' if top1 else 'differs'} (1 position)"
        table.add_row(v.name, f"{prefill:.1f}", f"{prefill / eager_prefill:.2f}", f"{min(v.prefill_ms):.1f}",
                      f"{decode:.2f}", f"{decode / eager_decode:.2f}", f"{v.weight_bytes / 2**20:.1f}", f"{err:.1e}",
                      top1_cell, "yes" if torch.equal(tokens, ref_tokens) else "no", f"{v.setup_s:.0f}")
    floors = {"fp32": eager.weight_bytes}
    int4 = [v for v in variants if "INT4" in v.name]
    if int4:
        floors["INT4"] = min(v.weight_bytes for v in int4)
    for kind, nbytes in floors.items():
        floor_ms = nbytes / bandwidth * 1e3
        table.add_row(f"floor: {kind} weights / bandwidth", "", "", "", f"{floor_ms:.2f}",
                      f"{floor_ms / eager_decode:.2f}", f"{nbytes / 2**20:.1f}", "", "", "", "")
    Console(width=220).print(table)
    recipes = [v for v in variants if v.name.startswith("ORT INT4 recipe")]
    if recipes:
        best = min(recipes, key=lambda v: statistics.median(v.decode_ms))
        best_ms = statistics.median(best.decode_ms)
        for v in variants:
            if v.name.startswith("graphopt") and "INT4" in v.name:
                print(f"{v.name}: decode {statistics.median(v.decode_ms) / best_ms:.2f}x of the recipe at its "
                      f"faster threading ({best_ms:.2f} ms/token: {best.name})")


if __name__ == "__main__":
    main()
