"""What a model file is before anything is built from it, without importing torch.

``load_checkpoint`` turns a spec into a ``Checkpoint`` (a ``.gguf`` run on its own weights:
its identity for the decoder cache, a ``build()`` for targets that need the module, a memory
check); ``needed_bytes`` / ``check_memory`` say up front whether decoding it fits. A warm
``graphopt generate model.gguf`` goes from here to a kept decoder with no torch in the process.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from graphopt.errors import ModelLoadError
from graphopt.generation.checkpoint import Checkpoint
from graphopt.sources.gguf_file import GGUFFormatError, file_identity


def load_checkpoint(spec: str, dtype: str = "float32") -> Checkpoint | None:
    """``spec`` as a ``Checkpoint`` (a file graphopt can key and build lazily: a ``.gguf`` run on
    its own weights), or None when it is another kind of model (load it with load_model)."""
    path = Path(spec).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return gguf_checkpoint(path, dtype)
    return None


def gguf_packages() -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ModelLoadError(f"reading a .gguf file needs the packages {' and '.join(missing)}: "
                             f"pip install {' '.join(missing)}")


def gguf_checkpoint(path: Path, dtype: str = "float32") -> Checkpoint:
    """The file as a ``Checkpoint`` (graphopt.generate decodes it without building the model when
    a runner kept from an earlier run serves it); ``build()`` makes the lazy model in ``dtype``
    (a torch dtype's name)."""
    gguf_packages()
    try:
        identity = f"gguf;{file_identity(path)};torch.{dtype}"
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc.strerror}") from None
    return Checkpoint(identity, lambda: _build(path, dtype), str(path), check_memory=lambda: check_memory(path, "file"))


def _build(path: Path, dtype: str):
    import torch

    from graphopt.sources.gguf import from_gguf

    return from_gguf(path, 0, 1, 1, False, getattr(torch, dtype)).module


def needed_bytes(path: Path, weights: str) -> tuple[int, list[tuple[str, int]]]:
    """(bytes a decoding process needs for the file read as ``weights``, alternatives that
    need less): the weights as the runtime holds them (blocks re-laid out, widened where
    MatMulNBits has no kernel of their width; float32 where dequantized, twice over for
    transformers' float model and the runtime's copy of it) and the runtime's own share."""
    from graphopt.memory import RUNTIME_BYTES
    from graphopt.sources.gguf_file import GGUFFile
    from graphopt.sources.gguf_lazy import FORMATS

    try:
        file = GGUFFile(path)
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
