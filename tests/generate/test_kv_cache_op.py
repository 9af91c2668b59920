"""graphopt.kv_cache_update: in-place writes at a data position, in every layout, and int8 KV."""

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

import graphopt.ops
from graphopt.ops.kv_cache import cache_shape, kv_cache_update, quantize_int8, read_cache

B, H, D, MAX, BLOCK = 2, 3, 8, 12, 4
POISON = 1e4


def _buffers(layout, int8, table_seed=0):
    shape = cache_shape(layout, B, H, MAX, D, BLOCK)
    cache = torch.zeros(shape, dtype=torch.int8) if int8 else torch.full(shape, POISON)
    scales = torch.zeros(*shape[:3], 1) if int8 else None
    table = None
    if layout == "paged":
        # A shuffled pool: sequence blocks are scattered, so a wrong block lookup shows.
        perm = torch.randperm(shape[0], generator=torch.Generator().manual_seed(table_seed))
        table = perm.view(B, -1)
    return cache, scales, table


@pytest.mark.parametrize("int8", [False, True], ids=["fp32", "int8"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd", "paged"])
def test_chunks_written_at_positions_read_back(layout, int8):
    gen = torch.Generator().manual_seed(1)
    cache, scales, table = _buffers(layout, int8)
    chunks = [torch.randn(B, H, n, D, generator=gen) for n in (5, 1, 3)]
    pos = 0
    for chunk in chunks:
        kv_cache_update(cache, chunk, torch.tensor(pos), layout, table, scales)
        pos += chunk.shape[2]
    expected = torch.cat(chunks, dim=2)
    got = read_cache(cache, layout, table, scales)[:, :, :pos]
    if int8:
        # Symmetric per-row int8: each element is within half a step (max|row| / 254) of the truth.
        step = expected.abs().amax(-1, keepdim=True) / 127
        assert ((got - expected).abs() <= step / 2 + 1e-6).all()
        assert (got - expected).abs().max() > 0  # it really quantized
    else:
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        assert (read_cache(cache, layout, table)[:, :, pos:] == POISON).all(), "wrote past the chunk"


def test_position_may_be_one_element_and_int32():
    cache = torch.zeros(1, 1, 4, 2)
    kv_cache_update(cache, torch.ones(1, 1, 1, 2), torch.tensor([2], dtype=torch.int32))
    assert cache[0, 0, :, 0].tolist() == [0, 0, 1, 0]


def test_casts_new_rows_to_the_cache_dtype():
    cache = torch.zeros(1, 1, 4, 2, dtype=torch.float16)
    kv_cache_update(cache, torch.full((1, 1, 2, 2), 1.5), torch.tensor(1))
    assert cache.dtype == torch.float16 and cache[0, 0, :, 0].tolist() == [0, 1.5, 1.5, 0]


def test_quantize_int8_keeps_zero_rows_zero():
    q, s = quantize_int8(torch.zeros(1, 1, 2, 4))
    assert (q == 0).all() and torch.isfinite(s).all()


@pytest.mark.parametrize("call, message", [
    (lambda: kv_cache_update(torch.zeros(1, 2, 4, 8), torch.zeros(1, 3, 1, 8), torch.tensor(0)), "does not hold"),
    (lambda: kv_cache_update(torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 1, 8), torch.tensor(0.0)), "int tensor"),
    (lambda: kv_cache_update(torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 1, 8), torch.tensor(0), "bsdh"), "layout"),
    (lambda: kv_cache_update(torch.zeros(4, 2, 4, 8), torch.zeros(1, 2, 1, 8), torch.tensor(0), "paged"), "block_table"),
    (lambda: kv_cache_update(torch.zeros(1, 2, 4, 8, dtype=torch.int8), torch.zeros(1, 2, 1, 8), torch.tensor(0)),
     "scales"),
])
def test_bad_arguments_fail_with_one_line(call, message):
    with pytest.raises(ValueError, match=message) as info:
        call()
    assert "\n" not in str(info.value)


def test_is_registered_and_declares_its_mutations():
    assert "kv_cache_update" in graphopt.ops.OPS
    schema = torch.ops.graphopt.kv_cache_update.default._schema
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert written == {"cache", "scales"} and not schema.returns


def test_fake_impl_checks_shapes_on_a_fake_cuda_cache():
    with FakeTensorMode():
        cache = torch.empty(1, 2, 8, 4, device="cuda")
        assert kv_cache_update(cache, torch.empty(1, 2, 1, 4, device="cuda"), torch.zeros((), dtype=torch.long)) is None
        with pytest.raises(ValueError, match="does not hold"):
            kv_cache_update(cache, torch.empty(1, 2, 1, 5, device="cuda"), torch.zeros((), dtype=torch.long))


def test_survives_dead_code_elimination_and_runs_in_a_graph():
    graph = fx.Graph()
    cache, new, pos = graph.placeholder("cache"), graph.placeholder("new"), graph.placeholder("pos")
    graph.call_function(torch.ops.graphopt.kv_cache_update.default, (cache, new, pos))
    graph.output(graph.call_function(torch.ops.aten.sum.default, (cache,)))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    buf = torch.zeros(1, 1, 4, 2)
    assert gm(buf, torch.full((1, 1, 1, 2), 3.0), torch.tensor(1)).item() == 6.0


def test_version_bump_with_defaults_filled_writes_and_bumps_the_written_tensors():
    # torch 2.11-2.12 need this kernel (their own one indexes the defaulted `scales` and raises
    # IndexError); registering it again on newer torch must keep the op's behaviour.
    from graphopt.ops.kv_cache import _bump_versions_with_defaults_filled

    _bump_versions_with_defaults_filled(kv_cache_update)
    cache, new = torch.zeros(1, 2, 8, 4), torch.randn(1, 2, 1, 4)
    before = cache._version
    torch.ops.graphopt.kv_cache_update(cache, new, torch.tensor(3))  # scales left out
    assert cache._version > before and torch.equal(cache[:, :, 3:4], new)
    q, scales = torch.zeros(1, 2, 8, 4, dtype=torch.int8), torch.zeros(1, 2, 8, 1)
    before = scales._version
    torch.ops.graphopt.kv_cache_update(q, new, torch.tensor(2), "bhsd", None, scales)
    assert scales._version > before
    torch.testing.assert_close(read_cache(q, scales=scales)[:, :, 2:3], new, atol=0.02, rtol=0.02)
