"""GroupQueryAttention that rotates q/k itself, on the in-place decoder (``fold_rotary_into_attention``).

After ``attention_layout.tidy_attention_layout`` each layer still runs two RotaryEmbeddings
(q and k) and a Split of the fused QKV projection before its GroupQueryAttention, and every
step recomputes the cos/sin tables from ``position_ids``. GQA can do the rotation itself
(``do_rotary=1``) from cos/sin caches indexed by absolute position, and can read q/k/v packed
in one input. The caches are made once, by running the decoder's own table subgraph for
every position, and are checked to depend on each position alone (a dynamic-NTK scaling
that looks at the longest sequence would not). ORT's CPU kernel takes do_rotary only for
head sizes that are multiples of 16; other models keep their RotaryEmbeddings.
"""

from __future__ import annotations

from graphopt.backends.onnxruntime.onnx_passes.attention_layout import MS_DOMAIN, _constant_ints


def _rotary_tables(model, tables: tuple, positions: int) -> tuple[list, str | None]:
    """([cos, sin] as numpy [positions, R/2] rows per absolute position, or [] with the reason),
    from the decoder's own subgraph that makes the RotaryEmbeddings' per-token ``tables``
    from ``position_ids``: run once for positions 0 .. positions - 1. The rows must be each
    position's alone: the subgraph is run again on a batch of scattered positions, and a
    table that depends on more than the token's own position (a scaling that reads the
    longest position, say) fails that check and keeps its RotaryEmbeddings."""
    import numpy as np
    import onnx_ir as ir
    import onnxruntime

    from graphopt.backends.onnxruntime.lower.onnx_model import lazy_weights_as_stubs

    names = [t.name for t in tables]
    with lazy_weights_as_stubs(model):  # the tables read no weight: do not read the checkpoint to serialize
        proto = ir.to_proto(model)
    sub = _extract(proto, names, tables[0].dtype or ir.DataType.FLOAT)
    needed = [i.name for i in sub.graph.input]
    if needed != ["position_ids"] and sorted(needed) != ["input_ids", "position_ids"]:
        return [], f"the rotary tables read {needed}, not only the positions"
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    session = onnxruntime.InferenceSession(sub.SerializeToString(), options, providers=["CPUExecutionProvider"])

    def run(ids):
        feeds = {"position_ids": ids, "input_ids": np.zeros_like(ids)}
        return [np.asarray(t).reshape(ids.size, -1) for t in session.run(names, {n: feeds[n] for n in needed})]

    full = run(np.arange(positions, dtype=np.int64)[None])
    scattered = np.array([[positions // 2, 3], [0, 1]], dtype=np.int64)  # another longest position
    for table, rows in zip(full, run(scattered)):
        if not np.allclose(table[scattered.reshape(-1)], rows, rtol=1e-6, atol=1e-6):
            return [], "a position's rotary row depends on more than its position"
    return full, None


def _extract(proto, names: list[str], dtype):
    """``proto`` cut down to the nodes, initializers and inputs that ``names`` depend on."""
    from onnx import helper

    producers = {out: node for node in proto.graph.node for out in node.output}
    wanted, kept, stack = set(), [], list(names)
    while stack:
        name = stack.pop()
        if name not in wanted and name in producers:
            kept.append(producers[name])
            stack.extend(x for x in producers[name].input if x)
        wanted.add(name)
    order = {id(node): i for i, node in enumerate(proto.graph.node)}
    kept = sorted({id(n): n for n in kept}.values(), key=lambda n: order[id(n)])
    graph = helper.make_graph(
        kept, "rotary_tables", [i for i in proto.graph.input if i.name in wanted],
        [helper.make_tensor_value_info(name, dtype.value, None) for name in names],
        [t for t in proto.graph.initializer if t.name in wanted])
    return helper.make_model(graph, opset_imports=proto.opset_import, ir_version=proto.ir_version)


def fold_rotary_into_attention(model, positions: int) -> dict[str, int | str]:
    """Move each GroupQueryAttention's q/k RotaryEmbeddings into the attention (``do_rotary=1``
    with cos/sin caches of ``positions`` rows and the graph's ``position_ids``), and feed it the
    fused QKV projection packed when q, k, v are a Split of it: per layer two RotaryEmbedding
    and a Split fewer, and the per-step cos/sin computation gone. For the in-place decoder
    (``inplace_cache.export_decoder``), whose ``position_ids`` input gives each token's
    absolute position; ``positions`` must cover the longest sequence it will run.
    Returns counts, and ``skipped`` with the reason when it changed nothing."""
    import onnx_ir as ir
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    graph = model.graph
    stats: dict[str, int | str] = {"rotary": 0, "packed": 0}
    found = []
    for node in graph:
        if node.op_type != "GroupQueryAttention" or node.domain != MS_DOMAIN or len(node.inputs) < 3:
            continue
        ropes = [x.producer() if x is not None else None for x in node.inputs[:2]]
        if not all(r is not None and r.op_type == "RotaryEmbedding" and r.domain == MS_DOMAIN for r in ropes):
            continue
        if any(len(r.outputs[0].uses()) > 1 or r.outputs[0].is_graph_output() for r in ropes):
            continue  # the rotated key is also returned or read elsewhere
        if len(node.inputs) > 7 and any(x is not None for x in node.inputs[7:]):
            continue
        head_size = _foldable_head_size(node, ropes)
        if head_size:
            found.append((node, ropes, head_size))
    if not found:
        return {**stats, "skipped": "no GroupQueryAttention reads full-width RotaryEmbeddings alone, with a "
                                    "head size ORT's CPU kernel rotates (a multiple of 16)"}
    position_ids = next((v for v in graph.inputs if v.name == "position_ids"), None)
    tables_of = {tuple(id(x) for x in r.inputs[2:4]) for _, ropes, _ in found for r in ropes}
    first = found[0][1][0]
    if position_ids is None or len(tables_of) != 1:
        return {**stats, "skipped": "no position_ids input, or ropes of different tables"}
    tables, reason = _rotary_tables(model, (first.inputs[2], first.inputs[3]), positions)
    if reason:
        return {**stats, "skipped": reason}
    caches = [ir.tensor(table, name=f"rotary_{kind}_cache") for kind, table in zip(("cos", "sin"), tables)]
    caches = [ir.Value(name=t.name, const_value=t, type=ir.TensorType(t.dtype), shape=ir.Shape(list(t.shape)))
              for t in caches]
    for value in caches:
        graph.register_initializer(value)
    for node, ropes, head_size in found:
        if tables[0].shape[1] * 2 != head_size:
            continue  # the tables rotate part of the head only: leave the ropes
        for index, rope in enumerate(ropes):
            node.replace_input_with(index, rope.inputs[0])
            graph.remove(rope, safe=True)  # its output had this one use: q and k keep one reader each
        node.resize_inputs(10)
        for index, value in ((7, caches[0]), (8, caches[1]), (9, position_ids)):
            node.replace_input_with(index, value)
        node.attributes["do_rotary"] = ir.AttrInt64("do_rotary", 1)
        node.attributes["rotary_interleaved"] = ir.AttrInt64("rotary_interleaved", _interleaved(ropes).pop())
        stats["rotary"] += 1
        stats["packed"] += _pack_qkv(node)
    RemoveUnusedNodesPass()(model)
    return stats


def _interleaved(ropes) -> set[int]:
    return {int(r.attributes["interleaved"].value) if "interleaved" in r.attributes else 0 for r in ropes}


def _foldable_head_size(node, ropes) -> int | None:
    """GroupQueryAttention's head size when its two ropes rotate whole heads alike and ORT's
    CPU kernel can rotate that size itself (it refuses do_rotary unless head_size is a
    multiple of 16); None otherwise. Checked before any table is made."""
    key = node.inputs[1]
    if key.shape is None or not isinstance(key.shape[-1], int):
        return None
    head_size = key.shape[-1] // node.attributes["kv_num_heads"].value
    dims = {r.attributes["rotary_embedding_dim"].value if "rotary_embedding_dim" in r.attributes else 0
            for r in ropes}
    if len(_interleaved(ropes)) != 1 or dims - {0, head_size} or head_size % 16:
        return None
    return head_size


def _projection_width(value) -> int | None:
    """The static last dim of a rank-3 value, from its shape or (an export without shapes) from
    the MatMul / MatMulNBits of a constant weight that made it, behind an Add of its bias."""
    if value.shape is not None:
        last = value.shape[-1] if len(value.shape) == 3 else None
        return last if isinstance(last, int) else None
    node = value.producer()
    if node is not None and node.op_type == "Add" and node.domain == "" and len(node.inputs) == 2:
        return _biased_width(*node.inputs)
    if node is not None and node.op_type == "MatMulNBits" and "N" in node.attributes:
        return node.attributes["N"].value
    weight = node.inputs[1] if node is not None and node.op_type == "MatMul" and len(node.inputs) > 1 else None
    if weight is not None and weight.const_value is not None and len(weight.const_value.shape) == 2:
        return weight.const_value.shape[1]
    return None


def _biased_width(a, b) -> int | None:
    """The width of ``a + b`` when one side is a projection of known width and the other a
    constant bias along its last axis only (Qwen2's merged q/k/v bias: ``[N]``): the packed
    projection then holds q, k and v with their biases, as the three slices did. A bias that
    broadcasts over other axes, or an operand of unknown width, gives None."""
    for projection, bias in ((a, b), (b, a)):
        const = bias.const_value if bias is not None else None
        if const is None or projection is None:
            continue
        width = _projection_width(projection)
        shape = list(const.shape)
        if width is not None and len(shape) <= 3 and shape[-1:] == [width] and all(n == 1 for n in shape[:-1]):
            return width
    return None


def _last_axis_parts(values) -> tuple | None:
    """(source, [(start, end), ...]) when ``values`` are last-axis parts of one rank-3 tensor:
    the outputs of one Split in order, or Slices with constant starts and ends, step 1."""
    producers = [v.producer() for v in values]
    if any(p is None or p.domain != "" for p in producers):
        return None
    source = producers[0].inputs[0]
    width = _projection_width(source)
    if width is None or any(p.inputs[0] is not source for p in producers):
        return None
    split = producers[0]
    if split.op_type == "Split" and all(p is split for p in producers) and list(split.outputs) == list(values):
        axis = split.attributes["axis"].value if "axis" in split.attributes else 0
        sizes = [v.shape[-1] if v.shape is not None else None for v in values]
        known = all(isinstance(n, int) for n in sizes)
        bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)] if known else None
        return (source, list(zip(bounds, bounds[1:]))) if axis in (-1, 2) and bounds else None
    parts = []
    for p in producers:
        if p.op_type != "Slice" or len(p.inputs) < 4:
            return None
        starts, ends, axes = (_constant_ints(x) for x in p.inputs[1:4])
        steps = _constant_ints(p.inputs[4]) if len(p.inputs) > 4 and p.inputs[4] is not None else [1]
        if None in (starts, ends, axes) or len(axes) != 1 or axes[0] not in (-1, 2) or steps != [1]:
            return None
        parts.append((starts[0], min(ends[0], width)))
    return source, parts


def _pack_qkv(node) -> int:
    """GroupQueryAttention's q, k, v read as one packed input when they are the consecutive
    last-axis parts of one [B, S, (H + 2 Hkv) * D] projection that nothing else reads. A
    biased projection (Qwen2) exports as MatMul + Add of the merged bias before the slices,
    so its packed input carries the biases already and is taken the same way."""
    found = _last_axis_parts(node.inputs[:3])
    if found is None:
        return 0
    source, parts = found
    ends = [0] + [end for _, end in parts]
    if [start for start, _ in parts] != ends[:-1] or ends[-1] != _projection_width(source) \
            or any(len(x.uses()) != 1 for x in node.inputs[:3]):
        return 0
    node.replace_input_with(0, source)
    node.replace_input_with(1, None)
    node.replace_input_with(2, None)
    return 1


class FoldRotaryIntoAttention:
    """``fold_rotary_into_attention`` as an ONNX pass (runner.py), for a decoder whose
    ``position_ids`` are absolute and at most ``positions`` long."""

    name = "fold_rotary_into_attention"
    summary = "q/k rotary moved into GroupQueryAttention (do_rotary) and q/k/v packed"

    def __init__(self, positions: int) -> None:
        self.positions = positions

    def run(self, model):
        from graphopt.backends.onnxruntime.onnx_passes.runner import OnnxPassResult, Refusal

        stats = dict(fold_rotary_into_attention(model, self.positions))
        skipped = stats.pop("skipped", None)
        return OnnxPassResult(int(stats.get("rotary", 0)) + int(stats.get("packed", 0)), stats,
                              [Refusal("graph", skipped)] if skipped else [])
