"""What a step kind is (``OpKind``) and the generator state it draws from (``Gen``): the
vocabulary the random ops (``ops``) and the planted patterns (``patterns_*``) are written
in, kept apart from ``generate``, which imports all of them to build its table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from graphopt.fuzz.case import Case, Draw, Expectation, Input, Step, Value

# float16 overflows at 65504; every op keeps its output's rough RMS under this.
MAX_MAG = 16.0


@dataclass(frozen=True)
class OpKind:
    """One step kind: ``draw(gen, x)`` makes a step reading value ``x`` (None when it cannot
    apply to x), ``emit(builder, step, arg_names)`` writes its code, ``expect(step)`` says
    what the passes should do with it (planted patterns only)."""

    kind: str
    draw: Callable[[Gen, int], Step | None]
    emit: Callable[..., None]
    expect: Callable[[Step], list[Expectation]] = lambda step: []
    dtypes: tuple[str, ...] = ()  # the case dtypes it can be drawn in (empty: all)


class Gen:
    """The case under construction and the choices that build it."""

    def __init__(self, draw: Draw, dtype: str, seed: int, name: str):
        self.draw = draw
        self.case = Case(dtype, seed, [], [], [], name)
        self.private: set[int] = set()  # eps scalars and rotary tables: not operands of other steps

    @property
    def dtype(self) -> str:
        return self.case.dtype

    def value(self, value_id: int) -> Value:
        return self.case.values()[value_id]

    def pick(self, accept: Callable[[Value], bool]) -> int | None:
        """One of the six most recent values satisfying ``accept`` (hypothesis shrinks to the latest)."""
        table = self.case.values()
        ids = [i for i in sorted(table, reverse=True) if i not in self.private and accept(table[i])]
        if not ids:
            return None
        return self.draw.choice(ids[:6])

    def new_input(self, value: Value, fill: str = "randn", fill_arg: float = 0.0) -> int:
        vid = self.case.next_id()
        if fill != "randn":
            self.private.add(vid)
        self.case.inputs.append(Input(vid, Value(value.shape, value.dtype, value.mag), fill, fill_arg))
        return vid

    def same_shape(self, x: int, fresh_percent: int = 30) -> int:
        """Another value shaped and typed like ``x`` (x itself included), or a new input."""
        want = self.value(x)
        if not self.draw.chance(fresh_percent):
            other = self.pick(lambda v: v.shape == want.shape and v.dtype == want.dtype)
            if other is not None:
                return other
        return self.new_input(Value(want.shape, want.dtype))

    def step(self, kind: str, args: tuple[int, ...], value: Value, **params: Any) -> Step:
        return Step(self.case.next_id(), kind, tuple(args), tuple(params.items()), value)
