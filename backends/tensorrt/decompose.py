"""``graphopt.<op>(...) -> the ATen ops of its reference implementation``, in place in the graph.

TensorRT has no converter for graphopt's ops, and torch-tensorrt would run each one in
PyTorch between engines, cutting the model into many small engines. Each op's reference
is plain torch, so tracing it on the node's own fake inputs gives standard ATen that
TensorRT's own fusions (normalization, GELU, attention) recognize.

Per node, not by re-tracing the whole graph: the other nodes keep their names, frozen
weights and metadata, and the reference is traced in the graph's own FakeTensorMode, so
symbolic sizes stay symbolic. Every new node carries ``meta["val"]``.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from graphopt import ir
from graphopt.errors import GraphoptError
from graphopt.ops import op_name

# Provenance the new nodes inherit from the op they replace; the rest of their meta
# (val, tensor_meta) is their own.
_INHERITED_META = ("stack_trace", "nn_module_stack", "source_fn_stack", ir.CREATED_BY)


def reference_of(op: torch._ops.OpOverload) -> Callable:
    """The plain-torch function a ``graphopt::`` op was defined from.

    torch has no public accessor for a custom op's Python body; this is its one use here.
    """
    from torch._library.custom_ops import _maybe_get_opdef

    opdef = _maybe_get_opdef(op)
    fn = getattr(opdef, "_init_fn", None)
    if fn is None:
        raise GraphoptError(f"{op_name(op)} has no Python reference to decompose for TensorRT")
    return fn


def decompose_graphopt_ops(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with every graphopt op node replaced by its reference's ATen ops (in place;
    returns ``gm``). Needs ``meta["val"]`` on the ops' inputs, as every graphopt graph has."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and op_name(node.target) is not None:
            _inline_reference(gm, node)
    gm.graph.lint()
    gm.recompile()
    return gm


def _inline_reference(gm: fx.GraphModule, node: fx.Node) -> None:
    inputs = node.all_input_nodes
    missing = [n.name for n in inputs if "val" not in n.meta]
    if missing:
        raise GraphoptError(f"cannot decompose {op_name(node.target)}: inputs {', '.join(missing)} have no meta['val']")
    vals = [n.meta["val"] for n in inputs]
    fn = reference_of(node.target)

    def body(*tensors: Any) -> Any:
        # Non-tensor arguments (eps, layout, sizes) are baked in; tensors become placeholders.
        env = dict(zip(inputs, tensors))
        return fn(*fx.node.map_arg(node.args, env.__getitem__), **fx.node.map_arg(node.kwargs, env.__getitem__))

    # "symbolic" reuses the graph's FakeTensorMode and ShapeEnv, so a size the
    # reference reads (x.shape[-1] // 2) stays an expression in the graph's symbols.
    symbolic = any(isinstance(v, torch.SymInt) or isinstance(v, torch.Tensor) and any(
        isinstance(s, torch.SymInt) for s in v.shape) for v in vals)
    sub = make_fx(body, tracing_mode="symbolic" if symbolic else "fake")(*vals)

    env: dict[fx.Node, Any] = {}
    placeholders = iter(inputs)
    with gm.graph.inserting_before(node):
        for sub_node in sub.graph.nodes:
            if sub_node.op == "placeholder":
                env[sub_node] = next(placeholders)
            elif sub_node.op == "get_attr":  # a constant the reference created
                env[sub_node] = ir.add_constant(gm, f"{node.name}_{sub_node.target}", getattr(sub, sub_node.target))
            elif sub_node.op == "output":
                result = fx.node.map_arg(sub_node.args[0], env.__getitem__)
            else:
                new = gm.graph.node_copy(sub_node, env.__getitem__)
                new.meta = {**{k: node.meta[k] for k in _INHERITED_META if k in node.meta}, **sub_node.meta}
                env[sub_node] = new
    _replace_uses(node, result)
    gm.graph.erase_node(node)


def _replace_uses(node: fx.Node, result: Any) -> None:
    """Point ``node``'s users at ``result``: a node, or a tuple/list for an op with several outputs."""
    if not isinstance(result, (tuple, list)):
        node.replace_all_uses_with(result)
        return
    for user in list(node.users):
        if user.target is not operator.getitem:
            raise GraphoptError(f"cannot decompose {op_name(node.target)}: {user.name} uses its outputs as a whole")
        user.replace_all_uses_with(result[user.args[1]])
        user.graph.erase_node(user)
