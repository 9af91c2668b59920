"""Attention's layout round trips, removed from an exported decoder (``tidy_attention_layout``).

The exported graph keeps each layer's head split as the FX graph spelled it: q/k as Reshape
[B, S, H, D] -> Transpose to BNSH -> RotaryEmbedding -> Transpose back -> Reshape [B, S, H*D]
into GroupQueryAttention, v as two Reshapes, the output as Reshapes back, and each layer's
seqlens_k / total_sequence_length recomputed from its own past's Shape. ORT's session
optimizer removes none of it (RotaryEmbedding sits between the Transposes, and no two
layers' past are the same input), so a decode step ran about 20 layout nodes per layer. The
tidy-up reads the rank-3 values straight: RotaryEmbedding takes [B, S, H*D] with num_heads,
the op ORT runs on either layout. Used by the in-place decoder (``inplace_cache.py``) and
the prefill/decode pair (``generate.py``). On the in-place decoder, whose ``position_ids``
input holds absolute positions, ``fold_rotary_into_attention`` then moves those
RotaryEmbeddings into GroupQueryAttention itself (do_rotary) and packs q/k/v.
"""

from __future__ import annotations

MS_DOMAIN = "com.microsoft"

_BNSH = [0, 2, 1, 3]


def _static_product(dims) -> int | None:
    product = 1
    for dim in dims:
        if not isinstance(dim, int):
            return None
        product *= dim
    return product


def _splits_last_dim(source, target) -> bool:
    """Whether a Reshape from ``source`` to ``target`` keeps axes 0 and 1 and only splits or
    merges the rest (row-major, so a chain of them from [B, S, C] back to [B, S, C] is the identity)."""
    from graphopt.backends.onnxruntime.translations._common import dims_equal

    a, b = source.shape, target.shape
    if a is None or b is None or len(a) < 3 or len(b) < 3:
        return False
    if not (dims_equal(a[0], b[0]) and dims_equal(a[1], b[1])):
        return False
    rest_a, rest_b = _static_product(list(a)[2:]), _static_product(list(b)[2:])
    return rest_a is not None and rest_a == rest_b


def _constant_ints(value) -> list[int] | None:
    if value is None:
        return None
    tensor = value.const_value
    node = value.producer()
    if tensor is None and node is not None and node.op_type == "Constant" and "value" in node.attributes:
        tensor = node.attributes["value"].value
    return None if tensor is None else [int(v) for v in tensor.numpy().reshape(-1)]


def _fill_shape(value) -> None:
    """Give ``value`` its shape when a translation made it without one (an export without
    onnxscript's rewrites infers none): a Transpose's from its input's, a Reshape's from its
    input's and a constant target, an Identity's its input's. Input shapes are filled first."""
    import onnx_ir as ir

    if value is None or value.shape is not None or (node := value.producer()) is None or not node.inputs:
        return
    x = node.inputs[0]
    _fill_shape(x)
    if x is None or x.shape is None or node.domain != "":
        return
    dims = list(x.shape)
    if node.op_type == "Identity":
        value.shape = ir.Shape(dims)
    elif node.op_type == "Transpose" and "perm" in node.attributes:
        value.shape = ir.Shape([dims[i] for i in node.attributes["perm"].value])
    elif node.op_type == "Reshape" and len(node.inputs) > 1:
        target = _constant_ints(node.inputs[1])
        if target is None or target.count(-1) > 1 or any(t == 0 and i >= len(dims) for i, t in enumerate(target)):
            return
        out = [dims[i] if t == 0 else t for i, t in enumerate(target)]
        if -1 in target:
            rest = [d for i, d in enumerate(dims) if not (i < len(target) and target[i] == 0)]
            known = _static_product([t for t in target if t > 0])
            symbols = [d for d in rest if not isinstance(d, int)]
            static = _static_product([d for d in rest if isinstance(d, int)])
            if not symbols and known and static % known == 0:
                out[target.index(-1)] = static // known
            elif len(symbols) == 1 and static == known:
                out[target.index(-1)] = symbols[0]
            else:
                return
        value.shape = ir.Shape(out)


def _bsh_source(value, allow_rope: bool):
    """The rank-3 [B, S, C] value behind ``value`` (also [B, S, C]) through layout-only nodes:
    Reshapes that split or merge the channels, Transpose pairs to BNSH and back, Identity, whole
    Slices, and
    (``allow_rope``) one RotaryEmbedding on the BNSH side. Returns (source, rope node or None,
    the values from the rope's output to ``value``), or None when the chain holds anything else."""
    from graphopt.backends.onnxruntime.translations._common import dims_equal

    _fill_shape(value)
    if value.shape is None or len(value.shape) != 3:
        return None
    current, bnsh, rope, after_rope = value, False, None, [value]
    while (node := current.producer()) is not None:
        x = node.inputs[0] if node.inputs else None
        if x is None:
            return None
        _fill_shape(x)
        if node.domain == "" and (node.op_type == "Identity" or node.op_type == "Slice" and x.shape is not None
                                  and x.shape == current.shape):
            pass  # a Slice that keeps its input's shape keeps all of it
        elif node.op_type == "Reshape" and node.domain == "" and not bnsh and _splits_last_dim(x, current):
            pass
        elif node.op_type == "Transpose" and node.domain == "" and list(node.attributes["perm"].value) == _BNSH:
            bnsh = not bnsh
        elif (node.op_type == "RotaryEmbedding" and node.domain == MS_DOMAIN and allow_rope and bnsh
              and rope is None and x.shape is not None and len(x.shape) == 4 and "num_heads" in node.attributes):
            rope = node
        else:
            return None
        current = x
        if rope is None:
            after_rope.append(current)
        shape = current.shape
        if not bnsh and shape is not None and len(shape) == 3 and current is not value:
            same = all(dims_equal(p, q) for p, q in zip(shape, value.shape))
            return (current, rope, after_rope) if same else None
    return None


def _canonical_sizes(graph) -> dict[str, tuple]:
    """For each named symbolic dim of a graph input: (input, axis) of its first appearance."""
    sizes: dict[str, tuple] = {}
    for value in graph.inputs:
        for axis, dim in enumerate(value.shape or []):
            name = getattr(dim, "value", None)
            if isinstance(name, str) and name not in sizes:
                sizes[name] = (value, axis)
    return sizes


def tidy_attention_layout(model) -> dict[str, int]:
    """Remove attention's layout round trips from ``model`` (onnx_ir, in place; see above):

    - each GroupQueryAttention's query, key and value read the [B, S, H*D] projection slices
      they were reshaped from; a RotaryEmbedding on the way moves onto that slice
      (``RotaryEmbedding(x [B, S, H*D], num_heads=H)`` rotates what the BNSH one did);
    - a rank-3 value that is a layout round trip of another (the attention output's Reshapes
      back to [B, S, H*D]) is replaced by it;
    - a Shape of one axis whose size is a named symbol of a graph input reads that input, so
      every layer's seqlens_k / total_sequence_length (and batch size) is one computation,
      merged by common subexpression elimination.

    Returns counts of each rewrite. Shapes come from the export's metadata (torch.export's
    fake tensors), so a value without one is left as it is."""
    import onnx_ir as ir
    from onnx_ir.passes.common import CommonSubexpressionEliminationPass, RemoveUnusedNodesPass

    graph = model.graph
    stats = {"attention_inputs": 0, "ropes": 0, "round_trips": 0, "shapes": 0}
    sizes = _canonical_sizes(graph)
    for node in list(graph):
        if node.op_type != "Shape" or node.domain != "" or node.inputs[0].shape is None:
            continue
        shape = node.inputs[0].shape
        start = node.attributes["start"].value if "start" in node.attributes else 0
        end = node.attributes["end"].value if "end" in node.attributes else len(shape)
        start, end = start + len(shape) if start < 0 else start, min(end + len(shape) if end < 0 else end, len(shape))
        if end - start != 1:
            continue
        name = getattr(shape[start], "value", None)
        if not isinstance(name, str) or name not in sizes or sizes[name][0] is node.inputs[0]:
            continue
        source, axis = sizes[name]
        replacement = ir.Node("", "Shape", [source], [ir.AttrInt64("start", axis), ir.AttrInt64("end", axis + 1)],
                              name=f"{node.name}_shared", version=node.version)
        replaced = replacement.outputs[0]
        replaced.name, replaced.shape, replaced.dtype = f"{node.outputs[0].name}_shared", ir.Shape([1]), \
            ir.DataType.INT64
        graph.insert_before(node, replacement)
        node.outputs[0].replace_all_uses_with(replacement.outputs[0])
        stats["shapes"] += 1
    RemoveUnusedNodesPass()(model)  # the Shapes replaced: a rotary output may have one use left
    nodes = list(graph)
    for node in nodes:
        if node.op_type != "GroupQueryAttention" or node.domain != MS_DOMAIN:
            continue
        for index in (0, 1, 2):
            value = node.inputs[index] if len(node.inputs) > index else None
            found = _bsh_source(value, allow_rope=index < 2) if value is not None else None
            if found is None:
                continue
            source, rope, chain = found
            if rope is not None and any(len(v.uses()) > 1 or v.is_graph_output() for v in chain[1:]):
                continue  # the rotated BNSH value is needed anyway (a returned key): rotating twice costs more
            if rope is not None:
                attributes = [ir.Attr(a.name, a.type, a.value) for a in rope.attributes.values()]
                moved = ir.Node(MS_DOMAIN, "RotaryEmbedding", [source, *rope.inputs[1:]], attributes,
                                name=f"{rope.name}_bsh", version=rope.version)
                moved.outputs[0].shape, moved.outputs[0].dtype = ir.Shape(value.shape), value.dtype or source.dtype
                moved.outputs[0].name = f"{rope.outputs[0].name}_bsh"
                graph.insert_before(node, moved)
                source = moved.outputs[0]
                stats["ropes"] += 1
            node.replace_input_with(index, source)
            stats["attention_inputs"] += 1
        query = node.inputs[0]
        out = node.outputs[0]
        if out.shape is None and len(node.inputs) > 1 and node.inputs[1] is not None and query.shape is not None:
            out.shape = ir.Shape(query.shape)  # unpacked query: the output has its shape
            out.dtype = out.dtype or query.dtype
    for node in list(graph):
        if node.op_type != "Reshape" or node.domain != "":
            continue
        out = node.outputs[0]
        found = _bsh_source(out, allow_rope=False)
        if found is None or out.is_graph_output():
            continue
        out.replace_all_uses_with(found[0])
        stats["round_trips"] += 1
    RemoveUnusedNodesPass()(model)
    CommonSubexpressionEliminationPass()(model)
    RemoveUnusedNodesPass()(model)
    return stats


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

    names = [t.name for t in tables]
    sub = _extract(ir.to_proto(model), names, tables[0].dtype or ir.DataType.FLOAT)
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
        found.append((node, ropes))
    if not found:
        return {**stats, "skipped": "no GroupQueryAttention reads RotaryEmbeddings alone"}
    position_ids = next((v for v in graph.inputs if v.name == "position_ids"), None)
    tables_of = {tuple(id(x) for x in r.inputs[2:4]) for _, ropes in found for r in ropes}
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
    for node, ropes in found:
        interleaved = {int(r.attributes["interleaved"].value) if "interleaved" in r.attributes else 0 for r in ropes}
        head_size = node.inputs[1].shape[-1] // node.attributes["kv_num_heads"].value if node.inputs[1].shape else None
        dims = {r.attributes["rotary_embedding_dim"].value if "rotary_embedding_dim" in r.attributes else 0
                for r in ropes}
        if len(interleaved) != 1 or dims - {0, head_size} or tables[0].shape[1] * 2 != head_size:
            continue  # partial rotary, or the two ropes differ: leave them
        if head_size % 16:
            continue  # ORT's CPU GroupQueryAttention refuses do_rotary unless head_size is a multiple of 16
        for index, rope in enumerate(ropes):
            node.replace_input_with(index, rope.inputs[0])
            graph.remove(rope, safe=True)  # its output had this one use: q and k keep one reader each
        node.resize_inputs(10)
        for index, value in ((7, caches[0]), (8, caches[1]), (9, position_ids)):
            node.replace_input_with(index, value)
        node.attributes["do_rotary"] = ir.AttrInt64("do_rotary", 1)
        node.attributes["rotary_interleaved"] = ir.AttrInt64("rotary_interleaved", interleaved.pop())
        stats["rotary"] += 1
        stats["packed"] += _pack_qkv(node)
    RemoveUnusedNodesPass()(model)
    return stats


def _projection_width(value) -> int | None:
    """The static last dim of a rank-3 value, from its shape or (an export without shapes) from
    the MatMul / MatMulNBits of a constant weight that made it."""
    if value.shape is not None:
        last = value.shape[-1] if len(value.shape) == 3 else None
        return last if isinstance(last, int) else None
    node = value.producer()
    if node is not None and node.op_type == "MatMulNBits" and "N" in node.attributes:
        return node.attributes["N"].value
    weight = node.inputs[1] if node is not None and node.op_type == "MatMul" and len(node.inputs) > 1 else None
    if weight is not None and weight.const_value is not None and len(weight.const_value.shape) == 2:
        return weight.const_value.shape[1]
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
    last-axis parts of one [B, S, (H + 2 Hkv) * D] projection that nothing else reads."""
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
