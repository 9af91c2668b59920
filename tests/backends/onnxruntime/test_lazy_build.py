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
