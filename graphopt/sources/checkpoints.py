"""What a model file is before anything is built from it, without importing torch.

``load_checkpoint`` turns a spec into a ``Checkpoint`` (a ``.gguf`` run on its own weights:
its identity for the decoder cache, a ``build()`` for targets that need the module, and the
memory check of ``gguf_needs``). A warm ``graphopt generate model.gguf`` goes from here to a
kept decoder with no torch in the process.
"""

from __future__ import annotations

from pathlib import Path

from graphopt.errors import ModelLoadError
from graphopt.generation.checkpoint import Checkpoint
from graphopt.sources.gguf_file import file_identity
from graphopt.sources.gguf_needs import check_memory, gguf_packages


def load_checkpoint(spec: str, dtype: str = "float32") -> Checkpoint | None:
    """``spec`` as a ``Checkpoint`` (a file graphopt can key and build lazily: a ``.gguf`` run on
    its own weights), or None when it is another kind of model (load it with load_model)."""
    path = Path(spec).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return gguf_checkpoint(path, dtype)
    return None


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
