"""The embedding part of ``quantize_int4`` (``embedding_bits`` 4 or 8; 0, the default, leaves
tables in full precision):

``aten.embedding(W, ids)``  ->  ``graphopt.quantized_embedding(codes, scales, ids, bits,
group_size, hidden, W.dtype)``, W [vocab, hidden] a frozen floating constant, quantized
symmetric and group-wise along the hidden axis by round-to-nearest, in exactly the format
of ``int4_linear`` / ``int8_linear`` with N = vocab, K = hidden (graphopt/ops/quant.py).

Why: a tied or untied table is vocab x hidden floats that decoding reads only a few rows
of, but a model file and a session hold it whole (SmolLM2-135M: 113 MB of 540 MB in fp32).

Tied tables (an LM head reading the same constant, as SmolLM2 and Gemma do): when the pass
already quantized that head at ``embedding_bits`` (symmetric, same group size), the
embedding reads the head's codes and scales, so the table is stored once; its record is
then ``shared`` and its bytes are the head's. The head's codes come from its own search
(GPTQ on the head's inputs by default), tuned for the head's outputs, not for the rows'
own error: the record's ``rel_error`` says what that costs the table. Otherwise the table
gets its own round-to-nearest codes; a tied table's fp32 bytes are then counted once, on
the head's record (``bytes_fp32`` 0 here), so the byte ratio stays against the fp32 file.

Bytes are the codes plus the scales in the dtype the runtime reads them: ONNX Runtime's
GatherBlockQuantized reads scales in the output's dtype (translations/embedding.py casts
them, and ORT folds that Cast at load), so they are counted at the table dtype's itemsize.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Callable

import torch
import torch.fx as fx

from graphopt import ir, lazy_weights
from graphopt.passes import _quantize_plan
from graphopt.quant import groupwise
from graphopt.rewrite.linears import param_name
from graphopt.pass_manager import NearMiss

aten = torch.ops.aten
graphopt = torch.ops.graphopt
PASS = "quantize_int4"
LINEARS = (graphopt.int4_linear.default, graphopt.int8_linear.default)


def quantize_embeddings(gm: fx.GraphModule, options: Any, constant: Callable[..., fx.Node | None],
                        record_key: str) -> tuple[list[dict[str, Any]], list[NearMiss]]:
    """Rewrite every ``aten.embedding`` of a constant table in place (module docstring);
    returns one layer record per table and the embeddings left alone with why.
    ``record_key`` is the node.meta key of the linears' records, ``constant(gm, name,
    suffix, tensor)`` makes a constant node."""
    records: dict[str, dict[str, Any]] = {}
    misses: list[NearMiss] = []
    done: dict[str, tuple[fx.Node, fx.Node]] = {}  # table target -> (codes, scales): a table read twice
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.embedding.default]:
        table_node, ids = node.args[0], node.args[1]
        reason = _refusal(table_node, options)
        if reason:
            misses.append(NearMiss(PASS, node.name, getattr(table_node, "name", node.name), reason))
            continue
        table = ir.get_constant(table_node)
        key, bits, hidden = table_node.target, options.embedding_bits, table.shape[1]
        if key not in done:
            head = quantized_linear_of(gm, key, record_key)
            with gm.graph.inserting_before(node):
                done[key], records[key] = _quantize(gm, table_node, table, head, options, constant, record_key)
        codes, scales = done[key]
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        for const in (codes, scales):
            if order[const] > order[node]:  # a tied head's constants, made beside the head further down
                node.prepend(const)
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(graphopt.quantized_embedding.default,
                                         (codes, scales, ids, bits, records[key]["group_size"], hidden,
                                          table.dtype))
        new.meta.update({k: node.meta[k] for k in ("stack_trace", "nn_module_stack") if k in node.meta})
        new.meta[ir.CREATED_BY] = PASS
        new.meta[record_key] = records[key]
        ir.infer_val(new)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        if not table_node.users:  # so the pass can drop the fp32 table (nothing else reads it)
            gm.graph.erase_node(table_node)
    if records:
        gm.graph.lint()
        gm.recompile()
    return list(records.values()), misses


def _refusal(table_node: Any, options: Any) -> str | None:
    table = ir.get_constant(table_node) if isinstance(table_node, fx.Node) else None
    if table is None:
        return "embedding table is not a frozen constant (freeze_weights=False?)"
    if table.dim() != 2 or not table.is_floating_point():
        return f"embedding table is {table.dtype} {tuple(table.shape)}, not a 2-D floating tensor"
    name = param_name(table_node)
    hit = next((p for p in options.skip if fnmatch.fnmatchcase(name, p)), None)
    if hit is not None:
        return f"{name} matches skip pattern {hit!r}"
    if table.numel() < options.min_size:
        return f"{name} has {table.numel()} elements < min_size {options.min_size}"
    return None


def quantized_linear_of(gm: fx.GraphModule, key: str, record_key: str) -> fx.Node | None:
    """The int4/int8 linear this pass made of the constant ``key`` (a second GEMM reading the
    weight, or a tied LM head reading the table), or None; ``bits`` in its record says
    whether its codes can serve another reader."""
    for node in gm.graph.nodes:
        record = node.meta.get(record_key)
        if node.op == "call_function" and node.target in LINEARS and record and record.get("_key") == key:
            return node
    return None


def _quantize(gm: fx.GraphModule, table_node: fx.Node, table: torch.Tensor, head: fx.Node | None, options: Any,
              constant: Callable[..., fx.Node | None], record_key: str):
    """((codes, scales) nodes, layer record) of one table: the tied head's when they fit."""
    name, bits = param_name(table_node), options.embedding_bits
    group = options.group_8bit(table.shape[1]) if bits == 8 else options.group_size
    out_size = table.element_size()  # what GatherBlockQuantized reads the scales as
    head_record = head.meta[record_key] if head is not None else None
    if head_record is not None and head_record["bits"] == bits and head_record["group_size"] == group \
            and (bits == 8 or head.args[3] is None):
        codes, scales = head.args[1], head.args[2]
        stored = groupwise.Int4Weight(ir.get_constant(codes), ir.get_constant(scales), None, group,
                                         table.shape[1], bits)
        record = _record(name, table, stored, options, table_node.target, head_record["search"], out_size)
        record.update(shared=True, tied_to=head_record["name"])
        return (codes, scales), record
    dtype = table.dtype if options.scale_dtype == "auto" else options.scale_dtype

    def quantize(rows: torch.Tensor) -> groupwise.Int4Weight:
        if bits == 8:
            return groupwise.quantize_int8(rows, group, dtype)
        return groupwise.quantize_int4(rows, group, True, dtype, "rtn")

    # a table still in its checkpoint is quantized as it is written, a block of rows at a time
    q = _quantize_plan.quantize_lazily(table, quantize) if lazy_weights.is_lazy(table) else quantize(table)
    nodes = (constant(gm, name, "qweight", q.packed), constant(gm, name, "scales", q.scales))
    record = _record(name, table, q, options, table_node.target, "rtn", out_size)
    if head_record is not None:  # tied, at other bits: two copies of the codes; the fp32 table counts once
        record.update(bytes_before=0, bytes_fp32=0, tied_to=head_record["name"])
    return nodes, record


def _record(name: str, table: torch.Tensor, q, options: Any, key: str, search: str, out_size: int) -> dict[str, Any]:
    return {
        "name": name,
        "kind": "embedding",
        "shape": list(table.shape),
        "bits": q.bits,
        "group_size": q.group_size,
        "symmetric": True,
        "scale_dtype": str(q.scales.dtype).removeprefix("torch."),
        "search": search,
        "rel_error": None if lazy_weights.is_lazy(table) else groupwise.relative_error(table, q),  # lazy: unread
        "output_error": None,
        "bytes_before": table.numel() * table.element_size(),
        "bytes_fp32": table.numel() * 4,
        "bytes_after": q.packed.numel() + q.scales.numel() * out_size,
        "shared": False,
        "_key": key,
    }
