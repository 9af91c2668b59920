"""Which ONNX Runtime kernel should run an 8-bit LM head on this CPU: one ORT node per
variant, the same random weight, timed interleaved in one process.

    python benchmarks/head_kernels.py                      # both heads, rows 1 4 16 128 512
    python benchmarks/perplexity.py --only gptq --keep /tmp/ppl          # two SmolLM2 exports, once
    python benchmarks/head_quality.py /tmp/ppl --topic execmodel     # perplexity per head kernel

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
``head_quality.py FOLDER`` scores SmolLM2-135M with the head through each kernel. A script, not a test.

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

    from graphopt.quant.groupwise import quantize_int8

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

    from graphopt.backends.onnxruntime.runtime.heap_trim import release_free_heap

    data = proto.SerializeToString()
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    gc.collect()
    release_free_heap()  # so that ``before`` holds no freed temporaries
    before = rss_bytes()
    sess = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    release_free_heap()  # hand back what the build freed (the parsed model's copy)
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
    parser.add_argument("--session-memory", nargs=2, metavar=("HEAD", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.session_memory:  # the child of session_memory(): one session in a fresh process
        head, variant = args.session_memory
        k, n = HEADS[head]
        sess, grown = session(model(variant, k, n, weights(k, n, seed=len(head))), args.threads)
        sess.run(None, {"x": np.zeros((1, k), np.float32)})
        return print(grown)
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


if __name__ == "__main__":
    main()
