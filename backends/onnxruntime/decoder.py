"""The onnxruntime target's step runner for ``graphopt.generate``.

``OrtRunner`` exports the prefill and decode-step models once (``generate.export_kv_cache``:
graphopt's passes, GroupQueryAttention with past/present, dynamic batch and past axes), opens
one session for each, and serves graphopt.generation's runner protocol: ``prefill`` starts
the cache (the present tensors the prefill model returns), ``step`` feeds it back as the past.
The decode loop, sampling, stopping and timing are graphopt.generation's; export time is
reported as compile time, never as decode time.

Two kinds of model decode here (``generate.cache_steps``): graphopt's built-in Llama with its
explicit cache and transformers causal LMs with their DynamicCache; anything else gets one
error line that names what works.

Padding: the exported models take no attention mask (hf_steps says why: an unmasked causal
attention is what lowers to GroupQueryAttention), so ``pads`` is False and graphopt.generate
decodes a left-padded batch as groups of one prompt length, each an unpadded batch on the
same two sessions (their batch axis is dynamic: no second export).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from graphopt.config import Options


def _export_prompt(input_ids: Tensor) -> Tensor:
    """A prompt of at least 2 x 2 for export: torch.export fixes any size of 1 it sees."""
    ids = input_ids if input_ids.shape[0] > 1 else input_ids.repeat(2, 1)
    return ids if ids.shape[1] > 1 else ids.repeat(1, 2)


class OrtRunner:
    """Prefill and decode-step ONNX models run in ORT sessions (graphopt.generation's StepRunner)."""

    target = "onnxruntime"
    pads = False
    cuda_graphs = ""

    def __init__(self, model: nn.Module | None, config: Options | None = None) -> None:
        from graphopt.backends.onnxruntime.generate import cache_steps

        if model is not None:
            cache_steps(model, otherwise="use --target eager")  # raises for a model without a cache to export
        self.model, self.config = model, config or Options.parse(None)
        self.compiles = self.prefill_compiles = 0
        self.compile_s, self.reports, self.notes = 0.0, [], []
        self.export_result = None
        self.prefill_run = self.decode_run = None
        self.past: list[Tensor] = []

    @classmethod
    def from_models(cls, prefill: Any, decode: Any, provider: str = "cpu") -> "OrtRunner":
        """A runner on models exported already (paths, bytes, OnnxModels or SessionRunners)."""
        runner = cls(None, Options.parse({"provider": provider}))
        runner.prefill_run, runner.decode_run = _session(prefill, provider), _session(decode, provider)
        return runner

    def prepare(self, input_ids: Tensor, attention_mask: Tensor | None) -> None:
        from graphopt.backends.onnxruntime.generate import decode_path, export_kv_cache

        if self.prefill_run is not None:
            return  # exported once: every batch and prompt length runs on the same sessions
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="graphopt-generate-") as folder:
            path = Path(folder) / "model.onnx"
            self.export_result = export_kv_cache(self.model, _export_prompt(input_ids), path, config=self.config,
                                                 int4=self.config.int4, validate_model=False)
            # Sessions read the files while they are created; the folder can go afterwards.
            self.prefill_run = _session(str(path), self.config.provider)
            self.decode_run = _session(str(decode_path(path)), self.config.provider)
        self.compile_s = time.perf_counter() - start
        self.compiles = self.prefill_compiles = 1  # one decode model serves every step (dynamic past axis)
        self.notes += [f"export: {f['where']}: {f['reason']}" for f in self.export_result.fallbacks]

    def prefill(self, input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        logits, *self.past = self.prefill_run(input_ids)
        return logits[:, -1]

    def prepare_step(self, token: Tensor, position: int) -> None:
        pass

    def step(self, token: Tensor, position: int) -> Tensor:
        logits, *self.past = self.decode_run(token, *self.past)
        return logits[:, -1]


def _session(model: Any, provider: str):
    from graphopt.backends.onnxruntime.session import SessionRunner, create_session

    return model if isinstance(model, SessionRunner) else SessionRunner(create_session(model, provider))
