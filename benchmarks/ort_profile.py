"""Where an ONNX Runtime decode step spends its kernel time, per step and per op kind, from a
session's profile (SessionOptions.enable_profiling), for benchmarks/ort_llama.py --profile.

Node events are assigned to the ``model_run`` whose span holds them, so a session that runs
the prompt and the steps (graphopt.generate's in-place decoder) splits into its prefill (the
first run) and its decode steps. MatMulNBits and MatMul are labelled by what they multiply
(K x N from the event's shapes, not node names, which ORT's optimizer rewrites): the QKV
projection (one merged or three), the attention output, the MLP's gate/up (merged or not)
and down, the LM head; an fp32 MatMul whose shapes are no weight's is attention's own.
"""

from __future__ import annotations

import bisect
import collections
import json
from dataclasses import dataclass, field

from rich.console import Console
from rich.table import Table


@dataclass
class Shapes:
    hidden: int
    kv: int  # kv heads x head dim
    intermediate: int
    vocab: int


@dataclass
class StepProfile:
    runs: int = 0
    ms: collections.Counter = field(default_factory=collections.Counter)  # label -> total ms over the runs
    nodes: collections.Counter = field(default_factory=collections.Counter)  # label -> nodes over the runs

    def per_run(self) -> list[tuple[str, float, float]]:
        """(label, ms per run, nodes per run), largest first."""
        n = max(self.runs, 1)
        return [(label, ms / n, self.nodes[label] / n) for label, ms in self.ms.most_common()]

    def total_ms(self) -> float:
        return sum(self.ms.values()) / max(self.runs, 1)


def _dims(entry: dict) -> list[int]:
    return next(iter(entry.values())) if entry else []


def gemm_label(op: str, args: dict, shapes: Shapes) -> str:
    """A MatMulNBits / MatMul / FusedMatMul event's layer kind from its input shapes and
    attributes. A FusedMatMul that multiplies a weight is graphopt's fp32 Linear read
    transposed (transposed_weights.py), the same MLAS GEMM as a MatMul, so it is labelled
    as one; any other FusedMatMul is ORT's scaled attention product."""
    inputs = args.get("input_type_shape", [])
    outputs = args.get("output_type_shape", [])
    a, out = (_dims(inputs[0]) if inputs else []), (_dims(outputs[0]) if outputs else [])
    if len(a) < 2 or not out:
        return op
    k, n = a[-1], out[-1]
    if op == "FusedMatMul":
        op = "MatMul" if (k, n) in _weight_kinds(shapes) else "FusedMatMul"
    kind = _weight_kinds(shapes).get((k, n))
    if kind is None:
        return f"{op} attention" if op == "MatMul" else op if op == "FusedMatMul" else f"{op} {k}x{n}"
    return f"{op} {kind}"


def _weight_kinds(shapes: Shapes) -> dict[tuple[int, int], str]:
    h, kv, i, v = shapes.hidden, shapes.kv, shapes.intermediate, shapes.vocab
    return {(h, h + 2 * kv): "qkv (merged)", (h, kv): "k or v", (h, h): "q or o", (h, v): "head",
            (h, 2 * i): "gate+up (merged)", (h, i): "gate or up", (i, h): "down"}


def summarize(trace_path: str, shapes: Shapes, period: int | None,
              bits: dict[str, int]) -> tuple[StepProfile, StepProfile | None]:
    """(the decode steps' profile, the prompts' when ``period``: the session ran generations of
    ``period`` runs each, a prefill then its steps). ``bits``: MatMulNBits node name -> bits
    (``nbits_attributes``). An If's own event is left out: its time is its branch's nodes',
    which the profile lists too."""
    with open(trace_path) as f:
        events = json.load(f)
    runs = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                  if e.get("cat") == "Session" and e.get("name") == "model_run")
    starts = [r[0] for r in runs]
    steps, prompt = StepProfile(), StepProfile() if period else None
    if period and len(runs) % period:
        raise ValueError(f"{len(runs)} runs are not generations of {period}")
    prompts = len(runs) // period if period else 0
    steps.runs = len(runs) - prompts
    if prompt is not None:
        prompt.runs = prompts
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        op = e["args"].get("op_name", "?")
        if op == "If":
            continue
        run = bisect.bisect_right(starts, e["ts"]) - 1
        label = gemm_label(op, e["args"], shapes) if op in ("MatMulNBits", "MatMul", "FusedMatMul") else op
        if op == "MatMulNBits":
            label += f" {bits.get(e['name'][: -len('_kernel_time')], '?')}-bit"
        target = prompt if period and run % period == 0 else steps
        target.ms[label] += e.get("dur", 0) / 1e3
        target.nodes[label] += 1
    return steps, prompt


def nbits_attributes(path: str) -> tuple[collections.Counter, dict[str, int]]:
    """((bits, block_size, accuracy_level) -> how many MatMulNBits nodes ``path`` has, node name -> bits)."""
    import onnx

    def nodes(graph):
        for node in graph.node:
            yield node
            for attr in node.attribute:
                yield from (nodes(attr.g) if attr.HasField("g") else ())

    counts: collections.Counter = collections.Counter()
    bits = {}
    for node in nodes(onnx.load(path, load_external_data=False).graph):
        if node.op_type == "MatMulNBits":
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            counts[(attrs.get("bits", 4), attrs["block_size"], attrs.get("accuracy_level", 0))] += 1
            bits[node.name] = attrs.get("bits", 4)
    return counts, bits


def print_profiles(variants: list, generate, new_tokens: int, config, folder: str, rounds: int) -> None:
    """Kernel ms per decode step by op kind: the mean over every step of ``rounds`` generations
    of ``new_tokens`` by ``generate(variant)``, the variants taking turns, each ORT variant in
    a fresh profiling session (profiling slows every node a little, so not the timed one)."""
    shapes = Shapes(config.hidden_size, config.num_kv_heads * (config.hidden_size // config.num_heads),
                    config.intermediate_size, config.vocab_size)
    steps = {}
    profiled = {v.name: v.profiled(folder) for v in variants if hasattr(v, "profiled")}
    for _ in range(rounds):
        for p in profiled.values():
            generate(p)
    for name, p in profiled.items():
        counts, bits = nbits_attributes(p.paths[-1])
        period = new_tokens if len(p.paths) == 1 else None  # one session: a prefill, then new_tokens - 1 steps
        steps[name], _ = summarize(p.sessions[-1].end_profiling(), shapes, period, bits)
        for session in p.sessions[:-1]:
            session.end_profiling()
        Console(stderr=True).print(f"{name}: MatMulNBits (bits, block, accuracy_level) -> count: {dict(counts)}")
    table = Table(title="ONNX Runtime kernel time per decode step (profiled sessions): ms (nodes)",
                  title_justify="left")
    table.add_column("op kind")
    for name in steps:
        table.add_column(name, justify="right")
    labels = sorted({label for p in steps.values() for label in p.ms},
                    key=lambda label: -max(p.ms[label] / max(p.runs, 1) for p in steps.values()))
    per_run = {name: {label: (ms, n) for label, ms, n in p.per_run()} for name, p in steps.items()}
    for label in labels:
        table.add_row(label, *[f"{per_run[n][label][0]:.3f} ({per_run[n][label][1]:.0f})" if label in per_run[n]
                               else "" for n in steps])
    table.add_row("total", *[f"{p.total_ms():.3f} ({sum(p.nodes.values()) / max(p.runs, 1):.0f})"
                             for p in steps.values()])
    Console(width=240).print(table)
