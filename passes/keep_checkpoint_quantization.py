"""Weights the checkpoint ships quantized stay as the checkpoint quantized them:
``mm(view(x, [M, K]), t(W))`` / ``addmm`` / ``linear`` / ``qkv_proj(x, W, b, sizes)``  ->
``graphopt.quantized_linear(x2d, codes, scales, zeros, offsets, bits, group_size, b)``, and
``aten.embedding(W, ids)``  ->  ``graphopt.quantized_gather(codes, scales, zeros, offsets, ids, ...)``,
where W is a lazy weight (graphopt/lazy_weights.py) whose source is block-quantized: a GGUF
tensor in Q4_0 ... Q6_K, or a merged QKV / gate-up projection of such tensors.

Why: a quantized file's own codes are its weights. Running them as shipped keeps the model at
the file's size and computes with exactly the file's values; inflating them to float and
quantizing again onto another grid (``quantize_int4``) loses quality on top of the file's own
rounding. The new constants are lazy too: their bytes are read from the file, re-laid out
(graphopt/sources/gguf_blocks.py), when a runtime writes its weights.

Preconditions: W is a frozen lazy constant whose source has a block format
(``lazy_weights.block_format``); a linear reads it as [N, K] with K its blocks' width. A weight
read by several readers (a tied embedding table and LM head) gets one set of constants.
Anything else is left as it is (screened: "weight is not a quantized checkpoint tensor").

A weight over ``max_weight_bytes`` (an LM head over a large vocabulary) becomes row blocks,
each a quantized_linear, their outputs concatenated: a runtime that repacks a weight at load
holds it twice while it does, and ONNX Runtime's MatMulNBits took 335 MB at its peak to load
Qwen2.5's 151936 x 896 8-bit head whole, 225 MB in four blocks, at the same speed.

Order: after merge_qkv and fuse_gated_mlp (rows of quantized parts concatenate into one
quantized weight, widened to a format that holds each part exactly), before quantize_int4,
which then finds only the float weights left.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from graphopt import ir, lazy_weights
from graphopt.pass_manager import PassContext, PassResult
from graphopt.rewrite import GEMM_OPS, PatternPass, expect, val
from graphopt.rewrite.linears import match_linear, param_name

aten = torch.ops.aten
graphopt = torch.ops.graphopt
RECORD = "graphopt_checkpoint_quant"  # node.meta key: the weight's name, format and bytes
_PARTS = ("codes", "scales", "zeros", "offsets")


@dataclass
class KeepOptions:
    max_weight_bytes: int = field(default=32 << 20, metadata={
        "help": "a larger linear weight is split into row blocks of at most this many bytes (0: never)"})

    def __post_init__(self) -> None:
        if not isinstance(self.max_weight_bytes, int) or self.max_weight_bytes < 0:
            raise ValueError(f"max_weight_bytes must be a non-negative int, got {self.max_weight_bytes!r}")


@dataclass
class Match:
    node: fx.Node  # the GEMM, qkv_proj or embedding replaced
    x: fx.Node  # the GEMM's [M, K] input, or the embedding's ids
    weight: fx.Node
    bias: fx.Node | None
    sizes: list[int] | None  # qkv_proj's split widths
    source: object
    embedding: bool


class _Part:
    """One of a block-quantized weight's tensors (``rows`` of them), read from its source when
    written out: the source converts only that field of those rows."""

    def __init__(self, source, name: str, shape: tuple[int, ...], dtype: torch.dtype, rows: slice) -> None:
        self.source, self.name, self.shape, self.dtype, self.rows = source, name, shape, dtype, rows

    def load(self) -> torch.Tensor:
        return torch.from_numpy(getattr(self.source.block_quantized(rows=self.rows), self.name))


class KeepCheckpointQuantization(PatternPass):
    name = "keep_checkpoint_quantization"
    summary = "weights a checkpoint ships block-quantized (GGUF Q4_0..Q6_K) -> quantized_linear / _gather"
    Options = KeepOptions
    anchors = (*GEMM_OPS, graphopt.qkv_proj.default, aten.embedding.default)

    def screen(self, anchor: fx.Node) -> str | None:
        weight = anchor.args[0] if anchor.target is aten.embedding.default else _weight_arg(anchor)
        tensor = ir.get_constant(weight) if isinstance(weight, fx.Node) else None
        if tensor is None or lazy_weights.block_format(lazy_weights.source_of(tensor)) is None:
            return "weight is not a quantized checkpoint tensor"
        return None

    def match(self, anchor: fx.Node, options: KeepOptions) -> Match:
        if anchor.target is aten.embedding.default:
            table, ids = anchor.args[0], anchor.args[1]  # padding_idx only shapes gradients
            return Match(anchor, ids, table, None, None, _source(table), True)
        if anchor.target is graphopt.qkv_proj.default:
            x, weight, bias, sizes = anchor.args[:4]
            found = Match(anchor, x, weight, bias, list(sizes), _source(weight), False)
        else:
            lin = match_linear(anchor, "linear")
            found = Match(anchor, lin.x2d, lin.weight, lin.bias, None, _source(lin.weight), False)
        k = val(found.x).shape[-1]
        expect(isinstance(k, int) and k == val(found.weight).shape[1],
               f"input width {k} is not the weight's {val(found.weight).shape[1]}", anchor)
        return found

    def rewrite(self, gm: fx.GraphModule, m: Match, options: KeepOptions) -> None:
        fmt = lazy_weights.block_format(m.source)
        n, k = val(m.weight).shape
        blocks = [slice(0, n)]
        if not m.embedding and not _read_whole_elsewhere(gm, m) and options.max_weight_bytes:
            rows = max(1, int(options.max_weight_bytes // (k * fmt.bytes_per_weight())))
            blocks = [slice(start, min(start + rows, n)) for start in range(0, n, rows)]
        graph = gm.graph
        outs = []
        for rows in blocks:
            parts = self._constants(gm, m, fmt, rows)
            with graph.inserting_before(m.node):
                if m.embedding:
                    out = graph.call_function(graphopt.quantized_gather.default,
                                              (*parts, m.x, fmt.bits, fmt.group_size, val(m.weight).dtype))
                else:
                    bias = m.bias
                    if bias is not None and len(blocks) > 1:
                        bias = graph.call_function(aten.slice.Tensor, (bias, 0, rows.start, rows.stop))
                    out = graph.call_function(graphopt.quantized_linear.default,
                                              (m.x, *parts, fmt.bits, fmt.group_size, bias))
            out.meta[RECORD] = _record(m, fmt, rows)
            outs.append(out)
        with graph.inserting_before(m.node):
            out = outs[0] if len(outs) == 1 else graph.call_function(aten.cat.default, (outs, -1))
            if m.sizes is not None:  # qkv_proj: its users read getitem(result, i) of a split
                out = graph.call_function(aten.split_with_sizes.default, (out, m.sizes, -1))
        m.node.replace_all_uses_with(out)

    def _constants(self, gm: fx.GraphModule, m: Match, fmt, rows: slice):
        """get_attr nodes of the weight's parts for ``rows`` (None for absent ones), made once
        per source and rows: placed after the graph's inputs, so every reader of a tied weight
        sees them."""
        made = gm.meta.setdefault(_MADE, {})
        key = (id(m.source), rows.start, rows.stop)
        if key in made:
            return made[key]
        k = val(m.weight).shape[1]
        n, groups = rows.stop - rows.start, k // fmt.group_size
        shapes = {"codes": ((n, groups, fmt.group_size * fmt.bits // 8), torch.uint8),
                  "scales": ((n, groups), torch.float32),
                  "zeros": ((n, -(-groups * fmt.bits // 8)), torch.uint8) if fmt.zeros else None,
                  "offsets": ((n, groups), torch.float32) if fmt.offsets else None}
        mode = lazy_weights.mode_of(ir.get_constant(m.weight))
        name = param_name(m.weight)
        suffix = "" if rows.start == 0 and rows.stop == val(m.weight).shape[0] else f"_rows{rows.start}"
        first = next(n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr"))
        nodes = []
        for part, spec in shapes.items():
            if spec is None:
                nodes.append(None)
                continue
            tensor = lazy_weights.fake(mode, _Part(m.source, part, *spec, rows))
            with gm.graph.inserting_before(first):
                node = ir.add_constant(gm, f"w_{name}_{part}{suffix}".replace(".", "_"), tensor)
            node.meta[ir.PARAM_NAME] = f"{name}.{part}{suffix}"
            nodes.append(node)
        made[key] = tuple(nodes)
        return made[key]

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        try:
            result = super().run(gm, ctx)
        finally:
            gm.meta.pop(_MADE, None)
        records = [n.meta[RECORD] for n in result.gm.graph.nodes if n.op == "call_function" and RECORD in n.meta]
        weights: dict[str, dict] = {}
        for r in records:  # a tied table and head are one weight; a weight in row blocks is one
            whole = weights.setdefault(r["name"], {**r, "bytes": 0, "fp32_bytes": 0, "blocks": set()})
            if r["rows"] not in whole["blocks"]:
                whole["blocks"].add(r["rows"])
                whole["bytes"] += r["bytes"]
                whole["fp32_bytes"] += r["fp32_bytes"]
        result.stats["weights"] = len(weights)
        result.stats["bytes"] = sum(r["bytes"] for r in weights.values())
        result.stats["fp32_bytes"] = sum(r["fp32_bytes"] for r in weights.values())
        result.stats["row_blocks"] = sum(len(r["blocks"]) for r in weights.values() if len(r["blocks"]) > 1)
        formats: dict[str, int] = {}
        for r in weights.values():
            formats[r["format"]] = formats.get(r["format"], 0) + 1
        result.stats["formats"] = formats
        return result


_MADE = "graphopt_checkpoint_parts"  # gm.meta key, during a run only: source id -> (part nodes, format)


def _weight_arg(anchor: fx.Node):
    if anchor.target is graphopt.qkv_proj.default:
        return anchor.args[1]
    try:
        return match_linear(anchor, "linear").weight
    except Exception:  # noqa: BLE001  (not a linear: the screen's reason covers it)
        return None


def _source(weight: fx.Node):
    tensor = ir.get_constant(weight)
    expect(tensor is not None and lazy_weights.is_lazy(tensor), "weight is not a lazy constant", weight)
    source = lazy_weights.source_of(tensor)
    expect(lazy_weights.block_format(source) is not None, "weight has no block format", weight)
    return source


def _record(m: Match, fmt, rows: slice) -> dict:
    n, k = rows.stop - rows.start, val(m.weight).shape[1]
    return {"name": param_name(m.weight), "shape": [n, k], "rows": (rows.start, rows.stop),
            "format": f"{fmt.bits}-bit/{fmt.group_size}" + (" +zeros" if fmt.zeros else "")
                      + (" +offsets" if fmt.offsets else ""),
            "bytes": int(n * k * fmt.bytes_per_weight()), "fp32_bytes": n * k * 4}


def _read_whole_elsewhere(gm: fx.GraphModule, m: Match) -> bool:
    """Whether an embedding reads this weight too (a tied table): its codes then stay one tensor
    for both, not row blocks for the head beside a whole table for the lookup."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is aten.embedding.default:
            table = ir.get_constant(node.args[0])
            if table is not None and lazy_weights.source_of(table) is m.source:
                return True
    return False


keep_checkpoint_quantization = KeepCheckpointQuantization()
