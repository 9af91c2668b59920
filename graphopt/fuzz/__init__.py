"""Differential testing of graphopt: random models through every pass and target.

NNSmith-style: generate valid models (``generate``: chains and DAGs of the ops the passes
care about, with the fusion patterns planted inside, as written and perturbed), materialise
each as a real ``nn.Module`` with seeded weights and readable source (``source``), compile it
with graphopt on every target available here and compare with eager (``check``, ``runner``;
a top-k router's token that ties within rounding is its own verdict, ``routing_ties``),
shrink what fails (``shrink``) and write a reproducer folder (``reproducer``).

    graphopt fuzz --graphs 500 --seed 0 --json

``graphopt.fuzz.strategies`` offers the same generator as hypothesis strategies for tests.
"""

from graphopt.fuzz.case import Case, Expectation, RandomDraw, Step, Value
from graphopt.fuzz.check import TOLERANCE, Outcome, check_module
from graphopt.fuzz.generate import Settings, expectations, generate
from graphopt.fuzz.runner import Summary, fuzz_pipeline, resolve_targets, run_fuzz
from graphopt.fuzz.source import materialize, module_source

__all__ = ["Case", "Expectation", "Outcome", "RandomDraw", "Settings", "Step", "Summary", "TOLERANCE", "Value",
           "check_module", "expectations", "fuzz_pipeline", "generate", "materialize", "module_source",
           "resolve_targets", "run_fuzz"]
