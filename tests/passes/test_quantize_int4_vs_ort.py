"""graphopt's INT4 against ONNX Runtime's own MatMulNBitsQuantizer (symmetric RTN, the same
block size) on the same llama-tiny: the same 15 weights, reconstruction error weight by
weight, and the logits' error against fp32 on the same inputs."""

import pytest
import torch

from graphopt import models
from graphopt.ops.quant import dequantize_int4
from graphopt.quant.report import int4_summary, logits_metrics
from tests.helpers import compile_with_graphopt, eager

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
nbits = pytest.importorskip("onnxruntime.quantization.matmul_nbits_quantizer")

PIPE = ["canonicalize", "fuse_rms_norm", "quantize_int4"]


class LogitsOnly(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids)[0]


@pytest.fixture(scope="module")
def setup():
    model = models.build("llama-tiny").eval()
    ids = models.example_inputs("llama-tiny", batch=4, seq_len=32, seed=1)[0]
    with torch.no_grad():
        program = torch.onnx.export(LogitsOnly(model), (ids,), dynamo=True, verbose=False)
    return model, ids, eager(model, ids)[0], program.model_proto


def ort_int4(proto, block: int):
    """MatMulNBitsQuantizer as ONNX Runtime's INT4 recipe runs it: symmetric RTN, ``block``."""
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    quantizer = nbits.MatMulNBitsQuantizer(copy, block_size=block, is_symmetric=True)
    quantizer.process()
    return quantizer.model.model


def ort_layer_errors(qmodel, params: dict) -> dict[str, float]:
    """Relative Frobenius error of each weight ORT quantized, keyed by the parameter it came
    from (the exporter renames initializers, so each is matched to its nearest weight)."""
    inits = {t.name: torch.from_numpy(onnx.numpy_helper.to_array(t).copy()) for t in qmodel.graph.initializer}
    errors = {}
    for node in (n for n in qmodel.graph.node if n.op_type == "MatMulNBits"):
        attrs = {a.name: a.i for a in node.attribute}
        packed, scales = inits[node.input[1]], inits[node.input[2]]
        deq = dequantize_int4(packed.reshape(attrs["N"], -1), scales.reshape(attrs["N"], -1), None,
                              attrs["block_size"], attrs["K"])
        rel = {name: ((deq - w).norm() / w.norm()).item() for name, w in params.items() if w.shape == deq.shape}
        name = min(rel, key=rel.get)
        assert rel[name] < 0.5, f"no weight matches a MatMulNBits of shape {tuple(deq.shape)}"
        errors[name] = rel[name]
    return errors


def run_ort(qmodel, ids):
    session = ort.InferenceSession(qmodel.SerializeToString(), providers=["CPUExecutionProvider"])
    return torch.from_numpy(session.run(None, {session.get_inputs()[0].name: ids.numpy()})[0])


def our_layer_errors(report, params: dict) -> dict[str, float]:
    ours = {}
    for layer in int4_summary(report)["layers"]:
        match = [p for p in params if layer["name"].endswith(("." + p, "_" + p)) or layer["name"] == p]
        ours[match[0]] = layer["rel_error"]
    return ours


@pytest.mark.parametrize("block", [32, 128])
def test_rtn_reproduces_onnxruntimes_quantizer_weight_by_weight(setup, block):
    model, ids, reference, proto = setup
    params = {n: p.detach() for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n}
    options = {"group_size": block, "search": "rtn", "symmetric": True, "head_bits": 4, "scale_dtype": "float32"}
    _, report = compile_with_graphopt(model, ids, passes=PIPE, pass_options={"quantize_int4": options})
    theirs = ort_layer_errors(ort_int4(proto, block), params)
    ours = our_layer_errors(report, params)
    assert len(theirs) == len(ours) == 15 and set(ours) == set(theirs), "both must quantize the same 15 weights"
    for name in ours:
        assert ours[name] == pytest.approx(theirs[name], rel=1e-5), name


@pytest.mark.parametrize("block", [32, 128])
def test_graphopt_int4_logits_are_closer_to_fp32_than_onnxruntimes_quantizer(setup, block):
    """The default recipe (GPTQ on the example inputs, LM head at 8 bits) against ORT's RTN.
    Its weight errors are larger than RTN's (it moves weights to keep the outputs), so
    this compares what a model feels: the logits."""
    model, ids, reference, proto = setup
    ours_logits, report = compile_with_graphopt(model, ids, passes=PIPE,
                                                pass_options={"quantize_int4": {"group_size": block}})
    assert int4_summary(report)["quantized_weights"] == 15
    ours_m = logits_metrics(ours_logits[0], reference)
    theirs_m = logits_metrics(run_ort(ort_int4(proto, block), ids), reference)
    print(f"\nblock {block}: logits rel error graphopt {ours_m['rel_error']:.4f} vs ORT {theirs_m['rel_error']:.4f}; "
          f"top-1 agreement {ours_m['top1_agreement']:.3f} vs {theirs_m['top1_agreement']:.3f}")
    assert ours_m["rel_error"] < theirs_m["rel_error"]
    assert ours_m["top1_agreement"] > 0.6 and theirs_m["top1_agreement"] > 0.6
