"""The onnxruntime target's step runner for ``graphopt.generate``.

On the CPU provider ``OrtRunner`` exports one decoder (``inplace_cache.export_decoder``:
graphopt's passes, GroupQueryAttention on a shared past/present buffer, dynamic batch and
sequence axes) and opens one session for it, so the weights are in memory once. Its KV cache
is one buffer per layer's key and value, [B, Hkv, capacity, D], bound through IOBinding as
both the past input and the present output (``InPlaceSession``): attention writes each new
row where it belongs and no step copies the cache. The buffer grows by doubling when a step
would pass its capacity (``max_length``, when the caller knows it, sizes it once).

Padding: a left-padded batch (``pads`` is True) is re-laid right-padded before the prompt
pass: row i's tokens at cache rows 0 .. len_i - 1, its rotary positions from 0, its logits
read at len_i - 1, and GroupQueryAttention's per-row ``seqlens_k`` bounding each row's
attention in the prompt pass and every step. So the batch decodes as one, in prefill and
decode, and each row equals its prompt alone.

Where the in-place decoder does not apply (another provider; a transformers model whose
mask carries more than causality, e.g. a sliding window: ``hf_steps.mask_kept``; an attention
that did not become GroupQueryAttention, found at export, for an unpadded batch) the runner
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

import numpy as np
import torch
from torch import Tensor, nn

from graphopt import lazy_weights
from graphopt.backends.onnxruntime.runtime import heap_trim
from graphopt.config import Options
from graphopt.errors import GraphoptError
from graphopt.threads import torch_threads

_ORT_DTYPES = {"tensor(float)": torch.float32, "tensor(float16)": torch.float16, "tensor(bfloat16)": torch.bfloat16}


def _export_prompt(input_ids: Tensor) -> Tensor:
    """A prompt of at least 2 x 2 for export: torch.export fixes any size of 1 it sees."""
    ids = input_ids if input_ids.shape[0] > 1 else input_ids.repeat(2, 1)
    return ids if ids.shape[1] > 1 else ids.repeat(1, 2)


def in_place_problem(model: nn.Module | None, provider: str) -> str | None:
    """Why ``model`` cannot decode on the in-place decoder here; None when it can."""
    from graphopt.backends.onnxruntime.decoder.hf_steps import mask_kept
    from graphopt.generation.runner import is_causal_lm

    if provider != "cpu":
        return f"the shared past/present buffer is bound on the CPU provider only, not {provider}"
    if model is not None and is_causal_lm(model):
        return mask_kept(model)
    return None


class InPlaceSession:
    """The in-place decoder's session, its KV buffers bound as past input and present output."""

    def __init__(self, session) -> None:
        self.session = session
        inputs = {i.name: i for i in session.get_inputs()}
        self.cache_names = [name for name in inputs if name.startswith("past_")]
        self.heads = [(inputs[n].shape[1], inputs[n].shape[3]) for n in self.cache_names]
        self.dtype = _ORT_DTYPES[inputs[self.cache_names[0]].type]
        vocab = session.get_outputs()[0].shape[-1]
        self.vocab = vocab if isinstance(vocab, int) else None
        from graphopt.backends.onnxruntime.decoder.inplace_cache import ROTARY_POSITIONS

        rows = session.get_modelmeta().custom_metadata_map.get(ROTARY_POSITIONS)
        self.max_positions = int(rows) if rows else None  # GroupQueryAttention's cos/sin cache rows
        self.cache: list[Tensor] = []
        self.binding = None
        self._bound_shape: tuple | None = None

    @property
    def capacity(self) -> int:
        return self.cache[0].shape[2] if self.cache else 0

    def reserve(self, batch: int, capacity: int, keep: int = 0) -> None:
        """Fresh buffers of ``capacity`` rows; the first ``keep`` rows of the old ones copied over."""
        old = self.cache
        self.cache = [torch.zeros(batch, h, capacity, d, dtype=self.dtype) for h, d in self.heads]
        for new, previous in zip(self.cache, old if keep else []):
            new[:, :, :keep] = previous[:, :, :keep]
        self._bind()

    def _bind(self) -> None:
        import onnxruntime

        self.binding = self.session.io_binding()
        self._bound_shape = None  # a new binding: the feeds are bound again on the next call
        self._values = [onnxruntime.OrtValue.ortvalue_from_numpy(t.numpy()) for t in self.cache]  # views, no copy
        for name, value in zip(self.cache_names, self._values):
            self.binding.bind_ortvalue_input(name, value)
            self.binding.bind_ortvalue_output("present_" + name.removeprefix("past_"), value)

    def __call__(self, input_ids: Tensor, position_ids: Tensor, last: Tensor, seqlens_k: Tensor,
                 total: int) -> Tensor:
        if self.max_positions is not None and total > self.max_positions:
            raise GraphoptError(f"a sequence of {total} tokens is longer than the {self.max_positions} positions "
                                "this model's rotary embedding was made for")
        feeds = self._bound_feeds(*input_ids.shape)
        for name, value in (("input_ids", input_ids), ("position_ids", position_ids), ("last", last),
                            ("seqlens_k", seqlens_k)):
            np.copyto(feeds[name], value.cpu().numpy(), casting="unsafe")
        feeds["total_sequence_length"][...] = total
        if self.vocab is None:
            self.binding.bind_output("logits", "cpu")
        self.session.run_with_iobinding(self.binding)
        if self.vocab is None:
            return torch.from_numpy(self.binding.get_outputs()[0].numpy())
        return self._logits.clone()  # the buffer is the next call's output

    def _bound_feeds(self, batch: int, length: int) -> dict:
        """Input buffers of this shape (and the logits'), bound once until the shape or the
        binding changes: each step then writes its few numbers into them instead of binding
        five new inputs and an output (llama-small INT4, steps in lockstep: 7.21 -> 7.08 ms)."""
        import onnxruntime

        if self._bound_shape == (batch, length):
            return self._feeds
        self._feeds = {"input_ids": np.zeros((batch, length), np.int64),
                       "position_ids": np.zeros((batch, length), np.int64), "last": np.zeros(batch, np.int64),
                       "seqlens_k": np.zeros(batch, np.int32), "total_sequence_length": np.zeros((), np.int32)}
        self._feed_values = [onnxruntime.OrtValue.ortvalue_from_numpy(a) for a in self._feeds.values()]  # views
        for name, value in zip(self._feeds, self._feed_values):
            self.binding.bind_ortvalue_input(name, value)
        if self.vocab is not None:
            self._logits = torch.empty(batch, self.vocab, dtype=self.dtype)
            self._feed_values.append(onnxruntime.OrtValue.ortvalue_from_numpy(self._logits.numpy()))
            self.binding.bind_ortvalue_output("logits", self._feed_values[-1])
        self._bound_shape = (batch, length)
        return self._feeds


def right_padded(input_ids: Tensor, lengths: Tensor) -> Tensor:
    """Each row of a left-padded batch moved to the front (its padding rotated to the end)."""
    width = input_ids.shape[1]
    index = (torch.arange(width, device=input_ids.device) + (width - lengths)[:, None]) % width
    return input_ids.gather(1, index)


class OrtRunner:
    """ONNX Runtime sessions as graphopt.generation's StepRunner (see the module docstring)."""

    target = "onnxruntime"
    cuda_graphs = ""
    serves_any_length = True  # dynamic axes: generate's runner cache keeps one per options

    def __init__(self, model: nn.Module | None, config: Options | None = None, max_length: int | None = None) -> None:
        from graphopt.backends.onnxruntime.decoder.generate import cache_steps

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
        self.prefill_run = self.decode_run = None
        self.past: list[Tensor] = []
        self.lengths: Tensor | None = None

    @classmethod
    def from_models(cls, prefill: Any, decode: Any, provider: str = "cpu") -> "OrtRunner":
        """A runner on a prefill and a decode model exported already (paths, bytes, OnnxModels or
        SessionRunners): ``generate.export_kv_cache``'s pair."""
        runner = cls(None, Options.parse({"provider": provider}))
        runner.pads = False
        runner.prefill_run, runner.decode_run = _session(prefill, provider), _session(decode, provider)
        return runner

    @classmethod
    def from_decoder(cls, decoder: Any, max_length: int | None = None) -> "OrtRunner":
        """A runner on an in-place decoder exported already (a path, bytes or an OnnxModel)."""
        runner = cls(None, Options.parse(None), max_length)
        runner.decoder = InPlaceSession(_decoder_session(decoder))
        return runner

    def prepare(self, input_ids: Tensor, attention_mask: Tensor | None) -> None:
        if self.decoder is not None or self.prefill_run is not None:
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
        from graphopt.backends.onnxruntime import tool
        from graphopt.backends.onnxruntime.decoder import decoder_cache
        from graphopt.backends.onnxruntime.decoder.inplace_cache import export_decoder

        config = tool.pipeline_options(self.config, self.config.int4)
        timer = tool.Timer(None)
        with timer("cache key"):
            key = decoder_cache.decoder_key(self.model, config.to_dict()) if decoder_cache.cache_dir() else None
        kept = decoder_cache.lookup(key) if key else None
        if kept is not None:
            try:
                with timer("session"):
                    self.decoder = InPlaceSession(_decoder_session(str(kept)))
                self.export_result = tool.ExportResult([], timer.seconds, [], [])
                self.notes.append(f"loaded the decoder exported by an earlier run from {kept.parent}")
                return
            except Exception as error:  # a damaged entry: export again and replace it
                decoder_cache.drop(key)
                self.notes.append(f"the kept decoder in {kept.parent} did not load ({type(error).__name__}); "
                                  "exported again")
        model, result = export_decoder(self.model, _export_prompt(input_ids), config, timer)
        records, fallbacks = [r.to_dict() for r in result.records], result.fallbacks
        self.notes += model.notes
        if lazy_weights.has_lazy_weights(self.model):
            # The weights are still in the checkpoint: write them out one tensor at a time and open
            # the session on the file, instead of holding them all to hand them over in memory.
            del result
            self._open_written(model, key, timer)
        else:
            with timer("session"):
                self.decoder = InPlaceSession(_decoder_session(model))
            if key:
                with timer("cache store"):
                    self.notes.append(decoder_cache.store(key, model)[1])
        self.export_result = tool.ExportResult([], timer.seconds, records, fallbacks)

    def _open_written(self, model, key: str | None, timer) -> None:
        """Write ``model`` (lazy weights) to the decoder cache, or to a temporary folder when the
        cache is off or cannot be written, and open the session on the written file."""
        from graphopt.backends.onnxruntime.decoder import decoder_cache

        path = None
        if key:
            with timer("cache store"):
                path, note = decoder_cache.store(key, model)
            self.notes.append(note)
        if path is None:
            self._scratch = tempfile.TemporaryDirectory(prefix="graphopt-decoder-")
            path = Path(self._scratch.name) / "model.onnx"
            with timer("write"):
                model.save(path, external_data=True)
        del model
        heap_trim.release_free_heap()  # the export's objects are gone: hand their memory back before the session takes its own
        with timer("session"):
            self.decoder = InPlaceSession(_decoder_session(str(path)))

    def _export_pair(self, input_ids: Tensor) -> None:
        from graphopt.backends.onnxruntime.decoder.generate import decode_path, export_kv_cache

        with tempfile.TemporaryDirectory(prefix="graphopt-generate-") as folder:
            path = Path(folder) / "model.onnx"
            self.export_result = export_kv_cache(self.model, _export_prompt(input_ids), path, config=self.config,
                                                 int4=self.config.int4, validate_model=False)
            # Sessions read the files while they are created; the folder can go afterwards.
            self.prefill_run = _session(str(path), self.config.provider)
            self.decode_run = _session(str(decode_path(path)), self.config.provider)
        self.notes.append(f"prefill and decode run as two models: {self.in_place_problem}")

    def decoding(self):
        """Torch on one thread while the loop runs on the in-place decoder (module docstring);
        the caller's thread count comes back after it."""
        return torch_threads(1) if self.decoder is not None else contextlib.nullcontext()

    def prefill(self, input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        if self.decoder is None:
            if attention_mask is not None:
                raise GraphoptError("this ONNX Runtime decoder takes no attention mask; pass prompts of one length")
            logits, *self.past = self.prefill_run(input_ids)
            return logits[:, -1]
        batch, width = input_ids.shape
        full = torch.full((batch,), width, dtype=torch.long)
        lengths = full if attention_mask is None else attention_mask.long().sum(-1).cpu()
        ids = input_ids.cpu() if attention_mask is None else right_padded(input_ids.cpu(), lengths)
        capacity = self.max_length or _round_up(width + 128, 64)
        self.decoder.reserve(batch, max(capacity, width))
        logits = self.decoder(ids, torch.arange(width).repeat(batch, 1), lengths - 1, lengths - 1, width)
        self.lengths = lengths
        return logits.to(input_ids.device)

    def prepare_step(self, token: Tensor, position: int) -> None:
        pass

    def step(self, token: Tensor, position: int) -> Tensor:
        if self.decoder is None:
            logits, *self.past = self.decode_run(token, *self.past)
            return logits[:, -1]
        lengths = self.lengths
        total = int(lengths.max()) + 1
        if total > self.decoder.capacity:  # amortized: the buffer doubles, one copy per doubling
            self.decoder.reserve(token.shape[0], max(2 * self.decoder.capacity, total), keep=total - 1)
        logits = self.decoder(token.cpu(), lengths[:, None], torch.zeros_like(lengths), lengths, total)
        self.lengths = lengths + 1
        return logits.to(token.device)


def _decoder_session(source: Any):
    """The in-place decoder's session: no arena (the cache lives in torch's buffers, and an
    arena would keep the largest prompt's activations for the session's life), and workers
    that spin between ops (module docstring)."""
    from graphopt.backends.onnxruntime.runtime.session import create_session

    return create_session(source, "cpu", arena=False, spin=True)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _session(model: Any, provider: str):
    from graphopt.backends.onnxruntime.runtime.session import SessionRunner, create_session

    return model if isinstance(model, SessionRunner) else SessionRunner(create_session(model, provider))
