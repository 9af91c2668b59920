"""INT4 weight-only quantization of linear layers:
``mm(view(x, [M, K]), t(W))`` / ``addmm(b, x2d, t(W))`` / ``linear(x, W, b)``  ->
``graphopt.int4_linear(x2d, packed, scales, zeros, group_size, b)``, and
``graphopt.qkv_proj(x, W, b, sizes)``  ->  ``split(graphopt.int4_linear(x, ...), sizes)``,
with W replaced by new frozen constants in the MatMulNBits format (graphopt/ops/quant.py).

Why: decoding is memory-bound (every token reads every weight once), and 4-bit codes
plus one fp32 scale per 32 weights are 5 bits a weight: 0.156x the bytes of fp32.
Backends dequantize inside the GEMM's K loop (MatMulNBits, the Triton INT4 kernel), so
a full-precision copy of the weight never exists at run time.

By default each group is rounded to the nearest of 16 levels over its [min, max]
(``search="rtn"``, ``symmetric=False``: a uint8 zero point per group, MatMulNBits' fast
path): measured on three held-out texts (benchmarks/int4_study.py) it never lost more
perplexity than ONNX Runtime's own round-to-nearest, and it reads nothing but each weight,
so a checkpoint streams through it (graphopt/quant/groupwise.py says why it is the default).
Symmetric ``"rtn"`` is exactly ONNX Runtime's MatMulNBitsQuantizer; ``"mse"`` minimises
each weight's own error, which on a trained model (SmolLM2-135M) raised perplexity more than
RTN did. ``search="gptq"`` (opt-in; ``--calibration-text`` asks for it) is GPTQ-style error
feedback on calibration activations (graphopt/quant/gptq.py): the graph itself runs on the
calibration inputs (given token ids, else the example inputs) and each weight is quantized
to keep its layer's *output* close on them, visiting the input channels with the most
activation energy first (``act_order``; the groups stay block-wise along K, so the format
is unchanged). It reads each weight when its input's calibration is done (a checkpoint's
weights stay in their file until then: passes/_quantize_plan.py) and costs 25-50x RTN's time.

A linear whose result is a graph output (an LM head: every logit depends on it) gets
``head_bits`` (8: ``graphopt.int8_linear``, MatMulNBits bits=8). With a ``budget`` (the
most quantized bytes as a fraction of fp32), more layers move to 8 bits, those whose
4-bit output error is largest per extra byte first (graphopt/quant/plan.py). 8-bit weights
take their own group size, ``group_size_8bit`` (128; smaller where that would pad K by more
than an eighth): ONNX Runtime's 8-bit MatMulNBits pays per group, and one decode row of
llama-small's 32000x1024 head took 833 us in groups of 32 against 459 us in groups of 128
(SmolLM2's 49152x576: 647 vs 413 us) on this 2-core CPU, while 8 bits in groups of 128 still
err ~13x less than 4 bits in groups of 32 (relative error 0.0064 against 0.086 on a Gaussian
weight; 0.0053 in groups of 32). Scales take
the activations' dtype by default: that is what MatMulNBits reads, so the reported bytes
are the bytes read.

Which bits and codes each weight gets, and its record, are planned before the rewrite
(passes/_quantize_plan.py).

Preconditions: the weight is a frozen constant (``freeze_weights=True``), 2-D and
floating point; its original parameter name (``node.meta["graphopt_param"]``) matches
none of the ``skip`` patterns; it has at least ``min_size`` elements. A weight read by
several GEMMs is quantized once. Each new int4_linear node carries its layer's numbers in
``meta["graphopt_int4"]``; the pass's stats sum them and list them under ``layers``.

Mixture of experts (passes/_quantize_moe.py): ``graphopt.moe``'s routed experts become
``graphopt.int4_moe`` (4-bit experts, round-to-nearest), its shared expert two linears
quantized as above; the router stays in full precision.

Embeddings (passes/_quantize_embedding.py, ``embedding_bits`` 4 or 8; 0 leaves them in
full precision): ``aten.embedding(W, ids)`` -> ``graphopt.quantized_embedding`` of the table
quantized the same way along the hidden axis (round-to-nearest); a table tied to an LM head
quantized at the same bits reads the head's codes, so it is stored once.

Order: run it after the fusions that concatenate weights (merge_qkv, fuse_gated_mlp):
they need the full-precision constants. It is opt-in, not in the default pipeline.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.pass_manager import PassContext, PassResult
from graphopt.passes import _quantize_embedding, _quantize_moe, _quantize_plan
from graphopt.passes._int4_options import Int4Options, LinearMatch
from graphopt.rewrite import CAST_OPS, GEMM_OPS, ROW_PICK_OPS, VIEW_OPS, NoMatch, PatternPass, expect, is_op, val
from graphopt.rewrite.linears import match_linear, param_name

aten = torch.ops.aten
INT4_META = "graphopt_int4"  # node.meta key: the per-layer record of a quantized linear
PLAN_META = "graphopt_int4_plan"  # gm.meta key, during a run only: the quantized weights planned


class QuantizeInt4(PatternPass):
    name = "quantize_int4"
    summary = "linear layers with constant weights -> graphopt.int4_linear (4-bit group-wise weights)"
    Options = Int4Options
    anchors = (*GEMM_OPS, torch.ops.graphopt.qkv_proj.default)

    def match(self, gemm: fx.Node, options: Int4Options) -> LinearMatch:
        if gemm.target is torch.ops.graphopt.qkv_proj.default:
            x, weight, bias, sizes = gemm.args[:4]
            found = LinearMatch(gemm, x, weight, bias, list(sizes))
        else:
            lin = match_linear(gemm, "linear")
            found = LinearMatch(gemm, lin.x2d, lin.weight, lin.bias, None)
        w = ir.get_constant(found.weight)
        expect(w is not None, "weight is not a frozen constant (freeze_weights=False?)", found.weight)
        expect(w.is_floating_point(), f"weight is {w.dtype}, not floating point", found.weight)
        name = param_name(found.weight)
        hit = next((p for p in options.skip if fnmatch.fnmatchcase(name, p)), None)
        expect(hit is None, f"{name} matches skip pattern {hit!r}", found.weight)
        expect(w.numel() >= options.min_size, f"{name} has {w.numel()} elements < min_size {options.min_size}",
               found.weight)
        x_val = val(found.x)
        expect(isinstance(x_val, torch.Tensor) and x_val.is_floating_point(), "input is not a floating tensor", gemm)
        expect(not (options.head_bits == 32 and _feeds_output(gemm)),
               f"{name} gives a graph output (an LM head) and head_bits is 32", gemm)
        return found

    def rewrite(self, gm: fx.GraphModule, m: LinearMatch, options: Int4Options) -> None:
        graph = gm.graph
        with graph.inserting_before(m.gemm):
            packed, scales, zeros, record = self._constants(gm, m, options)
            if record["bits"] == 8:
                out = graph.call_function(torch.ops.graphopt.int8_linear.default,
                                          (m.x, packed, scales, record["group_size"], m.bias))
            else:
                out = graph.call_function(torch.ops.graphopt.int4_linear.default,
                                          (m.x, packed, scales, zeros, record["group_size"], m.bias))
            out.meta[INT4_META] = record
            if m.sizes is not None:  # qkv_proj: the users read getitem(result, i) from the split
                out = graph.call_function(aten.split_with_sizes.default, (out, m.sizes, -1))
        m.gemm.replace_all_uses_with(out)

    def _constants(self, gm: fx.GraphModule, m: LinearMatch, options: Int4Options):
        """get_attr nodes of the quantized weight; a weight already quantized in this graph
        (a second GEMM reading it) reuses that node's constants."""
        key = m.weight.target
        node = _quantize_embedding.quantized_linear_of(gm, key, INT4_META)
        if node is not None:
            record = node.meta[INT4_META]
            zeros = node.args[3] if record["bits"] == 4 else None
            return (node.args[1], node.args[2], zeros, {**record, "shared": True})
        planned = gm.meta.get(PLAN_META, {}).get(key)
        if planned is None:  # a graph the planner did not see (a direct call of rewrite)
            planned = _quantize_plan.plan_one(m, options, None, 4)
        q, record = planned
        name = record["name"]
        nodes = [_constant(gm, name, suffix, t) for suffix, t in
                 (("qweight", q.packed), ("scales", q.scales), ("qzeros", q.zeros))]
        return (*nodes, record)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        earlier = {n.name for n in gm.graph.nodes if INT4_META in n.meta}  # from a previous run: not counted
        options = ctx.options_for(self)
        moved = _quantize_moe.split_shared_experts(gm)  # its GEMMs become linears the plan sees
        gm.meta[PLAN_META], calibration = self._plan(gm, ctx, options)
        try:
            result = super().run(gm, ctx)
        finally:
            gm.meta.pop(PLAN_META, None)
        layers = [n.meta[INT4_META] for n in result.gm.graph.nodes
                  if n.op == "call_function" and INT4_META in n.meta and n.name not in earlier]
        experts = _quantize_moe.quantize_experts(result.gm, options, _constant, lambda name, w, q, search, key: (
            _quantize_plan.layer_record(name, w, q, options, key, search, None)))
        embeddings: list[dict[str, Any]] = []
        if options.embedding_bits:  # after the linears: a tied table reuses its head's codes
            embeddings, misses = _quantize_embedding.quantize_embeddings(result.gm, options, _constant, INT4_META)
            result.near_misses.extend(misses)
        result.modified = result.modified or bool(moved or experts or embeddings)
        if result.modified:
            _drop_unused_attrs(result.gm, {layer["_key"] for layer in layers + experts + embeddings})
        result.stats.update(_quantize_plan.summarize(layers + experts + embeddings))
        result.stats["embeddings"] = len(embeddings)
        result.stats["moe_layers"] = len(experts) // 2
        result.stats["calibration"] = calibration
        return result

    def _plan(self, gm: fx.GraphModule, ctx: PassContext, options: Int4Options):
        """{weight target: (quantized weight, record)} for every weight the pass will
        rewrite, and a line saying what it calibrated on (passes/_quantize_plan.py)."""
        matches: dict[str, LinearMatch] = {}
        heads: set[str] = set()
        for anchor in self.candidates(gm):
            try:
                m = self.match(anchor, options)
            except NoMatch:
                continue
            matches.setdefault(m.weight.target, m)
            if _feeds_output(anchor):
                heads.add(m.weight.target)
        return _quantize_plan.plan_weights(gm, ctx, options, matches, heads)

def _feeds_output(node: fx.Node) -> bool:
    """Whether ``node``'s result is a graph output, through views, casts and row picks only
    (an LM head)."""
    frontier, seen = [node], set()
    while frontier:
        current = frontier.pop()
        for user in current.users:
            if user.op == "output":
                return True
            if user not in seen and is_op(user, *VIEW_OPS, *CAST_OPS, *ROW_PICK_OPS):
                seen.add(user)
                frontier.append(user)
    return False


def _constant(gm: fx.GraphModule, name: str, suffix: str, tensor: torch.Tensor | None) -> fx.Node | None:
    if tensor is None:
        return None
    node = ir.add_constant(gm, f"w_{name}_{suffix}".replace(".", "_"), tensor)
    node.meta[ir.PARAM_NAME] = f"{name}.{suffix}"
    return node


def _drop_unused_attrs(gm: fx.GraphModule, targets: set[str]) -> None:
    """Forget full-precision weights no node reads any more, so the graph does not keep
    them alive (the user's module still owns them; nothing is copied or freed there)."""
    still_read = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for target in targets - still_read:
        if "." not in target and hasattr(gm, target):
            delattr(gm, target)


quantize_int4 = QuantizeInt4()
