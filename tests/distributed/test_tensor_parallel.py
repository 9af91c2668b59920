"""Tensor parallelism on 2 gloo ranks (CPU, one thread each): llama-tiny sharded
Megatron-style matches the unsharded model, each shard still fuses (one qkv_proj, swiglu
and attention over the local heads per layer), and every row-parallel all-reduce becomes
one graphopt.all_reduce_add_rms_norm; graphopt.generate on the shards gives TP=1's
greedy tokens for 32 steps. One spawn runs every check, to keep the cost of
starting two Python processes to once."""

import pytest
import torch

from graphopt.distributed.launch import spawn
from graphopt.errors import GraphoptError

TOL = 1e-5


def _both_styles(rank, world):
    from graphopt.distributed.tp_run import rank_run

    functional = rank_run(rank, world, "llama-tiny", 0, 1, 8, {"target": "eager", "fallback": "error"}, 0,
                          "functional")
    dtensor = rank_run(rank, world, "llama-tiny", 0, 1, 8, {"target": "eager", "fallback": "error"}, 0,
                       "dtensor")
    from graphopt.distributed.tp_generate import rank_generate

    decoded = rank_generate(rank, world, "llama-tiny", 0, 1, 8, 32, {"target": "eager", "fallback": "error"},
                            "functional")
    return functional, dtensor, decoded, _transformers_llama(rank, world)


def _transformers_llama(rank, world):
    """transformers' Llama (2 layers, 4 heads, 2 kv heads) through the same plan."""
    import transformers

    import graphopt
    from graphopt.distributed.shard import shard_llama
    from graphopt.distributed.tp_run import op_counts
    from graphopt.numerics import compare

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 128, (1, 8))

    def logits(x):
        return model(x).logits

    with torch.no_grad():
        expected = logits(ids)
        shard_llama(model)
        graphopt.reset()
        torch._dynamo.reset()
        actual = torch.compile(logits, backend="graphopt", options={"target": "eager", "fallback": "error"})(ids)
    return compare(actual, expected).rel, op_counts(graphopt.reports())


@pytest.fixture(scope="module")
def rows():
    return spawn(_both_styles, 2)


def test_functional_shards_match_and_fuse(rows):
    for functional, *_ in rows:
        counts = functional["op_counts"]
        assert functional["rel_err"] <= TOL, functional["rel_err"]
        # llama-tiny: 2 layers; per layer one merged QKV of the local heads, one SwiGLU, one attention
        assert counts.get("graphopt.qkv_proj") == 2, counts
        assert counts.get("graphopt.swiglu") == 2, counts
        assert counts.get("graphopt.attention") == 2, counts
        # 2 row-parallel outputs per layer, each feeding the next add + RMSNorm (the last one the final norm)
        assert functional["fused_all_reduce_norms"] == 4, counts
        assert functional["all_reduces_left"] == 0, counts
        assert not functional["fallbacks"]


def graphopt_ops(counts: dict) -> dict:
    return {op: n for op, n in counts.items() if op.startswith("graphopt.")}


def test_dtensor_shards_fuse_like_the_functional_ones(rows):
    """parallelize_module's DTensor weights are frozen too (aot_autograd flattens each into
    its local tensor and mesh; the frontend lines them up again), so each shard gets the
    same graphopt ops as the plain-sharded model: merged QKV and SwiGLU included."""
    for functional, dtensor, *_ in rows:
        counts = dtensor["op_counts"]
        assert dtensor["rel_err"] <= TOL, dtensor["rel_err"]
        assert graphopt_ops(counts) == graphopt_ops(functional["op_counts"]), counts
        assert counts.get("graphopt.qkv_proj") == 2 and counts.get("graphopt.swiglu") == 2, counts
        assert dtensor["fused_all_reduce_norms"] == 4, counts
        assert not dtensor["fallbacks"]


def test_ranks_agree(rows):
    (a, *_), (b, *_) = rows
    assert a["rel_err"] == pytest.approx(b["rel_err"], rel=1e-6)


def test_greedy_tokens_match_tp1_for_32_steps(rows):
    for _, _, decoded, _ in rows:
        assert decoded["tokens_match_tp1"], f"first mismatch at token {decoded['first_mismatch']}"
        assert decoded["fallback"] is None


def test_transformers_llama_shards_match_and_fuse(rows):
    for *_, (rel_err, counts) in rows:
        assert rel_err <= TOL, rel_err
        for op in ("graphopt.qkv_proj", "graphopt.swiglu", "graphopt.attention"):
            assert counts.get(op) == 2, counts
        assert counts.get("graphopt.all_reduce_add_rms_norm") == 4, counts


def test_tp_that_does_not_divide_the_heads_names_the_fix():
    from graphopt.distributed.shard import check_divisible
    from graphopt.models import config_of
    from graphopt.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM(config_of("llama-tiny"))  # 4 heads, 2 kv heads
    with pytest.raises(GraphoptError, match="pick a --tp that divides 2"):
        check_divisible(model, 4)
