"""quantize_int4: which linears it quantizes and which it leaves, what the graph computes
afterwards (exactly the dequantized weights), and how close llama-tiny's logits stay."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphopt
from graphopt import ir, models
from graphopt.errors import OptionsError
from graphopt.pipeline import build_pass_manager
from graphopt.ops.quant import dequantize_int4, dequantize_int8
from graphopt.quant.report import int4_summary, logits_metrics
from tests.helpers import aten_graph, compile_with_graphopt, count, eager, run_pass

PIPE = ["canonicalize", "fuse_rms_norm", "quantize_int4"]
int4_op = torch.ops.graphopt.int4_linear.default
int8_op = torch.ops.graphopt.int8_linear.default


def quantized(report) -> int:
    """Linears the pass rewrote: 4-bit ones and the LM head's 8 bits (head_bits=8)."""
    return count(report, "graphopt.int4_linear") + count(report, "graphopt.int8_linear")


class Mlp(nn.Module):
    def __init__(self, hidden=64, inter=96):
        super().__init__()
        self.up = nn.Linear(hidden, inter, bias=True)  # addmm
        self.down = nn.Linear(inter, hidden, bias=False)  # mm
        self.lm_head = nn.Linear(hidden, 32, bias=False)

    def forward(self, x):
        return self.lm_head(self.down(F.gelu(self.up(x))))


def pass_stats(report):
    return next(p for p in report.passes if p.name == "quantize_int4").stats


def param_of(graph_name, params):
    """The module parameter a frozen weight's recorded name stands for (dynamo may prefix it)."""
    found = [p for p in params if graph_name == p or graph_name.endswith(("." + p, "_" + p))]
    assert len(found) == 1, f"{graph_name} names {found}"
    return found[0]


def dequantized_copy(module, graph):
    """``module`` with every weight the graph quantized replaced by its dequantized value."""
    out = copy.deepcopy(module)
    params = dict(out.named_parameters())
    for node in graph.graph.nodes:
        if node.target in (int4_op, int8_op):
            name = param_of(node.meta["graphopt_int4"]["name"], params)
            k = params[name].shape[1]
            if node.target is int4_op:
                packed, scales, zeros = (ir.get_constant(a) if a is not None else None for a in node.args[1:4])
                weight = dequantize_int4(packed, scales, zeros, node.args[4], k)
            else:
                weight = dequantize_int8(ir.get_constant(node.args[1]), ir.get_constant(node.args[2]), node.args[3], k)
            with torch.no_grad():
                params[name].copy_(weight)
    return out


@pytest.mark.parametrize("shape", [(2, 5, 64), (7, 64)], ids=["3d", "2d"])
@pytest.mark.parametrize("symmetric", [True, False])
def test_quantizes_mm_and_addmm_and_computes_the_dequantized_weights(shape, symmetric, final_graph):
    torch.manual_seed(0)
    module, x = Mlp(), torch.randn(*shape)
    out, report = compile_with_graphopt(module, x, passes=PIPE,
                                        pass_options={"quantize_int4": {"symmetric": symmetric}})
    # The last linear gives the output (an LM head): 8 bits by default (head_bits).
    assert count(report, "graphopt.int4_linear") == 2 and count(report, "graphopt.int8_linear") == 1
    assert count(report, "aten.mm") + count(report, "aten.addmm") + count(report, "aten.t") == 0
    stats = pass_stats(report)
    assert stats["matches"] == 3 and stats["quantized_weights"] == 3
    assert [layer["name"] for layer in stats["layers"]] == ["up.weight", "down.weight", "lm_head.weight"]
    assert [layer["bits"] for layer in stats["layers"]] == [4, 4, 8] and stats["bits"] == {4: 2, 8: 1}
    assert stats["calibration"] == "none"  # round-to-nearest, the default, reads nothing but the weights
    # The graph multiplies by exactly the dequantized weights: same fp32 GEMMs, same values.
    torch.testing.assert_close(out, eager(dequantized_copy(module, final_graph[-1]), x), rtol=1e-6, atol=1e-6)
    # And stays near the fp32 model: 4-bit weights cost ~8% per layer, ~5-6% at this output.
    assert logits_metrics(out, eager(module, x))["rel_error"] < 0.1
    assert not any(n.op == "get_attr" and n.meta.get(ir.PARAM_NAME, "").endswith("up.weight")
                   for n in final_graph[-1].graph.nodes), "the fp32 weight should be gone from the graph"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_models(dtype, final_graph):
    torch.manual_seed(0)
    module, x = Mlp().to(dtype), torch.randn(4, 64).to(dtype)
    out, report = compile_with_graphopt(module, x, passes=PIPE)
    assert quantized(report) == 3 and out.dtype == dtype
    # The dequantized weight rounded to the model's dtype, as the op rounds it.
    expected = eager(dequantized_copy(module, final_graph[-1]), x)
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-3)


def test_export_graph_linear_spelling_with_bias():
    torch.manual_seed(0)
    module, x = Mlp(), torch.randn(3, 64)
    gm = aten_graph(module, x)
    assert count(ir.op_counts(gm), "aten.linear") == 3
    ref = gm(x)
    result = run_pass("quantize_int4", gm, group_size=64, scale_dtype="float32", search="rtn", head_bits=4)
    assert result.stats["matches"] == 3
    assert count(ir.op_counts(result.gm), "graphopt.int4_linear") == 3
    assert count(ir.op_counts(result.gm), "aten.linear") == 0
    assert logits_metrics(result.gm(x)[0], ref[0])["rel_error"] < 0.15


def test_a_second_run_finds_nothing_new():
    torch.manual_seed(0)
    x = torch.randn(3, 64)
    first = run_pass("quantize_int4", aten_graph(Mlp(), x))
    second = run_pass("quantize_int4", first.gm)
    assert first.stats["quantized_weights"] == 3
    assert not second.modified and second.stats["matches"] == 0 and second.stats["quantized_weights"] == 0


@pytest.mark.parametrize("options, n, reason", [
    ({"skip": ["*lm_head*"]}, 2, "matches skip pattern '*lm_head*'"),
    ({"min_size": 64 * 96}, 2, "has 2048 elements < min_size 6144"),
])
def test_skips_by_name_pattern_and_size(options, n, reason):
    torch.manual_seed(0)
    out, report = compile_with_graphopt(Mlp(), torch.randn(4, 64), passes=PIPE,
                                        pass_options={"quantize_int4": options})
    assert quantized(report) == n
    assert count(report, "aten.mm") == 3 - n
    assert any(reason in m.reason for m in report.near_misses if m.pass_name == "quantize_int4")


def test_skips_weights_that_are_not_constants():
    torch.manual_seed(0)
    out, report = compile_with_graphopt(Mlp(), torch.randn(4, 64), passes=PIPE, freeze_weights=False)
    assert quantized(report) == 0
    assert any("not a frozen constant" in m.reason for m in report.near_misses)


class TwiceTheSameLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 64, bias=False)

    def forward(self, x):
        return self.proj(torch.relu(self.proj(x)))


def test_a_weight_read_twice_is_quantized_once(final_graph):
    torch.manual_seed(0)
    module, x = TwiceTheSameLinear(), torch.randn(4, 64)
    out, report = compile_with_graphopt(module, x, passes=PIPE)
    stats = pass_stats(report)
    assert stats["matches"] == 2 and stats["quantized_weights"] == 1
    assert stats["weight_bytes_fp32"] == 64 * 64 * 4
    packed = {n.args[1] for n in final_graph[-1].graph.nodes if n.target in (int4_op, int8_op)}
    assert len(packed) == 1
    torch.testing.assert_close(out, eager(dequantized_copy(module, final_graph[-1]), x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bad, message", [
    ({"group_size": 48}, "group_size 48 is not valid"),
    ({"group_size_8bit": 256}, "group_size_8bit 256 is not valid"),
    ({"search": "awq"}, "search 'awq' is not valid"),
    ({"scale_dtype": "float8"}, "scale_dtype 'float8' is not valid"),
    ({"min_size": -1}, "min_size must be"),
    ({"head_bits": 6}, "head_bits 6 is not valid"),
    ({"budget": 1.5}, "budget must be 0"),
    ({"calibration": [1, -2]}, "calibration must be a list of token ids"),
])
def test_bad_options_fail_with_one_line(bad, message):
    with pytest.raises(OptionsError, match=message):
        build_pass_manager(graphopt.Options.parse(
            {"pipeline": PIPE, "pass_options": {"quantize_int4": bad}}))


@pytest.mark.parametrize("k, group", [(1024, 128), (576, 128), (1536, 128), (64, 64), (96, 32), (16, 32)])
def test_8bit_group_pads_k_by_at_most_an_eighth(k, group):
    """128 unless that pads K by more than an eighth (576 -> 640 is 1/9: kept; 96 -> 128 is a third)."""
    from passes.quantize_int4 import Int4Options

    assert Int4Options().group_8bit(k) == group
    assert Int4Options(group_size_8bit=32).group_8bit(k) == 32


def test_8bit_head_takes_its_own_group_size():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 96))
    x = torch.randn(3, 64)
    for group_8bit in (64, 128):
        out, report = compile_with_graphopt(module, x, passes=PIPE, pass_options={
            "quantize_int4": {"search": "rtn", "group_size_8bit": group_8bit}})
        head = next(layer for layer in int4_summary(report)["layers"] if layer["bits"] == 8)
        assert head["group_size"] == group_8bit and head["shape"] == [96, 256]
        assert head["bytes_after"] == 96 * 256 + 96 * (256 // group_8bit) * 4  # codes + fp32 scales
        assert head["rel_error"] < 0.01  # 8 bits: ~0.005 on these weights in either group size
        assert logits_metrics(out, eager(module, x))["rel_error"] < 0.1


def test_merged_qkv_and_gated_mlp_are_quantized_whole():
    model, inputs = models.build("llama-tiny"), models.example_inputs("llama-tiny")
    pipe = ["canonicalize", "fuse_rms_norm", "merge_qkv", "fuse_gated_mlp", "quantize_int4"]
    out, report = compile_with_graphopt(model, *inputs, passes=pipe)
    layers = models.config_of("llama-tiny").num_layers
    # qkv_proj, o_proj, gate_up, down per layer, and lm_head.
    assert count(report, "graphopt.int4_linear") == 4 * layers and count(report, "graphopt.int8_linear") == 1
    assert count(report, "graphopt.qkv_proj") == 0 and count(report, "graphopt.swiglu") == layers
    names = [layer["name"] for layer in pass_stats(report)["layers"]]
    assert any("qkv_proj" in n for n in names) and any("gate_up_proj" in n for n in names)
    assert logits_metrics(out[0], eager(model, *inputs)[0])["rel_error"] < 0.2


def test_llama_tiny_logits_bytes_and_report():
    model = models.build("llama-tiny")
    ids = models.example_inputs("llama-tiny", batch=4, seq_len=32)
    gptq = {"search": "gptq", "symmetric": True}  # opt-in: what the output errors below measure
    out, report = compile_with_graphopt(model, *ids, passes=PIPE, pass_options={"quantize_int4": gptq})
    assert count(report, "graphopt.int4_linear") == 7 * models.config_of("llama-tiny").num_layers
    summary = int4_summary(report)
    assert summary["quantized_weights"] == 15 and summary["bits"] == {4: 14, 8: 1}
    # g32 with fp32 scales (auto: what MatMulNBits reads): 5 bits a weight; the 8-bit LM head
    # has one scale per 64 (group_size_8bit 128, capped at the 64-wide K): 8.5 bits.
    fp32 = summary["weight_bytes_fp32"]
    head = next(layer for layer in summary["layers"] if layer["bits"] == 8)
    assert head["group_size"] == 64
    assert summary["weight_bytes_after"] == pytest.approx((fp32 - head["bytes_fp32"]) * 5 / 32
                                                          + head["bytes_fp32"] * 8.5 / 32)
    # GPTQ trades weight error (RTN's is 0.05-0.09 here) for output error on the calibration inputs.
    assert 0.05 < summary["max_rel_error"] < 0.2
    assert all(0 < layer["output_error"] < 0.05 for layer in summary["layers"])
    metrics = logits_metrics(out[0], eager(model, *ids)[0])
    # Measured 0.117 (top-1 agreement 0.80): llama-tiny's 2 random layers amplify weight error ~1.4x.
    assert metrics["rel_error"] < 0.15
    assert metrics["top1_agreement"] > 0.6


def test_int4_option_adds_the_pass_and_the_report_block():
    from graphopt.sources import load_model
    from graphopt.pipeline import DEFAULT_PIPELINE

    loaded = load_model("llama-tiny", seq_len=8)
    out, report = compile_with_graphopt(loaded.module, *loaded.example_inputs, int4=True)
    # Right before capture: after every pass that merges weights (gated MLP, QKV), so the
    # merged matrices are what gets quantized.
    expected = list(DEFAULT_PIPELINE)
    expected.insert(expected.index("cuda_graphs"), "quantize_int4")
    assert [p.name for p in report.passes] == expected
    record = next(p for p in report.passes if p.name == "quantize_int4")
    # qkv_proj, o_proj, gate_up, down per layer, and lm_head: every linear, each quantized once.
    n = 4 * models.config_of("llama-tiny").num_layers + 1
    assert record.status == "changed" and record.matches == quantized(report) == n
    summary = report.to_dict()["int4"]
    assert summary["quantized_weights"] == n and summary["bits"] == {4: n - 1, 8: 1}
    # Measured 0.134 (top-1 agreement 0.875) with the default pipeline's fusions.
    metrics = logits_metrics(out, eager(loaded.module, *loaded.example_inputs))
    assert metrics["rel_error"] < 0.16 and metrics["top1_agreement"] > 0.6
    assert report.op_counts["graphopt.int4_linear"] > 0
    _, plain = compile_with_graphopt(loaded.module, *loaded.example_inputs)
    assert plain.to_dict()["int4"] is None and "quantize_int4" not in [p.name for p in plain.passes]


def test_the_eager_target_says_its_quantized_ops_are_the_slow_reference():
    """The eager target dequantizes every weight at each call; the report says so and names
    the targets with INT4 kernels, and says nothing on a float graph or an INT4 one on ORT."""
    from graphopt.sources import load_model
    from graphopt.compiler import REFERENCE_QUANTIZED_NOTE

    loaded = load_model("llama-tiny", seq_len=8)
    _, report = compile_with_graphopt(loaded.module, *loaded.example_inputs, int4=True)
    assert report.target == "eager" and REFERENCE_QUANTIZED_NOTE in report.notes
    _, plain = compile_with_graphopt(loaded.module, *loaded.example_inputs)
    assert REFERENCE_QUANTIZED_NOTE not in plain.notes
    pytest.importorskip("onnxruntime")
    _, ort = compile_with_graphopt(loaded.module, *loaded.example_inputs, int4=True, target="onnxruntime")
    assert ort.target == "onnxruntime" and REFERENCE_QUANTIZED_NOTE not in ort.notes


def test_act_order_option_lowers_the_output_error_on_loud_channels(final_graph):
    torch.manual_seed(0)
    module = Mlp()
    gen = torch.Generator().manual_seed(1)
    # Correlated inputs with a few loud channels, as a trained model's activations are.
    x = torch.randn(512, 8, generator=gen) @ torch.randn(8, 64, generator=gen) + 0.3 * torch.randn(512, 64, generator=gen)
    x[:, [3, 17, 40, 41]] *= 10
    errors = {}
    for act_order in (False, True):
        out, report = compile_with_graphopt(module, x, passes=PIPE,
                                            pass_options={"quantize_int4": {"search": "gptq", "act_order": act_order}})
        up = next(layer for layer in pass_stats(report)["layers"] if layer["name"] == "up.weight")
        errors[act_order] = up["output_error"]
        # Either order keeps the format: the graph computes with exactly the dequantized weights.
        torch.testing.assert_close(out, eager(dequantized_copy(module, final_graph[-1]), x), rtol=1e-5, atol=1e-5)
    assert errors[True] < 0.7 * errors[False]


def test_budget_spends_bytes_on_the_layer_with_most_output_error(final_graph):
    torch.manual_seed(0)
    module, x = Mlp(), torch.randn(512, 64)
    base = {"scale_dtype": "float32", "search": "gptq"}  # output errors need a calibration run
    out4, plain = compile_with_graphopt(module, x, passes=PIPE, pass_options={"quantize_int4": base})
    # 4 bits + the 8-bit head take 0.174 of fp32 here; one more layer at 8 bits makes 0.228.
    out, report = compile_with_graphopt(module, x, passes=PIPE, pass_options={"quantize_int4": {**base, "budget": 0.23}})
    stats, before = pass_stats(report), pass_stats(plain)
    assert before["bits"] == {4: 2, 8: 1} and stats["bits"] == {4: 1, 8: 2}
    assert before["bytes_ratio_fp32"] < 0.2 < stats["bytes_ratio_fp32"] <= 0.23
    errors = {layer["name"]: layer["output_error"] for layer in before["layers"]}
    promoted = next(layer["name"] for layer in stats["layers"] if layer["bits"] == 8 and layer["name"] != "lm_head.weight")
    assert promoted == max(("up.weight", "down.weight"), key=errors.get)
    torch.testing.assert_close(out, eager(dequantized_copy(module, final_graph[-1]), x), rtol=1e-5, atol=1e-5)
    reference = eager(module, x)
    assert logits_metrics(out, reference)["rel_error"] < logits_metrics(out4, reference)["rel_error"]
    with pytest.raises(Exception, match="raise the budget"):
        compile_with_graphopt(module, x, passes=PIPE, fallback="error",
                              pass_options={"quantize_int4": {**base, "budget": 0.1}})


class LastPositionHead(Mlp):
    """A decoder step that returns the last position's logits: the head's result reaches the
    output through a row pick (``logits[:, -1]``), as in graphopt.generate's decoder."""

    def forward(self, x):
        return super().forward(x)[:, -1]


class HeadThenMix(Mlp):
    """The head's logits mixed across positions before the output: no longer a row pick."""

    def forward(self, x):
        return super().forward(x).cumsum(1)


@pytest.mark.parametrize("module, head_bits", [(LastPositionHead, 8), (HeadThenMix, 4)], ids=["row-pick", "mixed"])
def test_the_head_is_found_through_row_picks_only(module, head_bits):
    torch.manual_seed(0)
    _, report = compile_with_graphopt(module(), torch.randn(2, 5, 64), passes=PIPE)
    assert [layer["bits"] for layer in pass_stats(report)["layers"]] == [4, 4, head_bits]
