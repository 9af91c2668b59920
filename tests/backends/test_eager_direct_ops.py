"""The eager target calls the decoder-layer ops (attention, KV cache, norms, rope, QKV, gated
MLP) as plain functions (no custom-op dispatch), computes what the ops compute, and leaves the
caller's graph as it was."""

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from graphopt import ir
from graphopt.backends.eager import DIRECT_OPS, eager
from graphopt.decompose import reference_of
from tests.op_cases import nonzero_random

g = torch.ops.graphopt


def _step(cache_k, cache_v, q, k, v, pos, lengths):
    g.kv_cache_update(cache_k, k, pos)
    g.kv_cache_update(cache_v, v, pos)
    out = g.rms_norm(g.cache_attention(q, cache_k, cache_v, lengths), torch.ones(16), 1e-6)
    return g.softmax_rms_norm(out, torch.ones(16), 1e-6)


def test_cache_ops_run_as_plain_functions_and_compute_the_same():
    caches = [nonzero_random(1, 2, 9, 16) for _ in range(2)]
    new = [nonzero_random(1, 4, 1, 16), nonzero_random(1, 2, 1, 16), nonzero_random(1, 2, 1, 16)]
    pos, lengths = torch.tensor(4), torch.tensor([5])
    gm = make_fx(_step, tracing_mode="fake")(*[c.clone() for c in caches], *new, pos, lengths)
    before = ir.op_counts(gm)
    lowered = eager.compile(gm, None, None)
    assert ir.op_counts(gm) == before, "the caller's graph must keep its ops"
    targets = {n.target for n in lowered.graph.nodes if n.op == "call_function"}
    for name in ("cache_attention", "kv_cache_update", "rms_norm"):
        op = getattr(g, name).default
        assert reference_of(op) in targets and op not in targets and f"graphopt.{name}" in DIRECT_OPS
    assert g.softmax_rms_norm.default in targets  # other ops keep the dispatcher
    got_caches, want_caches = [c.clone() for c in caches], [c.clone() for c in caches]
    got = lowered(*got_caches, *new, pos, lengths)
    want = _step(*want_caches, *new, pos, lengths)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for a, b in zip(got_caches, want_caches):  # the in-place writes happened
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert not torch.equal(a, caches[0]) and not torch.equal(a, caches[1])


def test_a_graph_without_those_ops_is_returned_as_it_is():
    gm = make_fx(lambda x: g.softmax_rms_norm(x, torch.ones(8), 1e-6), tracing_mode="fake")(torch.ones(2, 8))
    assert eager.compile(gm, None, None) is gm
