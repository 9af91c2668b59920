"""The fused-MoE kernels (tokens sorted by expert, grouped gate/up + SwiGLU GEMM, grouped
down GEMM with the routing weight) vs graphopt.moe's reference, under the interpreter.

Tiny shapes, none a power of two: the interpreter's 16-row blocks then hold several experts'
padded runs, partial column and K tiles, and experts no token chose."""

from __future__ import annotations

import pytest
import torch

import graphopt.ops  # noqa: F401  (registers torch.ops.graphopt.*)
from graphopt.backends.triton.kernels import moe as kernels

from ._numerics import DTYPES, assert_matches, randn

ops = torch.ops.graphopt


@pytest.fixture
def poisoned_scratch(monkeypatch):
    """The kernels' scratch (gathered SwiGLU rows, per-pair outputs) starts as NaN: a row the
    kernels forget to write, or a padding row they read, shows up in the result."""
    monkeypatch.setattr(kernels, "_buffer", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype))


def _weights(experts, hidden, inter, dtype, shared):
    w = dict(router_weight=randn(experts, hidden, dtype=dtype), gate_up=randn(experts, 2 * inter, hidden, dtype=dtype,
                                                                                scale=0.3),
             down=randn(experts, hidden, inter, dtype=dtype, scale=0.3))
    if shared:
        w.update(shared_gate_up=randn(2 * 10, hidden, dtype=dtype, scale=0.3),
                 shared_down=randn(hidden, 10, dtype=dtype, scale=0.3), shared_gate=randn(1, hidden, dtype=dtype))
    return w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, experts, k, normalize, shared", [
    (1, 4, 2, True, False),    # one decode token: two experts busy, two idle
    (13, 5, 2, False, True),   # prefill with Qwen2-MoE's shared expert and raw softmax weights
    (21, 6, 3, True, False),   # runs longer than one 16-row block
], ids=["decode", "prefill_shared", "top3"])
def test_matches_the_reference(tokens, experts, k, normalize, shared, dtype, poisoned_scratch):
    hidden, inter = 24, 20
    x = randn(tokens, hidden, dtype=dtype)
    w = _weights(experts, hidden, inter, dtype, shared)
    got = kernels.moe(x, k=k, normalize=normalize, **w)
    assert_matches(got, ops.moe(x, k=k, normalize=normalize, **w))


def test_align_pads_each_expert_to_whole_blocks():
    experts = torch.tensor([[2, 0], [2, 3], [0, 2]])  # expert 1 unused; pairs 0..5
    pairs, block_expert, total = kernels.align(experts, 4, 4)
    assert total.tolist() == [12]  # experts 0, 2, 3 each padded to one 4-row block
    assert pairs[:12].tolist() == [1, 4, 6, 6, 0, 2, 5, 6, 3, 6, 6, 6]  # 6 (= pairs) marks padding
    assert block_expert[:3].tolist() == [0, 2, 3]
    assert pairs.numel() % 4 == 0 and pairs.numel() >= 6 + 4 * 3
