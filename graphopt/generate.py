"""``graphopt.generate``: greedy or seeded-sampling decoding with a compiled step and a static KV cache.

    out = graphopt.generate(model, input_ids, max_new_tokens=32)            # greedy
    out = graphopt.generate(model, input_ids, 32, do_sample=True, temperature=0.8, top_k=50, seed=0)
    out.sequences        # [B, prompt + new] token ids
    out.compiles         # graph compilations during the decode steps: 1
    out.ms_per_token     # one figure per decode step

The prefill and the decode step are each exported once (torch.export, past length
dynamic), optimized with the configured pipeline, rewritten by ``static_kv_cache`` into
graphs with a preallocated cache updated in place at a position input, and lowered to the
target. Every decode step then has the same shapes, so one compiled graph serves all of
them: a step whose inputs have a signature not seen before would compile again, and
``compiles`` counts that. Works for ``transformers`` causal LMs and for modules with an
explicit cache (``forward(input_ids, past_key_values=None, position_ids=None) -> (logits,
((k, v), ...))``); batches are unpadded (every row has the prompt's length).

If the step cannot get a static cache (``static_kv_cache`` did not fire, export failed), the
loop runs the model eagerly with its own growing cache and ``fallback`` says why, unless
``options={"fallback": "error"}``. :func:`generate_with_reference` also runs that eager loop
as a reference, step for step in lockstep with the compiled one, so both loops' ms/token see
the same machine noise (what ``graphopt run --generate`` and the benchmark report).
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from graphopt.config import Options
from graphopt.errors import GraphoptError
from graphopt.report import CompileReport

log = logging.getLogger("graphopt")


@dataclass
class GenerateResult:
    sequences: Tensor  # [B, prompt_len + new tokens]
    prompt_len: int
    ms_per_token: list[float] = field(default_factory=list)  # one per decode step (compilation excluded)
    prefill_ms: float = 0.0
    compiles: int = 0  # graph compilations during the decode steps
    prefill_compiles: int = 0
    compile_s: float = 0.0  # wall time of all compilations (prefill and decode)
    fallback: str | None = None  # why decoding ran eagerly, if it did
    cuda_graphs: str = ""  # what CUDA graph capture did, or why not
    reports: list[CompileReport] = field(default_factory=list)

    @property
    def new_tokens(self) -> Tensor:
        return self.sequences[:, self.prompt_len:]

    def median_ms(self, first: int, last: int) -> float | None:
        """Median ms/token over decode steps ``first..last`` (1-based, inclusive)."""
        window = self.ms_per_token[first - 1:last]
        return statistics.median(window) if window else None


class Sampler:
    """Greedy argmax, or temperature / top-k sampling from a seeded generator."""

    def __init__(self, do_sample: bool, temperature: float, top_k: int | None, seed: int | None, device) -> None:
        if do_sample and temperature <= 0:
            raise GraphoptError(f"temperature must be > 0 when sampling, got {temperature}; use do_sample=False "
                                "for greedy decoding")
        if top_k is not None and top_k < 1:
            raise GraphoptError(f"top_k must be >= 1, got {top_k}")
        self.do_sample, self.temperature, self.top_k = do_sample, temperature, top_k
        self.generator = None
        if do_sample:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(0 if seed is None else seed)

    def __call__(self, logits: Tensor) -> Tensor:
        """[B, V] logits of the last position -> [B, 1] next tokens."""
        if not self.do_sample:
            return logits.argmax(-1, keepdim=True)
        scores = logits.float() / self.temperature
        if self.top_k is not None and self.top_k < scores.shape[-1]:
            kth = torch.topk(scores, self.top_k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _check(input_ids: Any, max_new_tokens: int, max_length: int | None = None) -> int:
    """Validate the arguments; returns the static cache length to use."""
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (torch.long, torch.int):
        got = f"{input_ids.dtype} {tuple(input_ids.shape)}" if isinstance(input_ids, Tensor) else type(input_ids).__name__
        raise GraphoptError(f"input_ids must be an integer tensor [batch, seq], got {got}")
    prompt = input_ids.shape[1]
    if prompt < 1 or max_new_tokens < 0:
        raise GraphoptError(f"need a prompt of >= 1 token and max_new_tokens >= 0, got {prompt} and {max_new_tokens}")
    max_length = max_length or prompt + max_new_tokens
    if max_length < prompt + max(max_new_tokens - 1, 0):
        raise GraphoptError(f"max_length {max_length} cannot hold the prompt ({prompt}) and {max_new_tokens} new "
                            f"tokens; pass max_length >= {prompt + max_new_tokens - 1}")
    return max_length


def drive(decoders: list, input_ids: Tensor, max_new_tokens: int) -> list[GenerateResult]:
    """Run ``decoders`` (see graphopt.decode_step.EagerDecoder) in lockstep on one prompt.

    Each prefill and each step is timed alone, compilation (``prepare``/``prepare_step``) left
    out, and the decoders take turns step by step, so on a shared machine the noise falls on
    all of them alike.
    """
    batch, prompt = input_ids.shape
    device = input_ids.device
    results = [GenerateResult(input_ids, prompt) for _ in decoders]
    tokens: list[list[Tensor]] = [[input_ids] for _ in decoders]
    current: list[Tensor] = []
    with torch.no_grad():
        for decoder in decoders:
            decoder.prepare(input_ids)
        for decoder, result in zip(decoders, results):
            start = time.perf_counter()
            current.append(decoder.prefill(input_ids))
            _sync(device)
            result.prefill_ms = (time.perf_counter() - start) * 1e3
        for i in range(max_new_tokens):
            for k in range(len(decoders)):
                tokens[k].append(current[k])
            if i == max_new_tokens - 1:
                break
            for k, (decoder, result) in enumerate(zip(decoders, results)):
                decoder.prepare_step(current[k], prompt + i)  # compiles on a new signature: the first step
                start = time.perf_counter()
                current[k] = decoder.step(current[k], prompt + i)
                _sync(device)
                result.ms_per_token.append((time.perf_counter() - start) * 1e3)
    for decoder, result, toks in zip(decoders, results, tokens):
        result.sequences = torch.cat(toks, dim=1)
        result.compiles, result.prefill_compiles = decoder.compiles, decoder.prefill_compiles
        result.compile_s, result.cuda_graphs, result.reports = decoder.compile_s, decoder.cuda_graphs, decoder.reports
    return results


def eager_generate(model: nn.Module, input_ids: Tensor, max_new_tokens: int, *, do_sample: bool = False,
                   temperature: float = 1.0, top_k: int | None = None, seed: int | None = None) -> GenerateResult:
    """The reference: the same loop run eagerly on the model's own growing (concatenated) cache."""
    from graphopt.decode_step import EagerDecoder, inference_mode

    _check(input_ids, max_new_tokens)
    sampler = Sampler(do_sample, temperature, top_k, seed, input_ids.device)
    with inference_mode(model):
        return drive([EagerDecoder(model, sampler)], input_ids, max_new_tokens)[0]


def generate(model: nn.Module, input_ids: Tensor, max_new_tokens: int, *, do_sample: bool = False,
             temperature: float = 1.0, top_k: int | None = None, seed: int | None = None,
             max_length: int | None = None, options: dict | Options | None = None) -> GenerateResult:
    """Decode ``max_new_tokens`` tokens after ``input_ids`` [B, S] with a compiled static-cache step.

    ``max_length``: positions the static cache holds (default prompt + max_new_tokens).
    ``options``: graphopt options; the cache layout is ``pass_options={"static_kv_cache":
    {"layout": "bhsd" | "bshd" | "paged", "block_size": 16, "kv_dtype": "auto" | "int8"}}``.
    """
    sampling = dict(do_sample=do_sample, temperature=temperature, top_k=top_k, seed=seed)
    return _run(model, input_ids, max_new_tokens, sampling, max_length, options, reference=False)[0]


def generate_with_reference(model: nn.Module, input_ids: Tensor, max_new_tokens: int, *,
                            max_length: int | None = None, options: dict | Options | None = None,
                            **sampling: Any) -> tuple[GenerateResult, GenerateResult]:
    """``(generate(...), eager_generate(...))`` run in lockstep: comparable tokens and ms/token."""
    return _run(model, input_ids, max_new_tokens, sampling, max_length, options, reference=True)


def _run(model, input_ids, max_new_tokens, sampling: dict, max_length, options, reference: bool) -> list:
    from graphopt.decode_step import EagerDecoder, StaticDecoder, inference_mode

    config = Options.parse(options)
    max_length = _check(input_ids, max_new_tokens, max_length)
    sampling = {"do_sample": False, "temperature": 1.0, "top_k": None, "seed": None, **sampling}
    sampler = lambda: Sampler(**sampling, device=input_ids.device)  # noqa: E731  (one RNG stream per loop)
    with inference_mode(model):
        if max_new_tokens == 0:
            return [GenerateResult(input_ids, input_ids.shape[1])] * 2
        decoders = [StaticDecoder(model, sampler(), config, max_length)]
        decoders += [EagerDecoder(model, sampler())] if reference else []
        try:
            return drive(decoders, input_ids, max_new_tokens)
        except GraphoptError as error:
            reason = str(error)
        except Exception as error:  # export or a pass crashed: never break the user's decoding
            reason = f"{type(error).__name__}: {error}"
        reason = reason.splitlines()[0] if reason else "unknown error"
        if config.fallback == "error":
            raise GraphoptError(f"graphopt.generate could not compile a static-cache step: {reason}")
        log.warning("graphopt.generate: %s; decoding eagerly with the model's own cache", reason)
        decoders = [EagerDecoder(model, sampler()) for _ in range(1 + reference)]
        results = drive(decoders, input_ids, max_new_tokens)
        results[0].fallback = reason
        return results
