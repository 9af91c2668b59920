"""Shard a Llama (graphopt's built-in or Hugging Face's) for tensor parallelism.

Megatron's layout: q/k/v and gate/up are column-parallel (each rank keeps a contiguous
slice of the output features: its own heads, its own slice of the MLP), o_proj and
down_proj are row-parallel (each rank keeps the matching slice of the input features and
sums its partial product with an all-reduce). Embedding, norms and lm_head stay
replicated. Both models name these projections alike, so one plan serves both.

Two spellings of the same sharding:
- ``style="functional"`` (default): weights become plain local tensors and the row-parallel
  projections call ``_c10d_functional.all_reduce`` + ``wait_tensor`` themselves. dynamo
  sees ordinary parameters, graphopt freezes them, and merge_qkv / fuse_gated_mlp fuse
  each shard.
- ``style="dtensor"``: ``torch.distributed.tensor.parallel.parallelize_module`` with
  ColwiseParallel / RowwiseParallel. aot_autograd flattens each DTensor parameter into its
  local tensor and DeviceMesh; graphopt's frontend lines those up with dynamo's inputs and
  freezes the local tensors, so each shard fuses as the functional style does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from graphopt.errors import GraphoptError

COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROW = ("self_attn.o_proj", "mlp.down_proj")
STYLES = ("functional", "dtensor")


class RowParallelLinear(nn.Module):
    """``all_reduce_sum(x_local @ W_local^T) + b``: this rank's slice of the input features."""

    def __init__(self, linear: nn.Linear, rank: int, world: int, group_name: str) -> None:
        super().__init__()
        width = linear.in_features // world
        self.weight = nn.Parameter(linear.weight.detach()[:, rank * width:(rank + 1) * width].clone(),
                                   requires_grad=False)
        # the bias is added once, after the sum, not once per rank
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.group_name = group_name

    def forward(self, x: Tensor) -> Tensor:
        c10d = torch.ops._c10d_functional
        out = c10d.wait_tensor(c10d.all_reduce(F.linear(x, self.weight), "sum", self.group_name))
        return out if self.bias is None else out + self.bias


def _column_slice(linear: nn.Linear, rank: int, world: int) -> None:
    width = linear.out_features // world
    keep = slice(rank * width, (rank + 1) * width)
    linear.weight = nn.Parameter(linear.weight.detach()[keep].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.detach()[keep].clone(), requires_grad=False)
    linear.out_features = width


def _layers(model: nn.Module) -> list[nn.Module]:
    """Every decoder layer: a module with both a ``self_attn`` and an ``mlp`` child."""
    found = [m for m in model.modules() if hasattr(m, "self_attn") and hasattr(m, "mlp")]
    if not found:
        raise GraphoptError(f"--tp: found no decoder layers (modules with self_attn and mlp) in "
                            f"{type(model).__name__}; tensor parallelism supports Llama-style models")
    return found


def _heads(attn: nn.Module) -> tuple[int, int]:
    config = getattr(attn, "config", None)
    heads = getattr(attn, "num_heads", None) or getattr(config, "num_attention_heads", None)
    kv = getattr(attn, "num_kv_heads", None) or getattr(config, "num_key_value_heads", None) or heads
    return heads, kv


def check_divisible(model: nn.Module, world: int) -> None:
    """Raise one clear error when the model's heads or MLP do not split ``world`` ways."""
    layer = _layers(model)[0]
    heads, kv = _heads(layer.self_attn)
    inter = layer.mlp.gate_proj.out_features
    for what, n in (("attention heads", heads), ("key/value heads", kv), ("MLP width", inter)):
        if n is None or n % world:
            raise GraphoptError(f"--tp {world}: the model's {what} ({n}) do not split into {world} equal "
                                f"shards; pick a --tp that divides {n}")


def _localize_heads(attn: nn.Module, world: int) -> None:
    """The built-in Llama (and older transformers) reshape by a stored head count."""
    for attr in ("num_heads", "num_kv_heads", "num_key_value_heads"):
        if isinstance(getattr(attn, attr, None), int):
            setattr(attn, attr, getattr(attn, attr) // world)
    if isinstance(getattr(attn, "hidden_size", None), int):
        attn.hidden_size //= world


def shard_llama(model: nn.Module, style: str = "functional", group: dist.ProcessGroup | None = None) -> nn.Module:
    """Shard ``model`` in place across ``group`` (default: the world) and return it."""
    if style not in STYLES:
        raise GraphoptError(f"unknown tensor-parallel style {style!r}; use one of {', '.join(STYLES)}")
    if not dist.is_initialized():
        raise GraphoptError("shard_llama needs torch.distributed initialised; launch ranks with "
                            "graphopt.distributed.launch.spawn or torchrun")
    group = group or dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    check_divisible(model, world)
    layers = _layers(model)
    if style == "dtensor":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = DeviceMesh.from_group(group, "cpu" if dist.get_backend(group) == "gloo" else "cuda")
        plan = {**{n: ColwiseParallel() for n in COLUMN}, **{n: RowwiseParallel() for n in ROW}}
        for layer in layers:
            parallelize_module(layer, mesh, plan)
            _localize_heads(layer.self_attn, world)
        return model
    for layer in layers:
        for name in COLUMN:
            _column_slice(layer.get_submodule(name), rank, world)
        for name in ROW:
            parent, child = name.split(".")
            owner = getattr(layer, parent)
            setattr(owner, child, RowParallelLinear(getattr(owner, child), rank, world, group.group_name))
        _localize_heads(layer.self_attn, world)
    return model
