"""``graphopt kernels``: every kernel builds for sm_90 and gfx942, JSON and table, one-line errors.

The real builds reuse the session's AOT cache (conftest's aot_builds fills it first), so they
are triton cache hits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from typer.testing import CliRunner

from graphopt.backends.triton.registry import KERNELS
from graphopt.cli.main import app

FIELDS = {"kernel", "arch", "built", "error", "registers", "shared_memory", "spills", "global_load_bits",
          "async_copies", "int_to_float_converts", "variants"}


def test_json_reports_every_kernel_built_for_sm_90_and_gfx942(aot_builds):
    aot_cache_dir = aot_builds.cache_dir
    aot_builds.get()  # waits for the session's build, so the command's builds are cache hits
    # A child without TRITON_INTERPRET, as a user runs it: it builds in its own process.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "graphopt.cli.main", "kernels", "--arch", "sm_90,gfx942",
                           "--json", "--cache-dir", aot_cache_dir],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout)
    assert all(set(r) == FIELDS for r in rows)
    assert [(r["kernel"], r["arch"]) for r in rows] == [(k, a) for k in KERNELS for a in ("sm_90", "gfx942")]
    for r in rows:
        assert r["built"] and r["error"] is None, r
        assert r["registers"] > 0 and r["shared_memory"] >= 0 and r["spills"] == 0, r
        assert r["variants"] and all(v["spills"] == 0 for v in r["variants"]), r
        assert r["global_load_bits"] == min(v["global_load_bits"] for v in r["variants"]), r
        assert r["async_copies"] == sum(v["async_copies"] for v in r["variants"]), r
        assert r["int_to_float_converts"] == sum(v["int_to_float_converts"] for v in r["variants"]), r
    # The done-when: INT4 weights move in 128-bit vectors on every path, and the
    # tiled (MMA) paths prefetch them asynchronously where the compiler does (cp.async on
    # sm_90; triton 3.9 stages gfx942 loads through registers, so no async copy there).
    for r in rows:
        if r["kernel"] == "int4_gemm":
            assert r["global_load_bits"] >= 128, r
            tiled = [v for v in r["variants"] if v["label"] in ("prefill 128x128x32", "decode M=16")]
            assert len(tiled) == 2, r
            if r["arch"] == "sm_90":
                assert all(v["async_copies"] > 0 for v in tiled), r
            # Codes become floats by bit tricks: no convert instruction anywhere in the kernel.
            assert r["int_to_float_converts"] == 0, r
        if r["kernel"] == "cache_attention":  # an int8 cache dequantizes without converts too
            converts = {v["label"]: v["int_to_float_converts"] for v in r["variants"]}
            assert converts["int8 paged"] == converts["fp16 bhsd"], r


def test_table_shows_each_build_and_the_error_of_a_failed_one(monkeypatch):
    from graphopt.backends.triton import aot

    def fake_build_all(archs, kernels, **kwargs):  # the builds themselves are the test above
        return [aot.BuildResult("rms_norm", "gfx942", True, registers=20, shared_memory=32, spills=0,
                                global_load_bits=128, async_copies=0),
                aot.BuildResult("swiglu", "gfx942", False, error="CompilationError: out of LDS")]

    monkeypatch.setattr(aot, "build_all", fake_build_all)
    result = CliRunner().invoke(app, ["kernels", "--arch", "gfx942", "--kernel", "rms_norm,swiglu"])
    assert result.exit_code == 1, result.output  # a failed build fails the command
    assert "1 of 2 builds succeeded" in result.stdout
    for text in ("graphopt.rms_norm", "graphopt.swiglu", "registers", "shared memory", "spills", "load bits",
                 "async copies", "int->float",
                 "failed swiglu for gfx942: CompilationError: out of LDS"):
        assert text in result.stdout, text


def test_unknown_arch_is_one_line_naming_the_valid_ones():
    result = CliRunner().invoke(app, ["kernels", "--arch", "sm_90,sm_70", "--json"])
    assert result.exit_code == 2
    assert result.stderr.strip() == "error: unknown arch 'sm_70'; valid: sm_80, sm_90, gfx90a, gfx942"
    assert result.stdout == ""


def test_without_triton_it_names_the_extra(monkeypatch):
    import graphopt.backends.triton as backend

    monkeypatch.setattr(backend, "is_available", lambda: False)
    result = CliRunner().invoke(app, ["kernels"])
    assert result.exit_code == 2
    assert result.stderr.strip() == ("error: graphopt kernels needs the Python package 'triton': "
                                     "pip install 'graphopt[triton]'")


def test_help_has_an_example_and_json():
    result = CliRunner().invoke(app, ["kernels", "--help"])
    assert result.exit_code == 0 and "Example" in result.stdout and "--json" in result.stdout
