"""linears.concat_constant: a recompile that merges the same weights again (merge_qkv,
fuse_gated_mlp on dynamo's graph for a new shape) gets the earlier graph's tensor, not a
second copy; parts that changed, or an earlier tensor that is gone, get a new one."""

from __future__ import annotations

import gc

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.rewrite.linears import concat_constant

gen = torch.Generator().manual_seed(3)


def merged(parts: list[torch.Tensor]) -> tuple[fx.GraphModule, torch.Tensor]:
    gm = fx.GraphModule(torch.nn.Module(), fx.Graph())
    node = concat_constant(gm, parts, "layers.0.attn.qkv.weight")
    return gm, ir.get_constant(node)


def test_the_same_parts_share_one_tensor_and_it_is_their_concatenation():
    q, k = torch.randn(8, 4, generator=gen), torch.randn(4, 4, generator=gen)
    first_gm, first = merged([q, k])
    second_gm, second = merged([q, k])
    assert second is first
    assert torch.equal(first, torch.cat([q, k]))


def test_parts_changed_in_place_get_a_new_tensor():
    q, k = torch.randn(8, 4, generator=gen), torch.randn(4, 4, generator=gen)
    first_gm, first = merged([q, k])
    with torch.no_grad():
        k.add_(1.0)  # a fine-tuning step between compiles: same address, new values
    _, second = merged([q, k])
    assert second is not first and torch.equal(second, torch.cat([q, k]))


def test_views_with_other_strides_or_order_are_other_keys():
    w = torch.randn(8, 4, generator=gen)
    first_gm, first = merged([w[:4], w[4:]])
    _, swapped = merged([w[4:], w[:4]])
    assert swapped is not first and torch.equal(swapped, torch.cat([w[4:], w[:4]]))


def test_an_earlier_tensor_that_no_longer_equals_the_parts_is_not_reused():
    """The key is where the parts live; the values are compared before reuse, so a tensor
    whose parts' addresses now hold other data (or that was itself changed) is not returned."""
    q, k = torch.randn(8, 4, generator=gen), torch.randn(4, 4, generator=gen)
    first_gm, first = merged([q, k])
    with torch.no_grad():
        first[0, 0] += 1.0
    _, second = merged([q, k])
    assert second is not first and torch.equal(second, torch.cat([q, k]))


def test_an_earlier_tensor_that_is_gone_is_made_again():
    q, k = torch.randn(8, 4, generator=gen), torch.randn(4, 4, generator=gen)
    gm, _ = merged([q, k])
    del gm, _
    gc.collect()
    _, again = merged([q, k])
    assert torch.equal(again, torch.cat([q, k]))
