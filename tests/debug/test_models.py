"""Every ``graphopt debug`` flag on llama-tiny and on a small transformers Llama (config.json)."""

import re

import pytest

from graphopt.pipeline import DEFAULT_PIPELINE
from tests.debug.conftest import RMS_PIPELINE, debug, debug_json

MODELS = ["llama-tiny", "hf-llama"]


@pytest.fixture(params=MODELS)
def model(request) -> str:
    return request.getfixturevalue("hf_llama_config") if request.param == "hf-llama" else request.param


def test_default_pipeline_with_every_reporting_flag(model, tmp_path):
    page = tmp_path / "page.html"
    data = debug_json(model, "--print-ir-before", "fuse_rms_norm", "--print-ir-after-change", "--diff", "--timing",
                      "--check-numerics", "--why", "fuse_rms_norm", "--bisect", "--report", str(page),
                      "--reproducer", str(tmp_path / "repro"))
    (graph,) = data["graphs"]
    assert [p["name"] for p in graph["passes"]] == list(DEFAULT_PIPELINE)
    rms = next(p for p in graph["passes"] if p["name"] == "fuse_rms_norm")
    assert rms["status"] == "changed" and rms["matches"] >= 4  # two layers' norms (some later fold into add_rms_norm)
    expected = []
    for p in graph["passes"]:
        expected += [("before", p["name"])] if p["name"] == "fuse_rms_norm" else []
        expected += [("diff", p["name"])] if p["status"] == "changed" else []
    assert [(c["when"], c["pass"]) for c in data["ir"]] == expected
    assert all(p["numerics"]["ok"] for p in graph["passes"] if p["status"] == "changed")
    assert graph["first_bad_pass"] is None and data["bisect"] is None
    assert data["reproducer"] is None and not (tmp_path / "repro").exists()
    assert page.stat().st_size == data["report"]["bytes"] and "<svg" in page.read_text()


def test_a_planted_bug_and_a_planted_failure_are_found(model, planted, tmp_path):
    repro, page = tmp_path / "repro", tmp_path / "page.html"
    data = debug_json(model, "--pipeline", RMS_PIPELINE + ",rewrite_eps,explode", "--check-numerics", "--bisect",
                      "--print-ir-after-failure", "--reproducer", str(repro), "--report", str(page))
    (graph,) = data["graphs"]
    assert graph["first_bad_pass"] == "rewrite_eps"
    assert [p["status"] for p in graph["passes"]][-1] == "failed"
    b = data["bisect"]
    assert (b["pass"], b["node"]) == ("rewrite_eps", planted["rewrite_eps"].wrong_anchor)
    earlier = sum(r["pass_name"] in ("canonicalize", "fuse_rms_norm") for r in graph["rewrites"])
    assert b["rewrite_index"] == earlier + 3  # canonicalize's, fuse_rms_norm's, then the third of ours
    assert [(c["when"], c["pass"]) for c in data["ir"]] == [("after failure of", "explode")]
    assert data["reproducer"]["pass"] == "explode"
    out = debug("--replay", str(repro), expect_code=1).stdout
    assert "reproduced: pass explode failed" in out
    html = page.read_text()
    assert "rewrite_eps" in html and 'id="bisect"' in html and "FAIL" in html


def test_timing_and_check_numerics_print_the_table(model):
    out = debug(model, "--timing", "--check-numerics").stdout
    assert re.search(r"pass\s+┃ status\s+┃ matches", out)
    for name in DEFAULT_PIPELINE:
        assert re.search(rf"│ {name}\s+│ (changed|unchanged)", out), name
