"""A Hugging Face checkpoint directory (``config.json`` + ``*.safetensors``) as a transformers
model whose weights stay in their files until a runtime asks.

``lazy_checkpoint(auto, config, files, dtype)`` builds the model from its config with fake
parameters (``accelerate.init_empty_weights``: no memory), reads each file's header (the
8-byte length and the JSON table of names, dtypes, shapes and byte ranges: a few kB), and links
every parameter to its tensor in the file (``graphopt.lazy_weights``). A runtime that writes
its weights (the ONNX exporter's external data) reads them one at a time: ``load()`` maps the
tensor's bytes, converts them to the model's dtype (fp16/bf16 -> fp32 for a float32 model; the
same dtype is a plain copy of the file's bytes), and lets go of the mapped pages, so peak memory
follows the largest tensor, not the model. ``load_rows(start, stop)`` reads a block of rows
alone: --int4's round-to-nearest quantizes a weight as it is written a block at a time, so
not even the largest tensor (an LM head) is read whole for it.

The mapping from checkpoint names to parameters is ``hf._load_safetensors``'s (a task-head
checkpoint's ``bert.`` prefix dropped for a base model); a checkpoint that does not cover every
parameter (a pooler it lacks, a tensor missing) is not built here: ``lazy_checkpoint`` says
why, and the caller loads it the in-memory way, whose errors and warnings say what is wrong.

``graphopt export``'s check against eager and --int4's calibration (GPTQ, a byte budget) run the
optimized graph node by node, reading each weight when a node uses it (graphopt/lazy_graph.py);
GPTQ keeps the codes it computes (a fifth of float32), not the weights. The file's own session,
in ONNX Runtime, holds the file's weights as it must. ONNX Runtime's CPU provider has no bf16
kernels, so a bf16 checkpoint runs there as float32 (converted per tensor as it is written;
fp16 is kept when the model is loaded in float16).
"""

from __future__ import annotations

import mmap
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from graphopt import lazy_weights
from graphopt.sources.safetensors_file import SafetensorsFormatError, read_header

# safetensors' dtype names -> torch dtypes (the ones a model's weights come in)
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}

__all__ = ["SafetensorsFormatError", "SafetensorsFile", "SafetensorsTensor", "lazy_checkpoint"]


class SafetensorsFile:
    """One ``.safetensors`` file read in place: its header parsed, its data mapped read-only."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.tensors = read_header(self.path)
        self._map = None
        if any(e.stop > e.start for e in self.tensors.values()):
            with open(self.path, "rb") as handle:
                self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)

    def read(self, name: str, dtype: torch.dtype, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor in ``dtype`` (with ``rows``, only rows ``start:stop`` of its first axis): a
        tensor of its own (the file's bytes copied, or converted from them), the mapped pages
        released afterwards."""
        entry = self.tensors[name]
        stored = DTYPES.get(entry.dtype)
        if stored is None:
            raise SafetensorsFormatError(f"{self.path}: {name} is stored as {entry.dtype}, which graphopt does not read")
        shape, start, stop = entry.shape, entry.start, entry.stop
        if rows is not None:  # rows of a row-major tensor are one contiguous byte range
            row_bytes = (stop - start) // entry.shape[0] if entry.shape and entry.shape[0] else 0
            shape = (rows[1] - rows[0], *entry.shape[1:])
            start, stop = start + rows[0] * row_bytes, start + rows[1] * row_bytes
        count = stop - start
        if count == 0 or self._map is None:
            return torch.empty(shape, dtype=dtype)
        with warnings.catch_warnings():  # the map is read-only and is only read from
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(self._map, dtype=torch.uint8, count=count, offset=start)
        mapped = raw.view(stored).reshape(shape)
        out = mapped.to(dtype, copy=True)
        del raw, mapped
        self.release(start, stop)
        return out

    def release(self, start: int, stop: int) -> None:
        """Let go of the mapped pages of bytes ``start:stop`` in this process (they stay in the
        page cache): read pages of a mapped file count as the process's memory."""
        start = start // mmap.PAGESIZE * mmap.PAGESIZE
        if self._map is not None and stop > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, stop - start)


class SafetensorsTensor:
    """One parameter's tensor in a file, a ``lazy_weights`` source."""

    def __init__(self, file: SafetensorsFile, key: str, shape: tuple[int, ...], dtype: torch.dtype,
                 identity: str) -> None:
        self.file, self.key, self.shape, self.dtype, self.identity = file, key, tuple(shape), dtype, identity

    @property
    def stored_dtype(self) -> torch.dtype | None:
        return DTYPES.get(self.file.tensors[self.key].dtype)

    def load(self) -> torch.Tensor:
        return self.file.read(self.key, self.dtype).reshape(self.shape)

    def load_rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` alone (a quantizer reads a large weight a block at a time)."""
        return self.file.read(self.key, self.dtype, (start, stop)).reshape(stop - start, *self.shape[1:])

    def fingerprint(self) -> str:
        """What the tensor's bytes depend on, for cache keys (``lazy_weights.fingerprint``)."""
        return f"safetensors:{self.identity}:{self.key}:{self.dtype}"


@dataclass
class LazyCheckpoint:
    model: Any  # the transformers model, every parameter lazy
    files: list[SafetensorsFile]
    sources: dict[str, SafetensorsTensor]  # parameter name -> its tensor in the files
    notes: list[str]


def read_files(files: list[Path]) -> list[SafetensorsFile]:
    return [SafetensorsFile(f) for f in files]


def plan(model: Any, files: list[SafetensorsFile], identities: dict[Path, str]) -> tuple[dict[str, SafetensorsTensor],
                                                                                          list[str], list[str]]:
    """({parameter name: source}, parameters no tensor covers, checkpoint keys with no parameter);
    raises ValueError for a tensor whose shape is not its parameter's."""
    params = dict(model.named_parameters(remove_duplicate=False))
    prefix = getattr(model, "base_model_prefix", "")
    sources: dict[str, SafetensorsTensor] = {}
    unexpected: list[str] = []
    for file in files:
        for key, entry in file.tensors.items():
            target = key
            if key not in params and prefix and key.startswith(prefix + "."):
                target = key[len(prefix) + 1:]  # a task-head checkpoint (bert.embeddings...) for a base model
            if target not in params:
                unexpected.append(key)
                continue
            shape = tuple(params[target].shape)
            if entry.shape != shape:
                raise ValueError(f"{file.path.name}: {key} has shape {entry.shape}, the config says {shape}; "
                                 "the weights do not belong to this config.json")
            sources[target] = SafetensorsTensor(file, key, shape, params[target].dtype, identities[file.path])
    covered = {id(params[name]) for name in sources}
    missing = [name for name, p in params.items() if id(p) not in covered]
    return sources, missing, unexpected


def lazy_checkpoint(auto: Any, config: Any, paths: list[Path], dtype: torch.dtype) -> LazyCheckpoint | str:
    """The model ``auto.from_config(config)`` with every parameter read lazily from ``paths``,
    or a one-line reason it cannot be (the caller then loads it in memory)."""
    from accelerate import init_empty_weights

    from graphopt.sources.gguf_file import file_identity

    files = read_files(paths)
    with init_empty_weights(include_buffers=False):  # buffers (rotary tables) are computed, not read
        model = auto.from_config(config, dtype=dtype)
    model.eval()
    if getattr(config, "tie_word_embeddings", False) and hasattr(model, "tie_weights"):
        model.tie_weights()  # the LM head reads the table: one parameter, one source
    sources, missing, unexpected = plan(model, files, {f.path: file_identity(f.path) for f in files})
    if missing:
        return f"the checkpoint has no tensor for {len(missing)} parameters (first: {missing[0]})"
    meta_buffers = [n for n, b in model.named_buffers() if b.device.type == "meta"]
    if meta_buffers:
        return f"buffer {meta_buffers[0]} is not computed by the config"
    lazy_weights.replace_parameters(model, sources)
    notes = []
    if unexpected:
        notes.append(f"ignored {len(unexpected)} checkpoint tensors the model has no place for "
                     f"(first: {unexpected[0]})")
    return LazyCheckpoint(model, files, sources, notes)
