"""One ONNX decoder for prefill and decode whose GroupQueryAttentions update a shared KV buffer in place.

The model (``export_decoder``) takes ``input_ids`` [batch, sequence], ``position_ids``
[batch, sequence], ``last`` [batch] (the position whose logits to return), ``seqlens_k``
[batch] int32, ``total_sequence_length`` (int32 scalar) and ``past_key_i`` /
``past_value_i`` [batch, Hkv, max_length, D]; it returns ``logits`` [batch, vocab] and
``present_key_i`` / ``present_value_i`` of the past's shape. Bound to the same memory
through IOBinding (``decoder.InPlaceSession``), past and present are one buffer: ONNX
Runtime's CPU GroupQueryAttention then writes the new rows at each row's own offset
(``seqlens_k``) and copies nothing else (it zero-fills and copies the whole past only when
the two differ). The same graph serves the prompt (sequence = total_sequence_length: GQA's
first-prompt mode, causal over each row's ``seqlens_k + 1`` tokens) and the step (sequence
1: attention over the row's cache up to ``seqlens_k``), so the weights are in memory once.

Layout: right-padded. Row i's prompt sits at cache rows 0 .. len_i - 1 whatever the batch's
longest prompt; the prompt pass also writes its padding's keys after it, which no query
reads (each attends to its own length) and the row's later tokens overwrite. Rotary takes
``position_ids``, so each row counts from its own first token.

How the graph is made: torch.export of the prompt pass alone (``DecoderStep``: no past, so
the attention is graphopt's causal ``attention``, which translates to GroupQueryAttention
without a past), then ``share_cache`` rewires every GroupQueryAttention onto the past
inputs, the graph's ``seqlens_k`` / ``total_sequence_length`` and present outputs, in place
of the keys and values the pass returned. Exporting the decode form instead would need a
``cat(past, new)`` in the traced graph, which transformers' mask code and GQA's
batch-1-for-chunks rule keep from lowering for a batch of prompts.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import Tensor, nn

from graphopt.errors import GraphoptError

MS_DOMAIN = "com.microsoft"


class DecoderStep(nn.Module):
    """``(input_ids, position_ids, last) -> (logits [B, V] at ``last``, k_0, v_0, k_1, ...)``
    for the prompt pass (no past). The logits come from the hidden state at ``last`` only:
    a pre-hook on the output head gathers that row before it, so the head runs on one
    position per row, not the whole prompt."""

    def __init__(self, model: nn.Module) -> None:
        from graphopt.backends.onnxruntime.hf_steps import mask_kept
        from graphopt.generation.runner import HFCausalStep, step_adapter

        super().__init__()
        self.step = step_adapter(model)
        self.hf = isinstance(self.step, HFCausalStep)
        if self.hf:
            self.step.extra = {"logits_to_keep": 0} if self.step.extra else {}  # the hook picks the row
        self.mask_kept = mask_kept(model) if self.hf else None
        getter = getattr(model, "get_output_embeddings", None)
        self.head = getter() if getter is not None else getattr(model, "lm_head", None)

    def forward(self, input_ids: Tensor, position_ids: Tensor, last: Tensor) -> tuple[Tensor, ...]:
        from graphopt.backends.onnxruntime.hf_steps import unmasked_sdpa

        with _gathered_head(self.head, last):
            unmasked = self.hf and torch.compiler.is_exporting() and self.mask_kept is None
            with unmasked_sdpa(self.step.model) if unmasked else contextlib.nullcontext():
                logits, *cache = self.step(input_ids, position_ids, [])
        if self.head is None or logits.shape[1] != 1:  # no head module to hook: pick the row from the logits
            logits = logits.gather(1, last[:, None, None].expand(-1, 1, logits.shape[-1]))
        return (logits[:, -1], *cache)


@contextlib.contextmanager
def _gathered_head(head: nn.Module | None, last: Tensor) -> Iterator[None]:
    """``head`` reads only row ``last[b]`` of each batch row's hidden states in the block."""
    if head is None:
        yield
        return

    def gather(module, args):
        hidden = args[0]
        return (hidden.gather(1, last[:, None, None].expand(-1, 1, hidden.shape[-1])), *args[1:])

    handle = head.register_forward_pre_hook(gather)
    try:
        yield
    finally:
        handle.remove()


def _bnsh_source(value, wanted: dict):
    """The [B, H, S, D] tensor in ``wanted`` behind GQA's ``Reshape(Transpose(x, [0, 2, 1, 3]),
    [0, 0, -1])``, through the no-op Identity and full Slice nodes an export without rewrites keeps."""
    reshape = value.producer() if value is not None else None
    if reshape is None or reshape.op_type != "Reshape":
        return None
    transpose = reshape.inputs[0].producer()
    if transpose is None or transpose.op_type != "Transpose":
        return None
    perm = transpose.attributes.get("perm")
    if perm is None or list(perm.value) != [0, 2, 1, 3]:
        return None
    source = transpose.inputs[0]
    while id(source) not in wanted and (node := source.producer()) is not None and _is_no_op(node):
        source = node.inputs[0]
    return source


def _is_no_op(node) -> bool:
    """Identity, or a Slice whose output has its input's (known) shape."""
    if node.op_type == "Identity":
        return True
    shape_in, shape_out = node.inputs[0].shape, node.outputs[0].shape
    return node.op_type == "Slice" and shape_in is not None and shape_in == shape_out


def _without_transpose_pairs(value):
    """``value`` behind pairs of Transposes that undo each other (``x.transpose(1, 2)`` then
    ``permute(0, 2, 1, 3)``, which an export without rewrites keeps) and Identity nodes."""
    while (node := value.producer()) is not None:
        if node.op_type == "Identity" and node.domain == "":
            value = node.inputs[0]
            continue
        inner = node.inputs[0].producer() if node.op_type == "Transpose" and node.inputs else None
        if inner is None or inner.op_type != "Transpose" or node.domain or inner.domain:
            return value
        outer_perm, inner_perm = list(node.attributes["perm"].value), list(inner.attributes["perm"].value)
        if [inner_perm[axis] for axis in outer_perm] != list(range(len(outer_perm))):
            return value
        value = inner.inputs[0]
    return value


def share_cache(model) -> int:
    """Rewire ``model`` (onnx_ir, outputs ``logits, k_0, v_0, ...``) in place so each
    GroupQueryAttention reads ``past_*_i`` and writes ``present_*_i``; returns the layers.
    Raises GraphoptError naming the first attention it cannot rewire."""
    import onnx_ir as ir
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    graph = model.graph
    logits, *kv = list(graph.outputs)
    if not kv or len(kv) % 2:
        raise GraphoptError(f"the prompt pass returns {len(kv)} cache tensors, not a key and a value per layer")
    where = {id(v): i for i, v in enumerate(kv)}
    for i, value in enumerate(kv):  # a key returned through a BNSH round trip is the value GQA reads
        where.setdefault(id(_without_transpose_pairs(value)), i)
    batch = ir.SymbolicDim("batch")
    seqlens = ir.Value(name="seqlens_k", type=ir.TensorType(ir.DataType.INT32), shape=ir.Shape([batch]))
    total = ir.Value(name="total_sequence_length", type=ir.TensorType(ir.DataType.INT32), shape=ir.Shape([]))
    past: dict[int, ir.Value] = {}
    present: dict[int, ir.Value] = {}
    for node in list(graph):
        if node.op_type != "GroupQueryAttention" or node.domain != MS_DOMAIN:
            continue
        k, v = _bnsh_source(node.inputs[1], where), _bnsh_source(node.inputs[2], where)
        i, j = where.get(id(k)), where.get(id(v))
        if i is None or j != i + 1 or i % 2:
            raise GraphoptError(f"attention {node.name} does not read a layer's returned key and value; "
                                "the in-place cache needs every attention to be GroupQueryAttention on them")
        if len(node.inputs) > 7 and any(x is not None for x in node.inputs[7:]):
            raise GraphoptError(f"attention {node.name} has a rotary cache or bias input; the in-place cache "
                                "rewires only plain causal GroupQueryAttention")
        layer = i // 2
        for index, source, kind in ((3, k, "key"), (4, v, "value")):
            shape = ir.Shape([batch, source.shape[1], ir.SymbolicDim("max_length"), source.shape[3]])
            past[i + index - 3] = ir.Value(name=f"past_{kind}_{layer}", type=ir.TensorType(source.dtype), shape=shape)
            node.replace_input_with(index, past[i + index - 3])
        node.replace_input_with(5, seqlens)
        node.replace_input_with(6, total)
        node.resize_outputs(3)
        for out, kind in ((1, "key"), (2, "value")):
            value = node.outputs[out]
            value.name, value.dtype, value.shape = f"present_{kind}_{layer}", past[i].dtype, past[i].shape
            present[i + out - 1] = value
    if len(present) != len(kv):
        missing = sorted(set(range(len(kv))) - set(present))
        raise GraphoptError(f"cache output {kv[missing[0]].name} is read by no GroupQueryAttention; the in-place "
                            "cache needs every layer's attention lowered to it")
    graph.inputs.extend([seqlens, total, *[past[i] for i in range(len(kv))]])
    graph.outputs.clear()
    graph.outputs.extend([logits, *[present[i] for i in range(len(kv))]])
    RemoveUnusedNodesPass()(model)
    return len(kv) // 2


def cache_names(layers: int, prefix: str) -> list[str]:
    return [f"{prefix}_{kind}_{i}" for i in range(layers) for kind in ("key", "value")]


def export_decoder(model: nn.Module, prompt: Tensor, config, timer=None, opset: int | None = None,
                   rewrite: bool = False):
    """The in-place decoder of ``model`` (see the module docstring) -> (OnnxModel, the pipeline's
    result). ``prompt`` [B, S] with B, S >= 2 (torch.export specializes sizes of 1).

    ``rewrite``: run onnxscript's pattern rewrites on the export (``export.export_graph``);
    off by default, since ORT's session optimizer makes the same rewrites when it loads the
    model and they cost half the ONNX export of a 30-layer model.
    """
    from graphopt.backends.onnxruntime import tool
    from graphopt.backends.onnxruntime.export import export_graph
    from graphopt.compiler import run_pipeline
    from graphopt.frontend import export_aten_graph

    timer = timer or tool.Timer(None)
    step = DecoderStep(model)
    batch, length = prompt.shape
    positions = torch.arange(length).repeat(batch, 1)
    last = torch.arange(batch) % length  # any in-range rows: values do not shape the graph
    with torch.no_grad():
        layers = (len(step(prompt, positions, last)) - 1) // 2
    sequence = {0: "batch", 1: "sequence"}
    axes = [sequence, sequence, {0: "batch"}]
    with timer("torch.export"):
        program = export_aten_graph(step, (prompt, positions, last), dynamic_shapes=tuple(tool.dims_for(axes)))
    with timer("passes"):
        result, _ = run_pipeline(program.gm, config, program.example_inputs)
    with timer("onnx export"):
        onnx_model = export_graph(result.gm, program.example_inputs, opset=opset, axis_names=axes,
                                  input_names=["input_ids", "position_ids", "last"],
                                  output_names=["logits", *cache_names(layers, "prompt")], rewrite=rewrite)
        share_cache(onnx_model.model)
        tidy_attention_layout(onnx_model.model)
    graph = onnx_model.model.graph
    onnx_model.input_names = [v.name for v in graph.inputs]
    onnx_model.output_names = [v.name for v in graph.outputs]
    onnx_model.output_plan = list(range(len(graph.outputs)))
    onnx_model.cached_attention = layers
    return onnx_model, result


# Attention's layout round trips. The exported graph keeps each layer's head split as the FX
# graph spelled it: q/k as Reshape [B, S, H, D] -> Transpose to BNSH -> RotaryEmbedding ->
# Transpose back -> Reshape [B, S, H*D] into GroupQueryAttention, v as two Reshapes, the
# output as Reshapes back, and each layer's seqlens_k / total_sequence_length recomputed from
# its own past's Shape. ORT's session optimizer removes none of it (RotaryEmbedding sits
# between the Transposes, and no two layers' past are the same input), so a decode step ran
# about 20 layout nodes per layer. ``tidy_attention_layout`` reads the rank-3 values straight:
# RotaryEmbedding takes [B, S, H*D] with num_heads, the op ORT runs on either layout.

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
