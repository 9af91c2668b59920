"""A kept decoder's weights as ONNX Runtime packs them, saved once beside it and mapped by every
later session instead of packed again.

Why: opening a session on the CPU packs each ``MatMulNBits`` weight into a fresh ``malloc``'d
buffer: for Qwen2.5-Coder-0.5B's GGUF decoder 650 MB of anonymous memory, filled page by page at
every start. ONNX Runtime can write the packed weights into the external data file of the
optimized model it saves (``session.save_external_prepacked_constant_initializers``), and a
session on that file reads them in place from the mapped file. Measured on that decoder
(benchmarks/RESULTS.md, "GGUF warm runs map the packed weights"): opening takes 1.1 s instead of
1.2 (2.0 on huge pages), the session holds 40 MB of anonymous memory instead of 650 (the rest is
the file's page cache, shared by every process on it), and a decode step takes 45-46 ms instead
of 52 on 4 KB pages: the page cache holds the file in large folios, so the weights are read
through few TLB entries, as llama.cpp's mapped GGUF is.

The saved model is specific to the machine that packed it (the packing follows the CPU's
instruction set, and the optimized graph may hold layout-specific nodes), so its name carries a
tag of the ONNX Runtime version and the CPU (``machine_tag``): another machine or version finds
no copy and packs again. Saving costs the first session 1-2 s and 120 MB more at its peak, and
the entry's disk doubles; it happens where the caller asks for it (a kept decoder's first
session), and any failure to save or to open the copy falls back to the plain model with a note.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

PREFIX = "model.prepacked-"
_SAVE_OPTIONS = {
    "session.save_external_prepacked_constant_initializers": "1",
    "session.optimized_model_external_initializers_min_size_in_bytes": "1024",
}


@functools.lru_cache(maxsize=1)
def machine_tag() -> str:
    """A short hash of what the packed bytes depend on: ONNX Runtime's version, the CPU's model
    and instruction-set flags, the architecture."""
    import onnxruntime

    cpu = ""
    try:
        with open("/proc/cpuinfo") as info:
            lines = [line for line in info if line.startswith(("model name", "flags", "Features"))]
        cpu = "".join(dict.fromkeys(lines))  # every core says the same: once each
    except OSError:
        cpu = platform.processor()
    text = f"{onnxruntime.__version__};{platform.machine()};{cpu}"
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def copy_path(model: str | os.PathLike) -> Path:
    """Where the packed copy of the decoder at ``model`` lives for this machine."""
    model = Path(model)
    return model.with_name(f"{PREFIX}{machine_tag()}.onnx")


def open_packed(model: str | os.PathLike, open_session: Callable[..., Any]) -> tuple[Any, str]:
    """A session on the packed copy of ``model`` (an .onnx path), saving the copy first when
    there is none: (session, a note saying which it did, or why it packed in memory instead).
    ``open_session(path, options)`` opens a session with the caller's settings on top of
    ``options`` (a SessionOptions or None)."""
    copy = copy_path(model)
    if copy.is_file():
        try:
            return open_session(copy, None), f"mapped the weights ONNX Runtime packed from {copy.name}"
        except Exception as error:  # a damaged copy: drop it and pack again below
            _remove(copy)
            damaged = f"the packed copy {copy.name} could not be opened ({type(error).__name__}); "
    else:
        damaged = ""
    staging = None
    try:
        try:
            staging = Path(tempfile.mkdtemp(prefix=".packing-", dir=copy.parent))
            session = open_session(model, _saving_options(staging / copy.name))
        except Exception as error:  # a read-only cache, or a save ORT refused: pack in memory as before
            return open_session(model, None), _could_not_keep(model, error)
        try:  # the data first: the model file's presence is what says a copy is whole
            os.replace(staging / (copy.name + ".data"), copy.with_name(copy.name + ".data"))
            os.replace(staging / copy.name, copy)
        except OSError as error:
            return session, _could_not_keep(model, error)
        return session, f"{damaged}saved the weights ONNX Runtime packed in {copy.name}: later runs map them"
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)


def _saving_options(path: Path):
    """SessionOptions under which opening a session also writes its optimized model to ``path``,
    with the packed weights in ``path``'s external data file."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.optimized_model_filepath = str(path)
    for key, value in {**_SAVE_OPTIONS,
                       "session.optimized_model_external_initializers_file_name": path.name + ".data"}.items():
        options.add_session_config_entry(key, value)
    return options


def _could_not_keep(model, error: Exception) -> str:
    text = str(error).strip()
    reason = text.splitlines()[0][:200] if text else type(error).__name__
    return f"could not keep the packed weights beside {Path(model).name}: {reason}"


def _remove(copy: Path) -> None:
    for path in (copy, copy.with_name(copy.name + ".data")):
        path.unlink(missing_ok=True)
