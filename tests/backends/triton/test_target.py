"""The triton target: graphopt ops run as graphopt_triton ops (our kernels, interpreted here),
the rest eagerly or through Inductor; without a GPU it falls back in one line.

Everything runs on the CPU: conftest sets TRITON_INTERPRET=1, which makes the target
available on CPU tensors. fp32 throughout; tolerances are _numerics.TOLERANCES[fp32]
(rtol = atol = 1e-5) per op and a relative error of 1e-5 on whole-model logits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import graphopt
from graphopt import models
from graphopt.backends.triton import ops, registry
from graphopt.backends.triton import target as T
from graphopt.config import Options
from graphopt.errors import GraphoptError
from tests.backends.triton._numerics import TOLERANCES
from tests.helpers import assert_matches_eager
from tests.op_cases import OP_CASES, nonzero_random

g = torch.ops.graphopt
TOL = TOLERANCES[torch.float32]
TRITON = Options.parse({"target": "triton", "fallback": "error"})


_r = nonzero_random
# The ops this target lowers, one small call each (tests/op_cases.py).
CASES = {name: case for name, case in OP_CASES.items() if case[0] in registry.lowered_ops()}


def _triton_nodes(gm) -> dict[str, int]:
    counts: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and getattr(n.target, "namespace", None) == ops.NAMESPACE:
            counts[n.target.name()] = counts.get(n.target.name(), 0) + 1
    return counts


def _clone(tensors):
    return [t.clone() for t in tensors]


def test_every_lowered_op_has_a_case():
    assert {op for op, _, _ in CASES.values()} == set(registry.lowered_ops())


@pytest.mark.parametrize("case", list(CASES))
def test_op_runs_its_kernel_and_matches_the_reference(case):
    op, fn, inputs = CASES[case]
    gm = make_fx(fn, tracing_mode="fake")(*_clone(inputs))
    compiled = T.triton.compile(gm, _clone(inputs), TRITON)
    assert _triton_nodes(compiled.fn.lowered_graph) == {f"{ops.NAMESPACE}::{op.split('.')[1]}": 1}
    assert f"triton: Triton kernels for {op} x1" in compiled.notes
    before = ops.calls.copy()
    actual = compiled(*_clone(inputs))
    assert ops.calls - before == {(op, "kernel"): 1}, "the kernel must run, not the reference"
    expected = fn(*_clone(inputs))
    for a, e in zip(actual if isinstance(actual, (tuple, list)) else [actual],
                    expected if isinstance(expected, (tuple, list)) else [expected]):
        assert a.dtype == e.dtype and a.shape == e.shape
        torch.testing.assert_close(a, e, **TOL)


def test_op_without_a_kernel_keeps_its_reference_and_says_so():
    x, w = _r(2, 5, 16), _r(24, 16)
    gm = make_fx(lambda x, w: g.qkv_proj(x, w, None, [8, 8, 8])[1] + 1, tracing_mode="fake")(x, w)
    compiled = T.triton.compile(gm, [x, w], TRITON)
    assert compiled.notes[0] == "triton: graphopt.qkv_proj x1 keeps its reference implementation " \
                                        "(no Triton kernel)"
    torch.testing.assert_close(compiled(x, w), g.qkv_proj(x, w, None, [8, 8, 8])[1] + 1, **TOL)


@pytest.mark.parametrize("inputs", [(_r(2, 20000), _r(20000)), (_r(2, 40).double(), _r(40).double())],
                         ids=["row-over-64KiB", "fp64"])
def test_inputs_a_kernel_refuses_run_the_reference(inputs):
    gm = make_fx(lambda x, w: g.rms_norm(x, w, 1e-6), tracing_mode="fake")(*inputs)
    compiled = T.triton.compile(gm, list(inputs), TRITON)
    before = ops.calls.copy()
    out = compiled(*inputs)
    assert ops.calls - before == {("graphopt.rms_norm", "reference"): 1}
    torch.testing.assert_close(out, g.rms_norm(*inputs, 1e-6), **TOL)


def _llama():
    model = models.build("llama-tiny")
    ids = models.example_inputs(model, batch=1, seq_len=8)[0]
    return model, ids


def test_llama_tiny_prefill_and_decode_match_eager_through_triton_kernels():
    model, ids = _llama()
    with torch.no_grad():
        logits, cache = model(ids[:, :7])
        step_logits, _ = model(ids[:, 7:], past_key_values=cache)
    torch._dynamo.reset()
    graphopt.reset()
    compiled = torch.compile(model, backend="graphopt", options={"target": "triton", "fallback": "error"})
    before = ops.calls.copy()
    with torch.no_grad():
        got, got_cache = compiled(ids[:, :7])
        got_step, _ = compiled(ids[:, 7:], past_key_values=cache)  # one query: flash-decoding
    ran = ops.calls - before
    assert_matches_eager(got, logits, rel=1e-5)
    assert_matches_eager(got_cache, cache, rel=1e-5)
    assert_matches_eager(got_step, step_logits, rel=1e-5)
    reports = graphopt.reports()
    assert [r.target for r in reports] == ["triton", "triton"] and not any(r.fallbacks for r in reports)
    for report in reports:  # every fused op with a kernel ran as that kernel, once per node
        lowered = next(n for n in report.notes if n.startswith("triton: Triton kernels for "))
        for op, n in report.fused_op_counts().items():
            if op in registry.lowered_ops():
                assert f"{op} x{n}" in lowered, report.notes
            else:
                assert f"triton: {op} x{n} keeps its reference implementation (no Triton kernel)" in report.notes
    expected = {}
    for report in reports:
        for op, n in report.fused_op_counts().items():
            if op in registry.lowered_ops():
                expected[(op, "kernel")] = expected.get((op, "kernel"), 0) + n
    assert ran == expected and ran[("graphopt.attention", "kernel")] == 2 * len(model.layers)


def test_generate_with_a_static_cache_updates_it_with_the_kernel():
    model, ids = _llama()
    ids = ids[:, :5]
    expected = ids
    with torch.no_grad():  # eager greedy decoding with the model's own growing cache
        logits, cache = model(ids)
        for _ in range(3):
            expected = torch.cat([expected, logits[:, -1:].argmax(-1)], dim=1)
            logits, cache = model(expected[:, -1:], past_key_values=cache)
    before = ops.calls.copy()
    out = graphopt.generate(model, ids, 3, options={"target": "triton", "fallback": "error"})
    ran = ops.calls - before
    assert torch.equal(out.sequences, expected) and out.compiles == 1
    # One launch per layer writes k (rotated) and v: the prompt and 2 decode steps.
    assert ran[("graphopt.rope_kv_cache_update", "kernel")] == len(model.layers) * 3
    assert ("graphopt.kv_cache_update", "kernel") not in ran and ("graphopt.rope", "kernel") not in ran
    assert not any(kind == "reference" for _, kind in ran)


def _in_place_step():
    """kv_cache_update, then attention reading the cache it wrote (no data edge between them)."""
    w = _r(16)

    def step(x, cache, new, pos):
        g.kv_cache_update(cache, new, pos)
        return g.attention(g.rms_norm(x, w, 1e-6), cache, cache) * 2 + 1

    inputs = [_r(1, 2, 1, 16), _r(1, 2, 9, 16), _r(1, 2, 1, 16), torch.tensor(5)]
    return step, make_fx(step)(*_clone(inputs)), inputs  # real tracing: w is a get_attr constant


def test_in_place_update_in_a_dynamo_graph_runs_the_kernel():
    """Through torch.compile the update reaches the target functionalized
    (auto_functionalized_v2 wrapping the graphopt op): the wrapper's op is retargeted."""

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(_r(16))

        def forward(self, x, cache, new, pos):
            g.kv_cache_update(cache, new, pos)
            return g.attention(g.rms_norm(x, self.w, 1e-6), cache, cache)

    step, inputs = Step(), [_r(1, 2, 1, 16), _r(1, 2, 9, 16), _r(1, 2, 1, 16), torch.tensor(5)]
    got, want = _clone(inputs), _clone(inputs)
    torch._dynamo.reset()
    graphopt.reset()
    compiled = torch.compile(step, backend="graphopt", options={"target": "triton", "fallback": "error"})
    before = ops.calls.copy()
    with torch.no_grad():
        out, expected = compiled(*got), step(*want)
    (report,) = graphopt.reports()
    assert any(op.startswith("auto_functionalized") for op in report.op_counts), report.op_counts
    assert ops.calls - before == {(op, "kernel"): 1 for op in
                                  ("graphopt.kv_cache_update", "graphopt.rms_norm", "graphopt.attention")}
    torch.testing.assert_close(out, expected, **TOL)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)


@pytest.mark.parametrize("inductor", [True, False], ids=["inductor", "eager-rest"])
def test_gpu_path_orders_the_in_place_update(monkeypatch, inductor):
    """As on a GPU (interpreted kernels stand in for compiled ones): with Inductor the graph
    is re-functionalized, and the attention must still see the cache the update wrote."""
    monkeypatch.setattr(T, "interpreting", lambda: False)
    monkeypatch.setattr(T, "_on_gpu", lambda gm, inputs: True)
    monkeypatch.setattr(T, "_on_gpu_node", lambda node: True)
    step, gm, inputs = _in_place_step()
    compiled = T.triton.compile(gm, _clone(inputs), TRITON.replace(inductor=inductor))
    assert compiled.notes[-1] == ("triton: the rest of the graph compiled by Inductor" if inductor else
                                           "triton: inductor=False: the rest of the graph runs eagerly")
    got, want = _clone(inputs), _clone(inputs)
    before = ops.calls.copy()
    out = compiled(*got)
    out = out[0] if isinstance(out, (tuple, list)) else out
    assert {op for op, kind in ops.calls - before if kind == "kernel"} == {
        "graphopt.kv_cache_update", "graphopt.rms_norm", "graphopt.attention"}
    torch.testing.assert_close(out, step(*want), **TOL)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)  # the cache, written in place


@pytest.mark.parametrize("inductor", [True, False], ids=["inductor", "eager-rest"])
def test_gpu_path_writes_both_caches_of_the_fused_rope_update_in_place(monkeypatch, inductor):
    """The fused op mutates two caches and returns the rotated query: Inductor's
    re-functionalization must still write both where they lie, before attention reads them."""
    monkeypatch.setattr(T, "interpreting", lambda: False)
    monkeypatch.setattr(T, "_on_gpu", lambda gm, inputs: True)
    monkeypatch.setattr(T, "_on_gpu_node", lambda node: True)

    def step(q, k, v, cos, sin, k_cache, v_cache, pos):
        q_rot = g.rope_kv_cache_update(q, k, v, cos, sin, k_cache, v_cache, pos)
        return g.cache_attention(q_rot, k_cache, v_cache, (pos + 1).expand(1)) * 2 + 1

    inputs = [_r(1, 4, 1, 16), _r(1, 2, 1, 16), _r(1, 2, 1, 16), _r(1, 1, 16), _r(1, 1, 16), _r(1, 2, 9, 16),
              _r(1, 2, 9, 16), torch.tensor(5)]
    compiled = T.triton.compile(make_fx(step)(*_clone(inputs)), _clone(inputs), TRITON.replace(inductor=inductor))
    got, want = _clone(inputs), _clone(inputs)
    before = ops.calls.copy()
    out = compiled(*got)
    out = out[0] if isinstance(out, (tuple, list)) else out
    assert {op for op, kind in ops.calls - before if kind == "kernel"} == {
        "graphopt.rope_kv_cache_update", "graphopt.cache_attention"}
    torch.testing.assert_close(out, step(*want), **TOL)
    torch.testing.assert_close(got[5:7], want[5:7], rtol=0, atol=0)  # both caches, written in place


def test_when_inductor_fails_the_kernels_stay_and_the_rest_runs_eagerly(monkeypatch):
    monkeypatch.setattr(T, "interpreting", lambda: False)
    monkeypatch.setattr(T, "_on_gpu", lambda gm, inputs: True)
    monkeypatch.setattr(T, "_on_gpu_node", lambda node: True)

    def broken(gm, inputs):
        raise RuntimeError("inductor lowering failed\nsecond line")

    monkeypatch.setattr(T, "compile_with_inductor", broken)
    step, gm, inputs = _in_place_step()
    compiled = T.triton.compile(gm, _clone(inputs), TRITON.replace(fallback="eager"))
    assert compiled.notes[-1] == ("triton: Inductor failed (RuntimeError: inductor lowering failed); "
                                           "the rest of the graph runs eagerly")
    torch.testing.assert_close(compiled(*_clone(inputs)), step(*_clone(inputs)), **TOL)
    with pytest.raises(RuntimeError, match="inductor lowering failed"):
        T.triton.compile(gm, _clone(inputs), TRITON)


def test_cpu_tensors_on_a_gpu_machine_fall_back_with_the_fix(monkeypatch):
    monkeypatch.setattr(T, "interpreting", lambda: False)
    _, gm, inputs = _in_place_step()
    with pytest.raises(GraphoptError, match=r"on the CPU.*\.to\('cuda'\)"):
        T.triton.compile(gm, inputs, TRITON)


def test_unavailable_reasons(monkeypatch):
    assert T.triton.unavailable_reason(TRITON) is None  # TRITON_INTERPRET=1
    monkeypatch.setattr(T, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert T.triton.unavailable_reason(TRITON) == T.NO_GPU and "\n" not in T.NO_GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert T.triton.unavailable_reason(TRITON) is None and T.gpu_vendor() == "rocm"
    monkeypatch.setattr(torch.version, "hip", None)
    assert T.gpu_vendor() == "cuda"
    monkeypatch.setattr(T.importlib.util, "find_spec", lambda name: None)
    assert T.triton.unavailable_reason(TRITON) == "needs the Python package 'triton': pip install 'graphopt[triton]'"


_FALLBACK_SCRIPT = """
import json, torch, graphopt
from graphopt import models
m = models.build("llama-tiny"); ids = models.example_inputs(m, batch=1, seq_len=4)
with torch.no_grad():
    want = m(*ids)[0]
    got = torch.compile(m, backend="graphopt", options={"target": "triton"})(*ids)[0]
r = graphopt.reports()[-1]
torch._dynamo.reset()
try:
    with torch.no_grad():
        torch.compile(m, backend="graphopt", options={"target": "triton", "fallback": "error"})(*ids)
    raised = None
except Exception as e:
    raised = str(e)
rel = ((got - want).abs().max() / want.abs().max()).item()
print(json.dumps({"target": r.target, "fallbacks": r.fallbacks, "rel_err": rel, "raised": raised}))
"""


def test_without_a_gpu_or_the_interpreter_it_falls_back_in_one_line():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _FALLBACK_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    reason = f"target 'triton' cannot run here: {T.NO_GPU}"
    assert result["target"] == "eager" and result["rel_err"] < 1e-5
    assert result["fallbacks"] == [{"where": "target", "reason": reason}]
    assert "BackendFailed" in result["raised"] and reason in result["raised"]
