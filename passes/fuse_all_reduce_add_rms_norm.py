"""Tensor-parallel all-reduce + residual add + RMSNorm:
``y, s = graphopt.add_rms_norm(wait_tensor(all_reduce(p, "sum", g)), r, w, eps)  ->
y, s = graphopt.all_reduce_add_rms_norm(p, r, w, eps, g)``.

Why: a row-parallel projection (o_proj, down_proj) ends in an all-reduce of its partial
sums, and the reduced rows go straight into the residual add and the next RMSNorm. One op
lets a target reduce, add and normalise in one pass over the rows (vLLM's fused
all-reduce + RMSNorm) instead of writing the reduced tensor out and reading it back.

Runs after fuse_add_rms_norm and matches its ``graphopt.add_rms_norm``, so every residual
add + RMSNorm spelling that pass knows composes here; the reduced value may be either
operand of the add.
Preconditions: the all-reduce sums (other reductions would not commute with the fused
kernel's contract); the all-reduce and its wait are read only by the norm (another reader
would need the reduced value the fused op keeps inside); no other collective sits between
the all-reduce and the norm, since moving the all-reduce to the norm would change the order
in which this rank joins collectives, and every rank must join them in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

import graphopt.ops.collectives  # noqa: F401  (registers graphopt::all_reduce_add_rms_norm)
from graphopt.rewrite import NoMatch, PatternPass, call_args, expect, is_op, scalar

c10d = torch.ops._c10d_functional


@dataclass
class AllReduceNormMatch:
    norm: fx.Node
    all_reduce: fx.Node
    wait: fx.Node
    partial: fx.Node  # the all-reduce's input: this rank's partial sums
    residual: fx.Node
    group: str


def _is_collective(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "namespace", None) in ("_c10d_functional", "c10d_functional")


def _reduced_operand(norm: fx.Node, args: dict) -> tuple[fx.Node, fx.Node]:
    """(the wait_tensor operand, the other operand) of the norm's residual add."""
    for mine, other in ((args["x"], args["residual"]), (args["residual"], args["x"])):
        if is_op(mine, c10d.wait_tensor.default):
            return mine, other
    raise NoMatch("neither operand of the residual add is a wait_tensor of an all_reduce", norm)


class FuseAllReduceAddRmsNorm(PatternPass):
    name = "fuse_all_reduce_add_rms_norm"
    summary = "add_rms_norm(wait(all_reduce(p)), r) -> graphopt.all_reduce_add_rms_norm(p, r)"
    requires = ("fuse_add_rms_norm",)
    anchors = (torch.ops.graphopt.add_rms_norm.default,)

    def match(self, norm: fx.Node, options) -> AllReduceNormMatch:
        args = call_args(norm)
        wait, residual = _reduced_operand(norm, args)
        reduce = wait.args[0]
        expect(is_op(reduce, c10d.all_reduce.default),
               f"wait_tensor {wait.name} waits on no all_reduce", wait)
        partial, op, group = reduce.args[:3]
        expect(op == "sum", f"all_reduce {reduce.name} reduces with {op!r}; the fused op sums", reduce)
        expect(isinstance(group, str), f"all_reduce {reduce.name} names its group by {type(group).__name__}, "
               "not by a group name", reduce)
        expect(len(reduce.users) == 1, f"all_reduce {reduce.name} has {len(reduce.users)} users", reduce)
        expect(len(wait.users) == 1, f"reduced value {wait.name} is read by {len(wait.users)} nodes; "
               "the fused op keeps it inside", wait)
        expect(scalar(args["eps"]) is not None, "eps is not a constant", norm)
        node = reduce.next
        while node is not norm:
            # the all-reduce moves down to the norm: it must not pass another collective
            expect(not (_is_collective(node) and node is not wait),
                   f"collective {node.name} sits between all_reduce {reduce.name} and the norm", node)
            node = node.next
        return AllReduceNormMatch(norm, reduce, wait, partial, residual, group)

    def rewrite(self, gm: fx.GraphModule, m: AllReduceNormMatch, options) -> None:
        args = call_args(m.norm)
        with gm.graph.inserting_before(m.norm):
            fused = gm.graph.call_function(
                torch.ops.graphopt.all_reduce_add_rms_norm.default,
                (m.partial, m.residual, args["weight"], scalar(args["eps"]), m.group,
                 scalar(args["weight_offset"]) or 0.0))
        m.norm.replace_all_uses_with(fused)
        # explicit erase: dead-code elimination keeps collectives (they count as side effects)
        for node in (m.norm, m.wait, m.all_reduce):
            gm.graph.erase_node(node)


fuse_all_reduce_add_rms_norm = FuseAllReduceAddRmsNorm()
