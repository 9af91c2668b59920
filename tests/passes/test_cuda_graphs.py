"""cuda_graphs: which ops of a GPU graph can be captured, and why each other op cannot.

The graphs here carry fake CUDA tensors in meta["val"] (FakeTensorMode fakes device="cuda"
on this CPU-only build), so the partitioner's decisions are tested without a GPU.
"""

import json

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
from typer.testing import CliRunner

from graphopt import ir, models
from graphopt.cuda_graphs import REGION, plan_of
from graphopt.frontend.trace import export_aten_graph
from graphopt.passes.cuda_graphs import SKIPPED
from tests.helpers import run_pass

aten = torch.ops.aten


class Builder:
    """A small ATen graph whose values are fake tensors (CUDA unless told otherwise)."""

    def __init__(self):
        self.mode = FakeTensorMode(shape_env=ShapeEnv())
        self.graph = fx.Graph()

    def input(self, name, shape, device="cuda", dynamic=False):
        node = self.graph.placeholder(name)
        if dynamic:
            ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] + [DimDynamic.STATIC] * (len(shape) - 1))
            base = self.mode.from_tensor(torch.empty(shape, device="meta"), symbolic_context=ctx)
            with self.mode:
                node.meta["val"] = torch.empty(base.shape, device=device)
        else:
            with self.mode:
                node.meta["val"] = torch.empty(shape, device=device)
        return node

    def op(self, target, *args, val=None, **kwargs):
        node = self.graph.create_node("call_function", target, args, kwargs, name=target._opname)
        if val is None:
            ir.infer_val(node, self.mode)
        else:
            with self.mode:
                node.meta["val"] = val()
        return node

    def done(self, *outputs, **constants):
        self.graph.output(outputs)
        root = torch.nn.Module()
        for name, value in constants.items():
            root.register_buffer(name, value)
        return fx.GraphModule(root, self.graph)


def regions(gm):
    return plan_of(gm).regions


def test_a_static_gpu_graph_is_one_region():
    b = Builder()
    x, w = b.input("x", (4, 8)), b.input("w", (8, 8))
    y = b.op(aten.relu.default, b.op(aten.mm.default, x, w))
    gm = b.done(b.op(aten.add.Tensor, y, 1.0))
    result = run_pass("cuda_graphs", gm)
    assert result.modified and result.stats == {"matches": 1, "regions": 1, "captured_ops": 3, "eager_ops": 0}
    assert regions(result.gm) == [["mm", "relu", "add"]] and not result.near_misses
    assert plan_of(result.gm).device == "cuda:0"
    assert all(n.meta[REGION] == 0 for n in result.gm.graph.nodes if n.op == "call_function")


def test_a_host_sync_splits_the_graph_and_is_explained():
    b = Builder()
    x = b.input("x", (4, 8))
    r = b.op(aten.relu.default, x)
    nz = b.op(aten.nonzero.default, r)  # its size is data: a host sync, and a data-dependent shape
    count = b.op(aten.sum.default, nz)
    m = b.op(aten.mul.Tensor, r, 2.0)
    gm = b.done(b.op(aten.add.Tensor, m, 1.0), count)
    result = run_pass("cuda_graphs", gm)
    assert regions(result.gm) == [["relu"], ["mul", "add"]]
    reasons = {m.node: m.reason for m in result.near_misses}
    assert "host sync" in reasons["nonzero"]
    assert reasons["sum_1"].startswith("dynamic shape i64[u0, 2]")
    assert result.gm.graph.find_nodes(op="call_function", target=aten.nonzero.default)[0].meta[SKIPPED]


def test_an_item_call_is_a_host_sync():
    b = Builder()
    x = b.input("x", (4,))
    s = b.op(aten._local_scalar_dense.default, b.op(aten.sum.default, x))
    gm = b.done(b.op(aten.mul.Tensor, x, 3.0), s)
    result = run_pass("cuda_graphs", gm)
    assert "(.item())" in {m.node: m.reason for m in result.near_misses}["_local_scalar_dense"]
    assert regions(result.gm) == [["sum_1"], ["mul"]]


def test_a_cpu_tensor_op_runs_eagerly():
    b = Builder()
    x = b.input("x", (4, 8))
    host = b.op(aten._to_copy.default, x, device=torch.device("cpu"), val=lambda: torch.empty(4, 8))
    b.op(aten.add.Tensor, host, 1.0, val=lambda: torch.empty(4, 8))
    gm = b.done(b.op(aten.neg.default, x))
    result = run_pass("cuda_graphs", gm)
    reasons = {m.node: m.reason for m in result.near_misses}
    assert reasons["_to_copy"].startswith("touches a CPU tensor (cpu)")
    assert reasons["add"].startswith("touches a CPU tensor")
    assert regions(result.gm) == [["neg"]]


def test_a_constant_cpu_scalar_is_a_kernel_argument_not_a_cpu_op():
    b = Builder()
    x = b.input("x", (4,))
    scale = b.graph.get_attr("scale")
    scale.meta["val"] = b.mode.from_tensor(torch.tensor(2.0))
    varying = b.input("step_scale", (), device="cpu")  # changes per call, capture would bake it in
    b.op(aten.mul.Tensor, x, varying)
    gm = b.done(b.op(aten.mul.Tensor, x, scale), scale=torch.tensor(2.0))
    result = run_pass("cuda_graphs", gm)
    assert regions(result.gm) == [["mul_1"]]
    assert result.near_misses[0].node == "mul" and "CPU tensor" in result.near_misses[0].reason


def test_a_dynamic_shape_is_not_captured():
    b = Builder()
    x = b.input("x", (4, 8), dynamic=True)
    gm = b.done(b.op(aten.relu.default, x))
    result = run_pass("cuda_graphs", gm)
    assert not result.modified and regions(result.gm) == []
    (miss,) = result.near_misses
    assert miss.node == "relu" and "dynamic shape f32[s" in miss.reason and "fixed shapes" in miss.reason


def test_two_devices_are_not_one_graph():
    b = Builder()
    x = b.input("x", (4,))
    other = b.op(aten._to_copy.default, x, device=torch.device("cuda:1"), val=lambda: torch.empty(4, device="cuda:1"))
    gm = b.done(b.op(aten.neg.default, x), other)
    result = run_pass("cuda_graphs", gm)
    assert "spans devices cuda:0, cuda:1" in result.near_misses[0].reason


def test_regions_below_min_region_ops_run_eagerly():
    b = Builder()
    x = b.input("x", (4,))
    r = b.op(aten.relu.default, x)
    s = b.op(aten._local_scalar_dense.default, b.op(aten.sum.default, r))
    gm = b.done(b.op(aten.neg.default, b.op(aten.exp.default, x)), s)
    result = run_pass("cuda_graphs", gm, min_region_ops=2)
    assert regions(result.gm) == [["relu", "sum_1"], ["exp", "neg"]]
    result = run_pass("cuda_graphs", gm, min_region_ops=3)
    assert regions(result.gm) == []
    assert any("below min_region_ops=3" in m.reason for m in result.near_misses)


def test_skips_a_cpu_graph_and_says_why():
    gm = export_aten_graph(models.build("llama-tiny"), (torch.tensor([[1, 2, 3]]),)).gm
    result = run_pass("cuda_graphs", gm)
    assert not result.modified and result.stats["regions"] == 0
    (miss,) = result.near_misses
    assert miss.reason == "the graph runs on cpu: CUDA graphs need a CUDA or HIP device; nothing captured"
    assert not any(REGION in n.meta for n in result.gm.graph.nodes)


def test_debug_why_shows_the_partitioners_reasons():
    from graphopt.cli.main import app

    result = CliRunner().invoke(app, ["debug", "llama-tiny", "--why", "cuda_graphs", "--seq-len", "4", "--json"])
    assert result.exit_code == 0, result.output
    misses = [m for g in json.loads(result.stdout)["graphs"] for m in g["near_misses"]]
    assert misses and all(m["pass_name"] == "cuda_graphs" for m in misses)
    assert "CUDA graphs need a CUDA or HIP device" in misses[0]["reason"]


@pytest.mark.parametrize("bad", [{"min_region_ops": "x"}, {"regions": 2}])
def test_bad_options(bad):
    import graphopt

    with pytest.raises(graphopt.OptionsError):
        run_pass("cuda_graphs", Builder().done(), **bad)
