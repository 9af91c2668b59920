"""``graphopt generate MODEL --tp N``: each rank decodes greedily with graphopt.generate on
its shard and compares its tokens with the unsharded model decoded eagerly (TP=1).

Greedy decoding makes every rank pick the same token (their logits are replicated after
the final all-reduce), so every rank's sequence must equal the TP=1 one.
"""

from __future__ import annotations

from typing import Any

import torch


def rank_generate(rank: int, world: int, spec: str, seed: int, batch: int, seq_len: int, tokens: int,
                  options: dict, style: str) -> dict[str, Any]:
    from graphopt.cli.model_source import load_model
    from graphopt.distributed.shard import shard_llama
    from graphopt.generation.api import eager_generate, generate

    loaded = load_model(spec, seed=seed, batch=batch, seq_len=seq_len, single_output=False)
    input_ids = loaded.example_inputs[0]
    ref = eager_generate(loaded.module, input_ids, tokens)
    shard_llama(loaded.module, style=style)
    torch._dynamo.reset()
    out = generate(loaded.module, input_ids, tokens, options=options)
    prompt = int(input_ids.shape[1])
    differs = (out.sequences[:, prompt:] != ref.sequences[:, prompt:]).any(0).nonzero()
    steps = list(out.ms_per_token)
    return {
        "rank": rank,
        "model": loaded.name,
        "target": out.target,
        "tokens": tokens,
        "tokens_match_tp1": bool(torch.equal(out.sequences, ref.sequences)),
        "first_mismatch": int(differs[0]) + 1 if len(differs) else None,
        "ms_per_token_median": sorted(steps)[len(steps) // 2] if steps else None,
        "tp1_eager_ms_per_token_median": sorted(ref.ms_per_token)[len(ref.ms_per_token) // 2],
        "fallback": getattr(out, "fallback", None),
    }


def generate_tp(spec: str, world: int, seed: int, batch: int, seq_len: int, tokens: int, options: dict,
                style: str = "functional", threads: int = 1) -> dict[str, Any]:
    from graphopt.distributed.launch import spawn

    rows = spawn(rank_generate, world, spec, seed, batch, seq_len, tokens, options, style, threads=threads)
    return {"model": rows[0]["model"], "tp": world, "style": style,
            "tokens_match_tp1": all(r["tokens_match_tp1"] for r in rows), "ranks": rows}
