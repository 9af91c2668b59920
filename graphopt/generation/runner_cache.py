"""Step runners kept from one ``graphopt.generate`` call to the next on the same model.

Building a runner exports and compiles the model (about 14 s for llama-small on the eager
target here, 28 s on ONNX Runtime), so a second call on the same model must not pay it again.
Each model keeps its runners in an attribute, so they live exactly as long as the model:

- the key is the parsed options and, for a runner whose static cache is compiled at one size
  (eager, triton), ``max_length``; the ONNX Runtime runner serves every length and batch
  (``serves_any_length``), so one runner per options;
- a runner is reused only while the weights it compiled are the model's: the key holds each
  parameter's and buffer's address and version (``load_state_dict``, ``copy_`` and ``.to()``
  all change one), and the training flag;
- a runner in use (another thread, or a generate called from ``on_token``) is not shared:
  that call builds its own, uncached;
- a call that fails drops its runner; each model keeps its ``KEEP`` most recent runners.

``forget(model)`` (or ``forget()`` for every model) drops them.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections import OrderedDict
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from torch import nn

from graphopt import lazy_weights

from graphopt.cache_root import tensor_bytes
from graphopt.config import Options

ATTRIBUTE = "_graphopt_generate_runners"
KEEP = 4

_lock = threading.Lock()
_holders: "weakref.WeakSet[_Runners]" = weakref.WeakSet()


class _Runners:
    """A model's runners by key. Copies and pickles of the model start empty: a runner holds
    compiled sessions and buffers that belong to the original model."""

    def __init__(self) -> None:
        self.entries: OrderedDict[tuple, Any] = OrderedDict()
        self.busy: set[int] = set()

    def __deepcopy__(self, memo: dict) -> "_Runners":
        return _Runners()

    def __reduce__(self) -> tuple:
        return _Runners, ()


def weights_key(model: nn.Module) -> tuple:
    """What the compiled runner baked in: every parameter and buffer (address, version, dtype).

    A tensor made under ``torch.inference_mode`` has no version counter; its in-place edits
    (only possible in inference mode) go unseen, so such a model's key holds a hash of its
    values instead of versions."""
    tensors = [*model.parameters(), *model.buffers()]
    return (model.training, tuple((_address(t), _version(t), t.dtype, t.device.type) for t in tensors))


def _address(t) -> int | str:
    """Where a tensor's data is: its address, or for a lazy weight (no data here) where in its
    checkpoint it is read from."""
    if lazy_weights.is_lazy(t):
        return lazy_weights.fingerprint(t) or id(t)
    return t.data_ptr()


def _version(t) -> int | str:
    if not t.is_inference():
        return t._version
    return hashlib.blake2b(tensor_bytes(t), digest_size=8).hexdigest()


def _holder(model: nn.Module) -> _Runners:
    holder = model.__dict__.get(ATTRIBUTE)
    if holder is None:
        holder = _Runners()
        object.__setattr__(model, ATTRIBUTE, holder)  # not a submodule or parameter: plain attribute
        _holders.add(holder)
    return holder


@contextmanager
def cached_runner(model: nn.Module, config: Options, max_length: int,
                  build: Callable[[], Any]) -> Iterator[tuple[Any, bool]]:
    """``(runner, reused)`` for this call: the model's cached runner for these options, or a
    new one from ``build()`` (cached unless that key's runner is in use). A call that raises
    drops the runner it used."""
    options_key = repr(sorted(config.to_dict().items()))
    weights = weights_key(model)
    with _lock:
        holder = _holder(model)
        key = next((k for k in ((options_key, weights, None), (options_key, weights, max_length))
                    if k in holder.entries), None)
        runner = holder.entries.get(key) if key is not None else None
        reused = runner is not None and id(runner) not in holder.busy
        if reused:
            holder.entries.move_to_end(key)
            holder.busy.add(id(runner))
    if not reused:
        runner = build()
        key = (options_key, weights, None if getattr(runner, "serves_any_length", False) else max_length)
        with _lock:
            if key in holder.entries:  # that key's runner is in use: this one stays uncached
                key = None
            else:
                holder.entries[key] = runner
                holder.busy.add(id(runner))
                _drop_stale(holder, weights)
    try:
        yield runner, reused
    except BaseException:
        with _lock:
            if key is not None:
                holder.entries.pop(key, None)
        raise
    finally:
        with _lock:
            holder.busy.discard(id(runner))


def _drop_stale(holder: _Runners, weights: tuple) -> None:
    """Runners compiled from other weights can never be used again; then keep the newest KEEP."""
    for key in [k for k in holder.entries if k[1] != weights and id(holder.entries[k]) not in holder.busy]:
        del holder.entries[key]
    while len(holder.entries) > KEEP:
        oldest = next(iter(holder.entries))
        if id(holder.entries[oldest]) in holder.busy:
            break
        del holder.entries[oldest]


def forget(model: nn.Module | None = None) -> None:
    """Drop the runners kept for ``model`` (every model when None); the next call rebuilds."""
    with _lock:
        holders = [model.__dict__.get(ATTRIBUTE)] if model is not None else list(_holders)
        for holder in holders:
            if holder is not None:
                holder.entries.clear()
