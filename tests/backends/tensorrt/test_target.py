"""The tensorrt target on a machine without TensorRT: why it cannot run (one line each),
its fallback through the CLI, the decomposition of graphopt ops it relies on, the INT4
refusal, and the call it makes into torch-tensorrt (a recording stand-in module).

All on the CPU. Numerics: fp32, seeded random non-zero inputs, rtol = atol = 1e-5.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import sys
import types

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from typer.testing import CliRunner

import graphopt
from graphopt import ir, models
from graphopt.backends.tensorrt import target as T
from graphopt.cli.main import app
from graphopt.config import Options
from graphopt.errors import GraphoptError
from graphopt.ops import OPS
from graphopt.ops.decompose import decompose_graphopt_ops
from tests.backends.tensorrt._graphs import CASES, fresh_inputs, optimized_graph, random

g = torch.ops.graphopt
TOL = {"rtol": 1e-5, "atol": 1e-5}
TENSORRT = Options.parse({"target": "tensorrt", "fallback": "error"})


def _graphopt_ops(gm) -> list[str]:
    """graphopt ops a graph still calls, directly or wrapped (auto_functionalized)."""
    return [T._graphopt_op_in(n) for n in gm.graph.nodes if T._graphopt_op_in(n)]


def _leaves(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


# (a) Why it cannot run: one line naming the fix, for each missing piece.

@pytest.mark.parametrize("cuda, hip, installed, expected", [
    (False, None, True, T.NO_NVIDIA_GPU),
    (True, "6.2", True, T.ROCM_BUILD),
    (True, None, False, T.NO_TORCH_TENSORRT),
    (True, None, True, None),
], ids=["no-gpu", "rocm-build", "no-torch-tensorrt", "available"])
def test_unavailable_reason_names_the_fix(monkeypatch, cuda, hip, installed, expected):
    real_find_spec = importlib.util.find_spec
    asked = []

    def find_spec(name, *args):
        asked.append(name)
        if name == "torch_tensorrt":
            return importlib.machinery.ModuleSpec("torch_tensorrt", None) if installed else None
        return real_find_spec(name, *args)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert T.tensorrt.unavailable_reason(TENSORRT) == expected
    assert "torch_tensorrt" not in sys.modules  # checking never imports it
    if cuda and not hip:
        assert asked == ["torch_tensorrt"]


@pytest.mark.parametrize("cuda, hip, installed, fixes", [
    (False, None, True, ("target='onnxruntime'", "'triton'")),
    (True, "6.2", True, ("target='triton'",)),
    (True, None, False, ("pip install 'graphopt[tensorrt]'",)),
], ids=["no-gpu", "rocm-build", "no-torch-tensorrt"])
def test_unavailable_messages_are_one_line_with_the_fix(monkeypatch, cuda, hip, installed, fixes):
    """What a user asking for target='tensorrt' is told, as the target resolver says it."""
    from graphopt.errors import TargetUnavailable
    from graphopt.targets import resolve_target

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: (
        (importlib.machinery.ModuleSpec(name, None) if installed else None) if name == "torch_tensorrt"
        else real_find_spec(name, *args)))
    with pytest.raises(TargetUnavailable) as raised:
        resolve_target(TENSORRT)
    message = str(raised.value)
    assert message.startswith("target 'tensorrt' cannot run here: ") and "\n" not in message
    assert all(fix in message for fix in fixes), message


def test_fallback_error_prints_that_line_and_exits_2(capsys, monkeypatch):
    reason = T.tensorrt.unavailable_reason(TENSORRT)
    if reason is None:
        pytest.skip("torch-tensorrt and an NVIDIA GPU are present: the target runs here")
    from graphopt.cli import main

    monkeypatch.setattr("sys.argv", ["graphopt", "run", "llama-tiny", "--target", "tensorrt", "--repeat", "1",
                                     "-o", "fallback=error"])
    with pytest.raises(SystemExit) as exit_info:
        main.main()
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == [f"error: graphopt target failed: target 'tensorrt' cannot run here: {reason}"], errors


# (b) Through the CLI on this machine: a fallback to eager with that line, eager's numerics.

def test_cli_run_falls_back_with_the_reason():
    reason = T.tensorrt.unavailable_reason(TENSORRT)
    if reason is None:
        pytest.skip("torch-tensorrt and an NVIDIA GPU are present: the target runs here")
    result = CliRunner().invoke(app, ["run", "llama-tiny", "--target", "tensorrt", "--repeat", "1", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["target"] == "eager" and data["reports"]
    for report in data["reports"]:
        assert report["fallbacks"] == [{"where": "target", "reason": f"target 'tensorrt' cannot run here: {reason}"}]
    assert data["rel_err"] < 1e-5 and data["max_abs_err"] < 1e-4


# (c) decompose_graphopt_ops: no graphopt op left, the same numbers as the fused graph.

@pytest.mark.parametrize("name", ["llama-tiny", "bert-tiny"])
def test_decomposed_pipeline_graph_matches_the_fused_one(name):
    fused, _ = optimized_graph(name)
    fused_ops = _graphopt_ops(fused)
    assert len(fused_ops) >= 5, f"the pipeline fused too little to test: {fused_ops}"
    decomposed = decompose_graphopt_ops(ir.copy_graph_module(fused))
    assert _graphopt_ops(decomposed) == []
    for node in decomposed.graph.nodes:
        assert node.op == "output" or "val" in node.meta, f"{node.name} has no meta['val']"
    inputs = fresh_inputs(name)  # not the capture inputs: new ids (and a padded mask for BERT)
    with torch.no_grad():
        want, got = _leaves(fused(*inputs)), _leaves(decomposed(*inputs))
    vals = [n.meta["val"] for n in _leaves(decomposed.graph.output_node().args[0])]
    assert len(got) == len(want) == len(vals)
    for g_out, w_out, val in zip(got, want, vals):
        assert g_out.shape == val.shape and g_out.dtype == val.dtype
        torch.testing.assert_close(g_out, w_out, **TOL)


def test_every_graphopt_op_has_a_decomposition_case():
    assert {case[0] for case in CASES.values()} == {f"graphopt.{name}" for name in OPS}


@pytest.mark.parametrize("case", list(CASES))
def test_each_op_decomposes_to_its_reference(case):
    op, fn, inputs = CASES[case]
    gm = make_fx(fn, tracing_mode="fake")(*[t.clone() for t in inputs])
    assert _graphopt_ops(gm) == [op]
    decomposed = decompose_graphopt_ops(gm)
    assert _graphopt_ops(decomposed) == []
    got, want = [t.clone() for t in inputs], [t.clone() for t in inputs]
    for a, b in zip(_leaves(decomposed(*got)), _leaves(fn(*want))):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, **TOL)
    for a, b in zip(got, want):  # kv_cache_update writes its cache in place: the same writes
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_symbolic_sizes_stay_symbolic():
    def fn(x, w, gate_up):
        return g.rms_norm(x, w, 1e-6) * 2, g.swiglu(gate_up)

    gm = decompose_graphopt_ops(make_fx(fn, tracing_mode="symbolic")(random(2, 5, 16), random(16), random(2, 5, 32)))
    inputs = (random(3, 7, 16), random(16), random(3, 7, 40))  # other sizes than traced
    for a, b in zip(gm(*inputs), fn(*inputs)):
        torch.testing.assert_close(a, b, **TOL)


# (d) INT4: refused in one line, and the model still runs (eagerly, quantized).

def _int4_graph():
    from graphopt.quant.groupwise import quantize_int4

    q = quantize_int4(random(24, 64) * 0.05, 32, True, "float32", "rtn")
    return make_fx(lambda x: g.int4_linear(x, q.packed, q.scales, None, 32) + 1)(random(3, 64))


def test_int4_is_refused_with_the_alternatives():
    assert T.int4_problem(_int4_graph()) == T.INT4_UNSUPPORTED
    assert T.int4_problem(optimized_graph("llama-tiny")[0]) is None
    assert "'onnxruntime' (MatMulNBits)" in T.INT4_UNSUPPORTED and "'triton'" in T.INT4_UNSUPPORTED
    with pytest.raises(GraphoptError, match="cannot run graphopt.int4_linear"):
        T.tensorrt.compile(_int4_graph(), [random(3, 64)], TENSORRT)


def _compile_llama(options):
    model = models.build("llama-tiny")
    ids = models.example_inputs(model, batch=1, seq_len=8)
    torch._dynamo.reset()
    graphopt.reset()
    with torch.no_grad():
        return torch.compile(model, backend="graphopt", options=options)(*ids)


def test_int4_through_torch_compile_falls_back_to_eager_with_that_reason(monkeypatch):
    # As on a machine where TensorRT is available, so that compile() is reached.
    monkeypatch.setattr(T.TensorRTTarget, "unavailable_reason", lambda self, config: None)
    got = _compile_llama({"target": "tensorrt", "int4": True})
    (report,) = graphopt.reports()
    assert report.fused_op_counts().get("graphopt.int4_linear", 0) > 0
    assert report.target == "eager"
    assert report.fallbacks == [{"where": "target:tensorrt", "reason": T.INT4_UNSUPPORTED}]
    want = _compile_llama({"target": "eager", "int4": True})  # the same quantized graph, eagerly
    for a, b in zip(_leaves(got), _leaves(want)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(Exception, match="BackendFailed: graphopt target:tensorrt failed: target 'tensorrt' "
                                        "cannot run graphopt.int4_linear"):  # dynamo wraps BackendFailed
        _compile_llama({"target": "tensorrt", "int4": True, "fallback": "error"})


# (e) The call into torch-tensorrt, through a recording stand-in for the package.

@pytest.fixture
def fake_torch_tensorrt(monkeypatch):
    """``torch_tensorrt.dynamo.compile`` that records its call and returns the exported
    program's module, so the compiled callable really computes. CPU tensors stand in for
    CUDA ones (``_on_gpu``), and the target counts as available."""
    calls = []

    def compile(exported_program, inputs=None, *, arg_inputs=None, **settings):
        calls.append({"program": exported_program, "arg_inputs": arg_inputs, "settings": settings})
        return exported_program.module()

    module = types.ModuleType("torch_tensorrt")
    module.dynamo = types.SimpleNamespace(compile=compile)
    monkeypatch.setitem(sys.modules, "torch_tensorrt", module)
    monkeypatch.setattr(T, "_on_gpu", lambda gm, inputs: True)
    monkeypatch.setattr(T.TensorRTTarget, "unavailable_reason", lambda self, config: None)
    return calls


def _program_ops(program) -> set[str]:
    return {ir.target_name(n.target) for n in program.graph.nodes if n.op == "call_function"}


def test_llama_reaches_torch_tensorrt_as_plain_aten_in_fp32(fake_torch_tensorrt):
    model = models.build("llama-tiny")
    ids = models.example_inputs(model, batch=1, seq_len=8)
    with torch.no_grad():
        want = model(*ids)
    got = _compile_llama({"target": "tensorrt", "fallback": "error"})
    (report,) = graphopt.reports()
    (call,) = fake_torch_tensorrt
    assert report.target == "tensorrt" and not report.fallbacks
    ops = _program_ops(call["program"])
    assert not any(op.startswith("graphopt.") or op.startswith("auto_functionalized") for op in ops), ops
    assert {"aten.rsqrt", "aten._softmax", "aten.silu"} <= ops  # the references' ATen, for TensorRT to fuse
    # token ids in, fp32 weights: an fp32 engine, TF32 off as in eager; no enabled_precisions
    assert [t.dtype for t in call["arg_inputs"]] == [torch.int64]
    assert call["settings"] == {"disable_tf32": True}
    assert "tensorrt: strongly typed engine in float32 (TF32 off)" in report.notes
    decomposed = next(n for n in report.notes if n.startswith("tensorrt: decomposed to ATen for TensorRT: "))
    for op, n in report.fused_op_counts().items():
        assert f"{op} x{n}" in decomposed
    for a, b in zip(_leaves(got), _leaves(want)):
        torch.testing.assert_close(a, b, **TOL)


def _norm_mlp(x, w, gate_up):
    return g.rms_norm(x, w, 1e-6) + g.swiglu(gate_up)


@pytest.mark.parametrize("dtype, settings", [
    (torch.float16, {"use_fp32_acc": True}),
    (torch.bfloat16, {}),
], ids=["fp16", "bf16"])
def test_precision_follows_the_inputs(fake_torch_tensorrt, dtype, settings):
    inputs = [random(2, 5, 16).to(dtype), random(16).to(dtype), random(2, 5, 32).to(dtype)]
    gm = make_fx(_norm_mlp, tracing_mode="fake")(*inputs)
    compiled = T.tensorrt.compile(gm, inputs, TENSORRT)
    (call,) = fake_torch_tensorrt
    assert call["settings"] == settings
    program = call["program"]
    placeholders = [n.meta["val"].dtype for n in program.graph.nodes if n.op == "placeholder"]
    assert placeholders == [dtype] * 3
    # the references' float32 statistics survive as explicit casts, which a strongly typed engine keeps
    vals = [n.meta.get("val") for n in program.graph.nodes if n.op == "call_function"]
    assert any(isinstance(v, torch.Tensor) and v.dtype == torch.float32 for v in vals)
    out = compiled(*inputs)
    assert out.dtype == dtype
    torch.testing.assert_close(out, _norm_mlp(*inputs), **TOL)


def test_fp32_allows_tf32_when_torch_does(fake_torch_tensorrt, monkeypatch):
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    inputs = [random(2, 5, 16), random(16), random(2, 5, 32)]
    T.tensorrt.compile(make_fx(_norm_mlp, tracing_mode="fake")(*inputs), inputs, TENSORRT)
    assert fake_torch_tensorrt[0]["settings"] == {"disable_tf32": False}


def test_cpu_tensors_symbolic_shapes_and_a_broken_install_each_get_one_line(monkeypatch):
    inputs = [random(2, 5, 16), random(16), random(2, 5, 32)]
    gm = make_fx(_norm_mlp, tracing_mode="fake")(*inputs)
    with pytest.raises(GraphoptError, match=r"on the CPU.*\.to\('cuda'\)"):
        T.tensorrt.compile(gm, inputs, TENSORRT)
    with pytest.raises(GraphoptError, match="static shapes only"):
        T.tensorrt.compile(gm, None, TENSORRT)
    monkeypatch.setattr(T, "_on_gpu", lambda gm, inputs: True)
    monkeypatch.setitem(sys.modules, "torch_tensorrt", None)  # import raises ImportError
    with pytest.raises(GraphoptError, match="torch-tensorrt is installed but does not import"):
        T.tensorrt.compile(gm, inputs, TENSORRT)

