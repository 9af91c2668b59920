"""Top-k routing ties: a router whose k-th and (k+1)-th scores for a token lie within the
model's rounding may send that token either way, and a compiled graph that rounds the router
input differently from eager (a fused norm rounds once, the op-by-op spelling rounds at every
op) is free to pick the other expert. Its outputs then differ from eager's by a whole
expert's contribution, yet nothing is wrong. Such an output is judged against eager *routed
the other way*; when it matches that, the verdict is a routing tie, not a mismatch.

:class:`Router` runs a module under a ``TorchFunctionMode`` that sees every last-axis
``topk``: it records eager's choices, and replays them (``pinned``) so the float64 reference
routes as eager did and a rerouted reference differs from eager only at the tied tokens.
:func:`near_ties` lists the tokens whose last chosen expert and the best unchosen one are
within ``TIE_ULPS`` rounding steps of the least precise dtype the module computes in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch.overrides import TorchFunctionMode

TIE_ULPS = 4  # rounding steps between two router scores that still count as a tie
MAX_TIES = 8  # the nearest ties are rerouted one by one (and all together); the rest are not
_TOPK = (torch.topk, torch.Tensor.topk)


@dataclass(frozen=True)
class Tie:
    """Token ``token`` (a row of the ``call``-th topk's scores) chose ``chosen`` at ``slot``;
    ``other`` scored within rounding of it and was left out."""

    call: int
    token: int
    slot: int
    chosen: int
    other: int
    chosen_score: float
    other_score: float

    def describe(self) -> str:
        return (f"token {self.token}: experts {self.chosen} and {self.other} tie (router scores "
                f"{self.chosen_score:.6g} vs {self.other_score:.6g})")


@dataclass
class Call:
    """One last-axis topk of an eager run: its scores ``[tokens, experts]`` and choices."""

    scores: torch.Tensor
    indices: torch.Tensor  # [tokens, k]
    largest: bool


def _topk_args(args: Sequence[Any], kwargs: dict) -> tuple[torch.Tensor, int, int, bool]:
    names = ("input", "k", "dim", "largest")
    bound = {**dict(zip(names, args)), **kwargs}
    return bound["input"], int(bound["k"]), int(bound.get("dim", -1)), bool(bound.get("largest", True))


class Router(TorchFunctionMode):
    """Records every last-axis ``topk`` of a run (``calls``); with ``pinned``, replaces the
    i-th call's indices by ``pinned[i]`` (``[tokens, k]``) and gathers its values from this run's
    own scores, so a run in another dtype routes exactly as the pinned one."""

    def __init__(self, pinned: Sequence[torch.Tensor | None] | None = None):
        super().__init__()
        self.pinned = pinned
        self.calls: list[Call | None] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func not in _TOPK:
            return out
        scores, k, dim, largest = _topk_args(args, kwargs)
        index = len(self.calls)
        if scores.dim() == 0 or dim not in (-1, scores.dim() - 1):
            self.calls.append(None)  # only a router's last-axis choice is understood
            return out
        pin = self.pinned[index] if self.pinned is not None and index < len(self.pinned) else None
        values, indices = out
        if pin is not None and pin.numel() == indices.numel():
            indices = pin.reshape(indices.shape).to(indices.device)
            values = scores.gather(-1, indices)
            out = torch.return_types.topk((values, indices))
        experts = scores.shape[-1]
        self.calls.append(Call(scores.detach().reshape(-1, experts).clone(), indices.detach().reshape(-1, k).clone(),
                               largest))
        return out


def least_precise_eps(module: torch.nn.Module, inputs: Sequence[Any]) -> float:
    """The machine epsilon of the least precise floating dtype among the module's weights and inputs."""
    tensors = [*module.parameters(), *module.buffers(), *(x for x in inputs if isinstance(x, torch.Tensor))]
    return max([torch.finfo(t.dtype).eps for t in tensors if t.is_floating_point()], default=torch.finfo().eps)


def near_ties(calls: Sequence[Call | None], eps: float) -> list[Tie]:
    """Tokens whose last chosen expert and best unchosen one are within ``TIE_ULPS * eps``
    of each other (relative), nearest first, at most ``MAX_TIES``."""
    found: list[tuple[float, Tie]] = []
    for index, call in enumerate(calls):
        if call is None or call.indices.shape[-1] >= call.scores.shape[-1]:
            continue  # every expert chosen: nothing to tie with
        scores = call.scores.double()
        chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, call.indices, True)
        sign = 1.0 if call.largest else -1.0  # compare as "larger is better"
        ranked = sign * scores
        worst_in = ranked.masked_fill(~chosen, float("inf")).argmin(-1)
        best_out = ranked.masked_fill(chosen, float("-inf")).argmax(-1)
        a, b = scores.gather(-1, worst_in[:, None])[:, 0], scores.gather(-1, best_out[:, None])[:, 0]
        gap = (a - b).abs() / torch.maximum(a.abs(), b.abs()).clamp_min(torch.finfo(torch.float64).tiny)
        for token in torch.nonzero(gap <= TIE_ULPS * eps).flatten().tolist():
            expert = int(worst_in[token])
            slot = int((call.indices[token] == expert).nonzero()[0])
            found.append((float(gap[token]), Tie(index, token, slot, expert, int(best_out[token]),
                                                 float(a[token]), float(b[token]))))
    return [tie for _, tie in sorted(found, key=lambda item: item[0])[:MAX_TIES]]


def rerouted(calls: Sequence[Call | None], ties: Sequence[Tie]) -> list[torch.Tensor | None]:
    """Eager's choices (for :class:`Router`'s ``pinned``) with each of ``ties`` sent to its other expert."""
    pinned = [call.indices.clone() if call is not None else None for call in calls]
    for tie in ties:
        pinned[tie.call][tie.token, tie.slot] = tie.other
    return pinned


def reroutings(ties: Sequence[Tie]) -> list[tuple[Tie, ...]]:
    """The alternative routings worth a rerun: each tie alone, and all of them together."""
    options = [(tie,) for tie in ties]
    return options + [tuple(ties)] if len(ties) > 1 else options
