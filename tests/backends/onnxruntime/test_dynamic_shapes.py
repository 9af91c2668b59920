"""One compile serves every shape on the onnxruntime target: a graph with symbolic sizes is
exported once with dynamic axes and runs in one session, and every build is in the report."""

from __future__ import annotations

import logging
from collections import Counter

import pytest
import torch

import graphopt
from graphopt import models
from graphopt.backends.onnxruntime.runtime import session as session_module
from tests.backends.onnxruntime._helpers import rel_err  # noqa: F401  (skips without onnxruntime)
from tests.helpers import assert_matches_eager, eager

OPTIONS = {"target": "onnxruntime", "provider": "cpu", "fallback": "error"}


@pytest.fixture
def sessions_run(monkeypatch):
    """The session behind every ORT call of a test, in call order."""
    seen = []
    for method in ("__call__", "run_into"):  # ORT's outputs, or outputs bound before the run
        real = getattr(session_module.SessionRunner, method)

        def spy(self, *args, real=real, **kwargs):
            seen.append(self.session)
            return real(self, *args, **kwargs)

        monkeypatch.setattr(session_module.SessionRunner, method, spy)
    return seen


@pytest.fixture
def exported(ort_models):
    """The ONNX models the target exports during a test, in order (conftest.py)."""
    return ort_models


def compile_fresh(module, options: dict | None = None, **kwargs):
    torch._dynamo.reset()
    graphopt.reset()
    return torch.compile(module, backend="graphopt", options={**OPTIONS, **(options or {})}, **kwargs)


def builds() -> list[dict]:
    return [b for r in graphopt.reports() for b in r.to_dict()["builds"]]


def run_checked(compiled, model, batch: int, seq: int) -> None:
    (ids,) = models.example_inputs(model, batch=batch, seq_len=seq, seed=seq)
    with torch.no_grad():
        assert_matches_eager(compiled(ids), eager(model, ids), rel=1e-4)  # logits and the KV cache


def test_llama_tiny_at_many_lengths_exports_twice_and_keeps_one_session(sessions_run, exported, caplog):
    model = models.build("llama-tiny")
    compiled = compile_fresh(model)
    # 6 lengths, 3 batch sizes. Not batch 1: dynamo specializes a size of 1, so a batch of 1
    # after a dynamic batch is a third graph (its guard: "2 <= input_ids.size()[0]").
    calls = ((2, 5), (4, 7), (2, 9), (4, 12), (3, 6), (2, 10))
    with caplog.at_level(logging.INFO, logger="graphopt"):
        for batch, seq in calls:
            run_checked(compiled, model, batch, seq)
    made = builds()
    assert len(made) == 2, made  # the first static compile, then dynamo's dynamic recompile
    assert made[0]["dynamic_dims"] == [] and len(made[1]["dynamic_dims"]) == 2  # batch and sequence
    # q and k share the sequence symbol, so the dynamic model picks the same fused ops
    # (GroupQueryAttention, RotaryEmbedding, ...) as the static one.
    static, dynamic = exported
    assert dynamic.fused_op_counts() == static.fused_op_counts() and static.fused_op_counts()
    assert {r.target for r in graphopt.reports()} == {"onnxruntime"}
    assert len(sessions_run) == len(calls) and len(set(map(id, sessions_run[1:]))) == 1
    # The recompile names the guard that failed, once.
    (line,) = [r.getMessage() for r in caplog.records if "guard failed" in r.getMessage()]
    assert "size mismatch" in line and "input_ids" in line
    assert graphopt.reports()[1].to_dict()["recompile_reason"] in line


@pytest.mark.parametrize("dynamic", [None, True])
def test_the_dynamic_recompile_takes_over_the_first_graph_and_releases_its_session(sessions_run, dynamic):
    """Dynamo's first graph is static (with ``dynamic=True``: its batch of 1 is); once the
    recompile with a dynamic batch exists, the first graph is an instance of it, so its session
    (another copy of the weights) is released and its shapes run on the new session, still
    matching eager."""
    import gc
    import weakref

    model = models.build("llama-tiny")
    compiled = compile_fresh(model, dynamic=dynamic)
    first_batch = 2 if dynamic is None else 1
    run_checked(compiled, model, first_batch, 5)
    first_session = weakref.ref(sessions_run[0])
    run_checked(compiled, model, 4, 7)  # the recompile with a dynamic batch
    run_checked(compiled, model, first_batch, 5 if dynamic is None else 9)  # dynamo's first graph again
    assert len(builds()) == 2
    assert sessions_run[2] is sessions_run[1]
    sessions_run[:1] = []
    gc.collect()
    assert first_session() is None
    first, second = graphopt.reports()
    assert any("was released" in n for n in first.notes), first.notes
    assert not any("released" in n for n in second.notes)


def test_the_first_graph_releases_its_session_before_the_dynamic_build(monkeypatch):
    """The static first graph is an instance of the dynamic recompile: it gives up its session
    before that build, so the build's copy of the weights is not added on top of it."""
    import weakref

    from graphopt.backends.onnxruntime.runtime import session

    sessions, alive_at_build = [], []
    create = session.create_session

    def spy(model, *args, **kwargs):
        alive_at_build.append([ref() is not None for ref in sessions])
        made = create(model, *args, **kwargs)
        sessions.append(weakref.ref(made))
        return made

    monkeypatch.setattr(session, "create_session", spy)
    model = models.build("llama-tiny")
    compiled = compile_fresh(model)
    run_checked(compiled, model, 2, 5)
    run_checked(compiled, model, 4, 7)  # the recompile with a dynamic batch
    assert alive_at_build == [[], [False]]
    run_checked(compiled, model, 2, 5)  # dynamo's first graph again: on the new session
    assert len(builds()) == 2


@pytest.mark.parametrize("level", ["dynamo", "session"])
def test_a_batch_of_one_after_a_dynamic_batch_runs_on_the_dynamic_session(sessions_run, exported, monkeypatch,
                                                                          level):
    """Dynamo's third graph (batch fixed at 1 after a dynamic batch) is the dynamic graph with
    s0 = 1: it runs on that graph's session, with a note and no build. First the dynamo graph
    is matched (graphopt/frontend/dynamo_reuse.py: no AOT trace, no passes); where that declines, the
    ATen graph after the passes (reuse.py: no export)."""
    from graphopt.frontend import dynamo_reuse

    if level == "session":
        monkeypatch.setattr(dynamo_reuse, "serve", lambda *args: None)
    model = models.build("llama-tiny")
    compiled = compile_fresh(model)
    calls = ((2, 5), (4, 7), (1, 9), (1, 6))
    for batch, seq in calls:
        run_checked(compiled, model, batch, seq)
    reports = graphopt.reports()
    assert len(reports) == 3 and len(builds()) == 2 and len(exported) == 2
    assert not reports[2].builds
    (note,) = [n for n in reports[2].notes if ("served by graph 1" if level == "dynamo" else "no export") in n]
    assert "= 1" in note
    assert len(set(map(id, sessions_run[1:]))) == 1  # calls 2-4: the dynamic graph's session


def test_dynamic_true_exports_once_with_a_complete_build_record():
    model = models.build("llama-tiny")
    compiled = compile_fresh(model, dynamic=True)
    for batch, seq in ((2, 5), (3, 8), (2, 11)):
        run_checked(compiled, model, batch, seq)
    (build,) = builds()
    assert build["what"] == "onnxruntime session"
    (shape,) = build["shapes"]  # input_ids, both axes symbolic, named as dynamo names them
    assert len(shape) == 2 and all(isinstance(d, str) and d.startswith("s") for d in shape)
    assert build["dynamic_dims"] == shape
    assert build["seconds"] > 0 and abs(build["export_s"] + build["session_s"] - build["seconds"]) < 1e-2


def test_mark_dynamic_exports_once():
    model = models.build("llama-tiny")
    compiled = compile_fresh(model)
    for seq in (5, 8, 11):
        (ids,) = models.example_inputs(model, batch=2, seq_len=seq, seed=seq)
        torch._dynamo.mark_dynamic(ids, 1)
        with torch.no_grad():
            assert_matches_eager(compiled(ids), eager(model, ids), rel=1e-4)
    (build,) = builds()
    assert build["shapes"][0][0] == 2 and isinstance(build["shapes"][0][1], str)


@pytest.mark.parametrize("lazy", [True, False], ids=["lazy_recompiles", "build_at_once"])
def test_decode_loop_does_not_export_per_token(exported, lazy):
    model = models.build("llama-tiny")
    compiled = compile_fresh(model, {"lazy_recompiles": lazy})
    (ids,) = models.example_inputs(model, batch=2, seq_len=6, seed=1)
    counts = []
    with torch.no_grad():
        logits, past = compiled(ids)
        ref_logits, ref_past = model(ids)
        for _ in range(6):
            token = logits[:, -1:].argmax(-1)
            assert torch.equal(token, ref_logits[:, -1:].argmax(-1))
            logits, past = compiled(token, past)
            ref_logits, ref_past = model(token, ref_past)
            assert_matches_eager((logits, past), (ref_logits, ref_past), rel=1e-4)
            counts.append(len(builds()))
    (decode,) = [b for b in builds() if b["dynamic_dims"]]
    assert decode["shapes"][0] == [2, 1]  # the new token stays one token: GQA decodes with past
    if lazy:  # the prefill and the dynamic recompile at the second step; the first step ran on torch
        assert counts[1] == counts[-1] == 2, counts
        assert exported[1].cached_attention == 2  # both layers
        return
    # prefill, the first decode step, its dynamic recompile at the second; then none per token
    assert counts[1] == counts[-1] == 3, counts
    prefill, static_step, dynamic_step = exported
    assert dynamic_step.cached_attention == static_step.cached_attention == 2  # both layers
    assert dynamic_step.fused_op_counts() == static_step.fused_op_counts()


class ShapeOutput(torch.nn.Module):
    """Returns a size computed from the input's: a SymInt output of a dynamo graph."""

    def forward(self, x):
        return torch.relu(x) * 2, x.shape[1] * 3 + 1


def test_symint_outputs_follow_the_input_size():
    compiled = compile_fresh(ShapeOutput(), dynamic=True)
    for cols in (4, 9, 13):
        x = torch.randn(3, cols)
        out, size = compiled(x)
        assert size == cols * 3 + 1
        torch.testing.assert_close(out, torch.relu(x) * 2)
    assert len(builds()) == 1


class SplitHeadsView(torch.nn.Module):
    """Returns a transposed view of its input: aot_autograd rebuilds it from the strides of
    what the target returns (found by graphopt fuzz --seed 11, graph 118)."""

    def forward(self, x):
        return (x.reshape(x.shape[:-1] + (2, 32)).transpose(-2, -1),)


def test_a_transposed_view_output_keeps_its_layout():
    compiled = compile_fresh(SplitHeadsView(), dynamic=True)
    for seq in (4, 7):
        x = torch.randn(2, seq, 64)
        (out,) = compiled(x)
        (want,) = SplitHeadsView()(x)
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        assert out.stride() == want.stride()
    assert len(builds()) == 1


class ScaledByInt(torch.nn.Module):
    """``n`` is a graph input that no tensor's size gives (as the int counters of transformers'
    sliding-window cache are), and the graph returns a size computed from it."""

    def forward(self, x, n: int):
        return x * n + 1, n + x.shape[-1]


def call_scaled_by_int(compiled, ints) -> None:
    """Each int with its own length of x: the tensor output and the size output as eager's."""
    for n in ints:
        x = torch.randn(2, 5 + n)
        out, size = compiled(x, n)
        torch.testing.assert_close(out, x * n + 1)
        assert size == n + 5 + n


def test_a_symint_that_is_no_input_size_is_an_input_of_the_one_dynamic_model(exported):
    compiled = compile_fresh(ScaledByInt(), dynamic=True)
    call_scaled_by_int(compiled, (2, 3, 5))
    (report,) = graphopt.reports()
    assert report.target == "onnxruntime" and not report.fallbacks
    assert not [note for note in report.notes if "per input shape" in note], report.notes
    assert len(builds()) == 1 and builds()[0]["export_route"] == "direct"
    (onnx_model,) = exported
    inputs = onnx_model.model.graph.inputs
    assert len(inputs) == 2 and inputs[1].shape.dims == () and inputs[1].dtype.name == "INT64"


def test_a_symint_input_without_the_direct_translation_is_exported_once_per_shape(caplog, monkeypatch):
    """The traced export takes tensors only: a graph whose SymInt input no tensor's size gives,
    and that the direct translation refuses, gets one static model per signature, and the
    note and the log say why."""
    from graphopt.backends.onnxruntime.lower import direct_export

    def refuse(*args, **kwargs):
        raise direct_export.NotDirect("refused by the test")

    monkeypatch.setattr(direct_export, "translate", refuse)
    compiled = compile_fresh(ScaledByInt(), dynamic=True)
    with caplog.at_level(logging.WARNING, logger="graphopt"):
        call_scaled_by_int(compiled, (2, 3, 2))
    (report,) = graphopt.reports()
    assert report.target == "onnxruntime"
    assert any("need the direct translation" in note and "refused by the test" in note for note in report.notes), \
        report.notes
    assert "once per input shape" in caplog.text
    assert len(builds()) == 2  # one static model per signature: (5+2, n=2) and (5+3, n=3), reused


def test_a_failed_dynamic_export_falls_back_to_one_static_export_per_shape(monkeypatch, caplog):
    """The dynamic export fails (an op ORT cannot take with a symbolic size, say): the graph
    still runs on ORT, one static model per shape, and the note and the log say why."""
    from graphopt.backends.onnxruntime import target as target_module
    from graphopt.backends.onnxruntime.errors import OnnxExportError

    real = target_module._build_session

    def no_dynamic_export(gm, example_inputs, provider, *, dynamic, **kwargs):
        if dynamic:
            raise OnnxExportError("planted: no dynamic axes for this graph")
        return real(gm, example_inputs, provider, dynamic=dynamic, **kwargs)

    monkeypatch.setattr(target_module, "_build_session", no_dynamic_export)
    model = models.build("llama-tiny")
    compiled = compile_fresh(model, dynamic=True)
    with caplog.at_level(logging.WARNING, logger="graphopt"):
        for batch, seq in ((2, 5), (3, 8), (2, 5)):
            run_checked(compiled, model, batch, seq)
    (report,) = graphopt.reports()
    assert report.target == "onnxruntime" and report.fallbacks == []
    assert any("the export with dynamic axes failed (planted" in note for note in report.notes), report.notes
    assert "once per input shape" in caplog.text
    made = builds()
    assert [b["dynamic_dims"] for b in made] == [[], []]  # (2, 5) and (3, 8); the repeat reuses the first


@pytest.mark.parametrize("tidy", [True, False])
def test_dynamic_export_reads_attention_inputs_without_layout_round_trips(ort_models, monkeypatch, tidy):
    """torch.compile's export removes attention's layout round trips (attention_layout.py):
    the query is rotated as [B, S, H*D] and read straight by GroupQueryAttention, and the
    attention output's Reshapes back are gone. The returned key and value keep the BNSH
    Transposes eager returns them in. Both ways match eager; the tidy-up only removes nodes."""
    from graphopt.backends.onnxruntime.lower import export as export_module

    real = export_module.export_graph
    monkeypatch.setattr(export_module, "export_graph", lambda *a, **k: real(*a, **{**k, "tidy_attention": tidy}))
    model = models.build("llama-tiny")
    compiled = compile_fresh(model, dynamic=True)
    for batch, seq in ((2, 5), (3, 8)):
        run_checked(compiled, model, batch, seq)
    (onnx_model,) = ort_models
    ops = Counter(n.op_type for n in onnx_model.model.graph)
    queries = [n.inputs[0].producer() for n in onnx_model.model.graph if n.op_type == "GroupQueryAttention"]
    assert len(queries) == 2
    if tidy:
        # Per layer: the key to BNSH for its rotation (it is returned rotated), back, and to
        # BNSH again for the return (a pair ORT's optimizer cancels); the value to BNSH (it is
        # returned). The query's pair and the output's Reshapes are gone.
        assert ops["Transpose"] == 4 * 2, ops
        assert all(q.op_type == "RotaryEmbedding" and len(q.inputs[0].shape) == 3 for q in queries)
    else:
        assert ops["Transpose"] > 4 * 2, ops
        assert all(q.op_type != "RotaryEmbedding" for q in queries)
