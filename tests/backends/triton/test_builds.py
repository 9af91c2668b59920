"""A Triton kernel compiled while a graph runs is a build in that graph's report.

No GPU here, so Triton never compiles: the test drives the two hooks the way Triton's JIT
calls them (cache hook before a compile, post-compile hook after) and checks the record.
"""

from types import SimpleNamespace

import pytest

from graphopt.backends.triton import builds
from graphopt.report import CompileReport

knobs = pytest.importorskip("triton").knobs


@pytest.fixture
def fresh_hooks(monkeypatch):
    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: seen.append(("cache", kw["key"])))
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: seen.append(("post", kw["key"])))
    monkeypatch.setattr(builds, "_installed", False)
    builds.install()
    yield seen


def compile_event(key):
    compile = {"key": key, "num_warps": 4, "num_stages": 3, "constants": {(2,): 64}}
    knobs.runtime.jit_cache_hook(key=key, repr="k", fn=SimpleNamespace(name="rms_norm_kernel"), compile=compile,
                                 is_manual_warmup=False, already_compiled=False)
    knobs.runtime.jit_post_compile_hook(key=key, repr="k", fn=SimpleNamespace(name="rms_norm_kernel"),
                                        compile=compile, is_manual_warmup=False, already_compiled=False)


def test_a_kernel_compiled_while_a_graph_runs_is_a_build_of_that_graph(fresh_hooks):
    report = CompileReport(target="triton", requested_target="triton", frontend="dynamo")
    with builds.running_for(report):
        compile_event(("fp32", 64))
    compile_event(("fp32", 128))  # outside any graph: nobody's build
    assert [b["what"] for b in report.builds] == ["triton kernel rms_norm_kernel"]
    assert report.builds[0]["num_warps"] == 4 and report.builds[0]["constants"] == {"(2,)": 64}
    assert report.to_dict()["builds"] == report.builds
    # the hooks that were set before ours still ran, for both compiles
    assert fresh_hooks == [("cache", ("fp32", 64)), ("post", ("fp32", 64)),
                           ("cache", ("fp32", 128)), ("post", ("fp32", 128))]


def test_install_chains_once(fresh_hooks):
    hook = knobs.runtime.jit_cache_hook
    builds.install()
    assert knobs.runtime.jit_cache_hook is hook
