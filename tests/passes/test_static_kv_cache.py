"""static_kv_cache: a cache grown by cat becomes a static cache updated in place at a position."""

import operator

import pytest
import torch
import torch.nn.functional as F

import graphopt
from graphopt import ir, models
from graphopt.frontend.trace import export_aten_graph
from graphopt.generation.runner import ExplicitCacheStep
from graphopt.ops.kv_cache import kv_cache_update, spec_of
from tests.helpers import run_pass

MAX = 24
PAST = 5  # the example past length the graphs are exported with


def export_step(module, *inputs, past, dynamic=True):
    shapes = (*[None] * len(inputs), [{2: torch.export.Dim.DYNAMIC}] * len(past)) if dynamic else None
    return export_aten_graph(module, (*inputs, past), dynamic_shapes=shapes).gm


@pytest.fixture(scope="module")
def llama():
    return models.build("llama-tiny", seed=0)


@pytest.fixture(scope="module")
def decode_graph(llama):
    """The tiny Llama's decode step (one new token), past length dynamic."""
    past = [torch.zeros(1, 2, PAST, 16) for _ in range(4)]
    return export_step(ExplicitCacheStep(llama), torch.tensor([[1]]), torch.tensor([[PAST]]), past=past)


def static_inputs(spec, ids, pos_ids, pos, caches, table=None, scales=()):
    args = [ids, pos_ids, *caches, torch.tensor(pos)]
    return args + ([table] if table is not None else []) + list(scales)


def decode_against_eager(llama, gm, spec, steps=4, prompt=6, table=None):
    """Prefill eagerly, load the cache into the static buffers, then compare decode steps' logits."""
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 256, (1, prompt), generator=gen)
    with torch.no_grad():
        logits, cache = llama(ids)
    caches = [torch.full(c.shape, 7.0) if c.dtype != torch.int8 else torch.zeros(c.shape, dtype=c.dtype)
              for c in spec.caches]  # a poisoned tail: attention must never read it
    scales = [torch.zeros(c.scales_shape) for c in spec.caches if c.scales_shape is not None]
    for i, t in enumerate(t for kv in cache for t in kv):
        kv_cache_update(caches[i], t, torch.tensor(0), spec.layout, table, scales[i] if scales else None)
    errors, token, pos = [], logits[:, -1:].argmax(-1), prompt
    with torch.no_grad():
        for _ in range(steps):
            expected, cache = llama(token, past_key_values=cache)
            (got,) = gm(*static_inputs(spec, token, torch.tensor([[pos]]), pos, caches, table, scales))
            errors.append((got - expected).abs().max().item() / expected.abs().max().item())
            token, pos = expected[:, -1:].argmax(-1), pos + 1
    return max(errors)


# ---------------------------------------------------------------- the rewrite

def test_rewrites_every_cache_cat_into_an_in_place_update(decode_graph):
    result = run_pass("static_kv_cache", ir.copy_graph_module(decode_graph), max_length=MAX)
    assert result.modified and result.stats["matches"] == 4 and result.stats["attention_ops"] == 2
    gm = result.gm
    counts = ir.op_counts(gm)
    assert counts["graphopt.kv_cache_update"] == 4
    spec = spec_of(gm)
    assert [c.shape for c in spec.caches] == [(1, 2, MAX, 16)] * 4 and spec.new_len == 1
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert [n.name for n in placeholders][-1] == "cache_position" and spec.pos_index == 6
    assert spec.dropped_outputs == [1, 2, 3, 4]  # the concatenated caches left the outputs
    (out,) = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert ir.describe_val(out.meta["val"]) == "f32[1, 1, 256]"
    for node in gm.graph.nodes:  # every shape is static now: one graph serves every position
        val = node.meta.get("val")
        assert not isinstance(val, torch.SymInt)
        if isinstance(val, torch.Tensor):
            assert all(isinstance(s, int) for s in val.shape), node.format_node()
    assert all(n.meta.get(ir.CREATED_BY) == "static_kv_cache"
               for n in gm.graph.nodes if ir.target_name(n.target) == "graphopt.kv_cache_update")


@pytest.mark.parametrize("layout, kv_dtype, tol", [
    ("bhsd", "auto", 1e-5), ("bshd", "auto", 1e-5), ("paged", "auto", 1e-5),
    ("bhsd", "int8", 3e-2), ("paged", "int8", 3e-2),
])
def test_decode_matches_eager(llama, decode_graph, layout, kv_dtype, tol):
    result = run_pass("static_kv_cache", ir.copy_graph_module(decode_graph), max_length=MAX, layout=layout,
                      kv_dtype=kv_dtype, block_size=4)
    spec = spec_of(result.gm)
    table = None
    if layout == "paged":
        assert spec.caches[0].shape == (MAX // 4, 2, 4, 16) and spec.block_table_shape == (1, MAX // 4)
        table = torch.randperm(MAX // 4, generator=torch.Generator().manual_seed(0)).view(1, -1)
    assert decode_against_eager(llama, result.gm, spec, table=table) <= tol


@pytest.mark.parametrize("layout, kv_dtype, tol", [("bhsd", "auto", 1e-5), ("bshd", "auto", 1e-5),
                                                   ("paged", "int8", 3e-2)])
def test_fused_attention_reads_the_raw_cache_up_to_the_valid_length(llama, decode_graph, layout, kv_dtype, tol):
    """After fuse_attention, attention reads the buffers themselves (int8 bytes, paged blocks)
    through graphopt.cache_attention with per-row lengths: no dense copy, no full-length mask."""
    fused = run_pass("fuse_attention", ir.copy_graph_module(decode_graph)).gm
    result = run_pass("static_kv_cache", fused, max_length=MAX, layout=layout, kv_dtype=kv_dtype, block_size=4)
    counts = ir.op_counts(result.gm)
    assert counts.get("graphopt.cache_attention") == 2 and "graphopt.attention" not in counts
    assert "aten.index" not in counts  # no gather of the paged blocks
    for node in result.gm.graph.nodes:
        if ir.target_name(node.target) == "graphopt.cache_attention":
            buffers = [a for a in node.args[1:3] + node.args[5:8] if a is not None]  # caches, table, scales
            assert all(a.op == "placeholder" for a in buffers), node.format_node()  # no dense copy
            assert len(buffers) == {"paged": 5}.get(layout, 2) and node.args[8] is None  # no full-length mask
    spec = spec_of(result.gm)
    table = torch.randperm(MAX // 4, generator=torch.Generator().manual_seed(0)).view(1, -1) \
        if layout == "paged" else None
    assert decode_against_eager(llama, result.gm, spec, table=table) <= tol


def test_chunk_with_a_causal_mask_over_the_cache(llama):
    """Three new tokens after a cache: the model's mask is built from the past length, which
    becomes the position input (value) and max_length (size)."""
    past = [torch.zeros(1, 2, PAST, 16) for _ in range(4)]
    gm = export_step(ExplicitCacheStep(llama), torch.tensor([[1, 2, 3]]), torch.tensor([[5, 6, 7]]), past=past)
    result = run_pass("static_kv_cache", gm, max_length=MAX)
    assert result.modified, result.near_misses
    spec = spec_of(result.gm)
    gen = torch.Generator().manual_seed(3)
    real_past = [torch.randn(1, 2, 7, 16, generator=gen) for _ in range(4)]
    ids, pos_ids = torch.tensor([[4, 9, 11]]), torch.tensor([[7, 8, 9]])
    with torch.no_grad():
        expected = ExplicitCacheStep(llama)(ids, pos_ids, real_past)[0]
        caches = [torch.full((1, 2, MAX, 16), -3.0) for _ in range(4)]
        for c, p in zip(caches, real_past):
            c[:, :, :7] = p
        (got,) = result.gm(*static_inputs(spec, ids, pos_ids, 7, caches))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


class CacheAttention(torch.nn.Module):
    """One attention over a concatenated cache, with a mask built from positions (HF style)."""

    def __init__(self, mask: str = "none", op: str = "sdpa", read_tail: bool = False):
        super().__init__()
        self.mask, self.op, self.read_tail = mask, op, read_tail

    def forward(self, q, k_new, v_new, past):
        k, v = torch.cat([past[0], k_new], dim=-2), torch.cat([past[1], v_new], dim=-2)
        kv_len, q_len = k.shape[2], q.shape[2]
        q_pos = torch.arange(q_len) + (kv_len - q_len)
        allowed = torch.arange(kv_len)[None, :] <= q_pos[:, None]
        mask = {"none": None, "bool": allowed,
                "additive": torch.zeros(q_len, kv_len).masked_fill(~allowed, float("-inf"))}[self.mask]
        if self.op == "graphopt":
            out = torch.ops.graphopt.attention(q, k, v, mask, None, False)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        if self.read_tail:
            out = out + k.sum()
        return out, k, v


def _attention_inputs(s_new=2, past_len=PAST):
    gen = torch.Generator().manual_seed(4)
    return ([torch.randn(1, 2, s_new, 8, generator=gen) for _ in range(3)],
            [torch.randn(1, 2, past_len, 8, generator=gen) for _ in range(2)])


@pytest.mark.parametrize("mask, op", [("none", "sdpa"), ("bool", "sdpa"), ("additive", "sdpa"), ("bool", "graphopt")])
def test_masks_over_the_static_cache_match_eager(mask, op):
    module = CacheAttention(mask, op)
    (q, k, v), past = _attention_inputs()
    gm = export_step(module, q, k, v, past=past)
    result = run_pass("static_kv_cache", gm, max_length=16)
    assert result.modified, result.near_misses
    (q, k, v), real_past = _attention_inputs(past_len=9)
    expected = module(q, k, v, real_past)[0]
    caches = [torch.full((1, 2, 16, 8), 50.0) for _ in range(2)]
    for c, p in zip(caches, real_past):
        c[:, :, :9] = p
    (got,) = result.gm(q, k, v, *caches, torch.tensor(9))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caches[0][:, :, 9:11], k)  # the new keys landed at the position


def _run_static(gm, module, tol=1e-5):
    result = run_pass("static_kv_cache", gm, max_length=16)
    assert result.modified, result.near_misses
    (q, k, v), real_past = _attention_inputs(past_len=9)
    caches = [torch.full((1, 2, 16, 8), 50.0) for _ in range(2)]
    for c, p in zip(caches, real_past):
        c[:, :, :9] = p
    (got,) = result.gm(q, k, v, *caches, torch.tensor(9))
    torch.testing.assert_close(got, module(q, k, v, real_past)[0], rtol=tol, atol=tol)
    return result.gm


@pytest.mark.parametrize("mask", ["none", "additive"])
def test_explicit_attention_gets_the_mask_before_its_softmax(mask):
    """SDPA decomposed to q @ k^T -> softmax -> @ v (what a model without fuse_attention shows)."""
    module = CacheAttention(mask)
    (q, k, v), past = _attention_inputs()
    dynamic = (None, None, None, [{2: torch.export.Dim.DYNAMIC}] * 2)
    gm = torch.export.export(module, (q, k, v, past), dynamic_shapes=dynamic).run_decompositions().graph_module
    assert "aten.bmm" in ir.op_counts(gm)
    rewritten = _run_static(gm, module)
    assert ir.op_counts(rewritten)["aten.masked_fill"] >= 1


def test_the_cpu_flash_variant_becomes_bounded_cache_attention():
    """aot_autograd's spelling on the CPU: a tuple op read at output 0, reading the cache directly."""
    module = CacheAttention("bool")
    (q, k, v), past = _attention_inputs()
    gm = export_step(module, q, k, v, past=past)
    sdpa = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default)
    with gm.graph.inserting_before(sdpa):
        flash = gm.graph.call_function(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                                       sdpa.args[:3], {"attn_mask": sdpa.args[3]})
        ir.infer_val(flash)
        first = gm.graph.call_function(operator.getitem, (flash, 0))
        ir.infer_val(first)
    sdpa.replace_all_uses_with(first)
    gm.graph.erase_node(sdpa)
    gm.recompile()
    rewritten = _run_static(gm, module)
    counts = ir.op_counts(rewritten)
    assert counts.get("graphopt.cache_attention") == 1 and "aten._scaled_dot_product_flash_attention_for_cpu" \
        not in counts


# ---------------------------------------------------------------- where it must not fire

def _misses(result):
    assert not result.modified and result.stats["matches"] == 0
    return " | ".join(m.reason for m in result.near_misses)


def test_skips_without_max_length(decode_graph):
    assert "max_length is not set" in _misses(run_pass("static_kv_cache", ir.copy_graph_module(decode_graph)))


def test_skips_a_static_past_length():
    (q, k, v), past = _attention_inputs()
    gm = export_step(CacheAttention(), q, k, v, past=past, dynamic=False)
    assert "export with a dynamic past length" in _misses(run_pass("static_kv_cache", gm, max_length=16))


def test_skips_a_cache_read_outside_attention():
    (q, k, v), past = _attention_inputs()
    gm = export_step(CacheAttention(read_tail=True), q, k, v, past=past)
    assert "feeds aten.sum" in _misses(run_pass("static_kv_cache", gm, max_length=16))


def test_skips_sdpa_is_causal_over_a_cache():
    class Causal(torch.nn.Module):
        def forward(self, q, k_new, v_new, past):
            k, v = torch.cat([past[0], k_new], 2), torch.cat([past[1], v_new], 2)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True), k, v

    (q, k, v), past = _attention_inputs()
    gm = export_step(Causal(), q, k, v, past=past)
    assert "aligns top-left" in _misses(run_pass("static_kv_cache", gm, max_length=16))


def test_skips_a_past_length_used_as_a_scale():
    class Scaled(torch.nn.Module):
        def forward(self, q, k_new, v_new, past):
            k, v = torch.cat([past[0], k_new], 2), torch.cat([past[1], v_new], 2)
            return F.scaled_dot_product_attention(q, k, v) * k.shape[2], k, v

    (q, k, v), past = _attention_inputs()
    gm = export_step(Scaled(), q, k, v, past=past)
    assert "cannot re-express" in _misses(run_pass("static_kv_cache", gm, max_length=16))


def test_skips_a_graph_without_a_cache():
    gm = export_aten_graph(models.build("llama-tiny"), (torch.tensor([[1, 2]]),)).gm
    assert "no graph input is concatenated" in _misses(run_pass("static_kv_cache", gm, max_length=16))


def test_bad_options_fail_with_one_line():
    with pytest.raises(graphopt.OptionsError, match="layout 'bsdh' is not one of"):
        run_pass("static_kv_cache", torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()), layout="bsdh")
