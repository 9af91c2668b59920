"""A static graph dynamo compiles again builds its session at its second call, not its first."""

from __future__ import annotations

import pytest
import torch

import graphopt
from graphopt import models

pytest.importorskip("onnxruntime")


def compiled_llama(**options):
    torch._dynamo.reset()
    graphopt.reset()
    model = models.build("llama-tiny")
    return model, torch.compile(model, backend="graphopt", dynamic=False,
                                options={"target": "onnxruntime", "fallback": "error", **options})


def builds_per_report() -> list[int]:
    return [len(r.builds) for r in graphopt.reports()]


def test_a_static_recompile_runs_on_torch_first_and_builds_at_its_second_call():
    model, compiled = compiled_llama()
    first, second = (models.example_inputs(model, batch=1, seq_len=n, seed=n) for n in (5, 7))
    with torch.no_grad():
        compiled(*first)
        assert builds_per_report() == [1], "a first compile builds at once"
        outputs = [compiled(*second)]
        assert builds_per_report() == [1, 0], "the recompile's first call builds nothing"
        outputs += [compiled(*second), compiled(*second)]
        assert builds_per_report() == [1, 1], "its second call builds, once"
        want = model(*second)
    recompiled = graphopt.reports()[1]
    assert recompiled.recompile_reason and recompiled.target == "onnxruntime" and not recompiled.fallbacks
    assert any("built at its second call" in n for n in recompiled.notes), recompiled.notes
    for got in outputs:
        torch.testing.assert_close(got[0] if isinstance(got, tuple) else got, want[0] if isinstance(want, tuple) else want,
                                   rtol=1e-4, atol=1e-4)


def test_lazy_recompiles_off_builds_at_the_first_call():
    model, compiled = compiled_llama(lazy_recompiles=False)
    with torch.no_grad():
        for n in (5, 7):
            compiled(*models.example_inputs(model, batch=1, seq_len=n, seed=n))
    assert builds_per_report() == [1, 1]


class ScaledByInt(torch.nn.Module):
    def forward(self, x, n: int):
        return x * n + 1


def test_a_recompile_with_only_int_inputs_symbolic_builds_at_its_second_call_then_serves_every_int():
    """A second int makes dynamo recompile with the int symbolic and the tensors static (a
    sliding-window cache's counters at Gemma 3's first decode step): like a static recompile
    it runs on torch first, then builds one session in which the int is an input."""
    torch._dynamo.reset()
    graphopt.reset()
    compiled = torch.compile(ScaledByInt(), backend="graphopt",
                             options={"target": "onnxruntime", "fallback": "error"})
    x = torch.randn(2, 5)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, 2), x * 2 + 1)
        assert builds_per_report() == [1]
        torch.testing.assert_close(compiled(x, 3), x * 3 + 1)
        assert builds_per_report() == [1, 0], "the recompile's first call builds nothing"
        for n in (4, 5, 6):
            torch.testing.assert_close(compiled(x, n), x * n + 1)
    assert builds_per_report() == [1, 1], "its second call builds one session for every int"
    recompiled = graphopt.reports()[1]
    assert recompiled.recompile_reason and not recompiled.fallbacks
    assert any("only int inputs symbolic" in n for n in recompiled.notes), recompiled.notes


class DoubledTail(torch.nn.Module):
    def forward(self, x):
        return (x * 2)[:, 1:]  # a strided view on torch; row-major from a session


def test_the_first_call_on_torch_returns_the_layout_the_session_will():
    """dynamo guards the next call's inputs on their strides: a cache returned as a strided view
    by the first call and row-major by the session afterwards would recompile its consumer."""
    torch._dynamo.reset()
    graphopt.reset()
    compiled = torch.compile(DoubledTail(), backend="graphopt", dynamic=False,
                             options={"target": "onnxruntime", "fallback": "error"})
    compiled(torch.randn(2, 5))
    x = torch.randn(2, 7)
    on_torch, on_session = compiled(x), compiled(x)
    assert builds_per_report() == [1, 1]
    assert DoubledTail()(x).stride() == (7, 1)
    assert on_torch.stride() == on_session.stride() == (6, 1)
    torch.testing.assert_close(on_torch, x[:, 1:] * 2)
    torch.testing.assert_close(on_session, x[:, 1:] * 2)
