"""Greedy decoding on ONNX Runtime behind graphopt.generate's decoder protocol.

``graphopt run MODEL --target onnxruntime --generate N`` lands here: ``OrtDecoder`` exports
the prefill and decode-step models (``generate.export_kv_cache``, graphopt's passes, GQA with
past/present), opens one session for each, and decodes in lockstep with the eager reference
(``graphopt.generate.drive``), so both see the same machine noise and the tokens can be
compared one for one. Export time is reported as compile time, never as decode time.

Two kinds of model decode here (``generate.cache_steps``): graphopt's built-in Llama with its
explicit cache (``model(input_ids, past_key_values=None) -> (logits, ((k, v), ...))``) and
transformers causal LMs with their DynamicCache; anything else gets one error line that names
what works.
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path

from torch import Tensor, nn

from graphopt.config import Options
from graphopt.errors import GraphoptError
from graphopt.generate import GenerateResult, Sampler, drive

log = logging.getLogger("graphopt.onnxruntime")


def _check_model(model: nn.Module) -> None:
    from graphopt.backends.onnxruntime.generate import cache_steps

    cache_steps(model, otherwise="use --target eager")  # raises for a model without a cache to export


def _export_prompt(input_ids: Tensor) -> Tensor:
    """A prompt of at least 2 x 2 for export: torch.export fixes any size of 1 it sees."""
    ids = input_ids if input_ids.shape[0] > 1 else input_ids.repeat(2, 1)
    return ids if ids.shape[1] > 1 else ids.repeat(1, 2)


class OrtDecoder:
    """Prefill and decode-step ONNX models run in ORT sessions (graphopt.decode_step's protocol)."""

    prefill_compiles = 1
    cuda_graphs = ""

    def __init__(self, model: nn.Module, sample, config: Options) -> None:
        self.model, self.sample, self.config = model, sample, config
        self.compiles, self.compile_s, self.reports = 0, 0.0, []
        self.export_result = None
        self.past: list[Tensor] = []

    def prepare(self, input_ids: Tensor) -> None:
        from graphopt.backends.onnxruntime.generate import _runner, decode_path, export_kv_cache

        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="graphopt-generate-") as folder:
            path = Path(folder) / "model.onnx"
            self.export_result = export_kv_cache(self.model, _export_prompt(input_ids), path, config=self.config,
                                                 validate_model=False)
            # Sessions read the files while they are created; the folder can go afterwards.
            self.prefill_run = _runner(str(path), self.config.provider)
            self.decode_run = _runner(str(decode_path(path)), self.config.provider)
        self.compile_s = time.perf_counter() - start
        self.compiles = 1  # one decode model serves every step (dynamic past_sequence axis)

    def prefill(self, input_ids: Tensor) -> Tensor:
        logits, *self.past = self.prefill_run(input_ids)
        return self.sample(logits[:, -1])

    def prepare_step(self, token: Tensor, position: int) -> None:
        pass

    def step(self, token: Tensor, position: int) -> Tensor:
        logits, *self.past = self.decode_run(token, *self.past)
        return self.sample(logits[:, -1])


def generate_with_reference(model: nn.Module, input_ids: Tensor, max_new_tokens: int, *,
                            options: dict | Options | None = None) -> tuple[GenerateResult, GenerateResult]:
    """Greedy decoding on ORT and eagerly, in lockstep: (ORT result, eager result).

    A model that cannot be exported decodes eagerly with ``fallback`` saying why (or raises
    GraphoptError with ``fallback="error"``), as graphopt.generate does.
    """
    from graphopt.decode_step import EagerDecoder, inference_mode

    config = Options.parse(options)
    if max_new_tokens < 1:
        raise GraphoptError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    _check_model(model)
    greedy = lambda: Sampler(False, 1.0, None, None, input_ids.device)  # noqa: E731
    with inference_mode(model):
        try:
            ort_decoder = OrtDecoder(model, greedy(), config)
            results = drive([ort_decoder, EagerDecoder(model, greedy())], input_ids, max_new_tokens)
            results[0].fallback = _fallback_text(ort_decoder)
            return results[0], results[1]
        except GraphoptError as error:
            if config.fallback == "error":
                raise
            reason = str(error).splitlines()[0]
        except Exception as error:  # export crashed: never break the user's decoding
            if config.fallback == "error":
                raise GraphoptError(f"ONNX Runtime decoding failed: {type(error).__name__}: {error}") from error
            reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        log.warning("onnxruntime generate: %s; decoding eagerly", reason)
        results = drive([EagerDecoder(model, greedy()), EagerDecoder(model, greedy())], input_ids, max_new_tokens)
        results[0].fallback = reason
        return results[0], results[1]


def _fallback_text(decoder: OrtDecoder) -> str | None:
    """Passes that fell back while exporting (the model still ran on ORT)."""
    fallbacks = decoder.export_result.fallbacks if decoder.export_result else []
    return "; ".join(f"{f['where']}: {f['reason']}" for f in fallbacks) or None
