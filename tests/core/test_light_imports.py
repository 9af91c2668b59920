"""The modules a warm ``graphopt generate model.gguf`` and ``graphopt --help`` load import no
torch (2.7 s and 170 MB on the 2-core machine, 0.65 s more at exit): one module-level
``import torch`` on this path would undo it, so each is imported in a fresh interpreter."""

import subprocess
import sys

import pytest

LIGHT = [
    "graphopt", "graphopt.cli.main", "graphopt.config", "graphopt.targets", "graphopt.memory",
    "graphopt.sources", "graphopt.sources.checkpoints", "graphopt.sources.gguf_needs", "graphopt.sources.tokenizers",
    "graphopt.sources.slim_tokenizer", "graphopt.generation", "graphopt.generation.api",
    "graphopt.generation.checkpoint", "graphopt.generation.loop", "graphopt.generation.sampling",
    "graphopt.backends.onnxruntime.decoder.from_checkpoint", "graphopt.backends.onnxruntime.decoder.in_place",
    "graphopt.backends.onnxruntime.decoder.decoder_cache", "graphopt.backends.onnxruntime.runtime.session",
]


@pytest.mark.parametrize("module", LIGHT)
def test_importing_it_imports_no_torch(module):
    code = f"import sys, {module}; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False", f"importing {module} imports torch"


def test_resolving_the_public_api_still_works():
    """The lazy names resolve to the real objects (and the graphopt:: ops register with them)."""
    import torch

    import graphopt

    assert graphopt.generate.__module__ == "graphopt.generation.api"
    assert graphopt.Options.__name__ == "Options" and callable(graphopt.reports)
    assert hasattr(torch.ops.graphopt, "rms_norm")
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        graphopt.nope  # noqa: B018
