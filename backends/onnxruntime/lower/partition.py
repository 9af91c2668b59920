"""Per-op fallback on ONNX Runtime: decompose what has no translation, split off what cannot export.

One op ORT cannot run must not send the whole graph to eager (DESIGN: fall back as little
as possible). Before any export, :func:`compile_partitioned`

1. replaces each graphopt op without a translation (``translations/``) by the ATen ops of
   its reference (``graphopt/ops/decompose.py``, which TensorRT uses too): the exporter emits
   those as standard ONNX ops and the graph stays whole;
2. marks what the exporter cannot take, each with a reason: an op torch.onnx neither
   translates nor decomposes (another library's custom op: an MoE's expert dispatch), an op
   whose output size depends on its input's values, one that writes its input in place,
   a higher-order op;
3. orders the nodes so each side forms runs as long as the data dependencies allow, and
   cuts the graph into those runs (``torch.fx.passes.split_module``). Each ONNX Runtime run
   is compiled by the target like any graph (``target.compile``: static, or one dynamic
   export for symbolic sizes); the other runs stay FX code, run eagerly;
4. when an export still fails naming an op (a translation that refuses these dtypes), that
   op moves to the eager side and the plan is made again: at most ``MAX_ROUNDS`` times,
   since each round moves at least one more op off the target.

The ``Compiled`` it returns carries ``off_target_ops``: one ``{"op", "count", "reason",
"how"}`` per op that did not run as itself on ONNX Runtime (``how``: ``"decomposed"`` or
``"eager"``), ``partitions`` (``[{"where", "nodes"}]`` in run order) and ``near_misses``
(the cached-attention rewrite's refusals, ``lowering.py``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.backends.onnxruntime.compile import placement
from graphopt.backends.onnxruntime.lower import lowering, translations
from graphopt.backends.onnxruntime.errors import UnsupportedOp
from graphopt.backends.onnxruntime.compile.placement import EAGER, ORT, Plan, refusal, schedule
from graphopt.errors import GraphoptError
from graphopt.ops import op_name
from graphopt.ops.decompose import inline_reference
from graphopt.targets import Compiled

MAX_ROUNDS = 8
_PARTITION = "graphopt_ort_partition"  # gm.meta flag: a graph this module already planned
DECOMPOSED = "no ONNX Runtime translation: exported as the ATen ops of its reference"


def is_partition(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` was planned here already (a partition, or a whole graph ORT takes)."""
    return bool(getattr(gm, "meta", {}).get(_PARTITION))


def compile_partitioned(target, gm: fx.GraphModule, example_inputs: Sequence[Any] | None, config) -> Compiled:
    """``gm`` compiled for ONNX Runtime with as few nodes off it as possible (module docstring).

    Raises the target's error unchanged when the whole graph fails for a reason that names
    no op of it (a missing kernel, an exporter crash), and UnsupportedOp when nothing would
    be left to run on ONNX Runtime: the core then runs the graph eagerly, as before.
    """
    gm = ir.copy_graph_module(gm)
    table = translations.translation_table()
    decomposed: Counter = Counter()  # (op, reason) -> how many nodes became their reference
    eager: dict[fx.Node, str] = {}
    untranslated = [n for n in gm.graph.nodes
                    if n.op == "call_function" and op_name(n.target) and n.target not in table]
    _decompose(gm, {n: DECOMPOSED for n in untranslated}, decomposed, eager)
    eager.update({n: r for n in gm.graph.nodes if n not in eager and (r := refusal(n, table))})
    built: dict[str, Compiled] = {}  # a part's code -> its compiled form, kept across rounds
    last: Exception | None = None
    for _ in range(MAX_ROUNDS):
        plan = schedule(gm, eager)
        if eager and not plan.has(ORT):
            node = next(iter(eager))
            raise last or UnsupportedOp(ir.target_name(node.target), eager[node])
        try:
            compiled = _compile_plan(target, gm, plan, example_inputs, config, built)
        except _Refused as refused:
            # A graphopt op whose translation refused this call becomes its reference; anything else goes eager.
            ours = {n: r for n, r in refused.nodes.items() if op_name(n.target)}
            _decompose(gm, ours, decomposed, eager)
            eager.update({n: r for n, r in refused.nodes.items() if n not in ours})
            last = refused.error
            continue
        compiled.off_target_ops = _off_target(decomposed, eager)
        compiled.partitions = [{"where": where, "nodes": len(nodes)} for where, nodes in plan.runs]
        compiled.notes = _notes(compiled, decomposed, eager)
        return compiled
    raise GraphoptError(f"ONNX export still failed after moving ops off ONNX Runtime {MAX_ROUNDS} times; "
                        f"last: {last}; use target='eager' for this graph")


class _Refused(Exception):
    """An export refused ops of the plan: ``nodes`` (of the planned graph) -> the reason."""

    def __init__(self, nodes: dict[fx.Node, str], error: Exception) -> None:
        super().__init__(str(error))
        self.nodes, self.error = nodes, error


def _decompose(gm: fx.GraphModule, nodes: dict[fx.Node, str], decomposed: Counter, eager: dict[fx.Node, str]) -> None:
    """Inline the reference of each graphopt op node in ``nodes`` (-> why it is not lowered
    as itself), counting it in ``decomposed``; one whose reference does not trace goes to ``eager``."""
    for node, reason in nodes.items():
        name = op_name(node.target)
        try:
            inline_reference(gm, node)
        except Exception as error:  # the op still runs, eagerly, and the report says why
            first = (str(error).strip().splitlines() or [""])[0][:200]
            eager[node] = f"{reason}, and its reference does not trace ({type(error).__name__}: {first})"
            continue
        decomposed[(name, reason)] += 1
    if nodes:
        gm.graph.lint()
        gm.recompile()


def _compile_plan(target, gm: fx.GraphModule, plan: Plan, example_inputs, config,
                  built: dict[str, Compiled]) -> Compiled:
    if len(plan.runs) <= 1:  # everything on ONNX Runtime (or nothing to compute): the graph itself, no split
        gm.meta[_PARTITION] = True
        nodes = plan.runs[0][1] if plan.runs else []
        compiled = _compile_part(target, gm, gm, nodes, example_inputs, config, whole=True)
        compiled.near_misses = lowering.cached_attention_near_misses(gm)
        return compiled
    plan.reorder(gm)
    from torch.fx.passes.split_module import split_module

    part_of = {node: index for index, (_, nodes) in enumerate(plan.runs) for node in nodes}
    split = split_module(gm, gm, lambda node: part_of[node], keep_original_order=True,
                         keep_original_node_name=True)
    by_name = {n.name: n for n in gm.graph.nodes}
    ort_parts = [f"submod_{i}" for i, (where, _) in enumerate(plan.runs) if where == ORT]
    for name in ort_parts:
        _restore_meta(getattr(split, name), by_name)
    inputs = _part_inputs(split, ort_parts, example_inputs)
    near_misses, notes = [], []
    for name in ort_parts:
        sub = getattr(split, name)
        sub.meta[_PARTITION] = True
        nodes = [by_name[n.name] for n in sub.graph.nodes if n.op == "call_function"]
        key = sub.code  # the same nodes with other inputs or outputs (a later round's cut) are another part
        if key not in built:
            built[key] = _compile_part(target, sub, gm, nodes, inputs.get(name), config, whole=False)
        near_misses += lowering.cached_attention_near_misses(sub)
        notes += [n for n in built[key].notes if n not in notes]
        split.add_submodule(name, _Part(built[key].fn))

    def run(*args: Any) -> Any:
        return split(*args)

    run.split_graph = split  # for tests and tools: the cut graph, ORT parts as _Part modules
    return Compiled(run, notes, near_misses=near_misses, strategy="partition")  # the parts' notes (how each exported)


def _compile_part(target, sub: fx.GraphModule, gm: fx.GraphModule, nodes: list[fx.Node], example_inputs,
                  config, whole: bool) -> Compiled:
    """``target.compile`` on ``sub``, the part of ``gm`` made of ``nodes``; an export that
    refuses some of its ops -> _Refused."""
    try:
        return target.compile(sub, example_inputs, config)
    except UnsupportedOp as error:
        # Every call of the op, not only this part's: the next round then exports each part once more at most.
        refused = {n: str(error) for n in gm.graph.nodes if n.op == "call_function" and _names(n, error.op)}
        if any(n in refused for n in nodes):
            raise _Refused(refused, error) from error
        raise
    except GraphoptError as error:
        if whole:
            raise  # not about one op (a missing kernel, ...): the core reports it as it is
        # A part that cannot export as a whole runs eagerly, and the rest of the graph stays on ORT.
        raise _Refused({n: f"its part of the graph did not export: {error}" for n in nodes
                        if ir.target_name(n.target) != "getitem"}, error) from error


def _names(node: fx.Node, op: str) -> bool:
    """Whether the exporter's op name (``aten.index.Tensor``, ``transformers.x``) is ``node``'s."""
    mine = ir.target_name(node.target)
    return op == mine or op.startswith(mine + ".")


def _restore_meta(sub: fx.GraphModule, by_name: dict[str, fx.Node]) -> None:
    """split_module leaves a part's placeholders without ``meta["val"]``; the export needs it."""
    for node in sub.graph.nodes:
        if node.op == "placeholder" and node.name in by_name and "val" in by_name[node.name].meta:
            node.meta["val"] = by_name[node.name].meta["val"]


def _part_inputs(split: fx.GraphModule, names: list[str], example_inputs) -> dict[str, list]:
    """The values each ORT part receives when the cut graph runs on ``example_inputs``
    (eagerly, once): the examples its export traces with. None for a symbolic graph, whose
    parts the target sizes from their fake values."""
    if example_inputs is None or any(isinstance(x, torch.SymInt) for x in example_inputs):
        return {}
    parts = [m for m in split.children() if isinstance(m, fx.GraphModule)]
    if any(placement.mutates(n) for part in parts for n in part.graph.nodes):
        # An in-place op (a cache write) must not write the caller's tensors at compile time.
        example_inputs = [x.clone() if isinstance(x, torch.Tensor) else x for x in example_inputs]
    seen: dict[str, list] = {}
    wanted = set(names)

    class Recorder(fx.Interpreter):
        def call_module(self, target, args, kwargs):
            if target in wanted:
                seen[target] = list(args)
            return super().call_module(target, args, kwargs)

    with torch.no_grad():
        Recorder(split).run(*example_inputs)
    return seen


class _Part(torch.nn.Module):
    """A compiled part in the cut graph's module tree."""

    def __init__(self, fn: Callable) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


def _off_target(decomposed: Counter, eager: dict[fx.Node, str]) -> list[dict]:
    rows = [{"op": op, "count": n, "reason": reason, "how": "decomposed"}
            for (op, reason), n in sorted(decomposed.items())]
    grouped = Counter((ir.target_name(n.target), reason) for n, reason in eager.items())
    rows += [{"op": op, "count": n, "reason": reason, "how": "eager"} for (op, reason), n in sorted(grouped.items())]
    return rows


def _notes(compiled: Compiled, decomposed: Counter, eager: dict[fx.Node, str]) -> list[str]:
    notes = list(compiled.notes)
    if decomposed:
        ops = Counter()
        for (op, _), n in decomposed.items():
            ops[op] += n
        notes.append("onnxruntime: decomposed to standard ONNX ops (no translation for them): "
                     + ", ".join(f"{op} x{n}" for op, n in sorted(ops.items())))
    if eager:
        parts = Counter(p["where"] for p in compiled.partitions)
        ops = Counter(ir.target_name(n.target) for n in eager)
        notes.append(f"onnxruntime: graph cut into {parts[ORT]} ONNX Runtime part(s) and {parts[EAGER]} eager "
                     "part(s); eager: " + ", ".join(f"{op} x{n}" for op, n in sorted(ops.items())))
    return notes
