"""What a model file is before anything is built from it, without importing torch.

``load_checkpoint`` turns a spec into a ``Checkpoint`` (a ``.gguf`` run on its own weights, or a
Hugging Face directory of ``config.json`` and ``*.safetensors``: its identity for the decoder
cache, a ``build()`` for targets that need the module, whose weights stay in the files until a
runtime writes them, and a memory check). A warm ``graphopt generate model.gguf`` (or ``DIR``)
goes from here to a kept decoder with no torch in the process.
"""

from __future__ import annotations

from pathlib import Path

from graphopt.errors import ModelLoadError
from graphopt.generation.checkpoint import Checkpoint
from graphopt.sources.gguf_file import file_identity
from graphopt.sources.gguf_needs import check_memory, gguf_packages
from graphopt.sources.safetensors_file import SafetensorsFormatError, checkpoint_files, float32_bytes, folder_identity


def load_checkpoint(spec: str, dtype: str = "float32") -> Checkpoint | None:
    """``spec`` as a ``Checkpoint`` (a file graphopt can key and build lazily: a ``.gguf`` run on
    its own weights), or None when it is another kind of model (load it with load_model)."""
    path = Path(spec).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return gguf_checkpoint(path, dtype)
    if path.is_dir() and (path / "config.json").is_file() and checkpoint_files(path):
        return safetensors_checkpoint(path, dtype)
    return None


def safetensors_checkpoint(path: Path, dtype: str = "float32") -> Checkpoint:
    """The directory as a ``Checkpoint``: ``build()`` makes the causal LM with its weights left
    in the files (``safetensors_lazy``), converted to ``dtype`` one tensor at a time as they are
    written (--int4's calibration too reads each when a node of the graph needs it)."""
    files = checkpoint_files(path)
    try:
        identity = f"safetensors;{folder_identity(path, files)};torch.{dtype}"
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc.strerror}") from None

    def check_memory() -> None:
        from graphopt.memory import RUNTIME_BYTES, check_fits

        try:
            needed = float32_bytes(files) if dtype == "float32" else sum(f.stat().st_size for f in files)
        except SafetensorsFormatError as exc:
            raise ModelLoadError(f"{exc}; re-save the checkpoint") from None
        check_fits(needed + RUNTIME_BYTES, f"{path.name} in {dtype}")

    return Checkpoint(identity, lambda: _build_folder(path, dtype), str(path), check_memory=check_memory)


def _build_folder(path: Path, dtype: str):
    import torch

    from graphopt.sources.hf import hf_model, read_config

    loaded = hf_model(str(path), read_config(path / "config.json"), checkpoint_files(path), 0, 1, 1, False,
                      getattr(torch, dtype), stream=True)
    from graphopt.sources.model_kind import is_causal_lm, model_kind

    if not is_causal_lm(loaded.module):
        raise ModelLoadError(f"{path} holds a {model_kind(loaded.module)} model; generating text needs a causal LM")
    return loaded.module


def gguf_checkpoint(path: Path, dtype: str = "float32") -> Checkpoint:
    """The file as a ``Checkpoint`` (graphopt.generate decodes it without building the model when
    a runner kept from an earlier run serves it); ``build()`` makes the lazy model in ``dtype``
    (a torch dtype's name)."""
    gguf_packages()
    try:
        identity = f"gguf;{file_identity(path)};torch.{dtype}"
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc.strerror}") from None
    from graphopt.sources.gguf_prepack import FilePrepack

    return Checkpoint(identity, lambda: _build(path, dtype), str(path), check_memory=lambda: check_memory(path, "file"),
                      prepack=FilePrepack(path))


def _build(path: Path, dtype: str):
    import torch

    from graphopt.sources.gguf import from_gguf

    return from_gguf(path, 0, 1, 1, False, getattr(torch, dtype)).module
