"""The fuzzer's verdict on top-k routers: a token whose two best experts tie within rounding
may go either way, and a graph that routes it the other way is a "routing tie", not a
mismatch; anything else wrong is still a mismatch. And the float64 reference that tells an
ill-conditioned output from a wrong one exists for MoE blocks too (aten's grouped GEMM
refuses float64), which is what graph 93 of seed 20261205 needed."""

from __future__ import annotations

import torch
from torch import nn

from graphopt.fuzz.case import Case
from graphopt.fuzz.check import ROUTING_TIE, Outcome, check_module, judge, reference
from graphopt.fuzz.routing_ties import Call, near_ties
from graphopt.fuzz.runner import Summary, TargetStats, _tally
from graphopt.registry import scoped_passes
from tests.fuzz.planted_bugs import BreakTiesHigh

H = 8


def unit(*pairs: tuple[int, float]) -> torch.Tensor:
    v = torch.zeros(H)
    for axis, value in pairs:
        v[axis] = value
    return v


class TopOneRouter(nn.Module):
    """Each token through its top-1 expert (one [H, H] matrix each), scaled by its router
    probability. Experts 0 and 1 score alike on axis 0 and apart on axis 1: tokens along
    axis 0 tie exactly between them."""

    def __init__(self, dtype=torch.bfloat16, gap: float = 0.0):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        router = torch.stack([unit((0, 2.0)), unit((0, 2.0 + gap), (1, 1.0)), unit((0, -2.0))])
        self.router = nn.Parameter(router.to(dtype), requires_grad=False)
        self.experts = nn.Parameter((torch.randn(3, H, H, generator=g) / H ** 0.5).to(dtype), requires_grad=False)

    def forward(self, x):
        probs = torch.softmax((x @ self.router.t()).float(), dim=-1)
        weight, expert = torch.topk(probs, 1, dim=-1)
        y = torch.bmm(x.unsqueeze(1), self.experts[expert[:, 0]]).squeeze(1)
        return (y.float() * weight).to(x.dtype)


def tokens(dtype=torch.bfloat16) -> torch.Tensor:
    """Token 0 goes to expert 1, token 1 to expert 2, tokens 2 and 3 tie between 0 and 1."""
    g = torch.Generator().manual_seed(1)
    noise = 0.1 * torch.randn(4, H, generator=g)
    noise[:, :2] = 0  # the tie lives on axes 0 and 1; the rest only makes the outputs differ
    return (torch.stack([unit((1, 1.0)), unit((0, -1.0)), unit((0, 1.0)), unit((0, 2.0))]) + noise).to(dtype)


def routed(module: TopOneRouter, x: torch.Tensor, experts: list[int]) -> torch.Tensor:
    """The module's output with token i sent to ``experts[i]``: what a graph that routed so computes."""
    probs = torch.softmax((x @ module.router.t()).float(), dim=-1)
    index = torch.tensor(experts)
    y = torch.bmm(x.unsqueeze(1), module.experts[index]).squeeze(1)
    return (y.float() * probs.gather(-1, index[:, None])).to(x.dtype)


def test_exact_ties_are_found_with_the_token_and_both_experts():
    module, x = TopOneRouter(), tokens()
    ref = reference(module, (x,))
    ties = {option.ties for option in ref.reroutings}
    singles = sorted((t.token, t.chosen, t.other) for option in ties if len(option) == 1 for t in option)
    assert singles == [(2, 0, 1), (3, 0, 1)]
    assert any(len(option) == 2 for option in ties)  # both at once: a graph may flip every tie


def test_a_gap_within_rounding_ties_in_bfloat16_but_not_in_float32():
    scores = torch.tensor([[0.5, 0.4985, 0.0015], [0.6, 0.3, 0.1]])
    calls = [Call(scores, torch.tensor([[0], [0]]), largest=True)]
    bf16 = near_ties(calls, torch.finfo(torch.bfloat16).eps)
    assert [(t.token, t.chosen, t.other) for t in bf16] == [(0, 0, 1)]
    assert near_ties(calls, torch.finfo(torch.float32).eps) == []


def test_the_other_side_of_a_tie_is_a_routing_tie_naming_token_and_experts():
    module, x = TopOneRouter(), tokens()
    got = routed(module, x, [1, 2, 1, 0])  # token 2 went to expert 1 instead of 0
    status, detail, rel = judge((got,), reference(module, (x,)), "bfloat16")
    assert status == ROUTING_TIE and rel < 1e-2
    assert "token 2: experts 0 and 1 tie" in detail and "token 2 to expert 1" in detail


def test_every_tie_flipped_at_once_is_a_routing_tie():
    module, x = TopOneRouter(), tokens()
    status, detail, _ = judge((routed(module, x, [1, 2, 1, 1]),), reference(module, (x,)), "bfloat16")
    assert status == ROUTING_TIE and "token 2" in detail and "token 3" in detail


def test_a_wrong_expert_where_there_is_no_tie_is_still_a_mismatch():
    module, x = TopOneRouter(), tokens()
    status, _, _ = judge((routed(module, x, [0, 2, 0, 0]),), reference(module, (x,)), "bfloat16")  # token 0: no tie
    assert status == "mismatch"


def test_a_precision_loss_next_to_a_tie_is_still_a_mismatch():
    module, x = TopOneRouter(), tokens()
    got = routed(module, x, [1, 2, 1, 0])
    got[0] = (got[0].float() * 1.25).to(got.dtype)  # wrong by 25% on a token that did not tie
    status, detail, _ = judge((got,), reference(module, (x,)), "bfloat16")
    assert status == "mismatch" and "relative error" in detail


def test_a_clear_winner_is_no_tie():
    module = TopOneRouter(gap=0.5)  # expert 1 now wins axis-0 tokens by far more than rounding
    assert reference(module, (tokens(),)).reroutings == []


def test_a_graph_that_breaks_ties_the_other_way_is_a_routing_tie_end_to_end():
    module, x = TopOneRouter(), tokens()
    with scoped_passes(BreakTiesHigh()):
        outcome = check_module(module, (x,), "eager", ["break_ties_high"], "bfloat16")
    assert outcome.hits["break_ties_high"] == 1
    assert outcome.status == ROUTING_TIE and not outcome.failed, outcome.line()
    assert "experts 0 and 1 tie" in outcome.detail


def test_routing_ties_are_counted_apart_from_mismatches():
    summary = Summary(seed=0, pipeline=[], targets={"eager": TargetStats()})
    case = Case("bfloat16", 0, [], [], name="case0")
    _tally(summary, case, [Outcome("eager", ROUTING_TIE, "token 2: experts 0 and 1 tie")])
    assert summary.mismatches == 0 and summary.targets["eager"].routing_ties == 1
    assert summary.to_dict()["routing_ties"] == [{"graph": "case0", "target": "eager",
                                                  "detail": "token 2: experts 0 and 1 tie"}]


class GroupedExperts(nn.Module):
    """Rows sorted by expert through aten's grouped GEMM, as the planted MoE block computes them."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(2)
        self.w = nn.Parameter(torch.randn(2, 8, 16, generator=g).bfloat16(), requires_grad=False)

    def forward(self, x):
        return torch._grouped_mm(x, self.w.transpose(-2, -1), offs=torch.tensor([3, 5], dtype=torch.int32))


def test_grouped_gemm_modules_get_a_float64_reference():
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(3)).bfloat16()
    ref = reference(GroupedExperts(), (x,))
    assert ref.float64 is not None and ref.float64.dtype == torch.float64
    w = GroupedExperts().w.double()
    expected = torch.cat([x[:3].double() @ w[0].T, x[3:].double() @ w[1].T])
    assert torch.allclose(ref.float64, expected)
