"""Generation: one decode loop for every target (see api.py for ``graphopt.generate``).

- ``loop``: the loop itself (lockstep runners, stop conditions, streaming, timing);
- ``sampling``: greedy / temperature / top-k / top-p, and the stop conditions;
- ``runner``: the step-runner protocol, the model adapters and the eager runner;
- ``static``: the compiled static-cache runner (eager and triton targets);
- ``runner_cache``: each model's runners, kept from one call to the next (``forget`` drops them);
- the onnxruntime target's runner lives with its backend (backends/onnxruntime/decoder/decoder.py).
"""

from graphopt.generation.api import RUNNERS, eager_generate, generate, generate_with_reference
from graphopt.generation.loop import GenerateResult, drive
from graphopt.generation.runner import EagerRunner, StepRunner
from graphopt.generation.runner_cache import forget
from graphopt.generation.sampling import Sampler, StopConditions

__all__ = ["generate", "generate_with_reference", "eager_generate", "GenerateResult", "drive", "Sampler",
           "StopConditions", "StepRunner", "EagerRunner", "RUNNERS", "forget"]
