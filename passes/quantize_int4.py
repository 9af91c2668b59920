"""INT4 weight-only quantization of linear layers:
``mm(view(x, [M, K]), t(W))`` / ``addmm(b, x2d, t(W))`` / ``linear(x, W, b)``  ->
``graphopt.int4_linear(x2d, packed, scales, zeros, group_size, b)``, and
``graphopt.qkv_proj(x, W, b, sizes)``  ->  ``split(graphopt.int4_linear(x, ...), sizes)``,
with W replaced by new frozen constants in the MatMulNBits format (graphopt/ops/quant.py).

Why: decoding is memory-bound (every token reads every weight once), and 4-bit codes
plus one fp16 scale per 32 weights are 4.5 bits a weight: 0.14x the bytes of fp32.
Backends dequantize inside the GEMM's K loop (MatMulNBits, the Triton INT4 kernel), so
a full-precision copy of the weight never exists at run time.

Scales come from a per-group search that minimises the reconstruction error
(``search="mse"``, graphopt/quantization.py); ``search="rtn"`` is plain round-to-nearest,
which for symmetric groups is exactly ONNX Runtime's MatMulNBitsQuantizer.

Preconditions: the weight is a frozen constant (``freeze_weights=True``), 2-D and
floating point; its original parameter name (``node.meta["graphopt_param"]``) matches
none of the ``skip`` patterns; it has at least ``min_size`` elements. A weight read by
several GEMMs is quantized once. Each new int4_linear node carries its layer's numbers in
``meta["graphopt_int4"]``; the pass's stats sum them and list them under ``layers``.

Order: run it after the fusions that concatenate weights (merge_qkv, fuse_gated_mlp):
they need the full-precision constants. It is opt-in, not in the default pipeline.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from graphopt import ir, quantization
from graphopt.ops.quant import GROUP_SIZES
from graphopt.linears import match_linear, param_name
from graphopt.pass_manager import PassContext, PassResult
from graphopt.quant_report import summarize_layers
from graphopt.quantization import SCALE_DTYPE_NAMES, SEARCHES, Int4Weight, relative_error
from graphopt.rewrite import GEMM_OPS, PatternPass, expect, val

aten = torch.ops.aten
INT4_META = "graphopt_int4"  # node.meta key: the per-layer record of a quantized linear


@dataclass
class Int4Options:
    group_size: int = field(default=32, metadata={"help": "weights per scale along K: 32, 64 or 128"})
    symmetric: bool = field(default=True, metadata={
        "help": "no zero points (an implied 8); false stores a 4-bit zero point per group"})
    scale_dtype: str = field(default="float16", metadata={"help": "dtype of the scales: float16 | bfloat16 | float32"})
    skip: list = field(default_factory=list, metadata={
        "help": 'fnmatch patterns of parameter names to leave in full precision, e.g. ["*lm_head*"]'})
    min_size: int = field(default=0, metadata={"help": "leave weights with fewer elements in full precision"})
    search: str = field(default="mse", metadata={
        "help": "mse: per-group clipping / scale search; rtn: round-to-nearest"})

    def __post_init__(self) -> None:
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"group_size {self.group_size} is not valid; choose one of: "
                             f"{', '.join(map(str, GROUP_SIZES))}")
        if self.scale_dtype not in SCALE_DTYPE_NAMES:
            raise ValueError(f"scale_dtype {self.scale_dtype!r} is not valid; choose one of: "
                             f"{', '.join(SCALE_DTYPE_NAMES)}")
        if self.search not in SEARCHES:
            raise ValueError(f"search {self.search!r} is not valid; choose one of: {', '.join(SEARCHES)}")
        if isinstance(self.skip, str):
            self.skip = [self.skip]
        if not all(isinstance(p, str) for p in self.skip):
            raise ValueError(f"skip must be a list of name patterns, got {self.skip!r}")
        if not isinstance(self.min_size, int) or self.min_size < 0:
            raise ValueError(f"min_size must be a non-negative int, got {self.min_size!r}")


@dataclass
class LinearMatch:
    gemm: fx.Node  # the node replaced: mm / addmm / linear / qkv_proj
    x: fx.Node  # what the int4 GEMM reads (the 2-D view for mm-style graphs)
    weight: fx.Node  # get_attr of the [N, K] weight
    bias: fx.Node | None
    sizes: list[int] | None  # qkv_proj's split widths


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
        return found

    def rewrite(self, gm: fx.GraphModule, m: LinearMatch, options: Int4Options) -> None:
        graph = gm.graph
        with graph.inserting_before(m.gemm):
            packed, scales, zeros, record = self._int4_constants(gm, m.weight, options)
            out = graph.call_function(torch.ops.graphopt.int4_linear.default,
                                      (m.x, packed, scales, zeros, options.group_size, m.bias))
            out.meta[INT4_META] = record
            if m.sizes is not None:  # qkv_proj: the users read getitem(result, i) from the split
                out = graph.call_function(aten.split_with_sizes.default, (out, m.sizes, -1))
        m.gemm.replace_all_uses_with(out)

    def _int4_constants(self, gm: fx.GraphModule, weight: fx.Node, options: Int4Options):
        """get_attr nodes of the quantized weight; a weight already quantized in this graph
        with the same options (a second GEMM reading it) reuses that node's constants."""
        key = (weight.target, options.group_size, options.symmetric, options.scale_dtype, options.search)
        for node in gm.graph.nodes:
            record = node.meta.get(INT4_META)
            if record is not None and record.get("_key") == key and node.op == "call_function":
                return (*node.args[1:4], {**record, "shared": True})
        w = ir.get_constant(weight)
        name = param_name(weight)
        q = quantization.quantize_int4(w, options.group_size, options.symmetric, options.scale_dtype, options.search)
        nodes = [_constant(gm, name, suffix, t) for suffix, t in
                 (("qweight", q.packed), ("scales", q.scales), ("qzeros", q.zeros))]
        return (*nodes, _layer_record(name, w, q, options, key))

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        earlier = {n.name for n in gm.graph.nodes if INT4_META in n.meta}  # from a previous run: not counted
        result = super().run(gm, ctx)
        layers = [n.meta[INT4_META] for n in result.gm.graph.nodes
                  if n.op == "call_function" and INT4_META in n.meta and n.name not in earlier]
        if result.modified:
            _drop_unused_attrs(result.gm, {layer["source"] for layer in layers})
        result.stats.update(summarize(layers))
        return result


def _constant(gm: fx.GraphModule, name: str, suffix: str, tensor: torch.Tensor | None) -> fx.Node | None:
    if tensor is None:
        return None
    node = ir.add_constant(gm, f"w_{name}_{suffix}".replace(".", "_"), tensor)
    node.meta[ir.PARAM_NAME] = f"{name}.{suffix}"
    return node


def _layer_record(name: str, w: torch.Tensor, q: Int4Weight, options: Int4Options, key: tuple) -> dict[str, Any]:
    return {
        "name": name,
        "shape": list(w.shape),
        "group_size": options.group_size,
        "symmetric": options.symmetric,
        "scale_dtype": options.scale_dtype,
        "search": options.search,
        "rel_error": relative_error(w, q),
        "bytes_before": w.numel() * w.element_size(),
        "bytes_fp32": w.numel() * 4,
        "bytes_after": q.nbytes,
        "shared": False,
        "source": key[0],
        "_key": key,
    }


def summarize(layers: list[dict[str, Any]]) -> dict[str, Any]:
    """Pass stats from the per-layer records (private keys dropped): see summarize_layers."""
    public = [{k: v for k, v in layer.items() if not k.startswith("_") and k != "source"} for layer in layers]
    return summarize_layers(public)


def _drop_unused_attrs(gm: fx.GraphModule, targets: set[str]) -> None:
    """Forget full-precision weights no node reads any more, so the graph does not keep
    them alive (the user's module still owns them; nothing is copied or freed there)."""
    still_read = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for target in targets - still_read:
        if "." not in target and hasattr(gm, target):
            delattr(gm, target)


quantize_int4 = QuantizeInt4()
