"""Shared test helpers: compile a module with graphopt and read back what happened."""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx as fx

import graphopt
from graphopt.numerics import compare
from graphopt.pass_manager import PassContext
from graphopt.registry import get_pass


def compile_with_graphopt(module: torch.nn.Module, *inputs: Any, passes: Sequence[str] | None = None,
                          **options: Any) -> tuple[Any, graphopt.CompileReport]:
    """Compile ``module`` through torch.compile(backend="graphopt") on the eager target and
    run it once. ``passes`` replaces the default pipeline. Failures raise (fallback="error")
    so a broken pass cannot hide behind a fallback. Returns (outputs, the one report)."""
    torch._dynamo.reset()
    graphopt.reset()
    opts = {"target": "eager", "fallback": "error", **options}
    if passes is not None:
        opts["pipeline"] = list(passes)
    compiled = torch.compile(module, backend="graphopt", options=opts, fullgraph=True)
    with torch.no_grad():
        out = compiled(*inputs)
    reports = graphopt.reports()
    assert len(reports) == 1, f"expected one compiled graph, got {len(reports)}"
    return out, reports[0]


def eager(module: torch.nn.Module, *inputs: Any) -> Any:
    with torch.no_grad():
        return module(*inputs)


def assert_matches_eager(actual: Any, expected: Any, rel: float) -> None:
    diff = compare(actual, expected)
    assert diff.rel <= rel, f"relative error {diff.rel:.3g} > {rel:g} (max abs {diff.max_abs:.3g})"


def aten_graph(module: torch.nn.Module, *inputs: Any) -> fx.GraphModule:
    """The frozen ATen graph graphopt's passes see, via the torch.export frontend."""
    from graphopt.frontend.trace import export_aten_graph

    return export_aten_graph(module, inputs).gm


def run_pass(name: str, gm: fx.GraphModule, **pass_options: Any):
    """Run one pass directly on ``gm``; returns its PassResult."""
    p = get_pass(name)
    ctx = PassContext(graphopt.Options.parse({"pass_options": {p.name: pass_options}} if pass_options else None))
    return p.run(gm, ctx)


def count(report_or_counts: Any, op: str) -> int:
    counts = report_or_counts.op_counts if hasattr(report_or_counts, "op_counts") else report_or_counts
    return counts.get(op, 0)


def small_moe_lm(family: str, layers: int = 2, hidden: int = 32, inter: int = 48, moe_inter: int = 24,
                 shared_inter: int = 40, vocab: int = 96) -> torch.nn.Module:
    """A seeded transformers Mixtral (``family="mixtral"``: 4 experts, top 2) or Qwen2-MoE (4
    experts, top 2, a shared expert) causal LM with a small config, in eval mode; the global
    RNG is left as it was."""
    import transformers

    small = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if family == "mixtral":
            cfg = transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **small)
            return transformers.MixtralForCausalLM(cfg).eval()
        cfg = transformers.Qwen2MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=moe_inter,
                                          shared_expert_intermediate_size=shared_inter, **small)
        return transformers.Qwen2MoeForCausalLM(cfg).eval()
