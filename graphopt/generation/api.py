"""``graphopt.generate``: decode with the step runner of the chosen target.

    out = graphopt.generate(model, input_ids, 32)                                   # greedy, target auto
    out = graphopt.generate(model, input_ids, 32, options={"target": "onnxruntime"})
    out = graphopt.generate(model, ids, 32, attention_mask=mask)                    # left-padded batch
    out = graphopt.generate(model, ids, 32, do_sample=True, temperature=0.8, top_p=0.9, seed=0)
    out.target, out.sequences, out.token_ids(0), out.prefill_ms, out.ms_per_token

Which runner decodes (``RUNNERS``): targets that run graph nodes in order (eager, triton) get
the compiled static-cache step (graphopt.generation.static); onnxruntime gets one exported
model whose attention writes a shared cache buffer in place (backends/onnxruntime/decoder/decoder.py);
``auto`` resolves to one of them
from the hardware. Any other target lowers the static-cache step on eager, and the report
says so. If a runner cannot be built (export failed, no static cache), the model decodes
eagerly with its own cache and ``fallback`` says why, unless ``options={"fallback": "error"}``.

The runner is kept on the model for the next call with the same options (and, for a static
cache compiled at one size, the same ``max_length``): a second call compiles nothing unless the
weights changed (graphopt.generation.runner_cache).

A left-padded batch (``attention_mask`` with zeros on the left) decodes in one batch on
runners that take per-row lengths (``pads``: the eager reference for transformers models, the
in-place ONNX Runtime decoder); a runner that takes none decodes it as groups of one prompt
length, each row then giving the tokens it gives alone, and ``notes`` says so.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any, Callable

from graphopt.config import Options, fall_back
from graphopt.errors import GraphoptError, TargetUnavailable
from graphopt.generation.checkpoint import Checkpoint, decode_checkpoint
from graphopt.generation.loop import GenerateResult, TokenCallback, drive, merge_groups
from graphopt.generation.sampling import Sampler, StopConditions, array_module
from graphopt.targets import TABLE, in_order_targets

if TYPE_CHECKING:
    from torch import Tensor, nn

log = logging.getLogger("graphopt")

# Step runners by resolved target, as "module:class" (graphopt.targets' table); the class is built
# as cls(model, config, max_length). Other targets decode with the static-cache step (graphopt.generation.static).
RUNNERS: dict[str, str] = {t.name: t.step_runner for t in TABLE if t.step_runner}


def _check(input_ids: Any, max_new_tokens: int, max_length: int | None, attention_mask: Any) -> int:
    """Validate the arguments (torch tensors, or numpy arrays for a Checkpoint); returns the
    static cache length to use."""
    kind = array_module(input_ids).__name__ if hasattr(input_ids, "shape") else None
    if kind not in ("torch", "numpy") or len(input_ids.shape) != 2 or str(input_ids.dtype).removeprefix("torch.") \
            not in ("int64", "int32"):
        got = f"{input_ids.dtype} {tuple(input_ids.shape)}" if kind else type(input_ids).__name__
        raise GraphoptError(f"input_ids must be an integer tensor [batch, seq], got {got}")
    prompt = input_ids.shape[1]
    if prompt < 1 or max_new_tokens < 0:
        raise GraphoptError(f"need a prompt of >= 1 token and max_new_tokens >= 0, got {prompt} and {max_new_tokens}")
    if attention_mask is not None:
        if not hasattr(attention_mask, "shape") or array_module(attention_mask).__name__ != kind \
                or tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise GraphoptError(f"attention_mask must have input_ids' shape {tuple(input_ids.shape)}")
        xp = array_module(attention_mask)
        mask = xp.asarray(attention_mask, dtype=xp.int64)
        ones = mask.cumsum(-1)
        if not bool(((mask == 1) | (ones == 0)).all()) or bool((mask[:, -1] == 0).any()):
            raise GraphoptError("attention_mask must pad on the left only (zeros, then ones, every row ending in "
                                "a token); pad with tokenizer.padding_side = 'left'")
    max_length = max_length or prompt + max_new_tokens
    if max_length < prompt + max(max_new_tokens - 1, 0):
        raise GraphoptError(f"max_length {max_length} cannot hold the prompt ({prompt}) and {max_new_tokens} new "
                            f"tokens; pass max_length >= {prompt + max_new_tokens - 1}")
    return max_length


def _materialize_unless_streamed(model: nn.Module, config: Options, reference: bool) -> str | None:
    """Read a lazy model's weights into memory (dequantized) unless only the onnxruntime decoder,
    which writes them from the checkpoint itself, will run it; the note says so."""
    from graphopt import lazy_weights

    if not lazy_weights.has_lazy_weights(model):
        return None
    try:
        streamed = resolve_name(config) == "onnxruntime" and not reference
    except TargetUnavailable:
        streamed = False
    if streamed:
        return None
    quantized = any(lazy_weights.block_format(lazy_weights.source_of(t)) is not None
                    for t in model.parameters() if lazy_weights.is_lazy(t))
    count = lazy_weights.materialize_module(model)
    if not quantized:  # a float checkpoint in memory is what any other target holds anyway
        return None
    return (f"read {count} checkpoint tensors into memory as float for "
            f"{'the eager reference' if reference else 'target ' + config.target}: only the onnxruntime target "
            "runs a quantized checkpoint's own weights")


def make_runner(model: nn.Module, config: Options, max_length: int):
    """The step runner of ``config.target`` (``auto`` resolved here)."""
    from graphopt.generation.static import StaticRunner

    try:
        name = resolve_name(config)
    except TargetUnavailable as error:
        if config.target != "auto":  # raises under fallback="error"; otherwise lower() reports it and runs eager
            fall_back(config, error, f"target {config.target}", None, raise_as=None)
        name = config.target
    where = RUNNERS.get(name)
    if where is not None:
        module, attr = where.split(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as error:
            raise GraphoptError(f"target {name}'s step runner {where} does not load ({error}); "
                                "use target eager") from None
        return cls(model, config.replace(target=name), max_length)  # sizes ORT's cache buffer once
    return StaticRunner(model, config, max_length, name if name in in_order_targets() else "eager")


def resolve_name(config: Options) -> str:
    from graphopt.targets import resolve_target

    return resolve_target(config)[0].name


def _drive(runners: list, input_ids: Tensor, mask: Tensor | None, max_new_tokens: int,
           sampler: Callable[[], Sampler], stop: StopConditions, on_token: TokenCallback | None) -> list:
    """``drive`` in lockstep, or runner after runner when one of them sets torch's threads for
    its loop (``decoding()``: the onnxruntime decoder, whose spinning workers would take the
    cores from an eager runner stepped between its steps: eager llama-small's reference steps
    measured 32.7 -> 44.6 ms in lockstep with it)."""
    if len(runners) > 1 and any(hasattr(r, "decoding") for r in runners):
        return [drive([r], input_ids, mask, max_new_tokens, [sampler()], stop, on_token if i == 0 else None)[0]
                for i, r in enumerate(runners)]
    return drive(runners, input_ids, mask, max_new_tokens, [sampler() for _ in runners], stop, on_token)


def _decode(runners: list, input_ids: Tensor, mask: Tensor | None, max_new_tokens: int,
            sampler: Callable[[], Sampler], stop: StopConditions, on_token: TokenCallback | None) -> list:
    """``drive`` on the whole batch, or group by group where a runner takes no attention mask."""
    if mask is None or all(r.pads for r in runners):
        return _drive(runners, input_ids, mask, max_new_tokens, sampler, stop, on_token)
    lengths = mask.long().sum(-1)
    grouped: list[list] = [[] for _ in runners]
    order = sorted(set(lengths.tolist()), reverse=True)
    for length in order:
        rows = (lengths == length).nonzero().flatten().tolist()
        spread = None
        if on_token is not None:
            def spread(token, live, rows=rows):  # the group's tokens in the whole batch's rows
                import torch

                full = torch.zeros(input_ids.shape[0], 1, dtype=token.dtype, device=token.device)
                alive = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=token.device)
                full[rows], alive[rows] = token, live
                on_token(full, alive)
        results = _drive(runners, input_ids[rows, -length:], None, max_new_tokens, sampler, stop, spread)
        for k, result in enumerate(results):
            grouped[k].append((rows, result))
    merged = [merge_groups(input_ids, groups, stop.pad) for groups in grouped]
    for runner, result in zip(runners, merged):
        if not runner.pads:
            result.notes.append(f"the padded batch of {input_ids.shape[0]} decoded as {len(order)} groups of one "
                                f"prompt length: the {runner.target} step takes no attention mask")
    return merged


def _run(model: nn.Module | Checkpoint, input_ids: Tensor, max_new_tokens: int, *, reference: bool,
         attention_mask=None, sampling: dict, stop: StopConditions | None, max_length: int | None, options,
         on_token) -> list:
    config = Options.parse(options)
    max_length = _check(input_ids, max_new_tokens, max_length, attention_mask)
    if isinstance(model, Checkpoint):
        if not reference:
            served = decode_checkpoint(model, input_ids, max_new_tokens, attention_mask=attention_mask,
                                       sampling=sampling, stop=stop, max_length=max_length, config=config,
                                       on_token=on_token)
            if served is not None:
                return [served]
        model = model.build()
    import torch

    from graphopt.generation.runner import EagerRunner, inference_mode, step_adapter
    from graphopt.generation.runner_cache import cached_runner

    if array_module(input_ids).__name__ == "numpy":  # a Checkpoint no file runner served: torch from here on
        input_ids = torch.from_numpy(input_ids)
        attention_mask = torch.from_numpy(attention_mask) if attention_mask is not None else None
    step_adapter(model)  # one line naming what graphopt decodes, before any target is tried
    mask = attention_mask if attention_mask is not None and not bool(attention_mask.all()) else None
    stop = stop or StopConditions()
    sampling = {"do_sample": False, "temperature": 1.0, "top_k": None, "top_p": None, "seed": None, **sampling}
    sampler = lambda: Sampler(**sampling, device=input_ids.device)  # noqa: E731  (one RNG stream per runner)
    Sampler(**sampling)  # bad sampling arguments fail here, in one line
    lazy_note = _materialize_unless_streamed(model, config, reference)
    with inference_mode(model):
        if max_new_tokens == 0:
            return [GenerateResult(input_ids, input_ids.shape[1], new_lengths=[0] * input_ids.shape[0])] * 2
        try:
            with cached_runner(model, config, max_length, lambda: make_runner(model, config, max_length)) as (
                    runner, reused):
                if getattr(runner, "serves_any_length", False):
                    runner.max_length = max_length  # its first buffer's size for this call
                before = runner.compiles, runner.prefill_compiles, runner.compile_s
                runners = [runner] + ([EagerRunner(model)] if reference else [])
                results = _decode(runners, input_ids, mask, max_new_tokens, sampler, stop, on_token)
            # Runners count cumulatively; a result reports what this call compiled.
            mine = results[0]
            mine.compiles, mine.prefill_compiles = mine.compiles - before[0], mine.prefill_compiles - before[1]
            mine.compile_s -= before[2]
            if reused:
                mine.compile_stages = {}  # its stages are the earlier call's build
                mine.notes.append("reused the step runner an earlier generate call compiled for this model")
            if lazy_note:
                mine.notes.append(lazy_note)
            if config.int4 and mine.target == "eager":
                from graphopt.compiler import REFERENCE_QUANTIZED_NOTE

                mine.notes.append(REFERENCE_QUANTIZED_NOTE)
            return results
        except GraphoptError as error:
            failure, reason = error, str(error)
        except Exception as error:  # export or a pass crashed: never break the user's decoding
            failure, reason = error, f"{type(error).__name__}: {error}"
        reason = reason.splitlines()[0] if reason else "unknown error"
        fall_back(config, failure, f"generate's step for target {config.target}",
                  "decoding eagerly with the model's own cache", reason=reason, raise_as=GraphoptError)
        _materialize_unless_streamed(model, config.replace(target="eager"), reference)
        runners = [EagerRunner(model) for _ in range(1 + reference)]
        results = _decode(runners, input_ids, mask, max_new_tokens, sampler, stop, on_token)
        results[0].fallback = reason
        return results


def generate(model: nn.Module, input_ids: Tensor, max_new_tokens: int, *, attention_mask: Tensor | None = None,
             do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             seed: int | None = None, stop: StopConditions | None = None, max_length: int | None = None,
             on_token: TokenCallback | None = None, options: dict | Options | None = None) -> GenerateResult:
    """Decode up to ``max_new_tokens`` tokens after ``input_ids`` [B, S] on ``options["target"]``.

    ``attention_mask``: [B, S], 0 for left padding. ``stop``: EOS ids / stop strings
    (``StopConditions``). ``on_token(token [B, 1], live [B])`` sees each token as it comes.
    ``max_length``: positions the static cache holds (default prompt + max_new_tokens).
    ``options``: graphopt options; the static cache layout is ``pass_options={"static_kv_cache":
    {"layout": "bhsd" | "bshd" | "paged", "block_size": 16, "kv_dtype": "auto" | "int8"}}``.
    """
    sampling = dict(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    return _run(model, input_ids, max_new_tokens, reference=False, attention_mask=attention_mask, sampling=sampling,
                stop=stop, max_length=max_length, options=options, on_token=on_token)[0]


def generate_with_reference(model: nn.Module, input_ids: Tensor, max_new_tokens: int, *,
                            attention_mask: Tensor | None = None, stop: StopConditions | None = None,
                            max_length: int | None = None, options: dict | Options | None = None,
                            **sampling: Any) -> tuple[GenerateResult, GenerateResult]:
    """``(generate(...), eager_generate(...))`` run in lockstep: comparable tokens and ms/token."""
    out, ref = _run(model, input_ids, max_new_tokens, reference=True, attention_mask=attention_mask,
                    sampling=sampling, stop=stop, max_length=max_length, options=options, on_token=None)
    return out, ref


def eager_generate(model: nn.Module, input_ids: Tensor, max_new_tokens: int, *,
                   attention_mask: Tensor | None = None, stop: StopConditions | None = None,
                   **sampling: Any) -> GenerateResult:
    """The reference: the same loop run eagerly on the model's own growing (concatenated) cache."""
    from graphopt.generation.runner import EagerRunner, inference_mode

    _check(input_ids, max_new_tokens, None, attention_mask)
    mask = attention_mask if attention_mask is not None and not bool(attention_mask.all()) else None
    sampling = {"do_sample": False, "temperature": 1.0, "top_k": None, "top_p": None, "seed": None, **sampling}
    with inference_mode(model):
        return _decode([EagerRunner(model)], input_ids, mask, max_new_tokens,
                       lambda: Sampler(**sampling, device=input_ids.device), stop or StopConditions(), None)[0]
