"""A generated test case: typed values and the steps that compute them.

A :class:`Case` is data, not code: inputs (shape, dtype, how to fill them), a list of
:class:`Step` (an op or a planted pattern reading earlier values by id), and the outputs.
``graphopt.fuzz.source`` turns it into a real ``nn.Module`` and its Python source. Keeping
the case as data is what makes shrinking simple: removing a step turns its value into a new
input of the same shape and dtype, so every smaller case is still a valid model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, TypeVar

T = TypeVar("T")

DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class Value:
    """A tensor in the generated model. ``mag`` is a rough bound on its RMS, kept so the
    generator never builds a chain that overflows float16 (which would test nothing)."""

    shape: tuple[int, ...]
    dtype: str
    mag: float = 1.0


@dataclass(frozen=True)
class Input:
    id: int
    value: Value
    fill: str = "randn"  # randn | eps (a positive scalar tensor) | cos | sin (rotary tables)
    fill_arg: float = 0.0


@dataclass(frozen=True)
class Step:
    """One op or planted pattern. ``kind`` names its emitter (``graphopt.fuzz.ops``);
    ``args`` are the ids of the values it reads; ``params`` are JSON-able constants."""

    id: int
    kind: str
    args: tuple[int, ...]
    params: tuple[tuple[str, Any], ...]
    value: Value

    @property
    def p(self) -> dict[str, Any]:
        return dict(self.params)


@dataclass(frozen=True)
class Expectation:
    """What a planted pattern should make a pass do: ``fires`` matches, and when the pattern
    was perturbed, a near miss whose reason contains ``near_miss``."""

    pass_name: str
    fires: int
    near_miss: str | None = None  # alternatives separated by "|"

    def explained_by(self, reasons: Sequence[str]) -> bool:
        """Whether one of the pass's near-miss ``reasons`` is the one this perturbation calls for."""
        if self.near_miss is None:
            return True
        return any(alt in reason for alt in self.near_miss.split("|") for reason in reasons)


@dataclass
class Case:
    dtype: str
    seed: int
    inputs: list[Input]
    steps: list[Step]
    outputs: list[int] = field(default_factory=list)
    name: str = "case"

    def values(self) -> dict[int, Value]:
        table = {i.id: i.value for i in self.inputs}
        table.update({s.id: s.value for s in self.steps})
        return table

    def next_id(self) -> int:
        return 1 + max([i.id for i in self.inputs] + [s.id for s in self.steps], default=-1)

    def dtypes(self) -> list[str]:
        """Every dtype a value of the case has (the tolerance follows the least precise)."""
        return sorted({v.dtype for v in self.values().values()} | {self.dtype})

    def users(self, value_id: int) -> list[Step]:
        return [s for s in self.steps if value_id in s.args]

    def plants(self) -> list[Step]:
        return [s for s in self.steps if s.kind.startswith("plant_")]

    def describe(self) -> str:
        """One line: dtype, sizes, and the steps by kind (for progress and reproducers)."""
        kinds = ", ".join(s.kind.removeprefix("plant_") + ("*" if s.p.get("perturb", "none") != "none" else "")
                          for s in self.steps)
        return f"{self.name} [{self.dtype}] {len(self.inputs)} inputs: {kinds}"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def copy(self) -> Case:
        return Case(self.dtype, self.seed, list(self.inputs), list(self.steps), list(self.outputs), self.name)

    # --- reductions used by the shrinker --------------------------------------------------

    def without_step(self, step_id: int) -> Case:
        """The case with one step removed; its readers read a new input of its shape instead."""
        step = next(s for s in self.steps if s.id == step_id)
        case = self.copy()
        case.steps = [s for s in self.steps if s.id != step_id]
        readers = [s for s in case.steps if step_id in s.args]
        if readers or step_id in case.outputs:
            value = Value(step.value.shape, step.value.dtype)
            case.inputs.append(Input(step_id, value))  # keeps the id: readers need no rewiring
        return case.pruned()

    def without_output(self, value_id: int) -> Case:
        case = self.copy()
        case.outputs = [o for o in self.outputs if o != value_id]
        return case.pruned()

    def pruned(self) -> Case:
        """Drop steps nothing reads and that are not outputs, and inputs nothing reads."""
        case = self.copy()
        while True:
            read = {a for s in case.steps for a in s.args} | set(case.outputs)
            alive = [s for s in case.steps if s.id in read]
            if len(alive) == len(case.steps):
                break
            case.steps = alive
        read = {a for s in case.steps for a in s.args} | set(case.outputs)
        case.inputs = [i for i in case.inputs if i.id in read]
        return case


class Draw(Protocol):
    """The choices the generator makes. Backed by ``random.Random`` (the CLI: seeded and
    reproducible per graph) or by hypothesis (the property tests: shrinkable). Options are
    listed simplest first, so hypothesis shrinks towards the plain spelling."""

    def integer(self, lo: int, hi: int) -> int: ...

    def choice(self, options: Sequence[T]) -> T: ...

    def chance(self, percent: int) -> bool: ...


class RandomDraw:
    def __init__(self, seed: int):
        import random

        self.rng = random.Random(seed)

    def integer(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def choice(self, options: Sequence[T]) -> T:
        return options[self.rng.randrange(len(options))]

    def chance(self, percent: int) -> bool:
        return self.rng.randrange(100) < percent
