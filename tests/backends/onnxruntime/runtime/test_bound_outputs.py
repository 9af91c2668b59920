"""A dynamic CPU session keeps ONNX Runtime's arena, shrinks it after each run at new input
shapes, and writes its outputs into torch tensors allocated before the run (bound_outputs.py)."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import graphopt
from graphopt import models
from graphopt.backends.onnxruntime.runtime import session as session_module
from graphopt.backends.onnxruntime.runtime import graph_runner as runner_module
from graphopt.backends.onnxruntime.runtime.bound_outputs import BoundOutputs
from graphopt.backends.onnxruntime.lower.signatures import SizePlan
from tests.backends.onnxruntime._helpers import rel_err  # noqa: F401  (skips without onnxruntime)
from tests.helpers import assert_matches_eager, eager

OPTIONS = {"target": "onnxruntime", "provider": "cpu", "fallback": "error"}
SHRINK = "memory.enable_memory_arena_shrinkage"


@pytest.fixture
def runs(monkeypatch):
    """(session, run options, bound outputs or None) of every ORT run in a test."""
    seen = []
    real_call, real_into = session_module.SessionRunner.__call__, session_module.SessionRunner.run_into

    def call(self, *tensors, run_options=None):
        seen.append((self.session, run_options, None))
        return real_call(self, *tensors, run_options=run_options)

    def into(self, tensors, outputs, run_options=None):
        seen.append((self.session, run_options, list(outputs)))
        return real_into(self, tensors, outputs, run_options)

    monkeypatch.setattr(session_module.SessionRunner, "__call__", call)
    monkeypatch.setattr(session_module.SessionRunner, "run_into", into)
    return seen


def compile_fresh(module, **kwargs):
    torch._dynamo.reset()
    graphopt.reset()
    return torch.compile(module, backend="graphopt", options=OPTIONS, **kwargs)


def shrinks(run_options) -> bool:
    return run_options is not None and run_options.get_run_config_entry(SHRINK) == "cpu:0"


def test_a_dynamic_llama_writes_into_bound_outputs_and_shrinks_the_arena(runs):
    model = models.build("llama-tiny")
    compiled = compile_fresh(model, dynamic=True)
    kept = []
    with torch.no_grad():
        for batch, seq in ((2, 5), (3, 9), (2, 13)):
            (ids,) = models.example_inputs(model, batch=batch, seq_len=seq, seed=seq)
            out = compiled(ids)
            assert_matches_eager(out, eager(model, ids), rel=1e-4)
            kept.append((out[0], out[0].clone()))
    assert len(runs) == 3
    for session, run_options, outputs in runs:
        assert session._graphopt_arena and shrinks(run_options)
        assert outputs is not None  # bound, not allocated by the arena
    # The outputs are torch's own memory: later runs (and the arena's shrink) leave them alone.
    for logits, copy in kept:
        assert torch.equal(logits, copy)


def test_a_batch_of_one_served_by_the_dynamic_session_is_bound_too(runs):
    model = models.build("llama-tiny")
    compiled = compile_fresh(model)
    with torch.no_grad():
        for batch, seq in ((2, 5), (4, 7), (1, 9)):
            (ids,) = models.example_inputs(model, batch=batch, seq_len=seq, seed=seq)
            assert_matches_eager(compiled(ids), eager(model, ids), rel=1e-4)
    static, dynamic, reused = runs
    assert not shrinks(static[1]) and static[2] is None  # the first compile is static: ORT plans it
    assert shrinks(dynamic[1]) and dynamic[2] is not None
    assert reused[0] is dynamic[0] and shrinks(reused[1]) and reused[2] is not None
    assert reused[2][0].shape[0] == 1


def test_output_shapes_with_floor_division_are_computed_per_call(runs):
    def f(x):
        half = x[: x.shape[0] // 2]
        return torch.cat([x, x], 0) * 2, half + 1

    compiled = compile_fresh(f, dynamic=True)
    for rows in (4, 7, 10):
        x = torch.randn(rows, 3)
        doubled, half = compiled(x)
        assert doubled.shape == (2 * rows, 3) and half.shape == (rows // 2, 3)
        torch.testing.assert_close(doubled, torch.cat([x, x]) * 2)
        torch.testing.assert_close(half, x[: rows // 2] + 1)
    assert runs and all(outputs is not None and shrinks(options) for _, options, outputs in runs)


def test_an_empty_output_runs_on_ort_allocated_outputs(runs):
    compiled = compile_fresh(lambda x: x[: x.shape[0] // 4] * 3, dynamic=True)
    for rows in (5, 3):  # 3 // 4 = 0 rows: no address to bind
        x = torch.randn(rows, 2)
        torch.testing.assert_close(compiled(x), x[: rows // 4] * 3)
    assert runs[-1][2] is None and shrinks(runs[-1][1])


def symbolic_graph(fn, *inputs):
    return make_fx(fn, tracing_mode="symbolic")(*inputs)


def test_a_data_dependent_output_size_cannot_be_bound():
    gm = symbolic_graph(lambda x: torch.nonzero(x), torch.tensor([1.0, 0.0, 2.0]))
    assert BoundOutputs.of(gm, SizePlan.of(gm)) is None


def test_an_output_without_a_numpy_dtype_cannot_be_bound():
    gm = symbolic_graph(lambda x: x.to(torch.bfloat16), torch.randn(3, 4))
    assert BoundOutputs.of(gm, SizePlan.of(gm)) is None


def test_output_sizes_follow_the_input_sizes():
    gm = symbolic_graph(lambda x, y: (torch.cat([x, y], 0), x.sum()), torch.randn(3, 4), torch.randn(5, 4))
    plan = SizePlan.of(gm)
    bound = BoundOutputs.of(gm, plan)
    positions = [0, 1]
    a, b = bound.allocate(positions, [torch.empty(6, 4), torch.empty(2, 4)])
    assert a.shape == (8, 4) and b.shape == () and a.dtype == torch.float32


def test_a_repeated_shape_keeps_the_arena_until_the_shape_changes(runs, monkeypatch):
    """Shrinking after a run that repeats the previous run's shapes would make every call
    fault its memory back in; the arena is released at the next new shape instead, and the C
    heap's free pages with it."""
    trims_after = []
    monkeypatch.setattr(runner_module, "release_after_run", lambda seconds: trims_after.append(len(runs) - 1))
    model = models.build("llama-tiny")
    compiled = compile_fresh(model, dynamic=True)
    with torch.no_grad():
        for batch, seq in ((2, 5), (2, 5), (2, 5), (3, 9), (2, 5)):
            (ids,) = models.example_inputs(model, batch=batch, seq_len=seq, seed=seq)
            assert_matches_eager(compiled(ids), eager(model, ids), rel=1e-4)
    assert [shrinks(options) for _, options, _ in runs] == [True, False, False, True, True]
    assert trims_after == [0, 3, 4]
    assert all(outputs is not None for _, _, outputs in runs)  # bound either way


def test_release_free_heap_returns_free_chunks_below_a_live_one():
    """glibc keeps free chunks below a live one resident; the trim hands them back."""
    import ctypes

    from graphopt.backends.onnxruntime.runtime import heap_trim

    if heap_trim._malloc_trim() is None:
        pytest.skip("no glibc malloc_trim in this C library")
    libc = ctypes.CDLL(None)
    libc.malloc.argtypes, libc.malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    chunk, count = 64 * 1024, 1600  # under glibc's mmap threshold: they come from the heap
    blocks = [libc.malloc(chunk) for _ in range(count)]
    for block in blocks:
        ctypes.memset(block, 1, chunk)
    for block in blocks[:-1]:  # the last one pins the heap's top, so free() alone releases nothing
        libc.free(block)
    before = _resident_bytes()
    assert heap_trim.release_free_heap()
    released = before - _resident_bytes()
    libc.free(blocks[-1])
    assert released > chunk * count // 2, released


def test_a_trim_follows_only_runs_long_enough_to_leave_memory(monkeypatch):
    from graphopt.backends.onnxruntime.runtime import heap_trim

    trims = []
    monkeypatch.setattr(heap_trim, "release_free_heap", lambda: trims.append(True) or True)
    assert not heap_trim.release_after_run(heap_trim.WORTH_IT_AFTER_S / 10) and trims == []
    assert heap_trim.release_after_run(heap_trim.WORTH_IT_AFTER_S) and trims == [True]


def _resident_bytes() -> int:
    import os

    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _mapping_of(address: int) -> tuple[int, int] | None:
    with open("/proc/self/maps") as maps:
        for line in maps:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= address < end:
                return start, end
    return None


def test_a_large_output_has_a_mapping_of_its_own_that_goes_with_it():
    """Freed, a large output's pages leave the process at once (no heap chunk left resident)."""
    from graphopt.backends.onnxruntime.runtime.bound_outputs import OWN_MAPPING_BYTES, empty_output

    rows = OWN_MAPPING_BYTES // (4 * 64) * 3
    out = empty_output((rows, 64), torch.float32)
    assert out.shape == (rows, 64) and out.dtype == torch.float32 and out.is_contiguous() and out._base is None
    out.fill_(2.0)
    assert float(out.sum()) == 2.0 * rows * 64
    mapping = _mapping_of(out.data_ptr())
    assert mapping is not None and mapping[1] - mapping[0] == -(-rows * 64 * 4 // 4096) * 4096
    del out
    assert _mapping_of(mapping[0]) != mapping
    small = empty_output((3, 4), torch.int64)
    assert small.shape == (3, 4) and small.dtype == torch.int64
