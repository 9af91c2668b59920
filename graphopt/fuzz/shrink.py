"""Shrinking a failing case: delta reduction over its steps and outputs.

A removed step's value becomes a fresh input of the same shape and dtype (``Case.without_step``),
so every candidate is a valid model; a candidate is kept when it still fails the same way
(same target, same status: a mismatch stays a mismatch, a crash a crash). Chunks of steps
go first (halves, quarters, ... single steps, as in ddmin), then surplus outputs. Each try
costs one compile, so ``budget`` caps them.
"""

from __future__ import annotations

from typing import Callable

from graphopt.fuzz.case import Case
from graphopt.fuzz.check import Outcome


def still_fails(case: Case, failure: Outcome, check: Callable[[Case], Outcome]) -> Outcome | None:
    """The candidate's outcome when it fails like ``failure``, else None."""
    try:
        outcome = check(case)
    except Exception:  # a candidate the generator's own code cannot build is no reproducer
        return None
    return outcome if outcome.status == failure.status else None


def shrink(case: Case, failure: Outcome, check: Callable[[Case], Outcome],
           budget: int = 40) -> tuple[Case, Outcome, int]:
    """The smallest case found that still fails like ``failure``, its outcome, the compiles
    spent. ``check(candidate)`` compiles and runs a candidate on ``failure``'s target (the
    runner's ``check_case``, passed in: the runner calls this module, not the reverse)."""
    best, best_outcome, tries = case, failure, 0

    def attempt(candidate: Case) -> bool:
        nonlocal best, best_outcome, tries
        if tries >= budget or not candidate.steps or not candidate.outputs:
            return False
        tries += 1
        outcome = still_fails(candidate, failure, check)
        if outcome is not None:
            best, best_outcome = candidate, outcome
            return True
        return False

    progress = True
    while progress and tries < budget:
        progress = False
        size = max(1, len(best.steps) // 2)
        while size >= 1 and tries < budget:
            i = 0
            while i < len(best.steps) and tries < budget:
                candidate = best
                for step in best.steps[i:i + size]:
                    candidate = candidate.without_step(step.id) if any(
                        s.id == step.id for s in candidate.steps) else candidate
                if attempt(candidate):
                    progress = True  # the same index now holds the next steps
                else:
                    i += size
            size //= 2
        for output in list(best.outputs):
            if len(best.outputs) > 1 and attempt(best.without_output(output)):
                progress = True
    return best, best_outcome, tries
