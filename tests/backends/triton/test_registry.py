"""The kernel registry: ops, launchers, documented kernels, and a triton-free import."""

from __future__ import annotations

import inspect
import pathlib
import re
import subprocess
import sys

import pytest

import graphopt.ops
from graphopt.backends.triton import registry
from graphopt.backends.triton.registry import KERNELS

TEST_DIR = pathlib.Path(__file__).parent


@pytest.mark.parametrize("name", list(KERNELS))
def test_entry_implements_a_graphopt_op(name):
    entry = KERNELS[name]
    assert entry.op.split(".", 1)[1] in graphopt.ops.OPS, f"{entry.op} is not a graphopt op"
    assert callable(entry.launcher)


@pytest.mark.parametrize("name", list(KERNELS))
def test_every_kernel_parameter_is_documented(name):
    for spec in KERNELS[name].aot_specs(32):
        src = inspect.getsource(spec.fn.fn)
        header = src[src.index("def "):re.search(r"\n\)\s*(->[^:]*)?:", src).start()]  # up to the closing "):"
        for arg in spec.fn.arg_names:
            line = next(ln for ln in header.splitlines()[1:] if re.search(rf"\b{arg}\b", ln.split("#")[0]))
            assert "#" in line, f"{spec.name}: parameter {arg} has no comment"


@pytest.mark.parametrize("name", list(KERNELS))
def test_every_launcher_is_tested(name):
    launcher = KERNELS[name].launcher_name
    assert any(f".{launcher}(" in p.read_text() for p in TEST_DIR.glob("test_*.py")), launcher


def test_lowerings():
    expected = {"graphopt.rms_norm", "graphopt.add_rms_norm", "graphopt.softmax_rms_norm",
                "graphopt.layer_norm", "graphopt.add_layer_norm", "graphopt.swiglu", "graphopt.geglu",
                "graphopt.bias_gelu", "graphopt.rope", "graphopt.attention", "graphopt.kv_cache_update",
                "graphopt.rope_kv_cache_update",
                "graphopt.int4_linear"}
    assert expected <= set(registry.lowered_ops())
    assert registry.lowering("graphopt.attention").__module__.endswith("kernels.attention")
    assert registry.lowering("graphopt.int4_linear").__module__.endswith("kernels.int4_gemm")
    assert registry.lowering("graphopt.qkv_proj") is None  # a plain GEMM: Inductor's (or cuBLAS's) job


def test_imports_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"
            "import graphopt.backends.triton as t, graphopt.backends.triton.aot\n"
            "from graphopt.backends.triton.registry import KERNELS, lowered_ops\n"
            "assert not t.is_available() and len(KERNELS) >= 12 and lowered_ops()\n"
            "assert 'triton' not in {m.split('.')[0] for m in sys.modules if sys.modules[m] is not None}\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
