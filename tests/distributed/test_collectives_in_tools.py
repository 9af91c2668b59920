"""Collectives in graphopt's tools: ``graphopt debug`` prints them in the IR of a sharded
model, and the CUDA-graph partitioner captures an NCCL collective (and the wait on it)
with its neighbours, while a gloo one runs eagerly with the reason.

One process, a gloo world of size 1: enough for dynamo to trace the functional
all-reduce and for the partitioner to look its process group up. The graphs for the
partitioner carry fake CUDA tensors (tests/passes/test_cuda_graphs.py's Builder).
"""

import operator

import pytest
import torch
import torch.distributed as dist
from typer.testing import CliRunner

import graphopt.ops.collectives  # noqa: F401  registers graphopt::all_reduce_add_rms_norm
from graphopt.cli.main import app
from graphopt.cuda_graphs import plan_of
from tests.helpers import run_pass
from tests.passes.test_cuda_graphs import Builder

aten, c10d = torch.ops.aten, torch.ops._c10d_functional


@pytest.fixture(scope="module")
def group_name():
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD.group_name
    if started:
        dist.destroy_process_group()


def row_parallel_graph(group: str):
    """mm -> all_reduce -> wait -> fused all-reduce + add + RMSNorm -> relu, all on CUDA."""
    b = Builder()
    x, w, res, nw = b.input("x", (4, 8)), b.input("w", (8, 8)), b.input("res", (4, 8)), b.input("nw", (8,))
    mm = b.op(aten.mm.default, x, w)
    reduced = b.op(c10d.wait_tensor.default, b.op(c10d.all_reduce.default, mm, "sum", group))
    fused = b.op(torch.ops.graphopt.all_reduce_add_rms_norm.default, reduced, res, nw, 1e-6, group,
                 val=lambda: (torch.empty(4, 8, device="cuda"), torch.empty(4, 8, device="cuda")))
    normed = b.graph.call_function(operator.getitem, (fused, 0))
    normed.meta["val"] = fused.meta["val"][0]
    return b.done(b.op(aten.relu.default, normed))


def test_nccl_collectives_are_captured_with_their_neighbours(group_name, monkeypatch):
    # No NCCL here: the group's backend is the one fact the partitioner asks; say it is NCCL.
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    result = run_pass("cuda_graphs", row_parallel_graph(group_name))
    assert plan_of(result.gm).regions == [["mm", "all_reduce", "wait_tensor", "all_reduce_add_rms_norm",
                                           "getitem", "relu"]]
    assert not result.near_misses


def test_gloo_collectives_run_eagerly_and_say_why(group_name):
    result = run_pass("cuda_graphs", row_parallel_graph(group_name))
    reasons = {m.node: m.reason for m in result.near_misses}
    assert plan_of(result.gm).regions == [["mm"], ["relu"]]
    assert reasons["all_reduce"].startswith("collective over a gloo process group")
    assert reasons["wait_tensor"] == "waits on all_reduce, which runs eagerly"
    assert reasons["all_reduce_add_rms_norm"].startswith("collective over a gloo process group")


def test_a_group_this_process_does_not_know_runs_eagerly(group_name):
    result = run_pass("cuda_graphs", row_parallel_graph("no-such-group"))
    reasons = {m.node: m.reason for m in result.near_misses}
    assert "'no-such-group', which this process cannot resolve" in reasons["all_reduce"]


def sharded_llama_tiny():
    """A ``package.module:factory`` for graphopt debug: llama-tiny sharded over this
    process's world (functional all-reduces in its row-parallel projections)."""
    from graphopt.sources import load_model
    from graphopt.distributed.shard import shard_llama

    loaded = load_model("llama-tiny", batch=1, seq_len=8)
    return shard_llama(loaded.module), loaded.example_inputs


def test_debug_prints_the_collectives(group_name):
    result = CliRunner().invoke(app, ["debug", f"{__name__}:sharded_llama_tiny",
                                      "--print-ir-before", "fuse_all_reduce_add_rms_norm",
                                      "--print-ir-after", "fuse_all_reduce_add_rms_norm"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    before, _, after = result.output.partition("after fuse_all_reduce_add_rms_norm")
    assert "_c10d_functional.all_reduce" in before and "_c10d_functional.wait_tensor" in before
    assert "graphopt.all_reduce_add_rms_norm" in after
    assert "_c10d_functional.all_reduce" not in after
