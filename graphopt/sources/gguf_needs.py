"""What reading a ``.gguf`` needs, checked before anything is read: its Python packages, and
memory for the weights as the runtime will hold them. No torch: ``checkpoints`` and ``gguf``
both ask here, before a model is built.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from graphopt.errors import ModelLoadError
from graphopt.sources.gguf_file import GGUFFormatError


def gguf_packages() -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ModelLoadError(f"reading a .gguf file needs the packages {' and '.join(missing)}: "
                             f"pip install {' '.join(missing)}")


def needed_bytes(path: Path, weights: str) -> tuple[int, list[tuple[str, int]]]:
    """(bytes a decoding process needs for the file read as ``weights``, alternatives that
    need less): the weights as the runtime holds them (blocks re-laid out, widened where
    MatMulNBits has no kernel of their width; float32 where dequantized, twice over for
    transformers' float model and the runtime's copy of it) and the runtime's own share."""
    from graphopt.memory import RUNTIME_BYTES
    from graphopt.sources.gguf_file import open_gguf
    from graphopt.sources.gguf_lazy import FORMATS

    try:
        file = open_gguf(path)
    except GGUFFormatError as exc:
        raise ModelLoadError(f"{exc}; check the file (a download cut short?)") from None
    own = dense = 0
    for info in file.tensors.values():
        elements = 1
        for d in info.shape:
            elements *= d
        fmt = FORMATS.get(info.type)
        own += int(elements * fmt.bytes_per_weight()) if fmt is not None else elements * 4
        dense += elements * 4
    own, dense = own + RUNTIME_BYTES, 2 * dense + RUNTIME_BYTES
    if weights == "file":
        return own, []
    return dense, [("on the file's own quantized weights (without --dequantize)", own)]


def check_memory(path: Path, weights: str) -> None:
    """MemoryNeeded, in one line, when the file read as ``weights`` would not fit."""
    from graphopt.memory import check_fits

    needed, alternatives = needed_bytes(path, weights)
    how = "its own quantized weights" if weights == "file" else "its weights dequantized to float32"
    check_fits(needed, f"{path.name} on {how}", alternatives)
