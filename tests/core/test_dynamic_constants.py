"""dynamic=True keeps the fusions: float attributes of the model (an RMSNorm's eps,
attention's scale) are specialized back into constants, guarded by dynamo, while floats
passed as forward arguments stay dynamic and the near miss they cause names them."""

import pytest
import torch

import graphopt
from tests.helpers import assert_matches_eager, eager

transformers = pytest.importorskip("transformers")  # a third-party model, not one of ours

LAYERS = 1
# what the default pipeline leaves on a Llama with L layers (README, "What the default pipeline fuses")
LLAMA_FUSED = {"graphopt.rms_norm": 1, "graphopt.add_rms_norm": 2 * LAYERS, "graphopt.swiglu": LAYERS,
               "graphopt.qkv_proj": LAYERS, "graphopt.attention": LAYERS, "graphopt.rope": 2 * LAYERS}


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config).eval()


def ids(length: int) -> torch.Tensor:
    # batch 2: dynamo specializes a size of 1, which would cost a recompile of its own
    return torch.randint(0, 64, (2, length), generator=torch.Generator().manual_seed(length))


def compile_and_run(module, calls, dynamic, **options):
    """Compile once, run every call in ``calls``; returns (outputs, reports)."""
    torch._dynamo.reset()
    graphopt.reset()
    compiled = torch.compile(module, backend="graphopt", dynamic=dynamic, options=options)
    with torch.no_grad():
        outputs = [compiled(*args) for args in calls]
    return outputs, graphopt.reports()


@pytest.mark.parametrize("target", ["eager", "onnxruntime"])
def test_llama_with_dynamic_true_fuses_as_a_static_compile(llama, target):
    calls = [(ids(5),), (ids(9),)]
    _, static = compile_and_run(llama, calls[:1], dynamic=False, target=target)
    outputs, dynamic = compile_and_run(llama, calls, dynamic=True, target=target)
    assert len(dynamic) == 1, "dynamic=True: one compile serves both sequence lengths"
    report = dynamic[0]
    assert report.target == target and report.fallbacks == [], report.fallbacks
    assert report.fused_op_counts() == static[0].fused_op_counts() == LLAMA_FUSED
    assert not [m.reason for m in report.near_misses if "constant" in m.reason]
    if target == "eager":  # the ONNX path's numerics are its own tests' business
        for (x,), out in zip(calls, outputs):
            assert_matches_eager(out.logits, eager(llama, x).logits, rel=1e-5)


class RMSNorm(torch.nn.Module):
    def __init__(self, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def test_a_changed_float_attribute_recompiles_instead_of_running_the_old_constant():
    norm = RMSNorm(eps=1e-6)
    x = torch.randn(2, 3, 8)
    torch._dynamo.reset()
    graphopt.reset()
    compiled = torch.compile(norm, backend="graphopt", dynamic=True, options={"target": "eager"})
    with torch.no_grad():
        first = compiled(x)
        assert_matches_eager(first, eager(norm, x), rel=1e-6)
        norm.eps = 4.0  # large enough to change the output far beyond rounding
        second = compiled(x)
    assert_matches_eager(second, eager(norm, x), rel=1e-6)
    assert (second - first).abs().max() > 1e-2, "the two eps values must give different outputs"
    reports = graphopt.reports()
    assert len(reports) == 2, "dynamo's guard on eps recompiles once"
    assert [r.fused_op_counts() for r in reports] == [{"graphopt.rms_norm": 1}] * 2


class NormWithEpsArgument(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8))

    def forward(self, x, eps):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * self.weight


def test_skips_a_float_passed_as_a_forward_argument_and_names_it():
    module = NormWithEpsArgument()
    x = torch.randn(2, 3, 8)
    outputs, reports = compile_and_run(module, [(x, 1e-5), (x, 2.0)], dynamic=True, target="eager")
    assert len(reports) == 1, "a float argument stays one graph input: no recompile per value"
    assert reports[0].fused_op_counts() == {}
    reasons = {m.reason for m in reports[0].near_misses if m.pass_name == "fuse_rms_norm"}
    assert reasons == {"eps is not a constant (float input L['eps'] is a forward argument: dynamic under dynamic=True)"}
    for (xs, eps), out in zip([(x, 1e-5), (x, 2.0)], outputs):
        assert_matches_eager(out, eager(module, xs, eps), rel=1e-6)
