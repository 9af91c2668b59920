"""The compile front half (graphopt.compiler.front_half) and the pipeline's named stages
(graphopt.pipeline): trace -> the stage's passes -> the target's callback, written once."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from graphopt.compiler import Optimized, front_half, run_pipeline
from graphopt.config import Options
from graphopt.errors import GraphoptError, OptionsError
from graphopt.frontend.trace import export_aten_graph
from graphopt.pipeline import DEFAULT_PIPELINE, INT4_PASS, STATIC_STEP_LAST, build_stage, with_int4
from graphopt.registry import scoped_passes


class RMSNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(8) + 0.5)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def _names(phase) -> list[str]:
    return [p.name for p in phase.manager.passes]


def test_front_half_traces_runs_the_stage_and_hands_the_optimized_graph_to_the_target():
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0))
    stages, handed = [], []

    @contextlib.contextmanager
    def timer(name):
        stages.append(name)
        yield

    def target(optimized: Optimized):
        handed.append(optimized)
        return optimized.gm(*optimized.example_inputs)

    config = Options(pipeline=["canonicalize", "fuse_rms_norm"])
    module = RMSNorm()
    out = front_half(module, config, target, args=(x,), timer=timer)
    (optimized,) = handed
    assert stages == ["torch.export", "passes"]
    assert [r.name for r in optimized.result.records] == ["canonicalize", "fuse_rms_norm"]
    ops = {str(n.target) for n in optimized.gm.graph.nodes if n.op == "call_function"}
    assert "graphopt.rms_norm.default" in ops and "aten.rsqrt.default" not in ops
    assert optimized.program.frozen_weights == 1  # the weight is a constant the passes can read
    torch.testing.assert_close(out[0], module(x), rtol=1e-5, atol=1e-6)  # the target got a graph that still runs


def test_front_half_takes_a_graph_traced_already_and_runs_no_trace():
    x = torch.randn(2, 8)
    program = export_aten_graph(RMSNorm(), (x,))
    stages = []

    @contextlib.contextmanager
    def timer(name):
        stages.append(name)
        yield

    gm = front_half(program, Options(pipeline=["fuse_rms_norm"]), lambda o: o.gm, timer=timer)
    assert stages == ["passes"]
    assert any(n.target is torch.ops.graphopt.rms_norm.default for n in gm.graph.nodes)


def test_front_half_explains_a_trace_failure_only_when_asked():
    class DataDependent(nn.Module):
        def forward(self, x):
            return x[: int(x.sum())]  # a size from a value: torch.export cannot trace it

    x = torch.ones(2, 3)
    with pytest.raises(GraphoptError, match="cannot capture: "):
        front_half(DataDependent(), Options(), lambda o: o, args=(x,),
                   trace_error=lambda error: GraphoptError(f"cannot capture: {type(error).__name__}"))
    with pytest.raises(Exception) as raw:
        front_half(DataDependent(), Options(), lambda o: o, args=(x,))
    assert not isinstance(raw.value, GraphoptError)


def test_default_stage_is_the_configured_pipeline_with_int4_before_capture():
    (phase,) = build_stage(with_int4(Options(), True))
    names = _names(phase)
    assert names == [*DEFAULT_PIPELINE[:-1], INT4_PASS, DEFAULT_PIPELINE[-1]]
    assert names[-1] == "cuda_graphs" and phase.replays_inputs
    assert with_int4(Options(), False) == Options()


def test_static_step_stage_runs_its_last_passes_apart_and_never_disables_the_cache_pass():
    config = Options(disable_passes=["static_kv_cache", "cuda_graphs", "fuse_bias_gelu"])
    fusion, last = build_stage(config, "static_step")
    assert _names(fusion) == [n for n in DEFAULT_PIPELINE if n not in STATIC_STEP_LAST]
    assert _names(last) == list(STATIC_STEP_LAST)
    assert fusion.replays_inputs and not last.replays_inputs  # static_kv_cache changes the inputs
    assert last.manager.disabled == {"cuda_graphs"}
    assert "fuse_bias_gelu" in fusion.manager.disabled


def test_static_step_stage_without_fusions_is_its_last_passes_alone():
    (last,) = build_stage(Options(pipeline=["cuda_graphs"]), "static_step")
    assert _names(last) == list(STATIC_STEP_LAST)


def test_an_unknown_stage_is_one_options_error():
    with pytest.raises(OptionsError, match="unknown pipeline stage 'fusions'; the stages are default, static_step"):
        build_stage(Options(), "fusions")


def test_int4_without_the_quantizer_registered_fails_before_any_model_loads():
    with scoped_passes(remove=(INT4_PASS,)):
        with pytest.raises(OptionsError, match="needs the quantize_int4 pass"):
            with_int4(Options(), True)


def test_run_pipeline_merges_the_phases_of_a_stage():
    from graphopt import models
    from graphopt.generation.runner import positions, step_adapter
    from graphopt.generation.static import example_past, layout_options
    from graphopt.ops.kv_cache import spec_of

    ids = torch.tensor([[1, 2]])
    step = step_adapter(models.build("llama-tiny"))
    past = example_past(step, ids)
    dynamic = torch.export.Dim.DYNAMIC
    program = export_aten_graph(step, (ids, positions(1, 0, 2, ids.device), past),
                                dynamic_shapes=(None, None, [{2: dynamic}] * len(past)))
    result, _ = run_pipeline(program.gm, layout_options(Options(), 16), list(program.example_inputs),
                             stage="static_step")
    names = [r.name for r in result.records]
    assert names[-3:] == list(STATIC_STEP_LAST) and names[0] == DEFAULT_PIPELINE[0]
    assert spec_of(result.gm) is not None  # the cache is static: the step the last phase exists for
