"""The direct ONNX translation writes the model torch.onnx.export's traced route writes.

``export_graph`` translates a compiled graph without torch.export's re-traces when it can
(``direct_export.py``). Each test captures the graphs the onnxruntime target (or the export
tool) hands to ``export_graph`` on a real model, exports each both ways and compares the two
ONNX models node for node, then runs both in ONNX Runtime on the same inputs.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

import graphopt
from graphopt import models
from graphopt.backends.onnxruntime.lower import direct_export
from graphopt.backends.onnxruntime.lower import export as export_module
from graphopt.backends.onnxruntime.runtime.session import SessionRunner, create_session
from graphopt.export import files
from graphopt.export import model as export_model
from tests.backends.onnxruntime._helpers import rel_err

OPTIONS = {"target": "onnxruntime", "provider": "cpu", "fallback": "error"}


@pytest.fixture
def captured(monkeypatch):
    """(gm, example inputs, keyword arguments) of every export_graph call, in order."""
    calls = []
    real = export_module.export_graph

    def spy(gm, example_inputs, **kwargs):
        calls.append((gm, example_inputs, kwargs))
        return real(gm, example_inputs, **kwargs)

    monkeypatch.setattr(export_module, "export_graph", spy)
    return calls


def traced(monkeypatch, gm, example_inputs, **kwargs):
    """``export_graph`` with the direct translation turned down: torch.onnx.export's route."""
    with monkeypatch.context() as patch:
        patch.setattr(direct_export, "translate", _refuse)
        return export_module.export_graph(gm, example_inputs, **kwargs)


def _refuse(*args, **kwargs):
    raise direct_export.NotDirect("turned down by the test")


def describe(model) -> dict:
    """Everything about an exported model that must not depend on the route. Names of
    intermediate values are left out: they come from the FX nodes' names, which torch.export's
    re-trace renumbers (``_unsafe_view_12`` against ``_unsafe_view_18``)."""
    graph = model.model.graph
    weights = {n: v for n, v in graph.initializers.items() if n.startswith("gm.")}
    folded = [v for n, v in graph.initializers.items() if not n.startswith("gm.")]  # constants it made
    return {
        "ops": Counter(f"{n.domain}::{n.op_type}" for n in graph),
        "inputs": [(v.name, str(v.shape), v.dtype) for v in graph.inputs],
        "outputs": [(str(v.shape), v.dtype) for v in graph.outputs],
        "weights": {name: (str(v.shape), v.dtype) for name, v in weights.items()},
        "folded": Counter((str(v.shape), v.dtype) for v in folded),
        "output_plan": model.output_plan,
        "cached_attention": model.cached_attention,
        "opsets": dict(model.model.opset_imports),
    }


def run(model, inputs) -> list[torch.Tensor]:
    return SessionRunner(create_session(model))(*[x for x in inputs if isinstance(x, torch.Tensor)])


def assert_same_both_ways(monkeypatch, gm, example_inputs, kwargs, run_inputs=None):
    direct = export_module.export_graph(gm, example_inputs, **kwargs)
    assert direct.route == "direct"
    slow = traced(monkeypatch, gm, example_inputs, **kwargs)
    assert slow.route == "traced: turned down by the test"
    assert describe(direct) == describe(slow)
    inputs = run_inputs or example_inputs
    for a, b in zip(run(direct, inputs), run(slow, inputs), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        if a.is_floating_point():
            assert rel_err(a, b) < 1e-6
        else:
            assert torch.equal(a, b)


def compile_and_call(model, shapes, **options):
    torch._dynamo.reset()
    graphopt.reset()
    compiled = torch.compile(model, backend="graphopt", options={**OPTIONS, **options})
    with torch.no_grad():
        for batch, seq in shapes:
            compiled(*models.example_inputs(model, batch=batch, seq_len=seq, seed=seq))


def test_llama_static_then_dynamic_graph_export_the_same_both_ways(monkeypatch, captured):
    model = models.build("llama-tiny")
    compile_and_call(model, [(2, 5), (3, 7)])  # a static graph, then dynamo's dynamic one
    assert len(captured) == 2
    static, dynamic = captured
    assert_same_both_ways(monkeypatch, *static)
    # The dynamic graph takes its sizes as SymInt inputs: the ONNX model reads them off input_ids.
    assert any(not isinstance(x, torch.Tensor) for x in dynamic[1])
    ids = models.example_inputs(model, batch=4, seq_len=9, seed=1)
    assert_same_both_ways(monkeypatch, *dynamic, run_inputs=[*ids])
    builds = [b for r in graphopt.reports() for b in r.to_dict()["builds"]]
    assert [b["export_route"] for b in builds] == ["direct", "direct"]


@pytest.mark.parametrize("name, options", [("bert-tiny", {}), ("llama-tiny", {"int4": True})],
                         ids=["bert-layernorm-gelu", "llama-int4"])
def test_other_catalogue_lowerings_export_the_same_both_ways(monkeypatch, captured, name, options):
    model = models.build(name)
    compile_and_call(model, [(2, 6)], **options)
    (call,) = captured
    direct = export_module.export_graph(call[0], call[1], **call[2])
    fused = {op for op in describe(direct)["ops"] if op.startswith("com.microsoft::")}
    assert fused, "the catalogue's fused ops reached the ONNX model"
    assert_same_both_ways(monkeypatch, *call)


def test_export_tool_with_named_axes_and_inputs_exports_the_same_both_ways(monkeypatch, captured, tmp_path):
    from graphopt.config import Options

    model = models.build("llama-tiny")
    (ids,) = models.example_inputs(model, batch=2, seq_len=6)
    export_model.optimize_and_export(model, (ids,), Options(target="onnxruntime"), files.Timer(None),
                                     axis_names=[{0: "batch", 1: "sequence"}], input_names=["input_ids"])
    (call,) = captured
    direct = export_module.export_graph(call[0], call[1], **call[2])
    assert [str(d) for d in direct.model.graph.inputs[0].shape] == ["batch", "sequence"]
    assert direct.input_names == ["input_ids"]
    assert_same_both_ways(monkeypatch, *call, run_inputs=[*models.example_inputs(model, batch=3, seq_len=4)])


def _aten_graph(fn, *inputs, tracing_mode: str = "fake") -> fx.GraphModule:
    """An ATen graph with a fake value on every node, as graphopt's frontends give one."""
    return make_fx(fn, tracing_mode=tracing_mode)(*inputs)


def test_an_in_place_op_takes_the_traced_route():
    def add_in_place(x):
        return x.add_(1.0) * 2

    x = torch.randn(3, 4)
    gm = _aten_graph(add_in_place, x)
    with pytest.raises(direct_export.NotDirect, match="writes one of its inputs"):
        direct_export.translate(gm, [x], dynamic=False, sizes_from=None, table={})


def test_an_op_the_exporter_would_decompose_takes_the_traced_route():
    op = torch.ops.aten.rsub.Tensor  # torch.onnx decomposes it to sub before translating
    assert not direct_export.registry({}).is_registered(op)
    x, y = torch.randn(5), torch.randn(5)
    gm = _aten_graph(lambda a, b: op(a, b), x, y)
    with pytest.raises(direct_export.NotDirect, match="has no direct translation"):
        direct_export.translate(gm, [x, y], dynamic=False, sizes_from=None, table={})
    model = export_module.export_graph(gm, [x, y], dynamic=False)
    assert model.route.startswith("traced: ") and "rsub" in model.route
    (got,) = run(model, [x, y])
    torch.testing.assert_close(got, y - x)


def test_a_static_export_of_a_symbolic_graph_takes_the_traced_route():
    gm = _aten_graph(lambda x: x * 2, torch.randn(3, 4))
    gm_symbolic = _aten_graph(lambda x: x * 2, torch.randn(3, 4), tracing_mode="symbolic")
    assert direct_export.translate(gm, [torch.randn(3, 4)], dynamic=False, sizes_from=None, table={}).model
    with pytest.raises(direct_export.NotDirect, match="symbolic size in a static export"):
        direct_export.translate(gm_symbolic, [torch.randn(3, 4)], dynamic=False, sizes_from=None, table={})


def test_a_failing_direct_translation_falls_back_to_the_traced_route_and_says_so(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("torch.onnx moved a private function")

    monkeypatch.setattr(direct_export, "translate", broken)
    x = torch.randn(3, 4)
    gm = _aten_graph(lambda a: torch.relu(a) * 2, x)
    with caplog.at_level("INFO", logger="graphopt"):
        model = export_module.export_graph(gm, [x], dynamic=False)
    assert model.route == "traced: the direct translation failed (RuntimeError: torch.onnx moved a private function)"
    assert any("re-traces this graph" in r.getMessage() for r in caplog.records)
    (got,) = run(model, [x])
    torch.testing.assert_close(got, torch.relu(x) * 2)


def test_an_input_or_a_value_returned_twice_is_copied_like_the_traced_route_copies_it(monkeypatch):
    """A cache returned as it came in, or one value at two output positions: an ONNX value
    is a graph output once and an input is not an output, so both routes return copies."""
    def returns_input_and_repeats(cache, x):
        y = x * 2
        return cache, y, y

    cache, x = torch.randn(2, 3), torch.randn(3, 4)
    gm = _aten_graph(returns_input_and_repeats, cache, x)
    direct = export_module.export_graph(gm, [cache, x], dynamic=False)
    slow = traced(monkeypatch, gm, [cache, x], dynamic=False)
    assert direct.route == "direct"
    # The traced route renames an input it also returns (tensors_0_orig); nothing else differs.
    unnamed = lambda model: {**describe(model), "inputs": [i[1:] for i in describe(model)["inputs"]]}  # noqa: E731
    assert unnamed(direct) == unnamed(slow)
    assert direct.output_plan == [0, 1, 2]
    for got in (run(direct, [cache, x]), run(slow, [cache, x])):
        torch.testing.assert_close(got[0], cache)
        torch.testing.assert_close(got[1], x * 2)
        torch.testing.assert_close(got[2], x * 2)


def test_the_registry_holds_what_torch_onnx_from_torchlib_holds():
    from torch.onnx._internal.exporter import _registration

    def entries(registry):
        return {target: [(m.onnx_function, m.fx_target, m.signature, m.is_custom, m.is_complex) for m in metas]
                for target, metas in registry.functions.items()}

    for opset in (direct_export.TORCHLIB_OPSET, direct_export.DEFAULT_OPSET):
        ours = direct_export._from_torchlib(opset)
        torchs = _registration.ONNXRegistry.from_torchlib(opset_version=opset)
        assert list(ours.functions) == list(torchs.functions)
        assert entries(ours) == entries(torchs)
        assert ours._opset_version == torchs._opset_version == opset
