"""What a decode step must read, and how fast this machine can read it.

Decode of one token at batch 1 is memory-bound: every weight is read once per step, so
weight bytes / memory bandwidth is the floor no runtime gets under. The benchmarks print
that floor beside the measured ms/token, with the bandwidth measured in the same run (these
machines are shared: a figure from a spec sheet or another run would flatter or shame us).
"""

from __future__ import annotations

import time

import torch
from torch import nn


def read_bandwidth(gib: float = 1.0, repeat: int = 5) -> float:
    """Bytes per second a ``sum`` over a ``gib`` GiB float32 buffer reads (best of ``repeat``),
    on torch's current thread count. Far larger than any cache, so it measures DRAM."""
    buffer = torch.ones(int(gib * 2**30) // 4)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * 4 / best


def torch_decode_bytes(model: nn.Module) -> int:
    """Bytes of parameters and buffers a decode step reads: all of them, except embedding
    tables (a step gathers one row), unless the same tensor is also a linear weight (tied)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    linears = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    seen, total = set(), 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in seen or (id(tensor) in embeddings and id(tensor) not in linears):
            continue
        seen.add(id(tensor))
        total += tensor.numel() * tensor.element_size()
    return total


def onnx_decode_bytes(path: str) -> int:
    """Bytes of the initializers an ONNX decode step reads, leaving out those only a Gather
    reads as its data (embedding tables: one row per token)."""
    import onnx_ir as ir

    model = ir.load(path)
    total = 0
    for value in model.graph.initializers.values():
        if value.const_value is None:
            continue
        uses = list(value.uses())
        gathered = uses and all(node.op_type == "Gather" and index == 0 for node, index in uses)
        if not gathered:
            total += value.const_value.nbytes
    return total
