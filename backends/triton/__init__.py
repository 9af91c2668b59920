"""Triton lowering of graphopt ops: kernels, their registry, and ahead-of-time builds.

- ``registry.KERNELS``: each kernel, the ``graphopt.*`` op it implements, its launcher
  and its AOT specs; ``registry.lowering(op)`` gives the launcher for an op.
- ``kernels/<family>.py``: the ``@triton.jit`` kernels and their Python launchers.
- ``aot.build(kernel, arch)``: compile for sm_80 / sm_90 / gfx90a / gfx942 without a GPU.
- ``ops``: a ``graphopt_triton::<op>`` custom op per lowered op, launching its kernel.
- ``target.triton``: the ``target="triton"`` Target (graphopt ops as those custom ops, the
  rest of the graph through Inductor or eagerly).

Importing this package (or the registry) does not import triton, so graphopt works on
machines without it; the kernel modules import triton when first used.
"""

import importlib.util


def is_available() -> bool:
    """Whether triton is installed (kernels may still need a GPU or TRITON_INTERPRET=1 to run)."""
    return importlib.util.find_spec("triton") is not None
