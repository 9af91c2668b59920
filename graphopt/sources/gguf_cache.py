"""A ``.gguf`` file converted once: its dequantized model and its tokenizer, kept as a
Hugging Face checkpoint folder that loads in a second instead of 20.

transformers reads a ``.gguf`` slowly: for SmolLM2-135M here, 15-23 s for the model (its
reader parses the file's 49k-token vocabulary twice and rebuilds a tensor-name map per
tensor) and 5 s for the tokenizer. ``graphopt generate`` and ``graphopt run`` on the same file
load the folder this module wrote instead (0.3 s for the tokenizer).

The key is the file's real path, size and modification time, the dtype asked for, and the
versions of transformers and gguf: a changed file or library is converted again, never
served stale. Each part (``model``, ``tokenizer``) is written to a staging folder and renamed
into place, so a reader never sees half of one. The folder is ``$GRAPHOPT_CACHE_DIR/gguf``
(default ``~/.cache/graphopt/gguf``); ``GRAPHOPT_CACHE_DIR=off`` turns it off. It keeps at
most ``KEEP_BYTES``, least recently used first. A part that cannot be written or read is
skipped: the .gguf is then read as before.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable

from graphopt.cache_root import cache_root, evict_lru, package_version, write_entry

log = logging.getLogger("graphopt")

FORMAT = 1
KEEP_BYTES = 8 << 30  # converted files, least recently used first (a 135M model in fp32 is 0.5 GB)


def part_dir(path: Path, part: str, dtype: Any = None) -> Path | None:
    """Where ``part`` ("model" or "tokenizer") of the .gguf at ``path`` is kept; None when off."""
    root = cache_root()
    if root is None:
        return None
    stat = path.resolve().stat()
    key = hashlib.blake2b(digest_size=16)
    key.update(f"{FORMAT};{path.resolve()};{stat.st_size};{stat.st_mtime_ns};{dtype};"
               f"transformers={package_version('transformers')};gguf={package_version('gguf')}".encode())
    return root / "gguf" / key.hexdigest() / part


def save_dequantized(model: Any, folder: str) -> None:
    """A model transformers dequantized from a .gguf, as a plain checkpoint: its config without
    the gguf quantization entry (``save_pretrained`` refuses such a model) and its weights as
    safetensors (tied weights once; loading ties them again)."""
    from safetensors.torch import save_model

    config = model.config.to_dict()
    config.pop("quantization_config", None)
    type(model.config).from_dict(config).save_pretrained(folder)
    save_model(model, str(Path(folder) / "model.safetensors"), metadata={"format": "pt"})


def load_or_convert(path: Path, part: str, dtype: Any, read_gguf: Callable[[], Any],
                    read_folder: Callable[[str], Any], save: Callable[[Any, str], None] | None = None) -> Any:
    """``part`` from its kept folder (``read_folder``), else from the .gguf (``read_gguf``),
    saved for next time (``save``, default ``save_pretrained``)."""
    folder = part_dir(path, part, dtype)
    if folder is not None and folder.is_dir():
        try:
            loaded = read_folder(str(folder))
            os.utime(folder.parent)  # used: evicted last
            return loaded
        except Exception:  # a damaged or foreign folder: read the .gguf and write it again
            shutil.rmtree(folder, ignore_errors=True)
    loaded = read_gguf()
    if folder is not None:
        _save(loaded, folder, save or (lambda obj, where: obj.save_pretrained(where)))
    return loaded


def _save(obj: Any, folder: Path, save: Callable[[Any, str], None]) -> None:
    problem = write_entry(folder, lambda staging: save(obj, str(staging)))
    if problem:  # the next run reads the .gguf again
        log.info("graphopt: could not keep the converted .gguf in %s (%s)", folder, problem)
        return
    os.utime(folder.parent)
    evict_lru(folder.parent.parent, folder.parent, KEEP_BYTES)
