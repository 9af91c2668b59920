"""graphopt.cuda_graphs: segments run in order, regions replay per bucket from static buffers,
the KV cache goes in by address. A recording backend stands in for torch.cuda graphs here;
the real capture runs in the gpu-marked tests."""

import pytest
import torch
import torch.fx as fx

import graphopt
from graphopt import models
from graphopt.cuda_graphs import PLAN, REGION, CapturedRegion, CapturePlan, SegmentRunner, split_segments, wrap_step
from graphopt.generation import eager_generate
from graphopt.ops.kv_cache import StaticCacheSpec

aten = torch.ops.aten


class RecordingBackend:
    """Captures by keeping the call; replay reruns it into the captured output buffers."""

    def __init__(self):
        self.pools, self.captured = [], []

    def pool(self):
        if not self.pools:
            self.pools.append(object())
        return self.pools[0]

    def capture(self, fn, args):
        self.pool()
        self.captured.append(list(args))
        outputs = fn(*args)

        def replay():
            for out, fresh in zip(outputs, fn(*args)):
                out.copy_(fresh)

        return replay, outputs


def cache_graph():
    """update the cache in place (region 0), an eager op, attention over the cache (region 1)."""
    graph = fx.Graph()
    cache, new, pos, q = (graph.placeholder(n) for n in ("cache", "new", "pos", "q"))
    def call(target, *args):
        return graph.create_node("call_function", target, args, name=target._opname)

    upd = call(torch.ops.graphopt.kv_cache_update.default, cache, new, pos)
    q2 = call(aten.mul.Tensor, q, 2.0)
    shifted = call(aten.add.Tensor, q2, 1.0)  # runs eagerly between the regions
    out = call(torch.ops.graphopt.attention.default, shifted, cache, cache)
    graph.output((out,))
    for node, region in ((upd, 0), (q2, 0), (out, 1)):
        node.meta[REGION] = region
    gm = fx.GraphModule(torch.nn.Module(), graph)
    gm.meta[PLAN] = CapturePlan("cuda:0", regions=[["kv_cache_update", "mul"], ["attention"]],
                                skipped=[("add", "planted")])
    return gm


def reference(cache, new, pos, q):
    cache = cache.clone()
    torch.ops.graphopt.kv_cache_update(cache, new, pos)
    return torch.ops.graphopt.attention(q * 2.0 + 1.0, cache, cache)


def test_segments_keep_node_order_and_region_marks():
    segments = split_segments(cache_graph())
    assert [s.region for s in segments] == [0, None, 1]
    assert [n.name for n in segments[0].inputs] == ["cache", "new", "pos", "q"]
    assert [n.name for n in segments[2].inputs] == ["add", "cache"]


def test_replays_from_static_buffers_and_passes_the_cache_by_address():
    backend = RecordingBackend()
    runner = SegmentRunner(cache_graph(), {"cache", "pos"}, backend)
    gen = torch.Generator().manual_seed(0)
    cache, pos = torch.zeros(1, 2, 8, 4), torch.zeros((), dtype=torch.long)
    for step in range(3):
        new, q = torch.randn(1, 2, 1, 4, generator=gen), torch.randn(1, 2, 1, 4, generator=gen)
        pos.fill_(step)  # generate updates the position in place: its address stays
        expected = reference(cache, new, pos, q)
        (got,) = runner(cache, new, pos, q)
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(cache[:, :, step:step + 1], new)
    assert runner.captures == 2 and len(backend.pools) == 1  # once per region, one shared pool
    first = backend.captured[0]
    assert first[0] is cache and first[2] is pos  # static: by address, never copied
    assert first[1] is not new and first[3] is not q  # the other inputs went into the graph's own buffers
    assert got is not runner.regions[1].buckets[next(iter(runner.regions[1].buckets))][2][0]  # outputs cloned


def test_a_new_shape_or_a_new_cache_is_a_new_bucket():
    backend = RecordingBackend()
    region = CapturedRegion(lambda c, x: (c.sum() + x,), {0}, backend)
    cache = torch.ones(4)
    region(cache, torch.ones(2))
    region(cache, torch.full((2,), 3.0))
    assert region.captures == 1
    region(cache, torch.ones(3))  # another shape
    assert region.captures == 2
    (out,) = region(torch.ones(4), torch.ones(3))  # another cache buffer: its address is part of the key
    assert region.captures == 3 and out.tolist() == [5.0, 5.0, 5.0]


def _spec():
    return StaticCacheSpec("bhsd", 8, 16, "auto", 1, 1, torch.device("cpu"), pos_index=2)


def test_wrap_step_says_why_it_did_not_capture():
    gm = cache_graph()
    fn = object()
    assert wrap_step(fn, fx.GraphModule(torch.nn.Module(), fx.Graph()), _spec())[1].endswith("did not run")
    gm.meta[PLAN] = CapturePlan(None, note="the graph runs on cpu")
    assert wrap_step(fn, gm, _spec()) == (fn, "no CUDA graph captured: the graph runs on cpu")
    gm = cache_graph()
    if not torch.cuda.is_available():
        assert "no CUDA or HIP runtime" in wrap_step(fn, gm, _spec())[1]
    # A target's single callable cannot be cut around the op that cannot be captured.
    wrapped, why = wrap_step(fn, gm, _spec(), backend=RecordingBackend())
    assert wrapped is fn and "add: planted" in why
    runner, why = wrap_step(gm, gm, _spec(), backend=RecordingBackend())
    assert isinstance(runner, SegmentRunner) and why.startswith("2 CUDA graph region(s)")


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU (none here)")


@pytest.mark.gpu
@needs_gpu
def test_generate_on_gpu_captures_the_decode_step_once():
    model = models.build("llama-tiny").cuda()
    ids = torch.randint(0, 256, (1, 6), device="cuda")
    out = graphopt.generate(model, ids, 24, options={"target": "eager", "fallback": "error"})
    ref = eager_generate(model, ids, 24)
    assert torch.equal(out.sequences, ref.sequences)
    assert out.compiles == 1 and "CUDA graph region" in out.cuda_graphs, out.cuda_graphs


@pytest.mark.gpu
@needs_gpu
def test_real_capture_replays_a_region_with_the_cache_in_place():
    from graphopt.cuda_graphs import TorchGraphs

    gm = cache_graph().cuda()
    runner = SegmentRunner(gm, {"cache", "pos"}, TorchGraphs())
    cache, pos = torch.zeros(1, 2, 8, 4, device="cuda"), torch.zeros((), dtype=torch.long, device="cuda")
    for step in range(3):
        new, q = torch.randn(1, 2, 1, 4, device="cuda"), torch.randn(1, 2, 1, 4, device="cuda")
        pos.fill_(step)
        expected = reference(cache, new, pos, q)
        (got,) = runner(cache, new, pos, q)
        torch.testing.assert_close(got, expected)
    assert runner.captures == 2


def test_generate_leaves_out_capture_when_cuda_graphs_is_disabled():
    model = models.build("llama-tiny")
    ids = torch.randint(0, 256, (1, 5))
    on = graphopt.generate(model, ids, 3, options={"target": "eager"})
    off = graphopt.generate(model, ids, 3, options={"target": "eager", "disable_passes": ["cuda_graphs"]})
    assert "runs on cpu" in on.cuda_graphs, on.cuda_graphs  # the pass ran and said why it could not capture
    assert off.cuda_graphs == "no CUDA graph captured: the cuda_graphs pass did not run"
    assert torch.equal(on.sequences, off.sequences)
