"""Mixture of experts: router, top-k, SwiGLU experts and their weighted sum as one op.

``graphopt.moe(x, router_weight, gate_up, down, k, normalize, shared_gate_up, shared_down,
shared_gate)`` for ``x`` of shape [tokens, hidden]:

- ``probs = softmax(x @ router_weight^T)`` over the experts, in float32;
- ``weights, experts = topk(probs, k)``; with ``normalize`` the k weights are divided by
  their sum (Mixtral), without it they stay as softmax gave them (Qwen2-MoE);
- each token goes through its k experts, ``down[e] @ (silu(g) * u)`` with
  ``[g; u] = gate_up[e] @ x`` (``gate_up`` is [experts, 2 * inter, hidden], the gate rows
  first; ``down`` is [experts, hidden, inter]: nn.Linear's [out, in] per expert), and the
  outputs are summed with the routing weights;
- a shared expert, when given (Qwen2-MoE), is one more SwiGLU MLP every token goes
  through, scaled by ``sigmoid(x @ shared_gate^T)`` when it has its own gate.

Why one op: the routed part is a tangle of sort, gather, grouped GEMMs and scatter that no
target lowers piece by piece (transformers' grouped GEMM is an opaque custom op); as one op
ONNX Runtime runs it as its ``MoE`` kernel and Triton as one sorted grouped GEMM.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from graphopt.ops._library import register


def route(x: Tensor, router_weight: Tensor, k: int, normalize: bool) -> tuple[Tensor, Tensor]:
    """``(weights [T, k] float32, experts [T, k] int64)``: the router's choice per token."""
    probs = torch.softmax((x @ router_weight.t()).float(), dim=-1)
    weights, experts = torch.topk(probs, k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def _swiglu_mlp(x: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    gate, up = (x @ gate_up.t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ down.t()


def _check(x: Tensor, router_weight: Tensor, gate_up: Tensor, down: Tensor, k: int) -> None:
    experts, hidden = router_weight.shape
    if x.dim() != 2 or x.shape[-1] != hidden:
        raise ValueError(f"moe: x must be [tokens, {hidden}], got {tuple(x.shape)}")
    if gate_up.dim() != 3 or gate_up.shape[0] != experts or gate_up.shape[2] != hidden or gate_up.shape[1] % 2:
        raise ValueError(f"moe: gate_up must be [{experts}, 2 * inter, {hidden}], got {tuple(gate_up.shape)}")
    if tuple(down.shape) != (experts, hidden, gate_up.shape[1] // 2):
        raise ValueError(f"moe: down must be [{experts}, {hidden}, {gate_up.shape[1] // 2}], got {tuple(down.shape)}")
    if not 1 <= k <= experts:
        raise ValueError(f"moe: k={k} must be between 1 and the number of experts ({experts})")


@torch.library.custom_op("graphopt::moe", mutates_args=())
def moe(x: Tensor, router_weight: Tensor, gate_up: Tensor, down: Tensor, k: int, normalize: bool,
        shared_gate_up: Tensor | None = None, shared_down: Tensor | None = None,
        shared_gate: Tensor | None = None) -> Tensor:
    """Routed SwiGLU experts (plus an optional shared expert) for ``x`` [tokens, hidden]."""
    _check(x, router_weight, gate_up, down, k)
    weights, experts = route(x, router_weight, k, normalize)
    if _recording:
        _recording[-1].add(router_weight, experts)
    # Dense on purpose: every expert runs on every token and the routing weights (zero off
    # the top k) pick the sum. No data-dependent shapes, so the reference traces with fake
    # tensors and is what a target without an MoE kernel runs (graphopt.ops.decompose).
    mix = torch.zeros(weights.shape[0], gate_up.shape[0], dtype=weights.dtype, device=x.device)
    mix = mix.scatter(1, experts, weights)  # [tokens, experts]
    gate, up = (x @ gate_up.transpose(1, 2)).chunk(2, dim=-1)  # [experts, tokens, inter] each
    y = (F.silu(gate) * up) @ down.transpose(1, 2)  # [experts, tokens, hidden]
    out = (y * mix.t().unsqueeze(-1)).sum(dim=0)
    return add_shared_expert(x, out.to(x.dtype), shared_gate_up, shared_down, shared_gate)


def capturing(x: Tensor) -> bool:
    """Whether a CUDA graph is being captured: the sparse dispatch reads the routing on the
    host, which a capture forbids, so the dense op runs instead."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def dispatch_routed(x: Tensor, weights: Tensor, experts: Tensor, num_experts: int, expert_mlp) -> Tensor:
    """The routed sum with each expert run on its own tokens only: ``expert_mlp(e, rows)``
    gives expert ``e``'s output for the rows of ``x`` routed to it.

    This is what an eager run wants (a decode step touches k experts, not all of them), and
    it has data-dependent shapes, so it is no reference: tracing needs the dense one above.
    Sums in float32 in (token, slot) order, as the dense reference's weighting does.
    """
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    token_of = order // experts.shape[-1]
    slot_weight = weights.reshape(-1)[order].float().unsqueeze(-1)
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n:
            rows = token_of[start:start + n]
            out.index_add_(0, rows, expert_mlp(e, x[rows]).float() * slot_weight[start:start + n])
        start += n
    return out.to(x.dtype)


def add_shared_expert(x: Tensor, out: Tensor, shared_gate_up: Tensor | None, shared_down: Tensor | None,
                      shared_gate: Tensor | None) -> Tensor:
    if shared_gate_up is None:
        return out
    shared = _swiglu_mlp(x, shared_gate_up, shared_down)
    if shared_gate is not None:
        shared = torch.sigmoid(x @ shared_gate.t()) * shared
    return out + shared


def moe_sparse(x: Tensor, router_weight: Tensor, gate_up: Tensor, down: Tensor, k: int, normalize: bool,
               shared_gate_up: Tensor | None = None, shared_down: Tensor | None = None,
               shared_gate: Tensor | None = None) -> Tensor:
    """``graphopt.moe`` computed with :func:`dispatch_routed`: what the eager target runs
    (the same function as the op up to float32 summation order)."""
    if capturing(x):
        return moe(x, router_weight, gate_up, down, k, normalize, shared_gate_up, shared_down, shared_gate)
    _check(x, router_weight, gate_up, down, k)
    weights, experts = route(x, router_weight, k, normalize)
    if _recording:
        _recording[-1].add(router_weight, experts)
    out = dispatch_routed(x, weights, experts, gate_up.shape[0], lambda e, rows: _swiglu_mlp(rows, gate_up[e], down[e]))
    return add_shared_expert(x, out, shared_gate_up, shared_down, shared_gate)


@moe.register_fake
def _(x, router_weight, gate_up, down, k, normalize, shared_gate_up=None, shared_down=None, shared_gate=None):
    _check(x, router_weight, gate_up, down, k)
    return x.new_empty(x.shape)


register("moe")


# --- routing observability --------------------------------------------------------------------

class RoutingLog:
    """The experts chosen per MoE layer and per call while recording was on: by the reference
    op inside :func:`record_routing` (layers told apart by their router weight), or by a
    compiled graph with ``options={"record_routing": True}`` (layers named after their
    ``graphopt.moe`` node). For a decode loop that is one call per layer and step, so two
    consecutive calls of a layer with the same number of tokens are consecutive tokens of
    each row."""

    def __init__(self) -> None:
        self.layers: dict = {}  # layer key -> [T, k] int64 expert ids per call
        self.num_experts: dict = {}
        self.names: dict = {}

    def add(self, router_weight: Tensor, experts: Tensor) -> None:
        self.add_layer(router_weight.data_ptr(), router_weight.shape[0], experts)

    def add_layer(self, key, num_experts: int, experts: Tensor, name: str | None = None) -> None:
        if isinstance(experts, torch._subclasses.FakeTensor):
            return  # tracing, not running: nothing was routed
        self.layers.setdefault(key, []).append(experts.detach().cpu())
        self.num_experts[key] = num_experts
        self.names.setdefault(key, name if name is not None else f"moe{len(self.names)}")

    def tokens_per_expert(self) -> list[list[int]]:
        """Per layer: how many (token, slot) pairs each expert received, over all calls."""
        return [torch.bincount(torch.cat([c.reshape(-1) for c in calls]), minlength=self.num_experts[key]).tolist()
                for key, calls in self.layers.items()]

    def _changes(self, calls: list[Tensor]) -> tuple[int, int]:
        """(rows whose top-k expert *set* changed, rows compared) over consecutive calls with
        the same number of tokens; a prefill next to a decode step is not the same rows."""
        changed = total = 0
        for prev, cur in zip(calls, calls[1:]):
            if prev.shape != cur.shape:
                continue
            changed += int((prev.sort(-1).values != cur.sort(-1).values).any(-1).sum())
            total += cur.shape[0]
        return changed, total

    def topk_change_rate(self) -> list[float | None]:
        """Per layer: the fraction of rows whose top-k expert set differs between two
        consecutive calls of the same batch size (consecutive decode steps); None without any."""
        rates = []
        for calls in self.layers.values():
            changed, total = self._changes(calls)
            rates.append(changed / total if total else None)
        return rates

    def summary(self) -> list[dict]:
        """Per layer: name, experts, k, calls, tokens, tokens_per_expert, imbalance (max / mean
        tokens per expert), topk_changes / rows_compared and topk_change_rate (the jitter)."""
        rows = []
        for (key, calls), counts, rate in zip(self.layers.items(), self.tokens_per_expert(), self.topk_change_rate()):
            changed, total = self._changes(calls)
            mean = sum(counts) / len(counts)
            rows.append({"layer": self.names[key], "experts": self.num_experts[key], "k": calls[0].shape[-1],
                         "calls": len(calls), "tokens": sum(c.shape[0] for c in calls), "tokens_per_expert": counts,
                         "imbalance": max(counts) / mean if mean else None, "topk_changes": changed,
                         "rows_compared": total, "topk_change_rate": rate})
        return rows

    def to_dict(self) -> dict:
        return {"tokens_per_expert": self.tokens_per_expert(), "topk_change_rate": self.topk_change_rate(),
                "layers": self.summary()}


_recording: list[RoutingLog] = []


@contextlib.contextmanager
def record_routing() -> Iterator[RoutingLog]:
    """Record every routing decision ``graphopt.moe``'s reference makes inside the block (the
    eager target, or a graph run eagerly); other targets route inside their own kernels."""
    log = RoutingLog()
    _recording.append(log)
    try:
        yield log
    finally:
        _recording.remove(log)
