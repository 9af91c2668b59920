"""Weights that are not in memory yet: fake tensors that know where their data comes from.

A checkpoint loaded for compilation gives the model fake parameters (``FakeTensor`` on the CPU:
a shape and a dtype, no data) and a *source* for each: how to read that tensor from the file
when a runtime needs its bytes. torch.export traces them, passes rewrite them, and the
exporters write each one by calling its source, one tensor at a time, so the weights are never
all in memory at once and never held twice (DESIGN: "a checkpoint keeps its size").

The link from a fake tensor to its source is its storage: torch.export and the frontend's
freezing make new tensor objects (``detach``, views) but keep the storage, so any tensor that
shares a registered storage finds its source, and a view (a slice of a tied table) reads the
matching part of it. A pass that computes a new weight from fake ones (a QKV merge's
``cat``) calls ``derive``, which records the computation as the new tensor's source; one that
computes several (INT4 codes, scales and zero points of one weight) calls ``derive_each``:
the first read computes them all from the weight, and each is kept only until it is read.
A computation that goes row by row (round-to-nearest quantization) asks for ``streamed``: it
gets the weight's source and reads it in blocks of rows (``row_blocks``), so the largest
weight (an LM head) is never in memory whole as float.

A checkpoint that ships quantized weights gives sources two more methods: ``block_format()``
(cheap: the ``BlockFormat`` its codes take, or None) and ``block_quantized()`` (the weight as
codes and scales in graphopt's block format, ``graphopt.ops.quant_blocks``, read from the file
when asked). The pass ``keep_checkpoint_quantization`` reads them, so the runtime gets the
file's own codes instead of a float weight.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode


class Source(Protocol):
    """Where a weight's data comes from. ``load`` returns a real tensor of ``shape`` and ``dtype``;
    a source that can read some of its rows without the rest has ``load_rows(start, stop)``
    (and ``reads_rows()`` where that depends on its parts); a block-quantized source also has
    ``block_format()`` and ``block_quantized(rows=None)``."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def load(self) -> torch.Tensor: ...


# storage key -> (source, a tensor that keeps the storage alive so the key is never reused)
_SOURCES: dict[int, tuple[Any, torch.Tensor]] = {}


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata  # noqa: SLF001  (the StorageImpl: shared by views and detach)


def is_lazy(t: Any) -> bool:
    """A tensor with no data of its own here (a fake weight)."""
    return isinstance(t, FakeTensor)


def new_mode() -> FakeTensorMode:
    """A fake mode for one model's weights (tensors of one model must share it to mix in ops)."""
    return FakeTensorMode(allow_non_fake_inputs=True)


def mode_of(t: torch.Tensor) -> FakeTensorMode:
    """The fake mode a lazy weight belongs to (new lazy tensors beside it must share it)."""
    return t.fake_mode


def fake(mode: FakeTensorMode, source: Source) -> torch.Tensor:
    """A fake CPU tensor of ``source``'s shape and dtype, linked to ``source``."""
    with mode:
        t = torch.empty(source.shape, dtype=source.dtype, device="cpu")
    _SOURCES[_key(t)] = (source, t)
    return t


def source_of(t: torch.Tensor) -> Any | None:
    """The source of ``t``'s data, or None when ``t`` is not a lazy weight. A view of a
    registered tensor (another shape, stride or offset) gets a source for that view."""
    if not is_lazy(t):
        return None
    entry = _SOURCES.get(_key(t))
    if entry is None:
        return None
    source, base = entry
    if t.shape == base.shape and t.stride() == base.stride() and t.storage_offset() == base.storage_offset():
        return source
    return _View(source, tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype)


def fingerprint(t: torch.Tensor) -> str | None:
    """What a lazy weight's data depends on (its file's identity and where in it), for cache
    keys that must not read the weight; None when ``t`` is not lazy or its source cannot say."""
    source = source_of(t)
    method = getattr(source, "fingerprint", None)
    return method() if method is not None else None


def materialize(t: torch.Tensor) -> torch.Tensor:
    """``t``'s data (a real tensor); ``t`` itself when it is real."""
    if not is_lazy(t):
        return t
    source = source_of(t)
    if source is None:
        raise ValueError(f"a fake weight of shape {tuple(t.shape)} has no source: the pass that made it must call "
                         "graphopt.lazy_weights.derive")
    return source.load()


def derive(fn: Callable[..., torch.Tensor], tensors: Sequence[torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
    """``fn(tensors, *args, **kwargs)`` (e.g. ``torch.cat``): computed now when all are real, else a
    fake result whose source computes it from the parts' data when asked."""
    tensors = list(tensors)
    if not any(is_lazy(t) for t in tensors):
        return fn(tensors, *args, **kwargs)
    result = fn(tensors, *args, **kwargs)  # on fakes: shapes only
    parts = [source_of(t) if is_lazy(t) else _Real(t) for t in tensors]
    if any(p is None for p in parts):
        raise ValueError("derive: a fake part has no source")
    _SOURCES[_key(result)] = (_Derived(fn, parts, args, kwargs, tuple(result.shape), result.dtype), result)
    return result


def derive_each(fn: Callable[..., Sequence[torch.Tensor | None]], tensors: Sequence[torch.Tensor],
                results: Sequence[torch.Tensor | None], *, streamed: bool = False) -> None:
    """Link ``results`` (fake tensors that ``fn(*tensors)`` gave on the fake ``tensors``: its
    shapes and dtypes) to ``fn`` run on the tensors' data. Reading any of them runs ``fn`` once
    and keeps the other results until each is read (the writer of a model's weights reads a
    weight's parts one after another), so one weight's worth is in memory at a time. With
    ``streamed``, ``fn`` gets the tensors' sources instead of their data, to read them with
    ``row_blocks``."""
    parts = [source_of(t) if is_lazy(t) else _Real(t) for t in tensors]
    if any(p is None for p in parts):
        raise ValueError("derive_each: a fake input has no source")
    shared = _Shared(fn, parts, sum(r is not None for r in results), streamed)
    for index, result in enumerate(results):
        if result is not None:
            _SOURCES[_key(result)] = (_SharedPart(shared, index, tuple(result.shape), result.dtype), result)


class _Shared:
    """``fn`` on its parts' data, computed at the first read and dropped once every result was read."""

    def __init__(self, fn, parts, wanted: int, streamed: bool) -> None:
        self.fn, self.parts, self.wanted, self.streamed = fn, parts, wanted, streamed
        self.lock = threading.Lock()  # the ONNX writer reads initializers on several threads
        self.values: list | None = None
        self.unread: set[int] = set()

    def take(self, index: int) -> torch.Tensor:
        with self.lock:
            if self.values is None or index not in self.unread:  # first read, or read again later
                self.values = list(self.fn(*(self.parts if self.streamed else [p.load() for p in self.parts])))
                self.unread = {i for i, v in enumerate(self.values) if v is not None}
            value = self.values[index]
            self.unread.discard(index)
            if not self.unread:
                self.values = None
            return value


class _SharedPart:
    def __init__(self, shared: _Shared, index: int, shape, dtype) -> None:
        self.shared, self.index, self.shape, self.dtype = shared, index, shape, dtype

    def load(self) -> torch.Tensor:
        return self.shared.take(self.index)


class _Real:
    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.shape, self.dtype = t, tuple(t.shape), t.dtype

    def load(self) -> torch.Tensor:
        return self.t

    def load_rows(self, start: int, stop: int) -> torch.Tensor:
        return self.t[start:stop]


class _View:
    """A view of a source's tensor: loads the whole and returns the view (a copy)."""

    def __init__(self, base: Any, shape, stride, offset, dtype) -> None:
        self.base, self.shape, self.stride, self.offset, self.dtype = base, shape, stride, offset, dtype

    def load(self) -> torch.Tensor:
        return self.base.load().as_strided(self.shape, self.stride, self.offset).contiguous()

    def block_format(self):
        return None  # a view cuts across blocks in general


class _Derived:
    def __init__(self, fn, parts, args, kwargs, shape, dtype) -> None:
        self.fn, self.parts, self.args, self.kwargs, self.shape, self.dtype = fn, parts, args, kwargs, shape, dtype

    def load(self) -> torch.Tensor:
        return self.fn([p.load() for p in self.parts], *self.args, **self.kwargs)

    def _row_concat(self) -> bool:
        return self.fn is torch.cat and (self.args or [self.kwargs.get("dim", 0)])[0] == 0

    def reads_rows(self) -> bool:
        return self._row_concat() and all(reads_rows(p) for p in self.parts)

    def load_rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of the parts stacked (a merged QKV), read from the parts that hold them."""
        taken = []
        for part, (low, high) in zip(self.parts, self._spans(start, stop)):
            if low < high:
                taken.append(part.load_rows(low, high))
        return taken[0] if len(taken) == 1 else torch.cat(taken)

    def _spans(self, start: int, stop: int) -> list[tuple[int, int]]:
        """Each part's rows that fall in ``start:stop`` of the stack, in the part's own numbering."""
        spans, offset = [], 0
        for part in self.parts:
            size = part.shape[0]
            spans.append((max(start, offset) - offset, min(stop, offset + size) - offset))
            offset += size
        return spans

    def block_format(self):
        """Rows of block-quantized parts stacked (a merged QKV) are block-quantized, in the
        format that holds every part exactly (``BlockFormat.widened``)."""
        formats = [block_format(p) for p in self.parts] if self._row_concat() else [None]
        if any(f is None for f in formats):
            return None
        joined = formats[0]
        for f in formats[1:]:
            joined = joined.widened(f)
        return joined

    def block_quantized(self, rows: slice | None = None):
        """The parts' blocks stacked; with ``rows``, only the parts' rows that fall in them."""
        from graphopt.ops.quant_blocks import concatenate

        target = self.block_format()
        start, stop = (0, self.shape[0]) if rows is None else (rows.start, rows.stop)
        taken = []
        for part, (low, high) in zip(self.parts, self._spans(start, stop)):
            if low < high:
                whole = low == 0 and high == part.shape[0]
                taken.append(part.block_quantized(None if whole else slice(low, high)))
        return concatenate([b.widen(target) for b in taken])


def reads_rows(source: Any) -> bool:
    """Whether ``source`` reads a block of its rows without the rest (``load_rows``)."""
    method = getattr(source, "reads_rows", None)
    return bool(method()) if method is not None else callable(getattr(source, "load_rows", None))


def row_blocks(source: Any, rows: int) -> Iterator[tuple[int, torch.Tensor]]:
    """``(first row, data)`` of ``source``'s tensor, ``rows`` rows at a time, in order: each
    block read on its own where the source can (a checkpoint's tensor, parts stacked from
    such), so one block is in memory at a time; else sliced from one read of the whole."""
    n = source.shape[0]
    if reads_rows(source):
        for start in range(0, n, rows):
            yield start, source.load_rows(start, min(n, start + rows))
        return
    whole = source.load()
    for start in range(0, n, rows):
        yield start, whole[start:start + rows]


def block_format(source: Any):
    """The block format a source's data comes in (``graphopt.ops.quant_blocks.BlockFormat``), or None."""
    method = getattr(source, "block_format", None)
    return method() if method is not None else None


def replace_parameters(module: torch.nn.Module, sources: dict[str, Any], mode: FakeTensorMode | None = None) -> None:
    """Give ``module`` a lazy parameter for every name in ``sources`` (a state-dict name ->
    source); a parameter tied to another (one tensor under two names) stays one tensor, made
    from whichever of its names has a source."""
    mode = mode or new_mode()
    owners = [(sub, name, param, f"{prefix}.{name}" if prefix else name)
              for prefix, sub in module.named_modules(remove_duplicate=False)
              for name, param in sub._parameters.items() if param is not None]
    source_of_param = {id(param): sources[full] for _, _, param, full in owners if full in sources}
    made: dict[int, torch.nn.Parameter] = {}
    for sub, name, param, _ in owners:
        if id(param) in source_of_param:
            if id(param) not in made:
                made[id(param)] = torch.nn.Parameter(fake(mode, source_of_param[id(param)]), requires_grad=False)
            sub._parameters[name] = made[id(param)]


def has_lazy_weights(module: torch.nn.Module) -> bool:
    return any(is_lazy(t) for t in module.state_dict(keep_vars=True).values())


def materialize_module(module: torch.nn.Module) -> int:
    """Replace every lazy parameter and buffer of ``module`` by its data (a weight tied under
    two names stays one tensor), so it runs eagerly; returns how many tensors were read."""
    loaded: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for name, t in list(table.items()):
                if t is None or not is_lazy(t):
                    continue
                if id(t) not in loaded:
                    data = materialize(t)
                    loaded[id(t)] = torch.nn.Parameter(data, requires_grad=False) if table is sub._parameters else data
                table[name] = loaded[id(t)]
    return len(loaded)


def load_constants(gm: torch.fx.GraphModule) -> int:
    """Replace every lazy constant of ``gm`` by its data, in place, so the graph runs eagerly
    (the eager target, numeric checks); returns how many were read."""
    count = 0
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        owner, _, attr = node.target.rpartition(".")
        holder = gm.get_submodule(owner) if owner else gm
        tensor = getattr(holder, attr, None)
        if is_lazy(tensor):
            holder._buffers[attr] = materialize(tensor)
            count += 1
    return count

