"""A failing case as a folder anyone can rerun: the module's source, its inputs, a script.

    <out>/<case>-<target>/
        model.py            FuzzModel (seeded weights), make_inputs(), make()
        inputs.safetensors  the inputs the failure was seen with (input0, input1, ...)
        inputs_1.safetensors  the same inputs at the second batch/sequence length the one
                            compile was also called at (absent when the case has none)
        repro.py            compiles FuzzModel with the same target and pipeline, checks it
                            against eager, exits 1 while it still fails
        case.json           the generated case, for tools
        README.md           what failed and the command to rerun it
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from graphopt.fuzz.case import Case
from graphopt.fuzz.check import Outcome
from graphopt.fuzz.source import materialize

REPRO = '''"""Rerun a graphopt fuzz failure: python repro.py (exit status 1 while it still fails)."""

import runpy
import sys
from pathlib import Path

from safetensors.torch import load_file

from graphopt.fuzz.check import check_module

HERE = Path(__file__).resolve().parent
TARGET = {target!r}
PIPELINE = {pipeline!r}
DTYPES = {dtypes!r}  # the dtypes the model computes in: they set the tolerance


def load(path):
    tensors = load_file(str(path))
    return tuple(tensors[f"input{{i}}"] for i in range(len(tensors)))


def main() -> int:
    model = runpy.run_path(str(HERE / "model.py"))
    inputs, more = load(HERE / "inputs.safetensors"), []
    if (HERE / "inputs_1.safetensors").exists():  # the second shape the same compile runs at
        more.append(("second shape", load(HERE / "inputs_1.safetensors"), None))
    outcome = check_module(model["FuzzModel"]().eval(), inputs, TARGET, PIPELINE, DTYPES, more=more)
    print(outcome.line())
    for fallback in outcome.fallbacks:
        print(f"fallback {{fallback['where']}}: {{fallback['reason']}}")
    return 1 if outcome.failed else 0


if __name__ == "__main__":
    sys.exit(main())
'''


def write_reproducer(case: Case, target: str, pipeline: Sequence[str] | None, out_dir: str | Path,
                     outcome: Outcome) -> Path:
    """Write the folder for ``case`` failing on ``target``; returns its path."""
    from safetensors.torch import save_file

    folder = Path(out_dir).resolve() / f"{case.name}-{target}"  # absolute: the README command works anywhere
    folder.mkdir(parents=True, exist_ok=True)
    from graphopt.fuzz.shapes import second_shape

    module, inputs, source = materialize(case)
    (folder / "model.py").write_text(source)
    save_file({f"input{i}": x.contiguous() for i, x in enumerate(inputs)}, str(folder / "inputs.safetensors"))
    shape, _ = second_shape(case, module)
    if shape is not None:
        save_file({f"input{i}": x.contiguous() for i, x in enumerate(shape.inputs)}, str(folder / "inputs_1.safetensors"))
    (folder / "repro.py").write_text(REPRO.format(target=target, pipeline=list(pipeline or []), dtypes=case.dtypes()))
    (folder / "case.json").write_text(json.dumps(case.to_dict(), indent=1, default=str))
    (folder / "README.md").write_text(
        f"# {case.name} on target {target}: {outcome.status}\n\n"
        f"{outcome.detail}\n\n"
        f"Case: {case.describe()}\n\n"
        f"Rerun: `python {folder}/repro.py` (exit status 1 while graphopt still fails), or\n"
        f"`cd {folder} && graphopt run model:make --target {target} -o pipeline={','.join(pipeline or [])}`.\n")
    return folder
