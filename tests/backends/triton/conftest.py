"""Run the Triton kernels on the CPU through triton's interpreter.

``triton.jit`` decides at decoration time whether a kernel is compiled or interpreted
(it reads TRITON_INTERPRET when each kernel module is imported), so the variable is
set here, before any test module imports a kernel. A kernel module imported earlier in
the session without it is reloaded so that its kernels are interpreted too.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys
from pathlib import Path

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


def _session_root(request, tmp_path_factory) -> Path:
    root = tmp_path_factory.getbasetemp()
    return root.parent if hasattr(request.config, "workerinput") else root  # per session, shared by its workers


@pytest.fixture(scope="session")
def aot_cache_dir(request, tmp_path_factory) -> str:
    """One TRITON_CACHE_DIR for every ahead-of-time build of the session (aot_builds, the
    ``graphopt kernels`` CLI): triton keys its cache by source, options and target, so a
    kernel built once is a cache hit for the next build. Shared by pytest-xdist workers."""
    path = _session_root(request, tmp_path_factory) / "triton-aot-cache"
    path.mkdir(exist_ok=True)
    return str(path)


class SessionBuilds:
    """The session's one ahead-of-time build of each kernel for every arch, with every autotune
    config, in aot_cache_dir: test_aot, test_int4_gemm and test_kernels_cmd all read it instead
    of each compiling the same specs (several CPU-minutes on two cores).

    The results live in a JSON file in the session's temp root, written under a file lock, so
    every pytest-xdist worker gets the same build; whoever takes the lock first builds what is
    missing while the others wait. A kernel that fails to build is kept as its BuildResult
    with the error, for each test that reads it to fail with; an exception from build_all
    reaches the test that asked, and the next one builds again. This process interprets
    kernels, so ``aot.build_all`` compiles in child processes, one per CPU.
    """

    def __init__(self, root: Path, cache_dir: str) -> None:
        self.cache_dir = cache_dir
        self._lock, self._done = str(root / "triton-aot.lock"), root / "triton-aot-results.json"

    def get(self, kernels=None) -> dict:
        """(kernel, arch) -> aot.BuildResult for ``kernels`` (default: all registered), built if missing."""
        from filelock import FileLock

        from graphopt.backends.triton import aot
        from graphopt.backends.triton.registry import KERNELS

        wanted = list(KERNELS) if kernels is None else list(kernels)
        with FileLock(self._lock):
            done = json.loads(self._done.read_text()) if self._done.exists() else []
            results = {(r.kernel, r.arch): r for r in map(aot.BuildResult.from_dict, done)}
            missing = [k for k in wanted if any((k, a) not in results for a in aot.ARCHS)]
            if missing:
                for r in aot.build_all(list(aot.ARCHS), missing, tuning=True, cache_dir=self.cache_dir):
                    results[(r.kernel, r.arch)] = r
                tmp = self._done.with_suffix(".tmp")
                tmp.write_text(json.dumps([dataclasses.asdict(r) for r in results.values()]))
                tmp.replace(self._done)
        return {key: r for key, r in results.items() if key[0] in wanted}


@pytest.fixture(scope="session")
def aot_builds(request, tmp_path_factory, aot_cache_dir) -> SessionBuilds:
    return SessionBuilds(_session_root(request, tmp_path_factory), aot_cache_dir)
