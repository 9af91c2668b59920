"""Exported in-place decoders kept on disk, so that the next process skips the export.

``graphopt generate model.gguf -p ...`` spends most of its time before the first token: for
SmolLM2-135M here (2026-12-05), torch.export 22 s, the ONNX export 5 s, writing this entry
3.6 s and the passes 2 s, against 0.5 s of decoding. Run again on the same model and options,
it loads the decoder this module kept instead: compile 1.6 s (the key's hashing and the
ONNX Runtime session). An entry keeps its weights in ``model.onnx.data`` beside the graph.

An entry is found only by a key that changes with anything that could change the exported
model: every weight's bytes (hashed, about 1 s per GB), the model's class and config, the
graphopt options, graphopt's own source files and the versions of torch, transformers, onnx,
onnxscript, onnx-ir and onnxruntime. A stale entry is therefore never found, only left
behind; the least recently used entries go once the folder holds more than ``KEEP_BYTES``.

Where: ``decoders/`` under graphopt's cache root (graphopt/cache_root.py: default
``~/.cache/graphopt``; ``GRAPHOPT_CACHE_DIR=off`` turns it off). An entry that cannot be read is exported
again and replaced; a cache that cannot be written is skipped with a note, never an error.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
from pathlib import Path

from typing import TYPE_CHECKING

from graphopt.cache_root import cache_root, evict_lru, package_version, tensor_bytes, write_entry

if TYPE_CHECKING:
    from torch import nn

KEEP_BYTES = 4 << 30
FORMAT = 1  # bump when an entry's layout changes
_PACKAGES = ("torch", "transformers", "onnx", "onnxscript", "onnx-ir", "onnxruntime")


def cache_dir() -> Path | None:
    """The decoders folder, or None when ``GRAPHOPT_CACHE_DIR=off`` (graphopt/cache_root.py)."""
    root = cache_root()
    return root / "decoders" if root is not None else None


@functools.lru_cache(maxsize=1)
def _code_fingerprint() -> str:
    """graphopt's source files and the versions of the packages the export goes through. The
    packages' folders are found without importing them: a warm run that only opens a kept
    decoder imports no pass and no model."""
    import importlib.util

    h = hashlib.blake2b(digest_size=16)
    for name in _PACKAGES:
        h.update(f"{name}={package_version(name)};".encode())
    roots = [Path(next(iter(importlib.util.find_spec(name).submodule_search_locations)))
             for name in ("graphopt", "graphopt.passes", "graphopt.backends", "graphopt.models")]
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def decoder_key(model: nn.Module, options: dict) -> str:
    """The cache key of ``model``'s decoder under ``options`` (a parsed Options' ``to_dict()``)."""
    import torch

    from graphopt import lazy_weights

    h = hashlib.blake2b(digest_size=20)
    h.update(f"format={FORMAT};code={_code_fingerprint()};".encode())
    h.update(f"{type(model).__module__}.{type(model).__qualname__};".encode())
    config = getattr(model, "config", None)
    if hasattr(config, "to_dict"):  # where it was loaded from and how it was stored do not shape the model
        config = {k: v for k, v in config.to_dict().items()
                  if not k.startswith("_") and k not in ("quantization_config", "transformers_version")}
    h.update(repr(config).encode())
    h.update(repr(sorted(options.items())).encode())
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
            # A lazy weight (a checkpoint read when written out) by its file's identity and
            # place: hashing it would read the whole checkpoint on every run.
            print_ = lazy_weights.fingerprint(t)
            h.update(print_.encode() if print_ is not None else tensor_bytes(t.detach()))
    return h.hexdigest()


def checkpoint_key(identity: str, options: dict) -> str:
    """The cache key of the decoder built from a checkpoint file known by ``identity`` (its
    path, size, modification time and content samples: ``Checkpoint.identity``), without
    building the model: the file fixes the model's class, config and weights, graphopt's code
    and the packages how they are exported."""
    h = hashlib.blake2b(digest_size=20)
    h.update(f"format={FORMAT};code={_code_fingerprint()};checkpoint={identity};".encode())
    h.update(repr(sorted(options.items())).encode())
    return h.hexdigest()


def lookup(key: str) -> Path | None:
    """The entry's model file, touched as used, or None."""
    folder = cache_dir()
    path = folder / key / "model.onnx" if folder is not None else None
    if path is None or not path.is_file():
        return None
    os.utime(path.parent)  # least recently used goes first
    return path


def store(key: str, onnx_model) -> tuple[Path | None, str]:
    """Write ``onnx_model`` (an OnnxModel) as the entry for ``key``; (its path, or None, and a note)."""
    folder = cache_dir()
    if folder is None:
        return None, "the decoder cache is off (GRAPHOPT_CACHE_DIR=off)"
    final = folder / key
    problem = write_entry(final, lambda staging: onnx_model.save(staging / "model.onnx", external_data=True))
    if problem:
        return None, f"could not keep the exported decoder in {folder}: {problem}"
    evict_lru(folder, final, KEEP_BYTES)
    return final / "model.onnx", f"kept the exported decoder in {final}"


def drop(key: str) -> None:
    """Remove an entry that could not be loaded."""
    folder = cache_dir()
    if folder is not None:
        shutil.rmtree(folder / key, ignore_errors=True)
