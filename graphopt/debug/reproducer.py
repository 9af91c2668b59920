"""Failure reproducers: a failing pass's input graph, inputs and pipeline in a directory,
and the one command that reruns the failure.

A directory holds:

- ``graph.py``: the input graph of the failing pass as Python source (see graph_source);
- ``constants.safetensors``: the graph's weights (its get_attr tensors);
- ``inputs.safetensors``: the example inputs, seeded random ones when the graph had none;
- ``manifest.json``: pipeline, failing pass, its options, the error, versions, commands;
- ``replay.py``: ``python DIR/replay.py`` reruns it, as ``graphopt debug --replay DIR`` does.

Nothing is pickled: loading a reproducer someone sent you runs only graph.py, which you
can read first. Replaying runs the failing pass alone on the stored graph (the earlier
passes already ran on it) with ``--print-ir-after-failure``, and exits 1 while the
failure reproduces, 0 once it is fixed, so it also works under ``git bisect run``.
"""

from __future__ import annotations

import json
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence, TextIO

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.debug.graph_source import graph_to_source, load_graph
from graphopt.errors import GraphoptError
from graphopt.pass_manager import Instrument

MANIFEST = "manifest.json"
FORMAT_VERSION = 1

_REPLAY_PY = '''"""Rerun a graphopt pass failure: python {dir}/replay.py

Exits 1 while the failure reproduces, 0 once it is fixed.
"""

import sys
from pathlib import Path

from graphopt.debug.reproducer import main

sys.exit(main(Path(__file__).resolve().parent))
'''


class ReproducerError(GraphoptError):
    """A reproducer directory that cannot be written or read."""


def write_reproducer(directory: str | Path, gm: fx.GraphModule, inputs: Sequence[Any] | None, *,
                     pass_name: str, error: str, pipeline: str, pass_options: dict | None = None,
                     origin: dict | None = None) -> Path:
    """Write ``gm`` (the input graph of ``pass_name``, which failed with ``error``) and
    everything needed to rerun it into ``directory``; returns the directory."""
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    source = graph_to_source(gm, f"Input graph of graphopt pass {pass_name}, which failed: {error.splitlines()[0]}")
    constants = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            tensor = ir.get_constant(n)
            if tensor is None:
                raise ReproducerError(f"get_attr {n.name} is not a tensor; reproducers hold tensor constants only")
            constants[n.target] = _storable(tensor)
    synthesized = inputs is None
    inputs = list(inputs) if inputs is not None else synthesize_inputs(gm)
    input_specs, input_tensors = [], {}
    for i, value in enumerate(inputs):
        if isinstance(value, torch.Tensor):
            input_tensors[f"input_{i}"] = _storable(value)
            input_specs.append({"tensor": f"input_{i}", "device": str(value.device)})
        elif value is None or isinstance(value, (bool, int, float)):
            input_specs.append({"value": value})
        else:
            raise ReproducerError(f"input {i} is a {type(value).__name__}; reproducers hold tensors and numbers")
    import graphopt

    manifest = {
        "format": FORMAT_VERSION,
        "pass": pass_name,
        "error": error,
        "pipeline": pipeline,
        "pass_options": {pass_name: (pass_options or {}).get(pass_name, {})},
        "inputs": input_specs,
        "inputs_synthesized": synthesized,
        "versions": {"graphopt": graphopt.__version__, "torch": torch.__version__,
                     "python": platform.python_version()},
        "replay": [f"graphopt debug --replay {out}", f"python {out / 'replay.py'}"],
        **({"origin": origin} if origin else {}),
    }
    (out / "graph.py").write_text(source)
    save_file(constants, str(out / "constants.safetensors"))
    save_file(input_tensors, str(out / "inputs.safetensors"))
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str) + "\n")
    (out / "replay.py").write_text(_REPLAY_PY.format(dir=out))
    return out


class WriteReproducer(Instrument):
    """On the first pass that fails (raises, or breaks verification), write its input
    graph, the inputs and the pipeline to ``directory`` (``write_reproducer``): an
    instrument for ``graphopt debug --reproducer``.

    A reproducer that cannot be written leaves the pipeline alone: the reason is kept in
    ``error`` for the caller to show."""

    def __init__(self, directory: str, pipeline: str, inputs: Sequence[Any] | None,
                 origin: dict | None = None):
        self.directory, self.pipeline, self.inputs, self.origin = directory, pipeline, inputs, origin
        self.written: dict | None = None  # {"dir", "pass", "error"} once written
        self.error: str | None = None
        self._input: fx.GraphModule | None = None

    def before_pass(self, p, gm, ctx) -> None:
        self._input = gm  # passes run on a copy, so this stays the failing pass's input

    def after_failure(self, p, gm, error, record, ctx) -> None:
        if self.written is not None or self.error is not None or self._input is None:
            return  # later failures may only be echoes of the first
        try:
            path = write_reproducer(self.directory, self._input, self.inputs, pass_name=p.name,
                                    error=record.error or repr(error), pipeline=self.pipeline,
                                    pass_options=ctx.config.pass_options, origin=self.origin)
        except Exception as failure:  # noqa: BLE001  (a debugging aid must not break the pipeline it watches)
            self.error = f"{type(failure).__name__}: {failure}"
            return
        self.written = {"dir": str(path), "pass": p.name, "error": record.error}


def _storable(tensor: torch.Tensor) -> torch.Tensor:
    # safetensors refuses shared storage (tied embeddings) and strided views: own copies.
    return tensor.detach().to("cpu").contiguous().clone()


def synthesize_inputs(gm: fx.GraphModule, seed: int = 0) -> list[Any]:
    """Seeded inputs shaped like the placeholders' ``meta["val"]`` (for graphs captured
    without concrete inputs): normal floats, zeros for integers and booleans."""
    generator = torch.Generator().manual_seed(seed)
    made = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise ReproducerError(f"input {n.name} has no static tensor shape; cannot make an input for it")
        try:
            shape = [int(s) for s in val.shape]
        except (TypeError, ValueError) as error:
            raise ReproducerError(f"input {n.name} has a symbolic shape {tuple(val.shape)}; cannot make an input for it") from error
        if val.dtype.is_floating_point:
            made.append(torch.randn(shape, generator=generator).to(val.dtype))
        else:
            made.append(torch.zeros(shape, dtype=val.dtype))
    return made


@dataclass
class Reproducer:
    directory: Path
    manifest: dict
    gm: fx.GraphModule
    inputs: list[Any]


def load_reproducer(directory: str | Path) -> Reproducer:
    """Read a reproducer directory back: manifest, graph (with fake values), inputs."""
    from safetensors.torch import load_file

    root = Path(directory)
    if not (root / MANIFEST).is_file():
        raise ReproducerError(f"{root} is not a graphopt reproducer (no {MANIFEST}); "
                              "write one with graphopt debug MODEL --reproducer DIR")
    manifest = json.loads((root / MANIFEST).read_text())
    if manifest.get("format") != FORMAT_VERSION:
        raise ReproducerError(f"{root}: reproducer format {manifest.get('format')!r}, this graphopt reads {FORMAT_VERSION}")
    constants = load_file(str(root / "constants.safetensors"))
    tensors = load_file(str(root / "inputs.safetensors"))
    inputs = [tensors[spec["tensor"]] if "tensor" in spec else spec["value"] for spec in manifest["inputs"]]
    source_path = root / "graph.py"
    gm = load_graph(source_path.read_text(), constants, inputs, filename=str(source_path))
    return Reproducer(root, manifest, gm, inputs)


@dataclass
class ReplayResult:
    """What rerunning a reproducer did: did the stored pass fail again, and how."""

    directory: str
    pass_name: str
    expected_error: str
    reproduced: bool
    status: str  # the pass's status now: failed | changed | unchanged
    error: str | None  # the pass's error now
    ir: list[dict] = field(default_factory=list)  # --print-ir-after-failure output

    def to_dict(self) -> dict:
        return {"directory": self.directory, "pass": self.pass_name, "expected_error": self.expected_error,
                "reproduced": self.reproduced, "status": self.status, "error": self.error, "ir": self.ir}


@dataclass
class _AsReplayed:
    """The failing pass without its ``requires``: the stored graph already went through
    the passes it needs, which the replay does not rerun."""

    inner: Any
    requires: tuple = ()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def run(self, gm: fx.GraphModule, ctx: Any) -> Any:
        return self.inner.run(gm, ctx)


def replay(directory: str | Path, stream: TextIO | None = None) -> ReplayResult:
    """Run the stored pass on the stored graph, printing the graph if it fails again."""
    from graphopt.config import Options
    from graphopt.instrument import PrintIR
    from graphopt.pass_manager import PassContext, PassManager
    from graphopt.registry import get_pass

    repro = load_reproducer(directory)
    name = repro.manifest["pass"]
    p = get_pass(name)
    config = Options.parse({"target": "eager", "fallback": "eager", "pass_options": repro.manifest["pass_options"]})
    printer = PrintIR(after_failure=True, stream=stream)
    manager = PassManager([_AsReplayed(p)], [printer])
    result = manager.run(repro.gm, PassContext(config, repro.inputs))
    record = result.records[0]
    return ReplayResult(str(repro.directory), name, repro.manifest["error"], record.status == "failed",
                        record.status, record.error, printer.chunks)


def main(directory: Path) -> int:
    """``replay.py``'s body: print the outcome; 1 while the failure reproduces, 2 when
    the reproducer cannot run (one error line, as the CLI prints)."""
    try:
        outcome = replay(directory, stream=sys.stdout)
    except GraphoptError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if outcome.reproduced:
        print(f"reproduced: pass {outcome.pass_name} failed: {outcome.error}")
        return 1
    print(f"not reproduced: pass {outcome.pass_name} now {outcome.status} "
          f"(it failed with: {outcome.expected_error})")
    return 0
