"""``graphopt.<op>(...) -> the ATen ops of its reference implementation``, in place in the graph.

A target that cannot lower a graphopt op still runs it at full speed of its own compiler
when the op becomes the standard ATen ops its reference is written in: TensorRT fuses
them itself (it knows no graphopt op at all), and ONNX Runtime exports them with standard
ONNX ops when it has no translation for that one op. Either way the graph stays whole on
the target instead of being cut around the op.

Per node, not by re-tracing the whole graph: the other nodes keep their names, frozen
weights and metadata, and the reference is traced in the graph's own FakeTensorMode, so
symbolic sizes stay symbolic. Every new node carries ``meta["val"]``.
"""

from __future__ import annotations

import operator
from collections import Counter
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from graphopt import ir
from graphopt.errors import GraphoptError
from graphopt.ops import op_name, reference_of

# Provenance the new nodes inherit from the op they replace; the rest of their meta
# (val, tensor_meta) is their own.
_INHERITED_META = ("stack_trace", "nn_module_stack", "source_fn_stack", ir.CREATED_BY)


def decompose_graphopt_ops(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with every graphopt op node replaced by its reference's ATen ops (in place;
    returns ``gm``). Needs ``meta["val"]`` on the ops' inputs, as every graphopt graph has."""
    decompose_ops(gm, lambda node: op_name(node.target) is not None)
    return gm


def decompose_ops(gm: fx.GraphModule, wanted: Callable[[fx.Node], bool]) -> Counter:
    """Replace every call_function node for which ``wanted(node)`` holds by its op's
    reference (in place); returns how many of each op (``graphopt.rope``) were replaced.
    Raises GraphoptError naming the op when one cannot be decomposed."""
    done: Counter = Counter()
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and wanted(node):
            name = op_name(node.target) or ir.target_name(node.target)
            inline_reference(gm, node)
            done[name] += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def inline_reference(gm: fx.GraphModule, node: fx.Node) -> None:
    """Replace ``node`` (a custom op call) by the ATen ops of its reference, traced on the
    node's own fake inputs. Non-tensor arguments (eps, layout, sizes) are baked in."""
    inputs = node.all_input_nodes
    missing = [n.name for n in inputs if "val" not in n.meta]
    if missing:
        raise GraphoptError(f"cannot decompose {op_name(node.target)}: inputs {', '.join(missing)} have no meta['val']")
    vals = [n.meta["val"] for n in inputs]
    fn = reference_of(node.target)

    def body(*tensors: Any) -> Any:
        env = dict(zip(inputs, tensors))
        return fn(*fx.node.map_arg(node.args, env.__getitem__), **fx.node.map_arg(node.kwargs, env.__getitem__))

    # "symbolic" reuses the graph's FakeTensorMode and ShapeEnv, so a size the
    # reference reads (x.shape[-1] // 2) stays an expression in the graph's symbols.
    symbolic = any(isinstance(v, torch.SymInt) or isinstance(v, torch.Tensor) and any(
        isinstance(s, torch.SymInt) for s in v.shape) for v in vals)
    if not symbolic:
        vals = _in_one_fake_mode(vals)
    sub = make_fx(body, tracing_mode="symbolic" if symbolic else "fake")(*vals)

    env: dict[fx.Node, Any] = {}
    placeholders = iter(inputs)
    result: Any = None
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


def _in_one_fake_mode(vals: list) -> list:
    """Static-shape stand-ins for ``vals`` in one fresh FakeTensorMode: a graph traced by
    plain ``make_fx`` gives each node's ``meta["val"]`` a mode of its own, and tracing
    refuses to mix them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
                if isinstance(v, torch.Tensor) else v for v in vals]


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
