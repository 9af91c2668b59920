"""One ONNX decoder for prefill and decode whose GroupQueryAttentions update a shared KV buffer in place.

The model (``export_decoder``) takes ``input_ids`` [batch, sequence], ``position_ids``
[batch, sequence], ``last`` [batch] (the position whose logits to return), ``seqlens_k``
[batch] int32, ``total_sequence_length`` (int32 scalar) and ``past_key_i`` /
``past_value_i`` [batch, Hkv, max_length, D]; it returns ``logits`` [batch, vocab] and
``present_key_i`` / ``present_value_i`` of the past's shape. Bound to the same memory
through IOBinding (``in_place.InPlaceSession``), past and present are one buffer: ONNX
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

Rotary: after the layout tidy-up, each layer's q/k RotaryEmbeddings move into its
GroupQueryAttention (``rotary_fold.fold_rotary_into_attention``: do_rotary with cos/sin
caches of the model's ``max_position_embeddings`` rows, read at ``position_ids``), which also
takes the fused QKV projection packed. The caches end there, so the model records their
length (metadata ``graphopt.rotary_positions``) and ``in_place.InPlaceSession`` refuses a
longer sequence instead of reading past them.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import Tensor, nn

from graphopt.backends.onnxruntime.decoder.in_place import ROTARY_POSITIONS
from graphopt.backends.onnxruntime.onnx_passes import attention_layout, rotary_fold
from graphopt.backends.onnxruntime.onnx_passes.runner import run_onnx_passes
from graphopt.errors import GraphoptError

MS_DOMAIN = "com.microsoft"
# ROTARY_POSITIONS, a metadata key: the rows of the cos/sin caches GroupQueryAttention rotates
# with, when it does; the decoder refuses a sequence longer than that (in_place.InPlaceSession).


class DecoderStep(nn.Module):
    """``(input_ids, position_ids, last) -> (logits [B, V] at ``last``, k_0, v_0, k_1, ...)``
    for the prompt pass (no past). The logits come from the hidden state at ``last`` only:
    a pre-hook on the output head gathers that row before it, so the head runs on one
    position per row, not the whole prompt."""

    def __init__(self, model: nn.Module) -> None:
        from graphopt.sources.transformers_attention import mask_kept
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
        from graphopt.sources.transformers_attention import unmasked_sdpa

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


def max_positions(model: nn.Module) -> int | None:
    """The longest sequence ``model`` was made for (its rotary tables' length), when it says."""
    config = getattr(model, "config", None)
    for name in ("max_position_embeddings", "max_seq_len"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def cache_names(layers: int, prefix: str) -> list[str]:
    return [f"{prefix}_{kind}_{i}" for i in range(layers) for kind in ("key", "value")]


def export_decoder(model: nn.Module, prompt: Tensor, config, timer=None, opset: int | None = None,
                   rewrite: bool = False):
    """The in-place decoder of ``model`` (see the module docstring) -> (OnnxModel, the pipeline's
    result). ``prompt`` [B, S] with B, S >= 2 (torch.export specializes sizes of 1). The core's
    front half traces and optimizes the prompt pass; ``lower_decoder`` makes the model of it.

    ``rewrite``: run onnxscript's pattern rewrites on the export (``export.export_graph``);
    off by default, since ORT's session optimizer makes the same rewrites when it loads the
    model and they cost half the ONNX export of a 30-layer model.
    """
    from graphopt.compiler import front_half
    from graphopt.export.files import Timer
    from graphopt.export.model import dims_for

    timer = timer or Timer(None)
    batch, length = prompt.shape
    positions = torch.arange(length).repeat(batch, 1)
    last = torch.arange(batch) % length  # any in-range rows: values do not shape the graph
    sequence = {0: "batch", 1: "sequence"}
    axes = [sequence, sequence, {0: "batch"}]
    lower = lambda optimized: (lower_decoder(optimized, model, axes, timer, opset, rewrite),  # noqa: E731
                               optimized.result)
    # a decoder's layers repeat: traced once (graphopt/frontend/repeated_layers.py)
    return front_half(DecoderStep(model), config, lower, args=(prompt, positions, last),
                      dynamic_shapes=tuple(dims_for(axes)), trace_repeated_once=True, timer=timer)


def lower_decoder(optimized, model: nn.Module, axes: list, timer, opset: int | None = None, rewrite: bool = False):
    """The optimized prompt pass (graphopt.compiler.Optimized) -> the in-place decoder's
    OnnxModel: exported, its attentions rewired onto the shared cache, the layout tidied and
    rotary folded into attention. Runs ONNX-level rewrites only, no FX pass."""
    from graphopt.backends.onnxruntime.lower.export import export_graph

    layers = (len(optimized.gm.graph.output_node().args[0]) - 1) // 2  # logits, then a key and a value per layer
    with timer("onnx export"):
        onnx_model = export_graph(optimized.gm, optimized.example_inputs, opset=opset, axis_names=axes,
                                  input_names=["input_ids", "position_ids", "last"],
                                  output_names=["logits", *cache_names(layers, "prompt")], rewrite=rewrite,
                                  infer_types=False)
        share_cache(onnx_model.model)
        positions = max_positions(model)
        # rotary inside GroupQueryAttention: its cos/sin cache needs a row per position
        fold = [rotary_fold.FoldRotaryIntoAttention(positions)] if positions else []
        done = run_onnx_passes(onnx_model.model, [attention_layout.tidy_attention_layout_pass, *fold])
        onnx_model.passes.extend(done)  # reported with the export's own ONNX passes
        if any(r.stats.get("rotary") for r in done.records if r.name.endswith(":fold_rotary_into_attention")):
            onnx_model.model.metadata_props[ROTARY_POSITIONS] = str(positions)
    onnx_model.notes = list(optimized.program.notes)
    graph = onnx_model.model.graph
    onnx_model.input_names = [v.name for v in graph.inputs]
    onnx_model.output_names = [v.name for v in graph.outputs]
    onnx_model.output_plan = list(range(len(graph.outputs)))
    onnx_model.cached_attention = layers
    return onnx_model
