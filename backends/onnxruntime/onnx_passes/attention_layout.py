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
input holds absolute positions, ``rotary_fold.fold_rotary_into_attention`` then moves those
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
    from graphopt.backends.onnxruntime.lower.translations._common import dims_equal

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


def fill_shape(value) -> None:
    """Give ``value`` its shape when a translation made it without one (an export without
    onnxscript's rewrites infers none): a Transpose's from its input's, a Reshape's from its
    input's and a constant target, an Identity's its input's. Input shapes are filled first."""
    import onnx_ir as ir

    if value is None or value.shape is not None or (node := value.producer()) is None or not node.inputs:
        return
    x = node.inputs[0]
    fill_shape(x)
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
    from graphopt.backends.onnxruntime.lower.translations._common import dims_equal

    fill_shape(value)
    if value.shape is None or len(value.shape) != 3:
        return None
    current, bnsh, rope, after_rope = value, False, None, [value]
    while (node := current.producer()) is not None:
        x = node.inputs[0] if node.inputs else None
        if x is None:
            return None
        fill_shape(x)
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


def tidy_attention_layout(model, refusals: list | None = None) -> dict[str, int]:
    """Remove attention's layout round trips from ``model`` (onnx_ir, in place; see above):

    - each GroupQueryAttention's query, key and value read the [B, S, H*D] projection slices
      they were reshaped from; a RotaryEmbedding on the way moves onto that slice
      (``RotaryEmbedding(x [B, S, H*D], num_heads=H)`` rotates what the BNSH one did);
    - a rank-3 value that is a layout round trip of another (the attention output's Reshapes
      back to [B, S, H*D]) is replaced by it;
    - a Shape of one axis whose size is a named symbol of a graph input reads that input, so
      every layer's seqlens_k / total_sequence_length (and batch size) is one computation,
      merged by common subexpression elimination.

    Returns counts of each rewrite; ``refusals`` (a list) gets a ``runner.Refusal`` for each
    attention input behind a layout round trip that stays. Shapes come from the export's
    metadata (torch.export's fake tensors), so a value without one is left as it is."""
    from graphopt.backends.onnxruntime.onnx_passes.runner import Refusal

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
            role = ("query", "key", "value")[index]
            if found is None:
                producer = value.producer() if value is not None else None
                if refusals is not None and producer is not None and producer.domain == "" \
                        and producer.op_type in ("Reshape", "Transpose"):
                    refusals.append(Refusal(node.name, f"{role}: its layout round trip holds a node other than "
                                            "Reshape, Transpose, Identity, a whole Slice or one RotaryEmbedding, or "
                                            "a shape is unknown"))
                continue
            source, rope, chain = found
            if rope is not None and any(len(v.uses()) > 1 or v.is_graph_output() for v in chain[1:]):
                # the rotated BNSH value is needed anyway (a returned key): rotating twice costs more
                if refusals is not None:
                    refusals.append(Refusal(node.name, f"{role}: the rotated value is also read elsewhere (a "
                                            "returned key), so moving its RotaryEmbedding would rotate twice"))
                continue
            if rope is not None:
                attributes = [ir.Attr(a.name, a.type, a.value) for a in rope.attributes.values()]
                moved = ir.Node(MS_DOMAIN, "RotaryEmbedding", [source, *rope.inputs[1:]], attributes,
                                name=f"{rope.name}_bsh", version=rope.version)
                moved.outputs[0].shape = ir.Shape(value.shape)
                _set_dtype(moved.outputs[0], value, source)
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
            _set_dtype(out, *node.inputs[:3])
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


def _set_dtype(value, *like) -> None:
    """Give ``value`` the first known dtype of ``like`` (attention's q, k, v share one) if it has
    none. Never assign None: onnx_ir then holds a typeless TensorType, which a value with a
    shape cannot serialize (a q/k norm made by a translation, as Qwen3's, carries no dtype)."""
    if value.dtype is not None:
        return
    dtype = next((v.dtype for v in like if v is not None and v.dtype is not None), None)
    if dtype is not None:
        value.dtype = dtype


class TidyAttentionLayout:
    """``tidy_attention_layout`` as an ONNX pass (runner.py)."""

    name = "tidy_attention_layout"
    summary = "attention's reshape/transpose round trips removed; RotaryEmbedding reads [B, S, H*D]"

    def run(self, model):
        from graphopt.backends.onnxruntime.onnx_passes.runner import OnnxPassResult

        refusals: list = []
        stats = tidy_attention_layout(model, refusals)
        return OnnxPassResult(sum(stats.values()), stats, refusals)


tidy_attention_layout_pass = TidyAttentionLayout()
