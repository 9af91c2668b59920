"""Run the Triton kernels on the CPU through triton's interpreter.

``triton.jit`` decides at decoration time whether a kernel is compiled or interpreted
(it reads TRITON_INTERPRET when each kernel module is imported), so the variable is
set here, before any test module imports a kernel. A kernel module imported earlier in
the session without it is reloaded so that its kernels are interpreted too.
"""

from __future__ import annotations

import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

# Dependency order: _common first, flash_attention before the modules that import it.
_KERNEL_MODULES = ["_common", "rms_norm", "layer_norm", "activations", "rope", "flash_attention",
                   "flash_decoding_reduce", "flash_decoding", "attention", "kv_cache", "splitk_reduce", "int4_gemv",
                   "int4_gemm"]


def _reload_compiled_kernel_modules() -> None:
    from triton.runtime.jit import JITFunction  # an interpreted kernel is not one

    loaded = [sys.modules[m] for m in (f"graphopt.backends.triton.kernels.{n}" for n in _KERNEL_MODULES)
              if m in sys.modules]
    if any(isinstance(v, JITFunction) for mod in loaded for v in vars(mod).values()):
        for mod in loaded:  # reload keeps each module object, so importers see the new kernels
            importlib.reload(mod)


_reload_compiled_kernel_modules()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def aot_cache_dir(request, tmp_path_factory) -> str:
    """One TRITON_CACHE_DIR for every ahead-of-time build of the session (test_aot, the
    ``graphopt kernels`` CLI): triton keys its cache by source, options and target, so a
    kernel built once is a cache hit for the next build. Shared by pytest-xdist workers."""
    root = tmp_path_factory.getbasetemp()
    if hasattr(request.config, "workerinput"):
        root = root.parent  # per session, shared by its workers
    path = root / "triton-aot-cache"
    path.mkdir(exist_ok=True)
    return str(path)
