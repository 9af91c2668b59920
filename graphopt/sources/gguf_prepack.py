"""A .gguf file's quantized tensors re-laid out ahead of need, on a core the export leaves idle.

Why: the first ``graphopt generate model.gguf`` exports the decoder in a child process whose
work is one long chain (imports, torch.export, passes, the ONNX lowering) on one core; at its
end it writes the weights, re-laying each quantized tensor out (``gguf_blocks.relayout``):
2.7 s of CPU for Qwen2.5-0.5B, on the same core, the GIL keeping its writer threads mostly
serial. The re-layout depends on nothing but the file, so ``prepack`` does it beforehand in
a process of its own while the export traces, and writes each field of each tensor to
``folder`` as ``<tensor>.<field>.npy``; the export then reads them (``prepacked``) instead of
decoding blocks. Where a field is not there yet, the export decodes it itself, as before.

Fields are written in the file's row order, the processor's row permutation (llama's q/k
heads) left to the reader, and each file appears whole or not at all (written, then renamed).
The values are those ``relayout`` gives (the same function makes them), so the exported
weights are byte for byte what they would be without the prepack.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

FIELDS = ("codes", "scales", "zeros", "offsets")

# GGUFFile.identity_key -> the folder its prepacked fields are in, for this process.
_FOLDERS: dict[str, Path] = {}


def prepack(path: str, folder: str) -> int:
    """Write the re-laid-out fields of every 2-D tensor of a supported type in ``path`` to
    ``folder``, tensor after tensor in the file's order (the export's order too); the count."""
    from graphopt.sources import gguf_blocks
    from graphopt.sources.gguf_file import open_gguf

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    file = open_gguf(path)
    done = 0
    for name, info in file.tensors.items():
        if len(info.shape) != 2 or not gguf_blocks.supported(info.type):
            continue
        blocks = gguf_blocks.relayout(file.data(name), info.type, info.shape[-1])
        for field in FIELDS:
            value = getattr(blocks, field)
            if value is not None:
                _write(out / f"{_safe(name)}.{field}.npy", value)
        file.release(name)
        done += 1
    return done


def use(identity_key: str, folder: Path) -> None:
    """Read the prepacked fields of the file known by ``identity_key`` from ``folder``."""
    _FOLDERS[identity_key] = Path(folder)


def prepacked(identity_key: str, tensor: str, field: str, rows=None) -> np.ndarray | None:
    """The field as ``prepack`` wrote it (in the file's row order), or None; with ``rows`` (a
    slice or an index array) only those rows are read: a head written in row blocks reads
    each block's rows, not the whole table once per block."""
    folder = _FOLDERS.get(identity_key)
    if folder is None:
        return None
    try:
        kept = np.load(folder / f"{_safe(tensor)}.{field}.npy", mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError):  # not written yet, or gone: the caller decodes it
        return None
    return np.array(kept if rows is None else kept[rows])  # a copy: the mapping goes with ``kept``


def _write(path: Path, value: np.ndarray) -> None:
    staging = path.with_name(path.name + f".{os.getpid()}.part")
    with open(staging, "wb") as handle:
        np.save(handle, value, allow_pickle=False)
    staging.rename(path)  # a reader finds the whole field or nothing


def _safe(name: str) -> str:
    return name.replace("/", "_")


class FilePrepack:
    """A ``Checkpoint``'s prepack (``Checkpoint.prepack``): ``run(folder)`` in a process of its
    own writes the fields, ``use(folder)`` in the export reads them from there."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)

    def run(self, folder: str) -> int:
        return prepack(self.path, folder)

    def use(self, folder: str | Path) -> None:
        from graphopt.sources.gguf_file import open_gguf

        use(open_gguf(self.path).identity_key, Path(folder))  # the parsed file the model reads, its key hashed once
