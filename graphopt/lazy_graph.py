"""Running a graph whose weights are still in their checkpoint (lazy constants,
graphopt/lazy_weights.py) without reading them all in: node by node, each weight read when a
node needs it and dropped after that node.

``run(gm, input_sets)`` is ``[gm(*inputs) for inputs in input_sets]`` computed so: a node that
depends on no input and reads a lazy weight (the weight itself, its transpose, a merged QKV's
concatenation) is not kept but computed when a node that reads an input needs it, and dropped
after that node; an input's values are dropped after their last use. A pure graph runs on
all the input sets in step, so each weight is read once for all of them; a graph that updates
something in place (a KV cache) runs one input set after the other, as separate calls would.
The values are those of the graph with every weight read in, bit for bit: the same ops on the
same tensors. Who uses it: ``graphopt export``'s check against eager (graphopt/export/validate.py)
and --int4's calibration (graphopt/quant/plan.py), so neither holds a float copy of the model.
"""

from __future__ import annotations

from typing import Any, Callable, Collection, Sequence

import torch.fx as fx

from graphopt import lazy_weights

_CALLS = ("call_function", "call_method", "call_module")

# watched node, its values on the input sets run in this step (all of them, or one at a time)
OnValue = Callable[[fx.Node, list[Any]], None]


def has_lazy_constants(gm: fx.GraphModule) -> bool:
    return any(lazy_weights.is_lazy(_attr(gm, n.target)) for n in gm.graph.find_nodes(op="get_attr"))


def in_step(gm: fx.GraphModule) -> bool:
    """Whether ``run`` takes ``gm``'s input sets in step: nothing in it updates in place."""
    return not any(n.op in _CALLS and n.is_impure() for n in gm.graph.nodes)


def run(gm: fx.GraphModule, input_sets: Sequence[Sequence[Any]], *, watched: Collection[fx.Node] = (),
        on_value: OnValue | None = None, outputs: bool = True) -> list[Any]:
    """``gm(*inputs)`` for each of ``input_sets`` (see the module docstring); ``on_value(node,
    values)`` sees each ``watched`` node's values as they are computed. With ``outputs`` false,
    a pure graph runs only what the watched nodes need (not an LM head's logits) and returns Nones."""
    if in_step(gm):
        return _run(gm, input_sets, watched, on_value, outputs, pure=True)
    return [out for inputs in input_sets for out in _run(gm, [inputs], watched, on_value, True, pure=False)]


def _run(gm: fx.GraphModule, input_sets: Sequence[Sequence[Any]], watched: Collection[fx.Node],
         on_value: OnValue | None, outputs: bool, pure: bool) -> list[Any]:
    nodes = list(gm.graph.nodes) if outputs else _needed(gm, watched)
    deferred = _deferred(gm, nodes, pure)
    last_use: dict[fx.Node, list[fx.Node]] = {}
    seen: set[fx.Node] = set()
    for node in reversed(nodes):
        for used in node.all_input_nodes:
            if used not in deferred and used not in seen:
                seen.add(used)
                last_use.setdefault(node, []).append(used)
    envs: list[dict[fx.Node, Any]] = [{} for _ in input_sets]
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    for env, inputs in zip(envs, input_sets):
        env.update(zip(placeholders, gm.graph.process_inputs(*inputs)))
    results: list[Any] = [None] * len(input_sets)
    for node in nodes:
        if node in deferred or node.op == "placeholder":
            continue
        computed: dict[fx.Node, Any] = {}  # this node's weights, shared by the sets
        for used in node.all_input_nodes:
            if used in deferred:
                _deferred_value(gm, used, computed, deferred, envs[0])
        for i, env in enumerate(envs):
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: computed[n] if n in computed else env[n])
            if node.op == "output":
                results[i] = gm.graph.process_outputs(args[0])
            elif node.op == "get_attr":  # a constant of its own (a buffer updated in place)
                env[node] = _attr(gm, node.target)
            else:
                env[node] = _call(gm, node, args, kwargs)
            for used in last_use.get(node, ()):
                env.pop(used, None)
            del args, kwargs
        del computed  # this node's weights go before the next node's are read
        if node in watched and on_value is not None:
            on_value(node, [env[node] for env in envs])
        if node not in seen:  # computed for the watcher only (no node here reads it)
            for env in envs:
                env.pop(node, None)
    return results


def _needed(gm: fx.GraphModule, watched: Collection[fx.Node]) -> list[fx.Node]:
    """The nodes the watched ones depend on (themselves included), in graph order."""
    needed: set[fx.Node] = set()
    stack = list(watched)
    while stack:
        node = stack.pop()
        if node not in needed:
            needed.add(node)
            stack.extend(node.all_input_nodes)
    return [n for n in gm.graph.nodes if n in needed]


def _deferred(gm: fx.GraphModule, nodes: list[fx.Node], pure: bool) -> set[fx.Node]:
    """Nodes computed when needed instead of kept: those that depend on no input and are no
    in-place update; in a graph with updates, only those that read a lazy weight (the rest
    run in order, as the graph does)."""
    constant: set[fx.Node] = set()
    lazy: set[fx.Node] = set()
    for node in nodes:
        if node.op == "get_attr":
            constant.add(node)
            if lazy_weights.is_lazy(_attr(gm, node.target)):
                lazy.add(node)
        elif node.op in _CALLS and not node.is_impure() and all(n in constant for n in node.all_input_nodes):
            constant.add(node)
            if any(n in lazy for n in node.all_input_nodes):
                lazy.add(node)
    return constant if pure else lazy


def _deferred_value(gm: fx.GraphModule, node: fx.Node, computed: dict[fx.Node, Any], deferred: set[fx.Node],
                    env: dict[fx.Node, Any]) -> Any:
    """A deferred node's value, its lazy weights read (memoized in ``computed``; what it reads
    that is not deferred comes from ``env``)."""
    if node in computed:
        return computed[node]
    if node not in deferred:
        return env[node]
    if node.op == "get_attr":
        value = _attr(gm, node.target)
        if lazy_weights.is_lazy(value):
            value = lazy_weights.materialize(value)
        elif isinstance(value, fx.GraphModule):  # a subgraph (a higher-order op's body): read its own in
            lazy_weights.load_constants(value)
    else:
        for used in node.all_input_nodes:
            _deferred_value(gm, used, computed, deferred, env)
        args, kwargs = fx.node.map_arg((node.args, node.kwargs),
                                       lambda n: computed[n] if n in computed else env[n])
        value = _call(gm, node, args, kwargs)
    computed[node] = value
    return value


def _call(gm: fx.GraphModule, node: fx.Node, args: Any, kwargs: Any) -> Any:
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    return _attr(gm, node.target)(*args, **kwargs)  # call_module


def _attr(gm: fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for atom in target.split("."):
        value = getattr(value, atom)
    return value
