"""fuse_softmax_rms_norm: router-style probabilities normalised then scaled (the pattern is
not in Llama, so a small synthetic gate shows it), the near misses it must leave, numerics."""

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from graphopt.errors import OptionsError
from graphopt.pipeline import build_pipeline
from tests.helpers import aten_graph, assert_matches_eager, compile_with_graphopt, count, eager, run_pass

PIPE = ["canonicalize", "fuse_rms_norm", "fuse_softmax_rms_norm"]
PASS = "fuse_softmax_rms_norm"


def hf_rms_norm(h, weight, eps=1e-6):
    dtype = h.dtype
    h = h.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


class Router(nn.Module):
    """A gate: expert logits -> probabilities -> RMSNorm -> per-expert scale."""

    def __init__(self, spelling="softmax", hidden=32, experts=8):
        super().__init__()
        self.proj = nn.Linear(hidden, experts, bias=False)
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(experts))
        self.scale = nn.Parameter(torch.randn(experts))
        self.spelling = spelling

    def probs(self, logits):
        if self.spelling == "softmax":
            return torch.softmax(logits, -1)
        if self.spelling == "softmax_f32":  # Hugging Face routers: float32 softmax, cast back
            return F.softmax(logits, dim=-1, dtype=torch.float32).to(logits.dtype)
        if self.spelling == "half_to_float":  # what a float16 softmax with dtype=float32 is on GPU
            return torch.ops.aten._softmax(logits, -1, True).to(logits.dtype)
        raise ValueError(self.spelling)

    def forward(self, x):
        return hf_rms_norm(self.probs(self.proj(x)), self.weight) * self.scale


class RouterTorchRmsNorm(Router):
    def forward(self, x):
        probs = torch.softmax(self.proj(x), -1)
        return F.rms_norm(probs, (probs.shape[-1],), self.weight, 1e-6) * self.scale


SPELLINGS = {
    "softmax": lambda: Router("softmax"),
    "softmax_f32": lambda: Router("softmax_f32"),
    "F.rms_norm": RouterTorchRmsNorm,
}


@pytest.mark.parametrize("spelling", SPELLINGS)
@pytest.mark.parametrize("dtype, rel", [(torch.float32, 1e-5), (torch.float16, 2e-3)], ids=["fp32", "fp16"])
def test_fuses_each_spelling_and_matches_eager(spelling, dtype, rel):
    # fp16: the op's float32 softmax rounded to f16 is what eager's CPU f16 softmax does, and
    # the norm is fuse_rms_norm's; measured bit-exact here, 2e-3 allows another kernel's order.
    torch.manual_seed(0)
    module = SPELLINGS[spelling]().to(dtype)
    x = torch.randn(2, 5, 32, dtype=dtype)
    out, report = compile_with_graphopt(module, x, passes=PIPE)
    assert count(report, "graphopt.softmax_rms_norm") == 1
    assert count(report, "graphopt.rms_norm") == 0 and count(report, "aten._softmax") == 0
    assert count(report, "aten._to_copy") == 0  # the casts around the softmax fuse away
    assert out.dtype == dtype
    assert_matches_eager(out, eager(module, x), rel=rel)


def test_half_to_float_cast_back_fuses():
    # CPU has no half_to_float softmax kernel, so run the fused export graph against the
    # float32-softmax spelling, which means the same thing.
    torch.manual_seed(0)
    module = Router("half_to_float").half()
    x = torch.randn(4, 32).half()
    gm = _through_pipeline(aten_graph(module, x))
    assert _ops(gm).count("graphopt.softmax_rms_norm") == 1 and "aten._softmax" not in _ops(gm)
    same_math = Router("softmax_f32").half()
    same_math.load_state_dict(module.state_dict())
    assert_matches_eager(gm(x), eager(same_math, x), rel=2e-3)


# --- near misses ---------------------------------------------------------------------------

class OtherAxis(Router):
    def forward(self, x):
        return hf_rms_norm(torch.softmax(self.proj(x), 1), self.weight)


class ProbsReturned(Router):
    def forward(self, x):
        probs = torch.softmax(self.proj(x), -1)
        return hf_rms_norm(probs, self.weight), probs


class UpcastNormKeepsFloat32(Router):
    """The norm reads f16 probabilities upcast to f32 and returns f32."""

    def forward(self, x):
        h = torch.softmax(self.proj(x), -1).float()
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight.float()


class RoundedBelowInput(Router):
    """f32 probabilities rounded to f16 before an f16 norm: the op would keep them f32."""

    def forward(self, x):
        return hf_rms_norm(torch.softmax(self.proj(x), -1).half(), self.weight.half())


@pytest.mark.parametrize(
    "module_type, dtype, reason",
    [
        (OtherAxis, torch.float32, "softmax over dim 1, norm over -1"),
        (ProbsReturned, torch.float32, "has 2 users; softmax_rms_norm does not return the probabilities"),
        (UpcastNormKeepsFloat32, torch.float16,
         "norm reads float16 probabilities upcast to float32 and its result is not cast back"),
        (RoundedBelowInput, torch.float32, "probabilities are rounded to float16 but the softmax reads float32"),
    ],
    ids=["other_axis", "second_user", "upcast_kept", "rounded_below_input"],
)
def test_skips_when_the_op_would_differ(module_type, dtype, reason):
    torch.manual_seed(0)
    module = module_type().to(dtype)
    x = torch.randn(2, 4, 32, dtype=dtype)
    out, report = compile_with_graphopt(module, x, passes=PIPE)
    assert count(report, "graphopt.rms_norm") == 1, "fuse_rms_norm should still have fused the norm"
    assert count(report, "graphopt.softmax_rms_norm") == 0
    reasons = [m.reason for m in report.near_misses if m.pass_name == PASS]
    assert any(reason in r for r in reasons), reasons
    leaves = out if isinstance(out, tuple) else (out,)
    assert_matches_eager(out, eager(module, x), rel=1e-5 if leaves[0].dtype == torch.float32 else 2e-3)


def test_skips_half_to_float_read_as_float32():
    """_softmax(x16, half_to_float=True) read by a float32 norm: the op would round to f16."""

    def fn(x, w):
        probs = torch.ops.aten._softmax.default(x, -1, True)
        return torch.ops.graphopt.rms_norm.default(probs, w, 1e-6, 0.0)

    gm = _traced(fn, torch.randn(4, 8).half(), torch.randn(8))
    result = run_pass(PASS, gm)
    assert result.stats["matches"] == 0
    assert [m.reason for m in result.near_misses] == [
        "softmax upcasts float16 -> float32 (half_to_float) and the norm reads float32 probabilities; "
        "softmax_rms_norm would round them to float16"]


def test_softmax_int_overload():
    """``aten.softmax.int`` (what graphs keep when nothing decomposes it), with and without
    an upcasting dtype."""

    def plain(x, w):
        return torch.ops.graphopt.rms_norm.default(torch.ops.aten.softmax.int(x, -1), w, 1e-6, 0.0)

    def upcast(x, w):
        return torch.ops.graphopt.rms_norm.default(torch.ops.aten.softmax.int(x, -1, torch.float32), w, 1e-6, 0.0)

    x, w = torch.randn(4, 8), torch.randn(8)
    gm = _traced(plain, x, w)
    assert run_pass(PASS, gm).stats["matches"] == 1 and "graphopt.softmax_rms_norm" in _ops(gm)
    assert_matches_eager(gm(x, w), plain(x, w), rel=1e-5)
    result = run_pass(PASS, _traced(upcast, x.half(), w))
    assert result.stats["matches"] == 0
    assert "softmax upcasts float16 -> float32 (dtype=float32)" in result.near_misses[0].reason


def test_hf_llama_has_no_softmax_norm_and_no_noise():
    """Llama has no softmax feeding a norm: nothing fires, no near misses clutter --why,
    and the pass composes with fuse_add_rms_norm in either order."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    model = transformers.LlamaForCausalLM(config).eval()

    class Logits(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, ids):
            return self.model(ids, use_cache=False).logits

    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    wrapped = Logits()
    out, report = compile_with_graphopt(wrapped, ids, passes=[*PIPE, "fuse_add_rms_norm"])
    assert count(report, "graphopt.softmax_rms_norm") == 0
    assert count(report, "graphopt.rms_norm") == 1 and count(report, "graphopt.add_rms_norm") == 4
    assert [m for m in report.near_misses if m.pass_name == PASS] == []
    assert_matches_eager(out, eager(wrapped, ids), rel=1e-5)


def test_requires_fuse_rms_norm_first():
    with pytest.raises(OptionsError, match="fuse_softmax_rms_norm needs fuse_rms_norm"):
        build_pipeline(["canonicalize", PASS])


# --- helpers ---------------------------------------------------------------------------------

def _traced(fn, *inputs) -> fx.GraphModule:
    """An ATen-level graph of ``fn`` with fake values on every node, as the passes see."""
    gm = fx.symbolic_trace(fn)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    FakeTensorProp(gm, mode).propagate(*[mode.from_tensor(t) for t in inputs])
    return gm


def _through_pipeline(gm: fx.GraphModule) -> fx.GraphModule:
    for name in PIPE:
        gm = run_pass(name, gm).gm
    return gm


def _ops(gm: fx.GraphModule) -> list[str]:
    from graphopt.ir import target_name

    return [target_name(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def test_skips_norms_without_a_softmax_with_a_screened_reason():
    """A norm of anything but a softmax is screened out with its reason (for --why), not a near miss."""

    def fn(x, w):
        return torch.ops.graphopt.rms_norm.default(x * 2, w, 1e-6, 0.0)

    result = run_pass(PASS, _traced(fn, torch.randn(4, 8), torch.randn(8)))
    assert result.stats["matches"] == 0
    assert [(m.screened, m.reason) for m in result.near_misses] == [(True, "the norm's input is no softmax")]
