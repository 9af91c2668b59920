"""Every registered pass is idempotent: run on a graph where it fires, then again on its own
result, the second run matches nothing, reports no change and leaves the graph printing the
same (graphopt.ir.format_graph, node names normalized: tests/passes/_before_expected.py).

A pass that fires again on its own output would rewrite forever under a fixpoint driver and
makes ``--print-ir-after-change`` report changes that are none. The graphs are real models
(llama-tiny and bert-tiny through both frontends, transformers' Llama and Qwen2-MoE under
aot_autograd) run through the default pipeline up to the pass, and for the passes that fire
only on special graphs (collectives, KV caches, lazy quantized weights, GPU values) the
builders of their own tests.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch
import torch.fx as fx

from graphopt import ir, models
from graphopt.frontend.trace import capture_aten_graphs
from graphopt.pipeline import DEFAULT_PIPELINE
from graphopt.registry import all_passes
from tests.helpers import aten_graph, run_pass, small_moe_lm
from tests.passes._before_expected import Expected, normalized

aten, g = torch.ops.aten, torch.ops.graphopt


@dataclass(frozen=True)
class Case:
    pass_name: str
    graph: str  # a key of GRAPHS
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def id(self) -> str:
        extra = ",".join(f"{k}={v}" for k, v in self.options.items() if k != "search")
        return f"{self.pass_name}-{self.graph}" + (f"-{extra}" if extra else "")


# ---------------------------------------------------------------- graphs where passes fire

@functools.cache
def _traced(name: str, frontend: str) -> fx.GraphModule:
    """A model's frozen ATen graph, traced once per session (cases work on copies)."""
    if name.startswith("hf-") or name in ("qwen2_moe",):
        model = small_moe_lm("qwen2_moe") if name == "qwen2_moe" else _hf_llama()
        inputs = (torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(0)),)
    else:
        model = models.build(name)
        inputs = models.example_inputs(name, batch=2, seq_len=8)
    if frontend == "export":
        return aten_graph(model, *inputs)
    return capture_aten_graphs(model, inputs)[0].gm


def _hf_llama():
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(cfg).eval()


def _model(name: str, frontend: str) -> Callable[[str], fx.GraphModule]:
    """The model's graph after the default pipeline's passes that run before ``pass_name``
    (every pass of it for passes outside the pipeline, such as quantize_int4)."""
    def build(pass_name: str) -> fx.GraphModule:
        gm = ir.copy_graph_module(_traced(name, frontend))
        order = list(DEFAULT_PIPELINE)
        before = order[:order.index(pass_name)] if pass_name in order else order
        for earlier in before:
            gm = run_pass(earlier, gm).gm
        return gm
    return build


class SoftmaxRouterNorm(torch.nn.Module):
    """Two router heads that normalise their probabilities (softmax, then an RMSNorm)."""

    def __init__(self, hidden=16):
        super().__init__()
        self.w = torch.nn.Parameter(1 + 0.1 * torch.randn(hidden, generator=torch.Generator().manual_seed(0)))

    def forward(self, x, y):
        return tuple(self.norm(torch.softmax(t.float(), -1).to(t.dtype)) for t in (x, y))

    def norm(self, p):
        h = p.float()
        return self.w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(p.dtype)


def _softmax_norms(pass_name: str) -> fx.GraphModule:
    gm = aten_graph(SoftmaxRouterNorm(), torch.randn(2, 16), torch.randn(2, 3, 16))
    return run_pass("fuse_rms_norm", gm).gm


def _all_reduce_layers(pass_name: str) -> fx.GraphModule:
    """Two tensor-parallel layers' ``add_rms_norm(wait(all_reduce(partial)), residual)``, by hand."""
    import graphopt.ops.collectives  # noqa: F401  (registers graphopt::all_reduce_add_rms_norm)

    c10d = torch.ops._c10d_functional
    b = Expected()
    residual, w = b.input((2, 8)), b.const("weight", torch.ones(8))
    outputs = []
    for _ in range(2):
        partial = b.op(aten.relu.default, residual)
        reduced = b.op(c10d.wait_tensor.default, b.op(c10d.all_reduce.default, partial, "sum", "tp"))
        norm = b.op(g.add_rms_norm.default, reduced, residual, w, 1e-6, 0.0)
        outputs.append(b.op(operator.getitem, norm, 0))
        residual = b.op(operator.getitem, norm, 1)
    return b.output(*outputs, residual)


def _grouped_mm_moe(pass_name: str) -> fx.GraphModule:
    from tests.passes.test_fuse_moe_expected import GroupedMmMoe, HIDDEN

    return aten_graph(GroupedMmMoe(normalize=True), torch.randn(6, HIDDEN).bfloat16())


def _decode_step(pass_name: str) -> fx.GraphModule:
    from graphopt.generation.runner import ExplicitCacheStep
    from tests.passes.test_static_kv_cache import PAST, export_step

    past = [torch.zeros(1, 2, PAST, 16) for _ in range(4)]
    return export_step(ExplicitCacheStep(_llama()), torch.tensor([[1]]), torch.tensor([[PAST]]), past=past)


def _static_decode_step(pass_name: str) -> fx.GraphModule:
    from tests.passes.test_fuse_rope_kv_cache_update import static_step

    return static_step(_llama())


@functools.cache
def _llama():
    return models.build("llama-tiny", seed=0)


def _lazy_quantized_lm(pass_name: str) -> fx.GraphModule:
    from tests.passes.test_keep_checkpoint_quantization import IDS, lazy_tiny_lm

    model, _ = lazy_tiny_lm()
    return run_pass("fuse_gated_mlp", aten_graph(model, IDS)).gm


def _gpu_graph(pass_name: str) -> fx.GraphModule:
    """Fake CUDA values (tests/passes/test_cuda_graphs.py): a host sync splits two regions."""
    from tests.passes.test_cuda_graphs import Builder

    b = Builder()
    x, w = b.input("x", (4, 8)), b.input("w", (8, 8))
    y = b.op(aten.relu.default, b.op(aten.mm.default, x, w))
    nonzero = b.op(aten.nonzero.default, y)
    return b.done(b.op(aten.add.Tensor, y, 1.0), nonzero)


def _identity_chain(pass_name: str) -> fx.GraphModule:
    from tests.passes.test_canonicalize_expected import _chain

    return _chain(Expected(), identities=True)


GRAPHS: dict[str, Callable[[str], fx.GraphModule]] = {
    **{f"{m}-{f}": _model(m, f) for m in ("llama-tiny", "bert-tiny") for f in ("export", "aot")},
    "hf-llama-aot": _model("hf-llama", "aot"),
    "qwen2_moe-aot": _model("qwen2_moe", "aot"),
    "identity-chain": _identity_chain,
    "softmax-norms": _softmax_norms,
    "all-reduce-layers": _all_reduce_layers,
    "grouped-mm-moe": _grouped_mm_moe,
    "llama-tiny-decode": _decode_step,
    "llama-tiny-static-decode": _static_decode_step,
    "lazy-quantized-lm": _lazy_quantized_lm,
    "gpu-graph": _gpu_graph,
}

RTN = {"search": "rtn"}  # no calibration run: run_pass hands the pass no example inputs

CASES = [
    Case("canonicalize", "hf-llama-aot"),
    Case("canonicalize", "identity-chain"),
    *[Case(p, m) for m in ("llama-tiny-export", "llama-tiny-aot", "hf-llama-aot")
      for p in ("fuse_rms_norm", "fuse_add_rms_norm", "fuse_gated_mlp", "merge_qkv", "fuse_rope", "fuse_attention")],
    *[Case(p, m) for m in ("bert-tiny-export", "bert-tiny-aot")
      for p in ("fuse_layer_norm", "fuse_bias_gelu", "merge_qkv", "fuse_attention")],
    Case("fuse_softmax_rms_norm", "softmax-norms"),
    Case("fuse_all_reduce_add_rms_norm", "all-reduce-layers"),
    Case("fuse_moe", "qwen2_moe-aot"),
    Case("fuse_moe", "grouped-mm-moe"),
    *[Case("quantize_int4", m, RTN) for m in ("llama-tiny-export", "llama-tiny-aot", "bert-tiny-aot", "qwen2_moe-aot")],
    Case("quantize_int4", "llama-tiny-export", {**RTN, "embedding_bits": 4}),
    Case("static_kv_cache", "llama-tiny-decode", {"max_length": 24}),
    Case("fuse_rope_kv_cache_update", "llama-tiny-static-decode"),
    Case("keep_checkpoint_quantization", "lazy-quantized-lm"),
    Case("cuda_graphs", "gpu-graph"),
]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_a_second_run_changes_nothing(case: Case):
    gm = GRAPHS[case.graph](case.pass_name)
    first = run_pass(case.pass_name, gm, **case.options)
    assert first.modified and first.stats.get("matches", 0) > 0, (
        f"{case.pass_name} does not fire on {case.graph}: {[m.reason for m in first.near_misses][:5]}")
    after_first = normalized(first.gm)
    second = run_pass(case.pass_name, first.gm, **case.options)
    assert normalized(second.gm) == after_first, f"the second run of {case.pass_name} changed the graph"
    assert second.stats.get("matches", 0) == 0, second.stats
    assert not second.modified


def test_cuda_graphs_second_run_keeps_the_same_plan():
    """cuda_graphs plans afresh on every run: the second run marks the same regions again."""
    from graphopt.cuda_graphs import REGION, plan_of

    first = run_pass("cuda_graphs", _gpu_graph("cuda_graphs"))
    regions, marks = plan_of(first.gm).regions, {n.name: n.meta.get(REGION) for n in first.gm.graph.nodes}
    second = run_pass("cuda_graphs", first.gm)
    assert plan_of(second.gm).regions == regions and regions
    assert {n.name: n.meta.get(REGION) for n in second.gm.graph.nodes} == marks
    assert {k: v for k, v in second.stats.items() if k != "matches"} == {
        k: v for k, v in first.stats.items() if k != "matches"}


def test_every_registered_pass_has_a_case():
    assert sorted(all_passes()) == sorted({c.pass_name for c in CASES})
