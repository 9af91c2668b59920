"""``graphopt generate MODEL --prompt TEXT``: text in, text out, with the model's own tokenizer.

The prompts are tokenized by the model's tokenizer (left padding when there are several),
decoded by ``graphopt.generate`` on the chosen target (the same function the library and
``graphopt run --generate`` call), and printed as text: streamed token by token for one
prompt, one block per prompt for several. A summary line gives prefill ms, ms/token and
tokens/s; ``--json`` prints the target, the timings and each prompt's text and new token ids.
"""

from __future__ import annotations

import statistics
import sys

import typer

from graphopt import huge_pages
from graphopt.cli.common import parse_options
from graphopt.cli.output import console, print_json, step
from graphopt.errors import GraphoptError
from graphopt.sources.model_kind import is_causal_lm

MODEL_HELP = ("a .gguf file (run on its own quantized weights), or a Hugging Face checkpoint directory with "
              "safetensors weights and tokenizer.json")


def generate(
    model: str = typer.Argument(..., help=MODEL_HELP),
    prompt: list[str] = typer.Option(..., "--prompt", "-p", help="a prompt (repeatable: several decode as one "
                                     "left-padded batch)"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n", help="new tokens per prompt at most"),
    int4: bool = typer.Option(False, "--int4", help="quantize float linear weights to 4 bits (pass quantize_int4); "
                              "a .gguf's quantized weights stay the file's own"),
    dequantize: bool = typer.Option(False, "--dequantize", help="read a .gguf as transformers does: every weight "
                                    "dequantized to float32 in memory (by default the file's own quantized "
                                    "weights run, read from the file when the runtime is built)"),
    target: str = typer.Option(None, "--target", "-t", help="auto | eager | onnxruntime | triton | tensorrt"),
    chat: bool = typer.Option(False, "--chat", help="wrap each prompt in the tokenizer's chat template as a user turn"),
    stop: list[str] = typer.Option([], "--stop", help="stop a row when its text contains this (repeatable)"),
    option: list[str] = typer.Option([], "--option", "-o", help="a backend option as key=value (repeatable); see "
                                     "`graphopt options`"),
    json_out: bool = typer.Option(False, "--json", help="print JSON: target, prefill_ms, ms_per_token, outputs "
                                  "[{prompt, text, token_ids}] (token_ids: the new tokens only), compile_s and "
                                  "compile_stages (seconds per build stage, where the target times them), huge_pages (whether "
                                  "malloc memory could be on 2 MB pages)"),
    tp: int = typer.Option(1, "--tp", help="tensor-parallel ranks (gloo processes on the CPU, 1 thread each); each "
                           "decodes its shard and is compared with the unsharded model's tokens (JSON: "
                           "tokens_match_tp1, ranks)"),
    tp_timeout: float = typer.Option(60.0, "--tp-timeout", help="seconds a --tp collective waits for the other "
                                     "ranks before the run fails, naming the rank and the collective"),
) -> None:
    """Generate text from MODEL for each --prompt with graphopt.generate, on the chosen target.

    Greedy decoding; a row stops at the tokenizer's end-of-sequence token, a --stop string, or
    --max-new-tokens. Target auto picks onnxruntime on a CPU machine (one exported decoder whose
    attention writes its KV cache in place), triton on a GPU. A .gguf runs on its own quantized
    weights (Q4_0 ... Q6_K as the file holds them; --dequantize reads it as float32 instead); the
    first run exports its decoder in a child process, and the decoder and the tokenizer are kept
    in ~/.cache/graphopt, so the next run on the same file and options starts in seconds
    (GRAPHOPT_CACHE_DIR=DIR moves them, GRAPHOPT_CACHE_DIR=off turns them off). A model that
    will not fit in the memory available fails before loading, saying what would fit. A warm
    run maps the weights ONNX Runtime packed on the first run (kept beside the decoder); the
    command puts memory it packs itself on 2 MB pages where the kernel allows it
    (GRAPHOPT_HUGE_PAGES=0 keeps 4 KB pages: a first run decodes about 10% slower).

    Example: graphopt generate model.gguf --prompt "The capital of France is" --max-new-tokens 24
    Example: graphopt generate ./SmolLM2 --chat -p "Name three rivers." -p "Hi" --target eager --json
    Example: graphopt generate model.gguf -p "The capital of France is" -n 32 --tp 2 --target eager
    """
    import graphopt
    from graphopt.config import Options
    from graphopt.generation.checkpoint import start_checkpoint
    from graphopt.generation.sampling import StopConditions
    from graphopt.sources import load_checkpoint
    from graphopt.sources.tokenizers import load_tokenizer

    if max_new_tokens < 1:
        raise GraphoptError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    if tp < 1:
        raise GraphoptError(f"--tp must be at least 1 (the number of tensor-parallel ranks), got {tp}")
    config = parse_options(option, target=target, **({"int4": True} if int4 else {}))
    with step(f"loading {model}", json_out):
        # A .gguf on its own weights is a Checkpoint: the decoder an earlier run kept for it opens
        # without building the model, or importing torch; --tp shards a module, so it builds one.
        checkpoint = None if dequantize or tp > 1 else load_checkpoint(model)
        if checkpoint is not None:  # a first run exports the decoder in a child while the tokenizer converts
            start_checkpoint(checkpoint, Options.parse(config.to_dict()))
        tokenizer = load_tokenizer(model, slim=not chat)  # a chat template needs transformers' renderer
        texts = [_chat(tokenizer, model, p) for p in prompt] if chat else list(prompt)
        loaded = None if checkpoint is not None else _load_causal_lm(model, dequantize)
    # numpy ids for a checkpoint: its decoder runs without torch (graphopt.generation.checkpoint)
    encoded = tokenizer(texts, return_tensors="np" if checkpoint is not None else "pt", padding=True,
                        add_special_tokens=not chat)
    eos = _eos_ids(tokenizer, loaded.module if loaded is not None else None)
    stops = StopConditions(eos, tuple(stop), decode=tokenizer.decode, pad_token_id=tokenizer.pad_token_id)
    if tp > 1:  # the same decode on N ranks, one shard each (graphopt.distributed.tp_generate)
        from graphopt.distributed.cli import generate_text_tp_cmd

        generate_text_tp_cmd(model, tp, config.to_dict(), prompt, encoded, stops, tokenizer, max_new_tokens,
                             json_out, module=loaded.module, timeout=tp_timeout)
        return
    stream = _Stream(tokenizer) if len(prompt) == 1 and not json_out else None
    if stream:
        sys.stdout.write(prompt[0] if not chat else "")
    with step(f"generating on target {config.target}", json_out or stream is not None):
        out = graphopt.generate(checkpoint if checkpoint is not None else loaded.module, encoded["input_ids"],
                                max_new_tokens, attention_mask=encoded["attention_mask"], stop=stops,
                                options=config.to_dict(), on_token=stream)
    load_notes = loaded.notes if loaded is not None else []
    outputs = [{"prompt": p, "text": tokenizer.decode(out.token_ids(i), skip_special_tokens=True),
                "token_ids": out.token_ids(i)} for i, p in enumerate(prompt)]
    summary = {"target": out.target, "prefill_ms": out.prefill_ms, "ms_per_token": out.ms_per_token,
               "outputs": outputs, "compile_s": out.compile_s, "compile_stages": out.compile_stages,
               "fallback": out.fallback, "notes": load_notes + out.notes,
               "huge_pages": huge_pages.in_effect()}  # malloc memory on 2 MB pages (graphopt/huge_pages.py)
    if json_out:
        print_json(summary)
        return
    if stream:
        sys.stdout.write("\n")
    else:
        for item in outputs:
            console.print(item["prompt"] + item["text"], highlight=False, markup=False)
    _print_summary(summary, len(prompt))


def _load_causal_lm(model: str, dequantize: bool):
    from graphopt.sources import load_model

    loaded = load_model(model, single_output=False, gguf_weights="dequantize" if dequantize else "file")
    if not is_causal_lm(loaded.module):
        raise GraphoptError(f"graphopt generate needs a causal LM; {model} is a {loaded.family} model")
    return loaded


def _chat(tokenizer, model: str, text: str) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise GraphoptError(f"the tokenizer of {model} has no chat template; drop --chat and write the prompt whole")
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=False)


def _eos_ids(tokenizer, module) -> tuple[int, ...]:
    """The tokenizer's end-of-sequence id and the model's generation config's, once each."""
    ids = [tokenizer.eos_token_id]
    configured = getattr(getattr(module, "generation_config", None), "eos_token_id", None)
    ids += configured if isinstance(configured, list) else [configured]
    return tuple(dict.fromkeys(i for i in ids if i is not None))


class _Stream:
    """Prints row 0's text as tokens come; decoding the whole tail each time keeps characters
    that span tokens (multi-byte UTF-8) whole."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.ids, self.shown = tokenizer, [], ""

    def __call__(self, token, live) -> None:  # [B, 1] and [B]: torch tensors or numpy arrays
        if not bool(live[0]):
            return
        self.ids.append(int(token[0, 0]))
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return  # half a character: wait for the rest
        sys.stdout.write(text[len(self.shown):])
        sys.stdout.flush()
        self.shown = text


def _stages(seconds: dict[str, float]) -> str:
    """`` (torch.export 23.8, passes 2.1, ...)``: where a first run's compile time went."""
    shown = [f"{name} {s:.1f}" for name, s in seconds.items() if s >= 0.05]
    return f" ({', '.join(shown)})" if shown else ""


def _print_summary(summary: dict, batch: int) -> None:
    steps = summary["ms_per_token"]
    per_token = statistics.median(steps) if steps else None
    rate = f"{batch * 1e3 / per_token:.1f} tokens/s" if per_token else "no decode steps"
    line = (f"target {summary['target']} · prefill {summary['prefill_ms']:.1f} ms · "
            + (f"{per_token:.2f} ms/token (median) · " if per_token else "") + rate
            + (f" (batch {batch})" if batch > 1 else "") + f" · compile {summary['compile_s']:.1f} s"
            + _stages(summary["compile_stages"]))
    console.print(line, highlight=False)
    if summary["fallback"]:
        console.print(f"[yellow]fallback[/] {summary['fallback']}")
    for note in summary["notes"]:
        console.print(f"note: {note}", highlight=False)
