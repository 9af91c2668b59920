"""fuse_rope_kv_cache_update: a static-cache layer's rope(q), rope(k) and two cache writes become one op."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import graphopt
from graphopt import ir, models
from graphopt.generation.runner import ExplicitCacheStep
from graphopt.ops.kv_cache import spec_of
from tests.helpers import run_pass
from tests.op_cases import nonzero_random
from tests.passes.test_static_kv_cache import MAX, PAST, decode_against_eager, export_step

g = torch.ops.graphopt
FUSED = "graphopt.rope_kv_cache_update"


@pytest.fixture(scope="module")
def llama():
    return models.build("llama-tiny", seed=0)


def static_step(llama, new_tokens: int = 1, **static_options):
    """The tiny Llama's step with fused rope and attention, then its cache made static."""
    past = [torch.zeros(1, 2, PAST, 16) for _ in range(4)]
    ids, pos = torch.arange(1, new_tokens + 1)[None], torch.arange(PAST, PAST + new_tokens)[None]
    gm = export_step(ExplicitCacheStep(llama), ids, pos, past=past)
    for name in ("fuse_rope", "fuse_attention"):
        gm = run_pass(name, gm).gm
    return run_pass("static_kv_cache", gm, max_length=MAX, block_size=4, **static_options).gm


# ---------------------------------------------------------------- the rewrite, on a model

@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_every_layer_gets_one_op_and_decodes_as_before(llama, layout):
    before = static_step(llama, layout=layout)
    result = run_pass("fuse_rope_kv_cache_update", ir.copy_graph_module(before))
    assert result.modified and result.stats["matches"] == 2 and result.near_misses == []
    counts = ir.op_counts(result.gm)
    assert counts[FUSED] == 2
    assert "graphopt.rope" not in counts and "graphopt.kv_cache_update" not in counts
    fused = [n for n in result.gm.graph.nodes if ir.target_name(n.target) == FUSED]
    assert all(n.meta[ir.CREATED_BY] == "fuse_rope_kv_cache_update" for n in fused)
    assert all(ir.target_name(u.target) == "graphopt.cache_attention" for n in fused for u in n.users)
    spec = spec_of(result.gm)
    assert decode_against_eager(llama, result.gm, spec) <= 1e-5
    assert decode_against_eager(llama, result.gm, spec) == decode_against_eager(llama, before, spec_of(before))


def test_a_prompt_chunk_fuses_through_the_layout_copies_rope_left(llama):
    result = run_pass("fuse_rope_kv_cache_update", static_step(llama, new_tokens=3))
    assert result.stats["matches"] == 2


def test_generate_runs_the_fused_op_and_keeps_greedy_tokens(llama):
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(3))
    out, ref = graphopt.generation.generate_with_reference(llama, ids, 6, options={"target": "eager"})
    assert torch.equal(out.new_tokens, ref.new_tokens)
    assert all(r.op_counts.get(FUSED) == 2 for r in out.reports)
    graphopt.generation.forget(llama)
    off = graphopt.generate(llama, ids, 6, options={"target": "eager",
                                                    "disable_passes": ["fuse_rope_kv_cache_update"]})
    assert torch.equal(off.new_tokens, out.new_tokens)
    assert all(FUSED not in r.op_counts and r.op_counts["graphopt.kv_cache_update"] == 4 for r in off.reports)


# ---------------------------------------------------------------- what must not fuse

@pytest.mark.parametrize("options, reason", [
    ({"layout": "paged"}, "paged"),
    ({"kv_dtype": "int8"}, "int8"),
], ids=["paged", "int8"])
def test_skips_paged_and_int8_caches(llama, options, reason):
    result = run_pass("fuse_rope_kv_cache_update", static_step(llama, **options))
    assert not result.modified and result.stats["matches"] == 0
    assert len(result.near_misses) == 2 and all(reason in m.reason for m in result.near_misses)


def test_skips_a_graph_without_a_static_cache():
    gm = make_fx(lambda x, w: g.rms_norm(x, w, 1e-6))(nonzero_random(2, 8), nonzero_random(8))
    result = run_pass("fuse_rope_kv_cache_update", gm)
    assert not result.modified and "static_kv_cache did not" in result.near_misses[0].reason


def _layer(k_other_reader=False, k_tables_differ=False, read_between=False):
    """The smallest static-cache layer: rope q and k, write k and v, attend."""
    def layer(q, k, v, cos, sin, k_cache, v_cache, pos):
        q_rot = g.rope(q, cos, sin)
        k_rot = g.rope(k, sin if k_tables_differ else cos, cos if k_tables_differ else sin)
        g.kv_cache_update(k_cache, k_rot, pos)
        extra = [k_cache.sum()] if read_between else []
        g.kv_cache_update(v_cache, v, pos)
        out = g.cache_attention(q_rot, k_cache, v_cache, (pos + 1).expand(1))
        return (out, k_rot * 2) if k_other_reader else (out, *extra)
    return layer


def _layer_inputs():
    r = nonzero_random
    return (r(1, 4, 1, 16), r(1, 2, 1, 16), r(1, 2, 1, 16), r(1, 1, 16), r(1, 1, 16), r(1, 2, 8, 16),
            r(1, 2, 8, 16), torch.tensor(3))


def test_the_smallest_layer_fuses_and_computes_the_same():
    gm = make_fx(_layer())(*_layer_inputs())
    result = run_pass("fuse_rope_kv_cache_update", ir.copy_graph_module(gm))
    assert result.stats["matches"] == 1
    assert [ir.target_name(n.target) for n in result.gm.graph.nodes if n.op == "call_function"] == [
        FUSED, "aten.add", "aten.expand", "graphopt.cache_attention"]
    inputs = _layer_inputs()
    want, got = [t.clone() for t in inputs], [t.clone() for t in inputs]
    torch.testing.assert_close(result.gm(*got), gm(*want), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[5:7], want[5:7], rtol=0, atol=0)  # the same cache writes


@pytest.mark.parametrize("variant, reason", [
    ({"k_other_reader": True}, "another reader"),
    ({"k_tables_differ": True}, "different tables"),
    ({"read_between": True}, "between its two writes"),
], ids=["rotated-keys-reused", "other-tables", "cache-read-between-writes"])
def test_skips_layers_it_cannot_fold_exactly(variant, reason):
    gm = make_fx(_layer(**variant))(*_layer_inputs())
    result = run_pass("fuse_rope_kv_cache_update", gm)
    assert not result.modified
    assert len(result.near_misses) == 1 and reason in result.near_misses[0].reason
