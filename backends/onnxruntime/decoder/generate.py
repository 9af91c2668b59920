"""Greedy generation on ONNX Runtime with an exported KV cache: a prefill model and a decode model.

Two kinds of model export, through one flat interface (``cache_steps`` picks the modules):
graphopt's reference Llama, ``model(input_ids, past_key_values=None) -> (logits, cache)``
with the cache a tuple per layer of ``(k, v)`` [B, Hkv, S, D] grown by concatenation on axis
2 (``PrefillStep``, ``DecodeStep``), and transformers causal LMs, whose DynamicCache grows the
same way (``hf_steps.HFCacheStep``). Two ONNX files come out:

- prefill (``model.onnx``): ``input_ids`` [batch, sequence] -> ``logits`` (a transformers
  model's: the last position only), ``present_key_i``, ``present_value_i``; attention is
  causal over the prompt (GroupQueryAttention).
- decode (``model.decode.onnx``): ``input_ids`` [batch, 1] and ``past_key_i`` /
  ``past_value_i`` [batch, Hkv, past_sequence, D] -> ``logits`` and the presents, one token
  longer; attention over ``cat(past, new)`` is GroupQueryAttention with past/present.

Two models rather than one with an empty past for the prompt: the reference model takes a
different attention path for a one-token step (no mask) than for a chunk (a bottom-right
mask), a single traced graph holds only one of them, and only the unmasked causal forms
lower to GroupQueryAttention. The cost is the weights twice on disk and in memory, and a
present cache copied from the past every step. That is why ``graphopt.generate`` decodes on
the one in-place model of ``inplace_cache.export_decoder`` instead, and comes here only for a
model that cannot take it (decoder.py); this pair remains what ``graphopt export --kv-cache``
writes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from graphopt.config import Options
from graphopt.errors import GraphoptError


class PrefillStep(nn.Module):
    """``input_ids -> (logits, k_0, v_0, k_1, v_1, ...)``: the cache flattened for ONNX."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor) -> tuple[Tensor, ...]:
        logits, cache = self.model(input_ids)
        return (logits, *[t for kv in cache for t in kv])


class DecodeStep(nn.Module):
    """``(input_ids, k_0, v_0, ...) -> (logits, present k_0, present v_0, ...)``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, *past: Tensor) -> tuple[Tensor, ...]:
        cache = tuple((past[i], past[i + 1]) for i in range(0, len(past), 2))
        logits, new_cache = self.model(input_ids, cache)
        return (logits, *[t for kv in new_cache for t in kv])


def cache_steps(model: nn.Module, otherwise: str = "export it without --kv-cache") -> tuple[nn.Module, nn.Module]:
    """(prefill, decode step) modules with the flat cache interface for ``model``; for a model
    without a cache to export, GraphoptError in one line that ends with ``otherwise``."""
    from graphopt.backends.onnxruntime.decoder.hf_steps import HFCacheStep
    from graphopt.sources.model_kind import CAUSAL_LM, EXPLICIT_CACHE, model_kind

    kind = model_kind(model)
    if kind == CAUSAL_LM:
        return HFCacheStep(model), HFCacheStep(model)
    if kind == EXPLICIT_CACHE:  # a transformers encoder that names a past_key_values is no such module
        return PrefillStep(model), DecodeStep(model)
    raise GraphoptError(
        f"{type(model).__name__} has no KV cache to export: graphopt exports transformers causal LMs and modules whose "
        "forward(input_ids, past_key_values=None) returns (logits, ((k, v), ...)) like graphopt's built-in Llama; "
        f"{otherwise}")


def decode_path(path: str | os.PathLike) -> Path:
    """``model.onnx`` -> ``model.decode.onnx``."""
    path = Path(path)
    return path.with_name(path.stem + ".decode" + (path.suffix or ".onnx"))


def _cache_names(layers: int, prefix: str) -> list[str]:
    return [f"{prefix}_{kind}_{i}" for i in range(layers) for kind in ("key", "value")]


def export_kv_cache(model: nn.Module, prompt: Tensor, path: str | os.PathLike, *, config: Options,
                    opset: int | None = None, int4: bool = False, validate_model: bool = True, force: bool = False,
                    new_tokens: int = 8, stage=None):
    """Write the prefill model to ``path`` and the decode model beside it; with ``validate_model``,
    compare both with eager and check greedy generation of ``new_tokens`` tokens token for token.

    ``prompt`` [B, S] with B, S >= 2 (torch.export specializes sizes of 1).
    """
    # the export machinery (onnx, onnxscript) only when exporting
    from graphopt.backends.onnxruntime.exporter import onnx_exporter
    from graphopt.export.files import ExportResult, Timer, check_destination, describe, save_atomically
    from graphopt.export.model import dims_for, optimize_and_export
    from graphopt.export.validate import flatten_outputs, resample_like, validate
    from graphopt.pipeline import with_int4

    from graphopt import ir

    prefill_path, step_path = check_destination(path, force), check_destination(decode_path(path), force)
    config = with_int4(config, int4)
    timer = Timer(stage)
    prefill_step, decode_step = cache_steps(model)
    with torch.no_grad():
        flat_cache = list(prefill_step(prompt)[1:])
    layers = len(flat_cache) // 2
    present = _cache_names(layers, "present")
    cache_axes = {0: "batch", 2: "past_sequence"}

    prefill, prefill_result = optimize_and_export(
        prefill_step, (prompt,), config, timer, axis_names=[{0: "batch", 1: "sequence"}],
        input_names=["input_ids"], output_names=["logits", *present], opset=opset, to=onnx_exporter)
    with timer("save"):
        prefill_files = save_atomically(prefill, prefill_path)

    token = prompt[:, -1:]
    dims = dims_for([{0: "batch"}, *[cache_axes] * len(flat_cache)])
    step, step_result = optimize_and_export(
        decode_step, (token, *flat_cache), config, timer,
        axis_names=[{0: "batch"}, *[cache_axes] * len(flat_cache)],
        input_names=["input_ids", *_cache_names(layers, "past")], output_names=["logits", *present],
        opset=opset, dynamic_shapes=(dims[0], tuple(dims[1:])), to=onnx_exporter)
    with timer("save"):
        step_files = save_atomically(step, step_path)

    files = [describe("prefill", prefill, prefill_files, ir.op_counts(prefill_result.gm)),
             describe("decode", step, step_files, ir.op_counts(step_result.gm))]
    extra: dict[str, Any] = {"cached_attention": step.cached_attention}
    if getattr(decode_step, "mask_kept", None):
        extra["attention_mask_kept"] = decode_step.mask_kept  # why GQA with past/present could not fire
    if validate_model:
        with timer("validate"):
            other = resample_like([prompt])[0]
            files[0].validation = validate(str(prefill_path), prefill_step, [[prompt], [other]],
                                           config.provider, flatten_outputs, onnx_exporter)
            files[1].validation = validate(str(step_path), decode_step, [[token, *flat_cache]],
                                           config.provider, flatten_outputs, onnx_exporter)
            ort_tokens = greedy_generate_ort(str(prefill_path), str(step_path), prompt, new_tokens, config.provider)
            eager_tokens = greedy_generate_eager(model, prompt, new_tokens)
            extra["generation"] = {"new_tokens": new_tokens, "tokens_equal": bool(torch.equal(ort_tokens, eager_tokens)),
                                   "ort_tokens": ort_tokens[:, prompt.shape[1]:].tolist(),
                                   "eager_tokens": eager_tokens[:, prompt.shape[1]:].tolist()}
    records = [r.to_dict() for r in prefill_result.records + step_result.records]
    return ExportResult(files, timer.seconds, records, prefill_result.fallbacks + step_result.fallbacks, extra)


class PairRunner:
    """The prefill and decode models of ``export_kv_cache`` as graphopt.generation's StepRunner:
    two sessions, the past fed back each step, no padding. ``OrtRunner`` decodes on one where
    the in-place decoder does not apply; ``greedy_generate_ort`` drives one to validate an export."""

    target = "onnxruntime"
    cuda_graphs = ""
    serves_any_length = True
    pads = False

    def __init__(self, prefill: Any, decode: Any, provider: str = "cpu") -> None:
        self.prefill_run, self.decode_run = session_runner(prefill, provider), session_runner(decode, provider)
        self.past: list = []
        self.compiles = self.prefill_compiles = 0
        self.compile_s, self.reports = 0.0, []

    def prepare(self, input_ids: Tensor, attention_mask: Tensor | None) -> None:
        pass

    def prefill(self, input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        if attention_mask is not None:
            raise GraphoptError("this ONNX Runtime decoder takes no attention mask; pass prompts of one length")
        logits, *self.past = self.prefill_run(input_ids)
        return logits[:, -1]

    def prepare_step(self, token: Tensor, position: int) -> None:
        pass

    def step(self, token: Tensor, position: int) -> Tensor:
        logits, *self.past = self.decode_run(token, *self.past)
        return logits[:, -1]


def session_runner(model: Any, provider: str):
    """A SessionRunner on ``model`` (a path, bytes, an OnnxModel, or a SessionRunner already)."""
    from graphopt.backends.onnxruntime.runtime.session import SessionRunner, create_session

    return model if isinstance(model, SessionRunner) else SessionRunner(create_session(model, provider))


def greedy_generate_ort(prefill: Any, decode: Any, input_ids: Tensor, max_new_tokens: int,
                        provider: str = "cpu") -> Tensor:
    """Greedy tokens [B, S + max_new_tokens] from the two exported models (paths, bytes,
    OnnxModels or SessionRunners), decoded by graphopt.generation's loop."""
    from graphopt.generation import Sampler, drive

    return drive([PairRunner(prefill, decode, provider)], input_ids, None, max_new_tokens, [Sampler()])[0].sequences


def greedy_generate_eager(model: nn.Module, input_ids: Tensor, max_new_tokens: int) -> Tensor:
    """The same loop on the PyTorch model: the reference the ORT tokens must equal."""
    from graphopt.generation import eager_generate

    return eager_generate(model, input_ids, max_new_tokens).sequences
