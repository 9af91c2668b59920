"""What ``graphopt export`` writes and returns: the stage timer, the destination checks, the
atomic save, and the description of each written file."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager

from graphopt.errors import GraphoptError

StageFn = Callable[[str], ContextManager[Any]]


@dataclass
class ExportedFile:
    """One written model: where, how big, what it is made of, how it compares with eager."""

    role: str  # "model", or "prefill" / "decode" with --kv-cache
    path: str
    files: list[str]
    size_bytes: int
    op_histogram: dict[str, int]
    fused_ops: dict[str, int]
    graphopt_ops: dict[str, int]
    inputs: list[str]
    outputs: list[str]
    validation: list[dict] = field(default_factory=list)  # one {shape, max_abs_err, rel_err, top1} per input set
    int4: dict | None = None  # OnnxModel.int4_weights(): MatMulNBits count and weight bytes
    export_route: str = "traced"  # OnnxModel.route: "direct", or "traced: <why>"
    notes: list[str] = field(default_factory=list)  # how it was made (layers traced once, ...)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class ExportResult:
    files: list[ExportedFile]
    stages_s: dict[str, float]
    passes: list[dict]
    fallbacks: list[dict]
    extra: dict = field(default_factory=dict)  # e.g. the greedy-generation check of --kv-cache

    def to_dict(self) -> dict:
        return {"files": [f.to_dict() for f in self.files], "stages_s": self.stages_s, "passes": self.passes,
                "fallbacks": self.fallbacks, **self.extra}


class Timer:
    """Times named stages and runs each inside the caller's ``stage`` context."""

    def __init__(self, stage: StageFn | None) -> None:
        self.stage = stage or (lambda name: contextlib.nullcontext())
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        with self.stage(name):
            yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


def check_destination(path: str | os.PathLike, force: bool) -> Path:
    """Refuse to overwrite without ``force``; the folder must exist (checked before any work)."""
    path = Path(path)
    if path.exists() and not force:
        raise GraphoptError(f"{path} exists; pass --force to overwrite it")
    if not path.parent.is_dir():
        raise GraphoptError(f"folder {path.parent} does not exist; create it first")
    return path


def save_atomically(model: Any, path: Path, external_data: bool | None = None) -> list[str]:
    """Write ``model`` (an exported model: ``save(path, external_data)``) into a temporary folder
    beside ``path``, then move into place (weights first, the model file last): an interrupted
    export leaves no half-written model. ``external_data``: the weights in a ``.data`` file
    beside it (None: where the model needs it, over 2 GB)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        written = [Path(f) for f in model.save(tmp / path.name, external_data)]
        final = []
        for f in sorted(written, key=lambda p: p.name == path.name):  # the .onnx file last
            os.replace(f, path.parent / f.name)
            final.append(str(path.parent / f.name))
        stale = path.parent / (path.name + ".data")
        if str(stale) not in final and stale.exists():
            stale.unlink()  # weights of an earlier export with external data under this name
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def describe(role: str, model: Any, files: list[str], graphopt_ops: dict[str, int]) -> ExportedFile:
    """The report entry of one written model (an exported model: its op histogram, fused ops,
    INT4 weights, input and output names, the route its export took)."""
    return ExportedFile(role=role, path=files[-1], files=files, size_bytes=sum(os.path.getsize(f) for f in files),
                        op_histogram=model.op_histogram(), fused_ops=model.fused_op_counts(),
                        graphopt_ops={k: v for k, v in graphopt_ops.items() if k.startswith("graphopt.")},
                        inputs=model.input_names, outputs=model.output_names, int4=model.int4_weights(),
                        export_route=model.route)
