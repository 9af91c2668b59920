"""How the attention fusion reads its operands' sizes: without adding dynamo guards."""

from __future__ import annotations


def test_k_and_v_lengths_are_related_without_a_guard():
    """Two symbols traced at one length are k's and v's lengths for attention with no guard
    (a decode step's two caches); other lengths, or a symbol against a constant, are not."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from graphopt.passes._attention_operands import _same_length

    env = ShapeEnv()
    k_len, v_len, other = (_symint(env, name, hint) for name, hint in (("k", 7), ("v", 7), ("other", 9)))
    assert _same_length(k_len, k_len) and _same_length(5, 5)
    assert _same_length(k_len, v_len)
    assert not _same_length(k_len, other)
    assert not _same_length(k_len, 7)  # comparing would pin the symbol to 7
    assert env.guards == []


def _symint(env, name: str, hint: int):
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    source = ConstantSource(f"{name}_len")
    symbol = env.create_symbol(hint, source, dynamic_dim=DimDynamic.DYNAMIC)
    return env.create_symintnode(symbol, hint=hint, source=source)
