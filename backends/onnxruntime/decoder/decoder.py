"""The onnxruntime target's step runner for ``graphopt.generate``.

On the CPU provider ``OrtRunner`` exports one decoder (``inplace_cache.export_decoder``:
graphopt's passes, GroupQueryAttention on a shared past/present buffer, dynamic batch and
sequence axes) and opens one session for it, so the weights are in memory once. Its KV cache,
bound in place, and the per-row lengths that let a left-padded batch decode as one are the
run-time side in ``in_place.py`` (numpy only); ``OrtRunner`` hands them torch's tensors as
numpy views.

Where the in-place decoder does not apply (another provider; a transformers model whose
mask carries more than causality, e.g. a sliding window:
``graphopt.sources.transformers_attention.mask_kept``; an attention that did not become
GroupQueryAttention, found at export, for an unpadded batch) the runner
exports the prefill and decode-step models of ``generate.export_kv_cache`` instead: two
sessions, the past fed back as numpy each step, no padding (graphopt.generate decodes a
padded batch as groups of one prompt length).

Threads: the decoder's session lets ORT's intra-op threads spin between its ops (a decode
step is ~90 small ops, and a sleeping worker wakes late for each), and while the decode loop
runs (``decoding()``, which graphopt.generation's ``drive`` enters once the models are
exported) torch computes on one thread, so that torch's OpenMP threads, which spin after
every parallel region, never fight ORT's spinning workers for the cores. SmolLM2-135M INT4
on 2 cores, 64 new tokens: 6.7-7.0 ms/token with neither, 11.8 with ORT spinning against
torch's two threads, 5.6-5.9 with ORT spinning and torch's threads idle. torch's thread count
is process-wide: torch work in another thread of the process runs on one thread too while a
loop decodes.

The decode loop, sampling, stopping and timing are graphopt.generation's; export time is
reported as compile time, never as decode time.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from graphopt import lazy_weights
from graphopt.backends.onnxruntime.decoder.generate import PairRunner, cache_steps, decode_path, export_kv_cache
from graphopt.backends.onnxruntime.decoder.in_place import InPlaceBatch, InPlaceSession, decoder_session
from graphopt.backends.onnxruntime.runtime import heap_trim
from graphopt.config import Options
from graphopt.errors import GraphoptError
from graphopt.threads import torch_threads


def _export_prompt(input_ids: Tensor) -> Tensor:
    """A prompt of at least 2 x 2 for export: torch.export fixes any size of 1 it sees."""
    ids = input_ids if input_ids.shape[0] > 1 else input_ids.repeat(2, 1)
    return ids if ids.shape[1] > 1 else ids.repeat(1, 2)


def in_place_problem(model: nn.Module | None, provider: str) -> str | None:
    """Why ``model`` cannot decode on the in-place decoder here; None when it can."""
    from graphopt.sources.model_kind import is_causal_lm
    from graphopt.sources.transformers_attention import mask_kept

    if provider != "cpu":
        return f"the shared past/present buffer is bound on the CPU provider only, not {provider}"
    if model is not None and is_causal_lm(model):
        return mask_kept(model)
    return None


class OrtRunner:
    """ONNX Runtime sessions as graphopt.generation's StepRunner (see the module docstring)."""

    target = "onnxruntime"
    cuda_graphs = ""
    serves_any_length = True  # dynamic axes: generate's runner cache keeps one per options

    def __init__(self, model: nn.Module | None, config: Options | None = None, max_length: int | None = None) -> None:
        if model is not None:
            cache_steps(model, otherwise="use --target eager")  # raises for a model without a cache to export
        self.model, self.config = model, config or Options.parse(None)
        self.max_length = max_length
        self.in_place_problem = in_place_problem(model, self.config.provider)
        self.pads = self.in_place_problem is None
        self.compiles = self.prefill_compiles = 0
        self.compile_s, self.reports, self.notes = 0.0, [], []
        self.export_result = None
        self.decoder: InPlaceSession | None = None
        self.pair: PairRunner | None = None  # the prefill/decode models, where the in-place decoder does not apply
        self.batch: InPlaceBatch | None = None  # the in-place decoder's batch, from its prompt pass on

    @classmethod
    def from_models(cls, prefill: Any, decode: Any, provider: str = "cpu") -> "OrtRunner":
        """A runner on a prefill and a decode model exported already (paths, bytes, OnnxModels or
        SessionRunners): ``generate.export_kv_cache``'s pair."""
        runner = cls(None, Options.parse({"provider": provider}))
        runner.pads = False
        runner.pair = PairRunner(prefill, decode, provider)
        return runner

    @classmethod
    def from_decoder(cls, decoder: Any, max_length: int | None = None) -> "OrtRunner":
        """A runner on an in-place decoder exported already (a path, bytes or an OnnxModel)."""
        runner = cls(None, Options.parse(None), max_length)
        runner.decoder = InPlaceSession(decoder_session(decoder))
        return runner

    def prepare(self, input_ids: Tensor, attention_mask: Tensor | None) -> None:
        if self.decoder is not None or self.pair is not None:
            return  # exported once: every batch and prompt length runs on the same sessions
        start = time.perf_counter()
        try:
            if self.pads:
                self._export_decoder(input_ids)
        except GraphoptError as error:  # an attention that did not become GroupQueryAttention
            if attention_mask is not None:
                raise
            self.pads, self.in_place_problem = False, str(error)
        if not self.pads:
            self._export_pair(input_ids)
        self.compile_s = time.perf_counter() - start
        self.compile_stages = dict(self.export_result.stages_s)  # torch.export, passes, onnx export, session, ...
        self.compiles = self.prefill_compiles = 1  # one model serves every step (dynamic axes)
        self.notes += [f"export: {f['where']}: {f['reason']}" for f in self.export_result.fallbacks]

    def _export_decoder(self, input_ids: Tensor) -> None:
        from graphopt.backends.onnxruntime.decoder import decoder_cache
        from graphopt.backends.onnxruntime.decoder.inplace_cache import export_decoder
        from graphopt.backends.onnxruntime.runtime.session import session_passes
        from graphopt.export.files import ExportResult, Timer

        config = self.config
        timer = Timer(None)
        with timer("cache key"):
            key = decoder_cache.decoder_key(self.model, config.to_dict()) if decoder_cache.cache_dir() else None
        kept = decoder_cache.lookup(key) if key else None
        if kept is not None:
            try:
                with timer("session"):
                    self.decoder = self._kept_session(kept)
                self.export_result = ExportResult([], timer.seconds, [], [])
                self.notes.append(f"loaded the decoder exported by an earlier run from {kept.parent}")
                return
            except Exception as error:  # a damaged entry: export again and replace it
                decoder_cache.drop(key)
                self.notes.append(f"the kept decoder in {kept.parent} did not load ({type(error).__name__}); "
                                  "exported again")
        model, result = export_decoder(self.model, _export_prompt(input_ids), config, timer)
        # the FX passes, then the ONNX passes the export ran (onnx_passes/runner.py)
        records = [r.to_dict() for r in [*result.records, *model.passes.records]]
        fallbacks = result.fallbacks
        self.notes += model.notes
        if lazy_weights.has_lazy_weights(self.model):
            # The weights are still in the checkpoint: write them out one tensor at a time and open
            # the session on the file, instead of holding them all to hand them over in memory.
            del result
            self._open_written(model, key, timer)
        else:
            with timer("session"):
                self.decoder = InPlaceSession(decoder_session(model))
            records += [r.to_dict() for r in session_passes(self.decoder.session).records]  # its bytes' own
            if key:
                with timer("cache store"):
                    self.notes.append(decoder_cache.store(key, model)[1])
        self.export_result = ExportResult([], timer.seconds, records, fallbacks)

    def _open_written(self, model, key: str | None, timer) -> None:
        """Write ``model`` (lazy weights) to the decoder cache, or to a temporary folder when the
        cache is off or cannot be written, and open the session on the written file."""
        from graphopt.backends.onnxruntime.decoder import decoder_cache

        path = None
        if key:
            with timer("cache store"):
                path, note = decoder_cache.store(key, model)
            self.notes.append(note)
        in_cache = path is not None
        if path is None:
            self._scratch = tempfile.TemporaryDirectory(prefix="graphopt-decoder-")
            path = Path(self._scratch.name) / "model.onnx"
            with timer("write"):
                model.save(path, external_data=True)
        del model
        heap_trim.release_free_heap()  # the export's objects are gone: hand their memory back before the session takes its own
        with timer("session"):
            self.decoder = self._kept_session(path) if in_cache else InPlaceSession(decoder_session(str(path)))

    def _kept_session(self, path: Path) -> InPlaceSession:
        """The session on a decoder in graphopt's cache, through its packed copy
        (runtime/prepacked_copy.py: saved by the first session on this machine, mapped after)."""
        from graphopt.backends.onnxruntime.decoder.in_place import kept_decoder_session

        session, note = kept_decoder_session(str(path))
        self.notes.append(note)
        return InPlaceSession(session)

    def _export_pair(self, input_ids: Tensor) -> None:
        with tempfile.TemporaryDirectory(prefix="graphopt-generate-") as folder:
            path = Path(folder) / "model.onnx"
            self.export_result = export_kv_cache(self.model, _export_prompt(input_ids), path, config=self.config,
                                                 int4=self.config.int4, validate_model=False)
            # Sessions read the files while they are created; the folder can go afterwards.
            self.pair = PairRunner(str(path), str(decode_path(path)), self.config.provider)
        self.notes.append(f"prefill and decode run as two models: {self.in_place_problem}")

    def decoding(self):
        """Torch on one thread while the loop runs on the in-place decoder (module docstring);
        the caller's thread count comes back after it."""
        return torch_threads(1) if self.decoder is not None else contextlib.nullcontext()

    def prefill(self, input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        if self.decoder is None:
            return self.pair.prefill(input_ids, attention_mask)
        self.batch = InPlaceBatch(self.decoder, self.max_length)
        mask = attention_mask.cpu().numpy() if attention_mask is not None else None
        return torch.from_numpy(self.batch.prefill(input_ids.cpu().numpy(), mask)).to(input_ids.device)

    def prepare_step(self, token: Tensor, position: int) -> None:
        pass

    def step(self, token: Tensor, position: int) -> Tensor:
        if self.decoder is None:
            return self.pair.step(token, position)
        return torch.from_numpy(self.batch.step(token.cpu().numpy())).to(token.device)

