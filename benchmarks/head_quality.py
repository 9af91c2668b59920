"""The quality half of ``head_kernels.py``: SmolLM2-135M's perplexity and KL to the fp32 head
with the LM head run through each 8-bit kernel, on the model's own last hidden states.

    python benchmarks/perplexity.py --only gptq --keep /tmp/ppl          # two SmolLM2 exports, once
    python benchmarks/head_quality.py /tmp/ppl --topic execmodel

The measured table and what it decided are in ``head_kernels.py``'s docstring.
"""

from __future__ import annotations

import argparse

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from rich.console import Console
from rich.table import Table

from head_kernels import model, session, weights_of


def head_input(path: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, onnx.NodeProto, onnx.ModelProto]:
    """(hidden states the head reads [rows, K], the file's own logits [rows, N], the head
    node, the model without external data) of an exported causal LM run on ``ids`` [1, T]:
    the head is the node that makes the logits output; its input becomes a second output."""
    import onnxruntime as ort

    proto = onnx.load(path)
    head = next(n for n in proto.graph.node if proto.graph.output[0].name in n.output)
    x = head.input[0]
    if head.op_type == "If":  # a dynamic-row int8_linear: x is what the branches' GEMMs read from outside
        x = next(n.input[0] for a in head.attribute if a.g for n in a.g.node if n.op_type == "MatMulNBits")
    proto.graph.output.append(helper.make_tensor_value_info(x, TensorProto.FLOAT, None))
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    sess = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    logits, hidden = sess.run(None, {sess.get_inputs()[0].name: ids})
    return hidden.reshape(-1, hidden.shape[-1]), logits.reshape(-1, logits.shape[-1]), head, proto


def head_codes(proto: onnx.ModelProto, head: onnx.NodeProto) -> tuple[np.ndarray, np.ndarray]:
    """The block-32 codes [N, G, 32] and scales [N, G] of an int8_linear head as exported:
    the bits=8 MatMulNBits, inside the head's If when the row count is dynamic."""
    inits = {t.name: t for t in proto.graph.initializer}
    nbits = head if head.op_type != "If" else \
        next(n for a in head.attribute if a.g for n in a.g.node if n.op_type == "MatMulNBits")
    producers = {o: n for n in proto.graph.node for o in n.output}

    def initializer(name: str) -> np.ndarray:
        while name not in inits:  # through Reshape / Cast of the stored tensor
            name = producers[name].input[0]
        return numpy_helper.to_array(inits[name])

    return initializer(nbits.input[1]), initializer(nbits.input[2]).astype(np.float32)


def head_weight(proto: onnx.ModelProto, head: onnx.NodeProto) -> np.ndarray:
    """The fp32 head's weight [N, K]: its MatMul's [K, N] initializer, or the Transpose of a
    tied [N, K] table (how graphopt exports SmolLM2's tied head)."""
    inits = {t.name: t for t in proto.graph.initializer}
    name = head.input[1]
    if name in inits:
        return numpy_helper.to_array(inits[name]).T.copy()
    (transpose,) = [n for n in proto.graph.node if name in n.output]
    return numpy_helper.to_array(inits[transpose.input[0]]).copy()


def dqmm_reference(x: np.ndarray, codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """DynamicQuantizeMatMul without saturation: x quantized per tensor to uint8 as
    ``DynamicQuantizeLinear`` does it (range widened to 0, zero point rounded half to even),
    an exact integer product with int8 codes [N, K], then both scales."""
    lo, hi = min(0.0, float(x.min())), max(0.0, float(x.max()))
    step = np.float32((hi - lo) / 255) if hi > lo else np.float32(1)
    zero = np.clip(np.rint(-lo / step), 0, 255)
    q = np.clip(np.rint(x / step) + zero, 0, 255) - zero
    acc = q.astype(np.float64) @ codes.astype(np.float64).T  # exact: |sum| < 2^53
    return (acc * step * scale.astype(np.float64)).astype(np.float32)


def head_logits(kind: str, x: np.ndarray, t: dict[str, np.ndarray], per_row: bool) -> np.ndarray:
    """Logits of ``x`` [rows, K] through one head kernel: each row its own call when
    ``per_row`` (decode: DynamicQuantizeMatMul's per-tensor activation range is then the
    row's), else one call for all rows (prefill)."""
    k, n = x.shape[1], t["channel_scale"].shape[0]
    if kind == "channel_fp32":  # the per-channel weights alone, activations kept fp32
        return x @ (t["channel_codes"].astype(np.float32) * t["channel_scale"][:, None]).T
    if kind == "dqmm_exact":
        rows = [dqmm_reference(r[None], t["channel_codes"], t["channel_scale"]) for r in x] if per_row else \
            [dqmm_reference(x, t["channel_codes"], t["channel_scale"])]
        return np.concatenate(rows)
    sess, _ = session(model(kind, k, n, t), 2)
    if not per_row:
        return sess.run(None, {"x": x})[0]
    return np.concatenate([sess.run(None, {"x": r[None]})[0] for r in x])


def perplexity(logits: np.ndarray, ids: np.ndarray) -> float:
    import torch

    nll = torch.nn.functional.cross_entropy(torch.from_numpy(logits[:-1]).float(), torch.from_numpy(ids[1:]))
    return float(torch.exp(nll))


def kl(reference: np.ndarray, logits: np.ndarray) -> float:
    """Mean KL(softmax(reference) || softmax(logits)) per token, in nats: the head's own
    error, without the text's luck in which tokens it scores."""
    import torch

    p = torch.log_softmax(torch.from_numpy(reference).double(), -1)
    q = torch.log_softmax(torch.from_numpy(logits).double(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def quality(folder: str, tokens: int, topic: str = "objects") -> None:
    """Perplexity of SmolLM2-135M with its head through each kernel, on two bodies: the fp32
    export (the head alone quantized) and the default INT4 recipe's (its 8-bit head's own
    GPTQ codes are row (a)); ``folder`` holds fp32.onnx and gptq.onnx as
    ``benchmarks/perplexity.py --only gptq --keep FOLDER`` leaves them."""
    import os
    from pydoc_data import topics

    from graphopt.sources.tokenizers import load_tokenizer, smollm2_gguf

    # benchmarks/perplexity.py's text by default: the first ``tokens`` of the Language
    # Reference's "Objects, values and types" as pydoc_data ships it
    ids = load_tokenizer(str(smollm2_gguf()))(topics.topics[topic], return_tensors="np").input_ids[:, :tokens]
    source = f"pydoc_data/topics.py [{topic!r}], {ids.shape[1]} tokens"
    x32, logits32, head, proto = head_input(f"{folder}/fp32.onnx", ids)
    w = head_weight(proto, head)
    t = weights_of(w)
    table = Table(title=f"SmolLM2-135M perplexity, head kernels; text {source}")
    for column in ("body", "head", "decode (rows one at a time): perplexity, KL vs fp32 head",
                   "prefill (all rows, one call): perplexity, KL"):
        table.add_column(column)
    bodies = {"fp32": (x32, logits32, None)}
    if os.path.exists(f"{folder}/gptq.onnx"):
        x4, logits4, head4, proto4 = head_input(f"{folder}/gptq.onnx", ids)
        bodies["int4 default"] = (x4, logits4, head_codes(proto4, head4))
    for body, (x, own, exported) in bodies.items():
        rows = {"fp32": (x @ w.T, None)}
        if exported is not None:  # MatMulNBits quantizes x per row and block: one call is every row's decode
            codes = {**t, "block_codes": exported[0].reshape(len(w), -1), "block_scale": exported[1]}
            rows["(a) as exported (block 32, GPTQ)"] = (head_logits("nbits8", x, codes, False), own)
        for name, kind in (("(a) block 32 RTN, MatMulNBits", "nbits8"), ("(b) per channel, DQMM int8", "dqmm"),
                           ("(b) per channel, DQMM uint8 zp 128", "dqmm_u8"),
                           ("(b) per channel 7 bits, DQMM int8", "dqmm_s7"), ("(b) per channel, exact", "dqmm_exact"),
                           ("per channel weights, fp32 activations", "channel_fp32")):
            rows[name] = (head_logits(kind, x, t, True), head_logits(kind, x, t, False))
        exact = rows["fp32"][0]
        for name, (decode, prefill) in rows.items():
            whole = f"{perplexity(prefill, ids[0]):.4f}  {kl(exact, prefill):.2e}" if prefill is not None else "-"
            table.add_row(body, name, f"{perplexity(decode, ids[0]):.4f}  {kl(exact, decode):.2e}", whole)
    Console().print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="holds fp32.onnx (and gptq.onnx) from benchmarks/perplexity.py --keep")
    parser.add_argument("--tokens", type=int, default=512, help="tokens of the text scored")
    parser.add_argument("--topic", default="objects",
                        help="the pydoc_data section scored (objects, as benchmarks/perplexity.py)")
    args = parser.parse_args()
    quality(args.folder, args.tokens, args.topic)


if __name__ == "__main__":
    main()
