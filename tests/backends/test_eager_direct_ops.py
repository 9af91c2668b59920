"""The eager target calls the decoder-layer ops (attention, KV cache, norms, rope, QKV, gated
MLP) as plain functions (no custom-op dispatch), computes what the ops compute, and leaves the
caller's graph as it was."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from graphopt import ir
from graphopt.backends.eager import DIRECT_OPS, eager
from graphopt.ops import reference_of
from tests.op_cases import OP_CASES, nonzero_random

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
    lowered = eager.compile(gm, None, None).fn
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
    assert eager.compile(gm, None, None).fn is gm


def _lowered_targets(fn, *args):
    gm = make_fx(fn, tracing_mode="fake")(*args)
    lowered = eager.compile(gm, None, None).fn
    return lowered, {n.target for n in lowered.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("name", ["moe", "int4_moe"])
@pytest.mark.parametrize("tokens", [1, 5, 40])  # a decode step, a short and a longer prefill
def test_moe_runs_each_expert_on_its_own_tokens_and_computes_the_op(name, tokens):
    from graphopt.ops.moe import moe_sparse
    from graphopt.ops.moe_int4 import int4_moe_sparse

    _, fn, args = OP_CASES[name]
    args = (nonzero_random(tokens, args[0].shape[1]), *args[1:])
    lowered, targets = _lowered_targets(fn, *args)
    assert {"moe": moe_sparse, "int4_moe": int4_moe_sparse}[name] in targets
    assert getattr(g, name).default not in targets
    torch.testing.assert_close(lowered(*args), fn(*args), rtol=1e-5, atol=1e-5)


def test_moe_sparse_skips_the_experts_no_token_was_routed_to(monkeypatch):
    """One token with k=2 runs exactly two expert MLPs (the dense reference runs all four),
    and the routing it records is the op's."""
    from graphopt.ops import moe as moe_module

    _, fn, args = OP_CASES["moe"]
    args = (nonzero_random(1, args[0].shape[1]), *args[1:])
    calls = []
    real = moe_module._swiglu_mlp
    monkeypatch.setattr(moe_module, "_swiglu_mlp", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    with moe_module.record_routing() as log:
        got = moe_module.moe_sparse(args[0], args[1], args[2], args[3], 2, True)
    assert calls == [1, 1]  # two experts, one row each; no shared expert given
    _, experts = moe_module.route(args[0], args[1], 2, True)
    assert log.tokens_per_expert() == [torch.bincount(experts.reshape(-1), minlength=4).tolist()]
    torch.testing.assert_close(got, g.moe(args[0], args[1], args[2], args[3], 2, True), rtol=1e-5, atol=1e-5)
