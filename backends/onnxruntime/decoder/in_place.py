"""The in-place decoder at run time, on numpy arrays: its session, one batch's lengths, a step runner.

The decoder (``inplace_cache.export_decoder``) keeps one KV buffer per layer's key and value,
[B, Hkv, capacity, D], bound through IOBinding as both the past input and the present output
(``InPlaceSession``): attention writes each new row where it belongs and no step copies the
cache. The buffer grows by doubling when a step would pass its capacity (``max_length``, when
the caller knows it, sizes it once).

Padding (``InPlaceBatch``): a left-padded batch is re-laid right-padded before the prompt
pass: row i's tokens at cache rows 0 .. len_i - 1, its rotary positions from 0, its logits
read at len_i - 1, and GroupQueryAttention's per-row ``seqlens_k`` bounding each row's
attention in the prompt pass and every step. So the batch decodes as one, in prefill and
decode, and each row equals its prompt alone.

Nothing here imports torch: ``ArrayRunner`` decodes a kept decoder for graphopt.generation's
loop on numpy arrays, which is how a warm ``graphopt generate model.gguf`` starts in a
second instead of four (importing torch is 2.7 s and 170 MB on the 2-core machine). The
torch step runner (``decoder.OrtRunner``) wraps the same two classes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from graphopt.errors import GraphoptError

# Model metadata: how many positions the rotary cos/sin cache folded into attention holds.
ROTARY_POSITIONS = "graphopt.rotary_positions"
_CACHE_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


def decoder_session(source: Any):
    """The in-place decoder's session (a path, bytes or an OnnxModel): no arena (the cache
    lives in this module's buffers, and an arena would keep the largest prompt's activations
    for the session's life), and workers that spin between ops (decoder.py's docstring)."""
    from graphopt.backends.onnxruntime.runtime.session import create_session

    return create_session(source, "cpu", arena=False, spin=True)


def kept_decoder_session(path: str):
    """``decoder_session`` on a decoder kept in graphopt's cache, through its packed copy
    (runtime/prepacked_copy.py: the weights ONNX Runtime packed, mapped from the file; saved by
    the first session on this machine): (session, a note on what it did with the copy)."""
    from graphopt.backends.onnxruntime.runtime.prepacked_copy import open_packed
    from graphopt.backends.onnxruntime.runtime.session import create_session

    return open_packed(path, lambda model, options: create_session(str(model), "cpu", arena=False, spin=True,
                                                                   options=options))


class InPlaceSession:
    """The in-place decoder's session, its KV buffers bound as past input and present output."""

    def __init__(self, session) -> None:
        self.session = session
        inputs = {i.name: i for i in session.get_inputs()}
        self.cache_names = [name for name in inputs if name.startswith("past_")]
        self.heads = [(inputs[n].shape[1], inputs[n].shape[3]) for n in self.cache_names]
        kind = inputs[self.cache_names[0]].type
        if kind not in _CACHE_DTYPES:
            raise GraphoptError(f"the in-place decoder keeps its KV cache as {kind}; ONNX Runtime's CPU decoder "
                                "runs float32 or float16 caches: export the model in one of those dtypes")
        self.dtype = _CACHE_DTYPES[kind]
        vocab = session.get_outputs()[0].shape[-1]
        self.vocab = vocab if isinstance(vocab, int) else None
        rows = session.get_modelmeta().custom_metadata_map.get(ROTARY_POSITIONS)
        self.max_positions = int(rows) if rows else None  # GroupQueryAttention's cos/sin cache rows
        self.cache: list[np.ndarray] = []
        self.binding = None
        self._bound_shape: tuple | None = None

    @property
    def capacity(self) -> int:
        return self.cache[0].shape[2] if self.cache else 0

    def reserve(self, batch: int, capacity: int, keep: int = 0) -> None:
        """Fresh buffers of ``capacity`` rows; the first ``keep`` rows of the old ones copied over."""
        old = self.cache
        self.cache = [np.zeros((batch, h, capacity, d), self.dtype) for h, d in self.heads]
        for new, previous in zip(self.cache, old if keep else []):
            new[:, :, :keep] = previous[:, :, :keep]
        self._bind()

    def _bind(self) -> None:
        import onnxruntime

        self.binding = self.session.io_binding()
        self._bound_shape = None  # a new binding: the feeds are bound again on the next call
        self._values = [onnxruntime.OrtValue.ortvalue_from_numpy(a) for a in self.cache]  # views, no copy
        for name, value in zip(self.cache_names, self._values):
            self.binding.bind_ortvalue_input(name, value)
            self.binding.bind_ortvalue_output("present_" + name.removeprefix("past_"), value)

    def __call__(self, input_ids: np.ndarray, position_ids: np.ndarray, last: np.ndarray, seqlens_k: np.ndarray,
                 total: int) -> np.ndarray:
        """[B, vocab] logits of each row's ``last`` position."""
        if self.max_positions is not None and total > self.max_positions:
            raise GraphoptError(f"a sequence of {total} tokens is longer than the {self.max_positions} positions "
                                "this model's rotary embedding was made for")
        feeds = self._bound_feeds(*input_ids.shape)
        for name, value in (("input_ids", input_ids), ("position_ids", position_ids), ("last", last),
                            ("seqlens_k", seqlens_k)):
            np.copyto(feeds[name], value, casting="unsafe")
        feeds["total_sequence_length"][...] = total
        if self.vocab is None:
            self.binding.bind_output("logits", "cpu")
        self.session.run_with_iobinding(self.binding)
        if self.vocab is None:
            return self.binding.get_outputs()[0].numpy()
        return self._logits.copy()  # the buffer is the next call's output

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
            self._logits = np.empty((batch, self.vocab), self.dtype)
            self._feed_values.append(onnxruntime.OrtValue.ortvalue_from_numpy(self._logits))
            self.binding.bind_ortvalue_output("logits", self._feed_values[-1])
        self._bound_shape = (batch, length)
        return self._feeds


def right_padded(input_ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Each row of a left-padded batch moved to the front (its padding rotated to the end)."""
    width = input_ids.shape[1]
    index = (np.arange(width) + (width - lengths)[:, None]) % width
    return np.take_along_axis(input_ids, index, axis=1)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class InPlaceBatch:
    """One batch on an ``InPlaceSession``: each row's length, the prompt pass and the steps."""

    def __init__(self, decoder: InPlaceSession, max_length: int | None) -> None:
        self.decoder, self.max_length = decoder, max_length
        self.lengths: np.ndarray | None = None

    def prefill(self, input_ids: np.ndarray, attention_mask: np.ndarray | None) -> np.ndarray:
        batch, width = input_ids.shape
        if attention_mask is None:
            lengths, ids = np.full(batch, width, np.int64), input_ids
        else:
            lengths = attention_mask.astype(np.int64).sum(-1)
            ids = right_padded(input_ids, lengths)
        capacity = self.max_length or _round_up(width + 128, 64)
        self.decoder.reserve(batch, max(capacity, width))
        logits = self.decoder(ids, np.tile(np.arange(width), (batch, 1)), lengths - 1, lengths - 1, width)
        self.lengths = lengths
        return logits

    def step(self, token: np.ndarray) -> np.ndarray:
        lengths = self.lengths
        total = int(lengths.max()) + 1
        if total > self.decoder.capacity:  # amortized: the buffer doubles, one copy per doubling
            self.decoder.reserve(token.shape[0], max(2 * self.decoder.capacity, total), keep=total - 1)
        logits = self.decoder(token, lengths[:, None], np.zeros_like(lengths), lengths, total)
        self.lengths = lengths + 1
        return logits


class ArrayRunner:
    """A kept in-place decoder as graphopt.generation's StepRunner, on numpy arrays (no torch)."""

    target = "onnxruntime"
    cuda_graphs = ""
    pads = True  # per-row lengths: a left-padded batch decodes as one
    serves_any_length = True

    def __init__(self, session: Any, max_length: int | None = None) -> None:
        self.decoder = InPlaceSession(session)
        self.batch = InPlaceBatch(self.decoder, max_length)
        self.compiles = self.prefill_compiles = 1  # one model serves every step (dynamic axes)
        self.compile_s, self.compile_stages = 0.0, {}
        self.reports: list = []
        self.notes: list[str] = []

    def prepare(self, input_ids: np.ndarray, attention_mask: np.ndarray | None) -> None:
        pass

    def prefill(self, input_ids: np.ndarray, attention_mask: np.ndarray | None) -> np.ndarray:
        return self.batch.prefill(input_ids, attention_mask)

    def prepare_step(self, token: np.ndarray, position: int) -> None:
        pass

    def step(self, token: np.ndarray, position: int) -> np.ndarray:
        return self.batch.step(token)
