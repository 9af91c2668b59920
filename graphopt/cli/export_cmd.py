"""``graphopt export MODEL -o model.onnx``: an optimized ONNX model with ORT's fused ops, proven
against eager PyTorch."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path

import typer

from graphopt.cli import calibration
from graphopt.cli.common import MODEL_HELP, parse_options
from graphopt.cli.output import console, print_json, status_console, table
from graphopt.errors import GraphoptError

# Stages the progress bar counts (torch.export, passes and onnx export run once per model).
_STAGES = {False: 6, True: 10}

# torch.onnx's exporter writes opset 18 and newer; asked for an older one it falls back to
# 18 without a word, so older opsets are refused rather than silently not honoured.
MIN_OPSET = 18
DEFAULT_OPSET = 20  # torch.onnx's default (torch 2.13), named here so the help and the file agree


def export(
    model: str = typer.Argument(..., help=MODEL_HELP),
    output: str = typer.Option(..., "--output", "-o", help="the .onnx file to write (with --kv-cache, also NAME.decode.onnx)"),
    int4: bool = typer.Option(False, "--int4", help="quantize linear weights to INT4 (MatMulNBits)"),
    calibration_text: str = typer.Option(None, "--calibration-text", metavar="FILE", help=(
        "with --int4: quantize with GPTQ calibrated on this UTF-8 text instead of round-to-nearest (slower: "
        "SmolLM2-135M 406 s against 8 s on 2 shared cores, 2048 tokens; it loads the weights), tokenized with the model's "
        "tokenizer (a .gguf file or a checkpoint directory with tokenizer.json); any prose in the model's "
        "language will do")),
    calibration_tokens: int = typer.Option(calibration.DEFAULT_TOKENS, "--calibration-tokens", metavar="N", help=(
        "with --calibration-text: calibrate on its first N tokens (more: better scales, slower export)")),
    int4_budget: float = typer.Option(None, "--int4-budget", metavar="F", help=(
        "with --int4: the quantized weights may take up to F times their fp32 bytes; the layers whose 4-bit "
        "error costs most move to 8 bits while it fits (4 bits alone take about 0.16; e.g. 0.2)")),
    embedding_bits: int = typer.Option(None, "--embedding-bits", metavar="B", help=(
        "with --int4: store the embedding table at B bits (4 or 8) as GatherBlockQuantized; a table tied to "
        "the LM head at the head's bits reads the head's codes (stored once). 0 (default) keeps it float")),
    kv_cache: bool = typer.Option(False, "--kv-cache", help="export prefill + decode-step models with KV-cache inputs/outputs"),
    opset: int = typer.Option(DEFAULT_OPSET, "--opset", help=f"ONNX opset of the model: {MIN_OPSET} up to the "
                              "newest the installed onnx package knows"),
    no_validate: bool = typer.Option(False, "--no-validate", help="skip running the file in ONNX Runtime against eager"),
    force: bool = typer.Option(False, "--force", help="overwrite existing files"),
    option: list[str] = typer.Option([], "--option", help="a graphopt option as key=value (repeatable), e.g. pipeline=..."),
    batch: int = typer.Option(2, help="batch size of the example inputs (at least 2: torch.export fixes sizes of 1)"),
    seq_len: int = typer.Option(16, "--seq-len", help="sequence length of the example inputs (at least 2)"),
    seed: int = typer.Option(0, help="seed for weights and inputs"),
    new_tokens: int = typer.Option(8, "--new-tokens", help="with --kv-cache: greedy tokens compared with eager"),
    json_out: bool = typer.Option(False, "--json", help="print the result as JSON"),
) -> None:
    """Export MODEL to ONNX through graphopt's passes, then check the file in ONNX Runtime.

    Prints the error against eager and top-1 agreement, the op histogram (ORT fused ops
    counted), INT4 weight bytes and what INT4 calibrated on, file sizes and the time of each
    stage. --int4 rounds each group of 32 weights to the nearest of 16 levels (asymmetric, as
    fast as the weights stream); --calibration-text calibrates GPTQ on a real text instead
    (slower, opt-in); --int4-budget spends bytes on 8-bit layers;
    --embedding-bits quantizes the embedding table too. Writes into a temporary
    folder and moves the files into place only once ONNX Runtime agrees with eager, so an
    interrupted or failed export leaves no file behind; never overwrites without --force. --kv-cache takes graphopt's Llama and Hugging Face causal LMs
    (no padding: the models take no attention mask).

    Example: graphopt export llama-tiny -o llama.onnx --kv-cache

    Example: graphopt export llama-small -o llama-int4.onnx --int4

    Example: graphopt export path/to/config.json -o model.onnx --kv-cache --json

    Example: graphopt export model.gguf -o q.onnx --int4 --calibration-text notes.txt --int4-budget 0.2
    """
    from graphopt.backends.onnxruntime.target import missing_package

    missing = missing_package()
    if missing:
        raise GraphoptError(f"graphopt export needs the Python package {missing!r}: pip install 'graphopt[onnxruntime]'")
    from graphopt.backends.onnxruntime.decoder import generate
    from graphopt.export.files import check_destination
    from graphopt.export.model import export_model
    from graphopt.pipeline import with_int4

    if batch < 2 or seq_len < 2:
        raise GraphoptError("--batch and --seq-len must be at least 2: torch.export fixes axes of size 1")
    _check_opset(opset)
    config = parse_options(option)
    int4 = int4 or config.int4  # --option int4=true is --int4: the same pass, the same validation
    check_destination(output, force)
    calibrated = _check_int4_flags(int4, kv_cache, calibration_text, calibration_tokens, int4_budget,
                                   embedding_bits)
    ids, calibration_source = (calibration.token_ids(model, calibration_text, calibration_tokens)
                               if calibrated else (None, None))
    config = calibration.with_int4_options(config, ids, int4_budget, embedding_bits)
    if kv_cache:
        check_destination(generate.decode_path(output), force)
        with_int4(config, int4)  # fail on --int4 before loading anything

    with _progress(json_out, _STAGES[kv_cache]) as stage:
        start = time.perf_counter()
        with stage("load"):
            loaded = _load(model, seed, batch, seq_len, kv_cache)
        load_s = time.perf_counter() - start
        common = dict(config=config, opset=opset, int4=int4, validate_model=not no_validate, force=force, stage=stage)
        with _staging(output) as staged:
            if kv_cache:
                result = generate.export_kv_cache(loaded.module, loaded.example_inputs[0], staged,
                                                  new_tokens=new_tokens, **common)
            else:
                result = export_model(loaded.module, loaded.example_inputs, staged, input_names=_input_names(loaded),
                                           output_names=_output_names(loaded), **common)
            data = {"model": loaded.name, **result.to_dict()}
            if int4:
                data["int4_calibration"] = {"source": calibration_source, "budget": int4_budget,
                                            "embedding_bits": embedding_bits or 0,
                                            "pass": calibration.calibration_lines(data)}
            failed = _failures(data, config.tolerance, int4 or _kept_quantized(data))
            _publish(data, Path(output).parent, move=not failed)
    data["stages_s"] = {"load": load_s, **data["stages_s"]}
    data["ok"] = data["written"] = not failed
    if json_out:
        print_json(data)
    else:
        _print_human(data, failed)
    if failed:
        raise typer.Exit(1)


def _check_int4_flags(int4: bool, kv_cache: bool, text: str | None, tokens: int, budget: float | None,
                      embedding_bits: int | None = None) -> bool:
    """Whether to calibrate on a text; one clear error for a flag that cannot apply."""
    given = {"--calibration-text": text, "--int4-budget": budget, "--embedding-bits": embedding_bits}
    flag = next((name for name, value in given.items() if value is not None), None)
    if not int4 and flag:
        raise GraphoptError(f"{flag} tunes INT4 quantization: add --int4")
    if text is not None and kv_cache:
        raise GraphoptError("--calibration-text calibrates a single-graph export: drop --kv-cache (the decode "
                            "graph's cache inputs cannot be filled from token ids), or drop --calibration-text")
    if text is None and tokens != calibration.DEFAULT_TOKENS:
        raise GraphoptError("--calibration-tokens counts tokens of --calibration-text: add --calibration-text FILE")
    return text is not None


def _check_opset(opset: int) -> None:
    import onnx

    newest = onnx.defs.onnx_opset_version()
    if not MIN_OPSET <= opset <= newest:
        raise GraphoptError(f"--opset {opset} is not supported: choose {MIN_OPSET} to {newest} "
                            f"(the exporter writes opset {MIN_OPSET} or newer; onnx {onnx.__version__} knows up to {newest})")


@contextlib.contextmanager
def _staging(output: str):
    """The path to export to: ``output``'s name in a hidden folder beside it, removed at the end
    with whatever was not published (so a failed validation leaves nothing, and an old file
    that --force would replace stays as it was)."""
    final = Path(output)
    folder = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".export", dir=final.parent))
    try:
        yield str(folder / final.name)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _publish(data: dict, folder: Path, move: bool) -> None:
    """Point ``data`` at the final paths in ``folder`` and, when ``move``, move each file there
    from the staging folder (weights before the model that names them)."""
    for f in data["files"]:
        final = [str(folder / Path(path).name) for path in f["files"]]
        if move:
            for path in sorted(f["files"], key=lambda p: p == f["path"]):  # the .onnx file last
                os.replace(path, folder / Path(path).name)
            stale = folder / (Path(f["path"]).name + ".data")
            if str(stale) not in final and stale.exists():
                stale.unlink()  # weights of an earlier, larger export under this name
        f["files"], f["path"] = final, str(folder / Path(f["path"]).name)


def _load(spec: str, seed: int, batch: int, seq_len: int, kv_cache: bool):
    from graphopt.sources import load_model

    # A safetensors checkpoint's weights stay in its files and are read one at a time: as they are
    # written, by the check against eager, and by --int4's calibration (GPTQ, a budget).
    loaded = load_model(spec, seed=seed, batch=batch, seq_len=seq_len, single_output=not kv_cache,
                        stream_weights=True)
    if kv_cache:
        from graphopt.backends.onnxruntime.decoder.generate import cache_steps

        cache_steps(loaded.module, otherwise=f"{spec} is a {loaded.family} model: export it without --kv-cache")
    return loaded


def _input_names(loaded) -> list[str]:
    names = ["input_ids", "attention_mask", "token_type_ids"]
    return names[: len(loaded.example_inputs)]


def _output_names(loaded) -> list[str] | None:
    """What the model's single output is called in Hugging Face terms (else the exporter's name)."""
    return {"llama": ["logits"], "hf-causal-lm": ["logits"], "bert": ["last_hidden_state"],
            "hf-encoder": ["last_hidden_state"]}.get(loaded.family)


@contextlib.contextmanager
def _progress(quiet: bool, total: int):
    """A rich progress bar on stderr, one step per stage; ``stage(name)`` marks one."""
    import sys

    if quiet or not sys.stderr.isatty():
        yield lambda name: contextlib.nullcontext()
        return
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("{task.description:<14}"), BarColumn(), TimeElapsedColumn(),
                  console=status_console, transient=True) as progress:
        task = progress.add_task("export", total=total)

        @contextlib.contextmanager
        def stage(name: str):
            progress.update(task, description=name)
            try:
                yield
            finally:
                progress.advance(task)

        yield stage


def _kept_quantized(data: dict) -> bool:
    """Whether the file runs a checkpoint's own quantized weights (a .gguf's): MatMulNBits then
    quantizes activations to int8, as llama.cpp does, so its error is shown like INT4's."""
    return any(p.get("name") == "keep_checkpoint_quantization" and (p.get("stats") or {}).get("matches")
               for p in data.get("passes", []))


def _failures(data: dict, tolerance: float, int4: bool) -> list[str]:
    """Why the export does not match eager (INT4 and a checkpoint's own quantized weights
    differ by design: their error is shown, not judged)."""
    failed = []
    for f in data["files"]:
        for row in f["validation"]:
            if not int4 and not row["rel_err"] <= tolerance:
                failed.append(f"{f['role']}: relative error {row['rel_err']:.3g} > {tolerance:g} on inputs {row['input_shapes']}")
    for fallback in data["fallbacks"] if int4 else ():
        if fallback["where"] == f"pass:{calibration.PASS_NAME}":  # --int4 asked, nothing quantized
            failed.append(f"INT4 quantization failed, so the file would be fp32: {fallback['reason']}")
    generation = data.get("generation")
    if generation and not generation["tokens_equal"] and not int4:
        failed.append("greedy tokens from ONNX Runtime differ from eager")
    return failed


def _print_calibration(info: dict | None) -> None:
    if not info:
        return
    source = info["source"]
    if not source and info["budget"] is None and set(info["pass"]) <= {"none"}:
        console.print("INT4 by round-to-nearest: nothing calibrated (--calibration-text FILE calibrates GPTQ on "
                      "real text instead, slower)", highlight=False)
        return
    what = (f"the first {source['tokens']} of {source['text_tokens']} tokens of {source['text']}" if source
            else "the example inputs (give --calibration-text FILE to calibrate on real text)")
    budget = f"; byte budget {info['budget']:g} of fp32" if info["budget"] is not None else ""
    console.print(f"INT4 calibrated on {what}{budget}; the pass: {'; '.join(info['pass']) or 'no record'}",
                  highlight=False)


def _print_human(data: dict, failed: list[str]) -> None:
    rows = [[f["role"], f["path"], f"{f['size_bytes'] / 2**20:.1f} MB", ", ".join(f["inputs"][:3]) +
             (" ..." if len(f["inputs"]) > 3 else "")] for f in data["files"]]
    console.print(table(f"graphopt export {data['model']}", ["model", "file", "size", "inputs"], rows))
    checks = [[f["role"], " ".join(str(s) for s in r["input_shapes"][:1]), r["max_abs_err"], r["rel_err"],
               "-" if r.get("top1_agreement") is None else f"{r['top1_agreement']:.1%}"]
              for f in data["files"] for r in f["validation"]]
    if checks:
        console.print(table("ONNX Runtime vs eager", ["model", "input shape", "max abs error", "relative error",
                                                      "top-1 = eager"], checks))
    if _kept_quantized(data) and checks:
        console.print("the file runs the checkpoint's own quantized weights; MatMulNBits quantizes activations to "
                      "int8 per block (as llama.cpp does), so the error above is shown, not judged")
    for f in data["files"]:
        for note in f.get("notes", []):
            console.print(f"note: {note}", highlight=False)
        q = f.get("int4")
        if q:
            label = "quantized weights" if _kept_quantized(data) else "INT4"
            console.print(f"[bold]{f['role']}[/] {label}: {q['matmulnbits']} MatMulNBits, their weights "
                          f"{q['bytes'] / 2**20:.1f} MB vs {q['fp32_bytes'] / 2**20:.1f} MB in fp32 ({q['ratio']:.3f}x); "
                          f"{q['float_matmuls']} MatMul left with float weights")
    _print_calibration(data.get("int4_calibration"))
    generation = data.get("generation")
    if generation:
        if generation["tokens_equal"]:
            verdict = "equal to eager's"
        else:
            ort, ref = generation["ort_tokens"], generation["eager_tokens"]
            first = min((i for row_o, row_e in zip(ort, ref) for i, (a, b) in enumerate(zip(row_o, row_e)) if a != b),
                        default=0) + 1
            verdict = f"differ from eager's from token {first} on" + (" (4-bit weights: expected)"
                                                                       if any(f.get("int4") for f in data["files"]) else "")
        console.print(f"greedy generation, {generation['new_tokens']} new tokens: ORT tokens {verdict}")
    if data.get("attention_mask_kept"):
        console.print(f"attention keeps the model's mask ({data['attention_mask_kept']}): "
                      "MultiHeadAttention, not GroupQueryAttention with past/present")
    for f in data["files"]:
        hist = f["op_histogram"]
        fused = ", ".join(f"{op} x{n}" for op, n in f["fused_ops"].items()) or "none"
        console.print(f"[bold]{f['role']}[/]: {sum(hist.values())} ONNX nodes; fused ORT ops: {fused}")
        console.print("  top ops: " + ", ".join(f"{op} x{n}" for op, n in list(hist.items())[:10]))
    console.print("time: " + ", ".join(f"{name} {s:.1f}s" for name, s in data["stages_s"].items()))
    for fb in data["fallbacks"]:
        console.print(f"[yellow]pass skipped[/] {fb['where']}: {fb['reason']}")
    for reason in failed:
        console.print(f"[red]validation failed[/] {reason}")
    if failed:
        console.print(f"[red]nothing written[/]: {', '.join(f['path'] for f in data['files'])} "
                      "left as before (the export did not match eager)")
