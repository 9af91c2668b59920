"""Hypothesis strategies for generated cases (needs ``hypothesis``, a dev dependency).

``cases(settings)`` draws a whole :class:`~graphopt.fuzz.case.Case` through the same
generator the CLI uses, so a property test shrinks a failing model the hypothesis way:
fewer steps, smaller integers, the first (plainest) option of every choice.
"""

from __future__ import annotations

from typing import Sequence, TypeVar

from hypothesis import strategies as st

from graphopt.fuzz.case import Case
from graphopt.fuzz.generate import Settings, generate

T = TypeVar("T")


class HypothesisDraw:
    """The generator's :class:`~graphopt.fuzz.case.Draw`, backed by ``st.data()``-style draws."""

    def __init__(self, draw):
        self._draw = draw

    def integer(self, lo: int, hi: int) -> int:
        return self._draw(st.integers(lo, hi))

    def choice(self, options: Sequence[T]) -> T:
        return self._draw(st.sampled_from(list(options)))

    def chance(self, percent: int) -> bool:
        return self._draw(st.integers(0, 99)) < percent


@st.composite
def cases(draw, settings: Settings = Settings()) -> Case:
    return generate(HypothesisDraw(draw), settings, name="hypothesis_case")
