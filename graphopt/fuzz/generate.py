"""The generator: random DAGs of ops with fusion patterns planted inside.

``generate(draw)`` builds a :class:`~graphopt.fuzz.case.Case` from a :class:`Draw`:
a few inputs, then ``steps`` times either a random op (``graphopt.fuzz.ops``) or a planted
pattern (``patterns_norm``, ``patterns_block``), each reading earlier values (recent ones
first, so chains form, and older ones too, so DAGs do). Every value nothing reads becomes
an output. The same code serves the CLI (``RandomDraw``: seeded, one seed per graph) and
the property tests (``graphopt.fuzz.strategies``: hypothesis draws, which shrink).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from graphopt.fuzz import ops, patterns_block, patterns_moe, patterns_norm
from graphopt.fuzz.case import DTYPES, Case, Draw, Expectation, Value
from graphopt.fuzz.kind import Gen, OpKind


@functools.cache
def kinds() -> dict[str, OpKind]:
    """Every step kind by name: the random ops, then the planted patterns."""
    return {op.kind: op for module in (ops, patterns_norm, patterns_block, patterns_moe) for op in module.KINDS}


def expectations(case: Case) -> list[Expectation]:
    """What the planted patterns of ``case`` should make the passes do."""
    return [e for s in case.steps for e in kinds()[s.kind].expect(s)]


@dataclass(frozen=True)
class Settings:
    """Size of generated cases. ``plant_percent``: how often a step is a planted pattern."""

    min_steps: int = 2
    max_steps: int = 8
    plant_percent: int = 45
    dtypes: tuple[str, ...] = DTYPES
    only: tuple[str, ...] = ()  # restrict to these step kinds (graphopt fuzz --only)

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)


def generate(draw: Draw, settings: Settings = Settings(), name: str = "case") -> Case:
    """One case: its dtype, one or two [B, S, H] (or [S, H]) inputs, then the steps."""
    dtype = draw.choice(settings.dtypes)
    gen = Gen(draw, dtype, draw.integer(0, 2**16), name)
    batch, seq, hidden = draw.choice((2, 1)), draw.choice((4, 8, 3, 1)), draw.choice((32, 16, 64, 48))
    shape = (batch, seq, hidden) if draw.chance(85) else (seq, hidden)
    gen.new_input(Value(shape, dtype))
    if draw.chance(40):
        gen.new_input(Value(shape, dtype))
    candidates = [k for k in kinds().values() if (not settings.only or k.kind in settings.only)
                  and (not k.dtypes or dtype in k.dtypes)]
    plants = [k for k in candidates if k.kind.startswith("plant_")]
    randoms = [k for k in candidates if not k.kind.startswith("plant_")]
    for _ in range(draw.integer(settings.min_steps, settings.max_steps) if candidates else 0):
        pool = plants if plants and (not randoms or draw.chance(settings.plant_percent)) else randoms
        for _attempt in range(4):  # an op that cannot apply to the value drawn: try another
            op = draw.choice(pool)
            x = gen.pick(lambda v: True)
            step = op.draw(gen, x)
            if step is not None:
                gen.case.steps.append(step)
                break
    read = {a for s in gen.case.steps for a in s.args}
    gen.case.outputs = [s.id for s in gen.case.steps if s.id not in read]
    if not gen.case.outputs:  # no step could apply to what was drawn: draw again
        return generate(draw, settings, name)
    return gen.case.pruned()
