"""How fast ONNX Runtime's CPU ``MatMulNBits`` multiplies one row by each weight layout a GGUF
file can become (graphopt/sources/gguf_blocks.py), next to the machine's read bandwidth.

A decode step at batch 1 reads every weight once, so each layout's rate in G weights/s says
what its tensors cost per token: if the rate times the layout's bytes per weight is well under
the read bandwidth, the kernel's arithmetic, not memory, is the limit, and a layout with fewer
bytes but the same kernel buys nothing. ``--layers`` runs that many distinct weights one after
the other, as a decoder's layers do, so they cannot stay in cache.

    python benchmarks/matmulnbits_rates.py [--k 896 --n 9728 --layers 24 --threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

# (label, bits, block, zero points): what each GGUF type is handed to ORT as
LAYOUTS = [
    ("Q4_0, folded Q4_1/Q4_K: 4-bit, no zero points", 4, 32, False),
    ("Q4_1/Q4_K unfolded: 4-bit, zero points", 4, 32, True),
    ("Q5_0/Q8_0/Q5_1/Q5_K: 8-bit, block 32", 8, 32, False),
    ("Q6_K: 8-bit, block 16", 8, 16, False),
]


def model(k: int, n: int, bits: int, block: int, zero_points: bool, layers: int) -> bytes:
    """``layers`` MatMulNBits nodes on one input, each with its own random weight."""
    import onnx_ir as ir

    rng = np.random.default_rng(0)
    groups = k // block
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1, k]))
    nodes, weights = [], []
    for i in range(layers):
        inputs = [x, ir.Value(name=f"codes{i}", const_value=ir.tensor(
                      rng.integers(0, 256, (n, groups, block * bits // 8), dtype=np.uint8))),
                  ir.Value(name=f"scales{i}", const_value=ir.tensor(
                      (rng.random((n, groups), dtype=np.float32) * 0.01)))]
        if zero_points:
            inputs.append(ir.Value(name=f"zeros{i}", const_value=ir.tensor(
                np.full((n, (groups * bits + 7) // 8), 0x88, np.uint8))))
        weights += inputs[1:]
        node = ir.Node("com.microsoft", "MatMulNBits", inputs, attributes=[
            ir.AttrInt64("K", k), ir.AttrInt64("N", n), ir.AttrInt64("bits", bits),
            ir.AttrInt64("block_size", block), ir.AttrInt64("accuracy_level", 4)])
        node.outputs[0].name = f"y{i}"
        nodes.append(node)
    graph = ir.Graph([x], [node.outputs[0] for node in nodes], nodes=nodes, initializers=weights,
                     opset_imports={"": 20, "com.microsoft": 1})
    return ir.to_proto(ir.Model(graph, ir_version=10)).SerializeToString()


def run_ms(session, k: int, repeat: int = 15) -> float:
    feed = {"x": np.random.default_rng(1).random((1, k), dtype=np.float32)}
    for _ in range(3):
        session.run(None, feed)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        session.run(None, feed)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    import onnxruntime as ort
    import torch

    from weight_traffic import read_bandwidth  # run as a script: benchmarks/ is on sys.path

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, default=896)
    parser.add_argument("--n", type=int, default=9728)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bandwidth = read_bandwidth()
    print(f"read bandwidth ({args.threads} threads): {bandwidth / 1e9:.1f} GB/s; "
          f"{args.layers} weights of {args.n} x {args.k}, one row, {args.threads} threads")
    print(f"| layout | ms | G weights/s | GB/s read |\n|---|---|---|---|")
    for label, bits, block, zero_points in LAYOUTS:
        options = ort.SessionOptions()
        options.intra_op_num_threads = args.threads
        options.log_severity_level = 3
        session = ort.InferenceSession(model(args.k, args.n, bits, block, zero_points, args.layers), options,
                                       providers=["CPUExecutionProvider"])
        ms = run_ms(session, args.k)
        weights = args.layers * args.k * args.n
        per_weight = bits / 8 + 4 / block + (bits / 8 / block if zero_points else 0)
        print(f"| {label} | {ms:.2f} | {weights / ms / 1e6:.1f} | {weights * per_weight / ms / 1e6:.1f} |")


if __name__ == "__main__":
    main()
