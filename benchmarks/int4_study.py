"""Which INT4 method should ``--int4`` use on a checkpoint that is not quantized yet? Perplexity
on three held-out texts, in ONNX Runtime, of graphopt's methods and ONNX Runtime's own, with
each method's quantization wall time.

    python benchmarks/int4_study.py --model CKPT_DIR [--model CKPT_DIR ...] [--json]
    python benchmarks/int4_study.py --model CKPT_DIR --only ort-rtn --only rtn --only gptq

A model is a fp32/fp16/bf16 safetensors checkpoint folder (config.json, tokenizer.json). Every
row is scored on the same token ids of each text through ONNX Runtime (MatMulNBits accuracy
level 4, one thread); ``fp32`` (graphopt's export without --int4) is the reference, and every
ONNX Runtime row is quantized from that very file.

Texts. Calibration (only ``gptq-text`` reads it): the first ``--calibration-tokens`` tokens of
each of four sections of CPython's Language Reference (``pydoc_data/topics.py``: execmodel,
compound, specialnames, types; benchmarks/perplexity.py's calibration). Evaluation, three
texts of other kinds from other files, the first ``--tokens`` tokens of each, which nothing in
graphopt's INT4 work was ever tuned on:
- ``license``: the Apache License 2.0 (``/usr/share/common-licenses/Apache-2.0``), legal prose;
- ``code``: the source of the standard library's ``textwrap.py``, Python code;
- ``manpage``: grep(1) rendered by groff (``man -Tutf8``), runs of spaces collapsed.

Methods (4 bits, groups along K; ``head`` is the LM head: ONNX Runtime's quantizer leaves a
tied head in fp32, since its weight reaches the MatMul through a Transpose):
- ``ort-rtn``: the peer, ``MatMulNBitsQuantizer`` (MLAS round-to-nearest), symmetric, block 32;
- ``ort-rtn-asym``: the same asymmetric (uint8 zero points); ``ort-hqq``: its HQQ algorithm,
  block 32 (float zero points: MatMulNBits' slow path, so a quality row, not a speed one);
- ``rtn-head32``: graphopt round-to-nearest with the head fp32, ORT's recipe exactly;
- ``rtn``, ``rtn-asym``, ``rtn-g128``: graphopt round-to-nearest, head at 8 bits: symmetric,
  asymmetric (``--int4``'s default, picked by this study), symmetric in groups of 128;
- ``mse-asym``: graphopt's per-group scale and zero point search on weight error, head 8 bits;
- ``gptq``: act-order GPTQ, symmetric, calibrated on the export's 32 example token ids, head 8
  bits (``--int4``'s default before this study); ``gptq-text``: the same calibrated on the
  calibration text (``--calibration-text``).

``quant s`` is the quantization alone: the quantize_int4 pass (its calibration run included)
or ORT's ``process()``; ``holds vs X`` says whether a method's perplexity increase is at most
X's on every text, for X each of ONNX Runtime's round-to-nearest rows. A script, not a test; ``--json`` adds one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from perplexity import calibration_ids, export_variant, ort_rtn, perplexity, run, session, weight_bytes
from rich.console import Console
from rich.table import Table

LICENSE = Path("/usr/share/common-licenses/Apache-2.0")
MANPAGE = Path("/usr/share/man/man1/grep.1.gz")
ORT = {"ort-rtn": {}, "ort-rtn-asym": {"symmetric": False}, "ort-hqq": {"algorithm": "hqq"}}
# Every option spelled out, so that a row means the same method whatever Int4Options' defaults are.
RTN, GPTQ = {"search": "rtn", "symmetric": True, "group_size": 32}, {"search": "gptq", "symmetric": True, "act_order": True}
GRAPHOPT = {
    "rtn-head32": {**RTN, "head_bits": 32},
    "rtn": RTN,
    "rtn-asym": {**RTN, "symmetric": False},
    "rtn-g128": {**RTN, "group_size": 128},
    "mse-asym": {**RTN, "search": "mse", "symmetric": False},
    "gptq": GPTQ,
    "gptq-text": {**GPTQ, "calibration": None},  # filled with the calibration text's ids
}
VARIANTS = ("fp32", *ORT, *GRAPHOPT)
PEERS = ("ort-rtn", "ort-rtn-asym")  # ONNX Runtime's round-to-nearest: the bar a default must meet


def eval_texts() -> dict[str, tuple[str, str]]:
    """name -> (text, where it comes from); none of them is the calibration text."""
    import textwrap

    page = subprocess.run(f"zcat {MANPAGE} | groff -man -Tutf8 -P-cbou", shell=True, check=True,
                          capture_output=True, text=True).stdout
    page = "\n".join(re.sub(r"\s+", " ", line).strip() for line in page.splitlines())
    return {"license": (LICENSE.read_text(), str(LICENSE)),
            "code": (Path(textwrap.__file__).read_text(), textwrap.__file__),
            "manpage": (re.sub(r"\n{3,}", "\n\n", page), f"{MANPAGE} via groff")}


def build(variant: str, loaded, folder: Path, calibration: list[int]) -> tuple[Path, float, float]:
    """The variant's .onnx, its quantization seconds and its whole build's seconds."""
    path = folder / f"{variant}.onnx"
    start = time.perf_counter()
    if variant in ORT:
        quant_s = ort_rtn(folder / "fp32.onnx", path, **ORT[variant])
    else:
        options = GRAPHOPT.get(variant)
        if options is not None and "calibration" in options:
            options = {**options, "calibration": calibration}
        quant_s, _ = export_variant(loaded, path, options)
    return path, quant_s, time.perf_counter() - start


def study(spec: str, variants: list[str], tokens: int, calibration_tokens: int, folder: Path) -> dict:
    from graphopt.sources import load_model
    from graphopt.sources.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(spec)
    sequences = {k: (torch.tensor([tokenizer(text)["input_ids"][:tokens]]), where)
                 for k, (text, where) in eval_texts().items()}
    calibration = calibration_ids(tokenizer, calibration_tokens)
    loaded = load_model(spec, batch=2, seq_len=16)
    result = {"model": spec, "tokens": tokens, "calibration_tokens": len(calibration),
              "texts": {k: where for k, (_, where) in sequences.items()}, "rows": {}}
    reference: dict[str, tuple[float, torch.Tensor]] = {}
    for variant in variants:
        path, quant_s, build_s = build(variant, loaded, folder, calibration)
        ort_session = session(path)
        row = {"quant_s": round(quant_s, 2), "build_s": round(build_s, 1), "perplexity": {}, "delta": {}, "top1": {}}
        for key, (ids, _) in sequences.items():
            logits = run(ort_session, ids)
            ppl, top = perplexity(logits, ids), logits[0].argmax(-1)
            reference.setdefault(key, (ppl, top))
            row["perplexity"][key] = round(ppl, 4)
            row["delta"][key] = round(ppl - reference[key][0], 4)
            row["top1"][key] = round((top == reference[key][1]).float().mean().item(), 4)
            del logits
        del ort_session
        q = weight_bytes(path) if variant != "fp32" else None
        row["bytes_ratio"] = round(q["ratio"], 4) if q else 1.0
        result["rows"][variant] = row
        print(f"{Path(spec).name} {variant}: {json.dumps(row)}", file=sys.stderr, flush=True)
        if variant != "fp32":  # the fp32 file stays: every ORT row quantizes it
            for f in folder.glob(f"{variant}.onnx*"):
                f.unlink()
        gc.collect()
    for row in result["rows"].values():  # per ORT round-to-nearest row: no more loss on any text
        row["holds"] = {name: all(row["delta"][k] <= peer["delta"][k] for k in sequences)
                        for name, peer in result["rows"].items() if name in PEERS}
    return result


def print_table(result: dict) -> None:
    keys = list(result["texts"])
    table = Table(title=f"INT4 on {Path(result['model']).name}: perplexity (increase over fp32), first "
                        f"{result['tokens']} tokens; calibration {result['calibration_tokens']} other tokens")
    peers = [p for p in PEERS if p in result["rows"]]
    for column in ("method", *keys, "top-1 vs fp32 (mean)", "MB read / fp32", "quant s", *(f"holds vs {p}" for p in peers)):
        table.add_column(column)
    for variant, row in result["rows"].items():
        cells = [f"{row['perplexity'][k]:.3f}" + (f" ({row['delta'][k]:+.3f})" if variant != "fp32" else "")
                 for k in keys]
        top1 = sum(row["top1"].values()) / len(keys)
        table.add_row(variant, *cells, f"{top1:.3f}", f"{row['bytes_ratio']:.3f}", f"{row['quant_s']:.1f}",
                      *("-" if variant in ("fp32", p) else "yes" if row["holds"][p] else "no" for p in peers))
    Console(width=max(160, Console().width)).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", required=True, help="a safetensors checkpoint folder (repeatable)")
    parser.add_argument("--tokens", type=int, default=512, help="tokens scored of each evaluation text")
    parser.add_argument("--calibration-tokens", type=int, default=512,
                        help="tokens of each of the four calibration sections (gptq-text)")
    parser.add_argument("--only", action="append", choices=VARIANTS, help="run only these methods (fp32 always)")
    parser.add_argument("--keep", default=None, help="folder for the fp32 .onnx of each model (else a temporary one)")
    parser.add_argument("--json", action="store_true", help="also print the results as one JSON line")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    variants = [v for v in VARIANTS if not args.only or v in args.only or v == "fp32"]
    results = []
    for spec in args.model:
        with tempfile.TemporaryDirectory(prefix="graphopt-int4-") as scratch:
            folder = Path(args.keep) / Path(spec).name if args.keep else Path(scratch)
            folder.mkdir(parents=True, exist_ok=True)
            results.append(study(spec, variants, args.tokens, args.calibration_tokens, folder))
        print_table(results[-1])
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
