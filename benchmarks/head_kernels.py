"""Which ONNX Runtime kernel should run an 8-bit LM head on this CPU: one ORT node per
variant, the same random weight, timed interleaved in one process.

    python benchmarks/head_kernels.py                      # both heads, rows 1 4 16 128 512
    python benchmarks/perplexity.py --only gptq --keep /tmp/ppl          # two SmolLM2 exports, once
    python benchmarks/head_kernels.py --perplexity /tmp/ppl --topic execmodel

Heads: llama-small's (K=1024, N=32000) and SmolLM2-135M's (K=576, N=49152). Variants:
- ``fp32``: ``MatMul`` of an fp32 [K, N] weight (what the dequantize-then-MatMul branch of
  translations/int4.py becomes once ORT folds the dequantization at load);
- ``nbits8``: ``com.microsoft.MatMulNBits`` bits=8, block 32, accuracy_level 4 (today's
  decode lowering of ``graphopt.int8_linear``);
- ``dqmm``: ``com.microsoft.DynamicQuantizeMatMul`` of int8 [K, N] codes with one fp32
  scale per output channel; ORT quantizes the activations per tensor to uint8 at run time.
  MLAS's U8S8 kernel on AVX2 without VNNI sums pairs of u8 x s8 products in saturating
  16-bit lanes (``vpmaddubsw``): 255 * 128 * 2 does not fit, so large products clip;
- ``dqmm_s7``: ``dqmm`` with 7-bit codes in [-64, 63] (ORT's ``reduce_range``): no clipping;
- ``dqmm_u8``: uint8 codes with a zero point of 128 per column (graphopt's 8-bit format
  with one group per row): MLAS's U8U8 kernel, which widens to 16 bits first: exact;
- ``mmint``: the int8 form in standard ops: ``DynamicQuantizeLinear`` + ``MatMulInteger`` +
  ``Cast`` + ``Mul`` by the product of the two scales.

Timing: for each repeat, every (head, rows, variant) runs ``--inner`` calls in turn, so a
burst of load from the other jobs on this shared machine hits all variants alike; the
table gives the median per call and its ratio to ``nbits8`` (and to ``fp32``). Session MB
is the growth of a fresh process's resident memory while ORT builds the session (initializers
plus any prepacked copy: what the session holds for the weight before any activation).
``--perplexity FOLDER`` scores SmolLM2-135M with the head through each kernel instead
(:func:`quality`). A script, not a test.

Measured (ORT 1.32, AMD EPYC with AVX2 and no VNNI, 2 cores, quiet; median of 15; ratio to
nbits8 at 1 row, to fp32 at 16 to 512 rows; December 2026):

    threads  head          1 row: dqmm  dqmm_u8   16-512 rows / fp32: nbits8     dqmm       dqmm_u8
    1        llama-small          0.78   0.81                         1.10-1.50  0.43-0.49  0.49-0.65
    1        smollm2-135m         0.78   0.83                         1.12-1.60  0.43-0.52  0.50-0.69
    2        llama-small          1.16   1.61                         0.88-1.43  0.37-0.58  0.50-0.72
    2        smollm2-135m         1.16   1.78                         0.88-1.42  0.47-0.54  0.48-0.71

(dqmm_s7 runs dqmm's kernel: 0.70-0.72 at 1 row, 1 thread, in an earlier run.) With two
threads, ORT's default here, MatMulNBits is the faster one-row kernel.

Session memory (RSS growth, ~10 MB of it the session itself): fp32 141 / 123 MB, nbits8
56 / 49, dqmm 43 / 39 (llama-small / SmolLM2). Perplexity, 512 tokens of three pydoc
sections, body fp32 or the default INT4 recipe; head (a) today's block-32 MatMulNBits (RTN
on the fp32 body, the export's own GPTQ head on the INT4 one), (b) per-channel RTN codes +
DynamicQuantizeMatMul; one row per call, as decode runs the head:

    text (body)           fp32 head  (a) nbits8  (b) dqmm   dqmm_s7   dqmm_u8 = exact
    objects (fp32)         12.445     12.448     15.113    12.326    12.447
    objects (int4)         15.002     15.010     18.441    15.023    15.120
    execmodel (fp32)       18.442     18.414     19.098    18.826    18.614
    execmodel (int4)       22.125     22.230     22.445    22.342    22.012
    specialnames (fp32)    14.954     14.953     16.517    15.170    15.081
    specialnames (int4)    18.545     18.587     20.475    18.948    18.761

KL to the fp32 head's logits (nats/token) says the same without the texts' luck: (a)
1.2-1.5e-3, per-channel weights alone 1.1-1.4e-3, dqmm_u8 5.6-8.0e-3 (the per-row uint8
activation range), dqmm_s7 0.85-1.1e-2, dqmm 5-10e-2 (the clipping). So the 8-bit head
stays on MatMulNBits (block 32, int8 activations per block of 32): each per-channel form
costs 4-80x its KL and +0.1 to +3.4 perplexity on some text (the change allowed +0.05),
and at two threads none is faster at one row.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import statistics
import time

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from rich.console import Console
from rich.table import Table

HEADS = {"llama-small": (1024, 32000), "smollm2-135m": (576, 49152)}
VARIANTS = ("fp32", "nbits8", "dqmm", "dqmm_s7", "dqmm_u8", "mmint")
BLOCK = 32
MS_OPSET = helper.make_opsetid("com.microsoft", 1)


def weights(k: int, n: int, seed: int) -> dict[str, np.ndarray]:
    """A random fp32 [N, K] weight and its two 8-bit forms (:func:`weights_of`)."""
    return weights_of(np.random.default_rng(seed).standard_normal((n, k), dtype=np.float32) * 0.02)


def weights_of(w: np.ndarray) -> dict[str, np.ndarray]:
    """``w`` [N, K] and its two 8-bit forms, both graphopt's ``quantize_int8`` (symmetric,
    round to nearest, the extreme on -128): block-32 codes (MatMulNBits' ``B``, zero point
    128) and one group per row, whose codes minus 128 are DynamicQuantizeMatMul's int8
    per-output-channel codes, exactly."""
    import torch

    from graphopt.quantization import quantize_int8

    n, k = w.shape
    block = quantize_int8(torch.from_numpy(w), BLOCK, "float32")
    channel = quantize_int8(torch.from_numpy(w), k, "float32")
    return {"w": w, "block_codes": block.packed.numpy(), "block_scale": block.scales.numpy(),
            "channel_codes": (channel.packed.numpy().astype(np.int16) - 128).astype(np.int8),
            "channel_scale": channel.scales[:, 0].numpy(), **reduced_range(w)}


def reduced_range(w: np.ndarray) -> dict[str, np.ndarray]:
    """Per-channel 7-bit codes in [-64, 63] (the extreme on -64), for ``dqmm_s7``."""
    extreme = np.take_along_axis(w, np.abs(w).argmax(-1)[:, None], -1)[:, 0]
    scale = np.where(extreme == 0, 1, extreme / -64).astype(np.float32)
    return {"s7_codes": np.clip(np.rint(w / scale[:, None]), -64, 63).astype(np.int8), "s7_scale": scale}


def model(variant: str, k: int, n: int, t: dict[str, np.ndarray]) -> onnx.ModelProto:
    """One-node (or four-node) model ``logits[M, N] = x[M, K] @ head``; M is dynamic."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])
    if variant == "fp32":
        inits = [numpy_helper.from_array(np.ascontiguousarray(t["w"].T), "w")]
        nodes = [helper.make_node("MatMul", ["x", "w"], ["y"])]
    elif variant == "nbits8":
        inits = [numpy_helper.from_array(t["block_codes"].reshape(n, -1, BLOCK), "b"),
                 numpy_helper.from_array(t["block_scale"], "s")]
        nodes = [helper.make_node("MatMulNBits", ["x", "b", "s"], ["y"], domain="com.microsoft", K=k, N=n, bits=8,
                                  block_size=BLOCK, accuracy_level=4)]
    else:
        inits = [numpy_helper.from_array(np.ascontiguousarray(t["channel_codes"].T), "b"),
                 numpy_helper.from_array(t["channel_scale"], "s")]
        if variant == "dqmm":
            nodes = [helper.make_node("DynamicQuantizeMatMul", ["x", "b", "s"], ["y"], domain="com.microsoft")]
        elif variant == "dqmm_s7":  # ORT's reduce_range: 7-bit codes cannot saturate vpmaddubsw's pairs
            inits = [numpy_helper.from_array(np.ascontiguousarray(t["s7_codes"].T), "b"),
                     numpy_helper.from_array(t["s7_scale"], "s")]
            nodes = [helper.make_node("DynamicQuantizeMatMul", ["x", "b", "s"], ["y"], domain="com.microsoft")]
        elif variant == "dqmm_u8":
            inits[0] = numpy_helper.from_array(np.ascontiguousarray((t["channel_codes"].T.astype(np.int16) + 128)
                                                                    .astype(np.uint8)), "b")
            inits.append(numpy_helper.from_array(np.full(n, 128, np.uint8), "z"))
            nodes = [helper.make_node("DynamicQuantizeMatMul", ["x", "b", "s", "z"], ["y"], domain="com.microsoft")]
        else:
            nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
                     helper.make_node("MatMulInteger", ["xq", "b", "xz"], ["acc"]),
                     helper.make_node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT),
                     helper.make_node("Mul", ["xs", "s"], ["scale"]),
                     helper.make_node("Mul", ["accf", "scale"], ["y"])]
    graph = helper.make_graph(nodes, variant, [x], [y], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), MS_OPSET])


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def session(proto: onnx.ModelProto, threads: int):
    import onnxruntime as ort

    data = proto.SerializeToString()
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # so that ``before`` holds no freed temporaries
    before = rss_bytes()
    sess = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand back what the build freed (the parsed model's copy)
    grown = rss_bytes() - before
    del data  # after measuring: it was counted in ``before``
    return sess, grown


def session_memory(head: str, variant: str) -> float:
    """MB this process's resident memory grows by while ORT builds one head's session, in a
    fresh process: in this one, memory freed by earlier sessions would be reused."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, __file__, "--session-memory", head, variant], check=True,
                         capture_output=True, text=True).stdout
    return int(out.split()[-1]) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", nargs="+", default=list(HEADS), choices=list(HEADS))
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 16, 128, 512])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--repeats", type=int, default=15, help="interleaved rounds; the median is reported")
    parser.add_argument("--inner", type=int, default=0, help="calls per timing (0: about 20 ms of work)")
    parser.add_argument("--threads", type=int, default=2, help="ORT intra-op threads")
    parser.add_argument("--perplexity", metavar="FOLDER", default=None,
                        help="instead: SmolLM2 perplexity with each head kernel (see quality())")
    parser.add_argument("--tokens", type=int, default=512, help="--perplexity: tokens of the text scored")
    parser.add_argument("--topic", default="objects",
                        help="--perplexity: the pydoc_data section scored (objects, as benchmarks/perplexity.py)")
    parser.add_argument("--session-memory", nargs=2, metavar=("HEAD", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.session_memory:  # the child of session_memory(): one session in a fresh process
        head, variant = args.session_memory
        k, n = HEADS[head]
        sess, grown = session(model(variant, k, n, weights(k, n, seed=len(head))), args.threads)
        sess.run(None, {"x": np.zeros((1, k), np.float32)})
        return print(grown)
    if args.perplexity:
        return quality(args.perplexity, args.tokens, args.topic)
    console = Console(stderr=True)

    sessions, errors = {}, {}
    memory = {(head, variant): session_memory(head, variant) for head in args.heads for variant in args.variants}
    for head in args.heads:
        k, n = HEADS[head]
        t = weights(k, n, seed=len(head))
        probe = np.random.default_rng(7).standard_normal((4, k), dtype=np.float32)
        exact = probe @ t["w"].T
        for variant in args.variants:
            sessions[head, variant], _ = session(model(variant, k, n, t), args.threads)
            out = sessions[head, variant].run(None, {"x": probe})[0]
            errors[head, variant] = float(np.linalg.norm(out - exact) / np.linalg.norm(exact))
        console.print(f"{head}: sessions built", highlight=False)

    inputs = {(head, rows): np.random.default_rng(rows).standard_normal((rows, HEADS[head][0]), dtype=np.float32)
              for head in args.heads for rows in args.rows}
    inner = {}
    for (head, rows), x in inputs.items():  # warm up every session at every shape, and size the inner loop
        start = time.perf_counter()
        for variant in args.variants:
            sessions[head, variant].run(None, {"x": x})
        per_call = (time.perf_counter() - start) / len(args.variants)
        inner[head, rows] = args.inner or max(1, int(0.02 / per_call))
    times: dict[tuple, list[float]] = {}
    for _ in range(args.repeats):
        for (head, rows), x in inputs.items():
            for variant in args.variants:
                sess, reps = sessions[head, variant], inner[head, rows]
                start = time.perf_counter()
                for _ in range(reps):
                    sess.run(None, {"x": x})
                times.setdefault((head, rows, variant), []).append((time.perf_counter() - start) / reps)

    table = Table(title=f"8-bit LM head kernels, ORT CPU, {args.threads} threads, median of {args.repeats} "
                        "interleaved rounds (ms per call; ratio to nbits8 / to fp32)")
    for column in ("head (K x N)", "rows", *args.variants):
        table.add_column(column)
    for head in args.heads:
        for rows in args.rows:
            med = {v: statistics.median(times[head, rows, v]) for v in args.variants}
            cells = []
            for v in args.variants:
                cell = f"{med[v] * 1e3:.3f}"
                if "nbits8" in med and v != "nbits8":
                    cell += f" ({med[v] / med['nbits8']:.2f} / {med[v] / med['fp32']:.2f})" if "fp32" in med \
                        else f" ({med[v] / med['nbits8']:.2f})"
                cells.append(cell)
            table.add_row(f"{head} ({HEADS[head][0]} x {HEADS[head][1]})", str(rows), *cells)
    Console().print(table)
    extra = Table(title="session memory (RSS growth while ORT builds the session, fresh process) and relative "
                        "output error vs the fp32 weight on 4 random rows")
    for column in ("head", *args.variants):
        extra.add_column(column)
    for head in args.heads:
        extra.add_row(head, *[f"{memory[head, v]:.1f} MB, err {errors[head, v]:.1e}" for v in args.variants])
    Console().print(extra)


# --- quality: the same head kernels on a real model's last hidden states ------------------


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

    from graphopt.cli.tokenizers import load_tokenizer, smollm2_gguf

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


if __name__ == "__main__":
    main()
