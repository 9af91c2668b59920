"""``graphopt generate MODEL --tp N`` and ``graphopt run MODEL --generate K --tp N``: each
rank decodes greedily with graphopt.generate on its shard and compares its tokens with the
unsharded model decoded eagerly (TP=1).

Greedy decoding makes every rank pick the same token (their logits are replicated after
the final all-reduce), so every rank's sequence must equal the TP=1 one. The prompt is the
model's random example input (``graphopt run``) or a ``Prompt`` the parent tokenized
(``graphopt generate``); each rank loads its own copy of the model and shards it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from graphopt.generation.sampling import StopConditions


@dataclass
class Prompt:
    """Tokenized prompts handed to every rank: ``input_ids`` [B, S], left-padding mask, stops."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None = None
    stop: StopConditions | None = None


def _median(steps: list[float]) -> float | None:
    return sorted(steps)[len(steps) // 2] if steps else None


def _first_mismatch(new: list[list[int]], expected: list[list[int]]) -> int | None:
    """The 1-based new-token position where some row first differs from TP=1 (None: none do)."""
    firsts = [next((k for k, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
              for x, y in zip(new, expected) if x != y]
    return min(firsts) + 1 if firsts else None


def rank_generate(rank: int, world: int, spec: str, seed: int, batch: int, seq_len: int, tokens: int,
                  options: dict, style: str, prompt: Prompt | None = None) -> dict[str, Any]:
    from graphopt.sources import load_model
    from graphopt.distributed.shard import shard_llama
    from graphopt.generation.api import eager_generate, generate

    loaded = load_model(spec, seed=seed, batch=batch, seq_len=seq_len, single_output=False)
    prompt = prompt or Prompt(loaded.example_inputs[0])
    given = dict(attention_mask=prompt.attention_mask, stop=prompt.stop)
    ref = eager_generate(loaded.module, prompt.input_ids, tokens, **given)
    shard_llama(loaded.module, style=style)
    torch._dynamo.reset()
    out = generate(loaded.module, prompt.input_ids, tokens, options=options, **given)
    rows = range(prompt.input_ids.shape[0])
    new, expected = [out.token_ids(i) for i in rows], [ref.token_ids(i) for i in rows]
    return {
        "rank": rank,
        "model": loaded.name,
        "target": out.target,
        "tokens": tokens,
        "tokens_match_tp1": new == expected,
        "first_mismatch": _first_mismatch(new, expected),
        "token_ids": new,
        "tp1_token_ids": expected,
        "prefill_ms": out.prefill_ms,
        "ms_per_token_median": _median(list(out.ms_per_token)),
        "tp1_eager_ms_per_token_median": _median(list(ref.ms_per_token)),
        "compile_s": out.compile_s,
        "fallback": getattr(out, "fallback", None),
        "notes": list(out.notes),
    }


def generate_tp(spec: str, world: int, seed: int, batch: int, seq_len: int, tokens: int, options: dict,
                style: str = "functional", threads: int = 1, prompt: Prompt | None = None,
                timeout: float | None = None) -> dict[str, Any]:
    from graphopt.distributed.launch import BACKEND, DEFAULT_TIMEOUT_S, spawn

    rows = spawn(rank_generate, world, spec, seed, batch, seq_len, tokens, options, style, prompt, threads=threads,
                 timeout=DEFAULT_TIMEOUT_S if timeout is None else timeout)
    return {"model": rows[0]["model"], "tp": world, "backend": BACKEND, "style": style,
            "tokens_match_tp1": all(r["tokens_match_tp1"] for r in rows), "ranks": rows}
