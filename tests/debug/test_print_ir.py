"""The printing switches of ``graphopt debug`` on llama-tiny: print-ir-*, --diff, --timing,
--disable-pass, --bisect-limit, and the same data under --json."""

import re

from tests.debug.conftest import RMS_PIPELINE, debug, debug_json


def _chunks(stdout: str) -> list[tuple[str, str]]:
    """(when, pass) of each ``// ----- IR <when> <pass> -----`` header, in order."""
    return re.findall(r"^// ----- IR (.+) (\S+) -----$", stdout, flags=re.M)


def test_print_ir_after_change_with_diff_shows_only_changing_passes_as_diffs():
    out = debug("llama-tiny", "--pipeline", RMS_PIPELINE, "--print-ir-after-change", "--diff").stdout
    assert _chunks(out) == [("diff", "fuse_rms_norm")]  # canonicalize changes nothing on llama-tiny
    assert "--- before fuse_rms_norm" in out and "+++ after fuse_rms_norm" in out
    added = [l for l in out.splitlines() if l.startswith("+%rms_norm")]
    assert len(added) == 5 and all("graphopt.rms_norm(" in l and "<- fuse_rms_norm" in l for l in added)
    assert len([l for l in out.splitlines() if l.startswith("-%rsqrt")]) == 5


def test_print_ir_before_and_after_one_pass_one_node_a_line_with_shapes():
    out = debug("llama-tiny", "--pipeline", RMS_PIPELINE, "--print-ir-before", "fuse_rms_norm",
                "--print-ir-after", "fuse-rms-norm").stdout
    assert _chunks(out) == [("before", "fuse_rms_norm"), ("after", "fuse_rms_norm")]
    before, after = re.split(r"^// ----- IR .+ -----$", out, flags=re.M)[1:3]
    assert "%arg0_1 = input  : i64[1, 16]" in before
    assert re.search(r"^%rsqrt = aten\.rsqrt\(%add\)  : f32\[1, 16, 1\]$", before, flags=re.M)
    assert "graphopt.rms_norm" not in before
    assert re.search(r"^%rms_norm_default = graphopt\.rms_norm\(%embedding, %w_\w+, 1e-05, 0\)  : f32\[1, 16, 64\]"
                     r"  <- fuse_rms_norm$", after, flags=re.M)
    assert after.strip().splitlines()[-1].startswith("return [%")


def test_print_ir_after_all_prints_every_pass():
    data = debug_json("llama-tiny", "--pipeline", RMS_PIPELINE, "--print-ir-after-all")
    assert [(c["when"], c["pass"]) for c in data["ir"]] == [("after", "canonicalize"), ("after", "fuse_rms_norm")]
    assert all(c["text"].count("\n") > 100 for c in data["ir"])  # whole graphs, one node a line


def test_print_ir_after_failure_prints_the_graph_the_pass_failed_on(planted):
    out = debug("llama-tiny", "--pipeline", RMS_PIPELINE + ",drops_val", "--print-ir-after-failure").stdout
    assert _chunks(out) == [("after failure of", "drops_val")]
    assert "// ValueError: node rms_norm_default (graphopt.rms_norm) has no meta['val']" in out
    assert "pass drops_val failed and was skipped" in out


def test_timing_and_check_numerics_print_the_table():
    out = debug("llama-tiny", "--timing", "--check-numerics").stdout
    for column in ("pass", "status", "matches", "ms", "nodes before", "nodes after", "max abs err", "rel err", "numerics"):
        assert column in out
    assert re.search(r"fuse_rms_norm\s+│ changed\s+│\s+5 │", out)
    assert "FAIL" not in out


def test_timing_json_has_numbers_for_every_pass():
    data = debug_json("llama-tiny", "--timing", "--check-numerics")
    (graph,) = data["graphs"]
    from graphopt.pipeline import DEFAULT_PIPELINE

    assert [p["name"] for p in graph["passes"]] == list(DEFAULT_PIPELINE)
    for p, following in zip(graph["passes"], graph["passes"][1:]):
        assert following["nodes_before"] == p["nodes_after"]  # each pass starts from the last one's graph
    for p in graph["passes"]:
        assert p["time_ms"] > 0 or p["status"] == "disabled"
        if p["status"] == "changed":
            assert p["numerics"]["ok"] and p["numerics"]["rel_err"] <= 1e-4
    assert graph["first_bad_pass"] is None


def test_disable_pass_and_bisect_limit_by_hand():
    data = debug_json("llama-tiny", "--pipeline", RMS_PIPELINE, "--disable-pass", "fuse_rms_norm")
    assert [p["status"] for p in data["graphs"][0]["passes"]] == ["unchanged", "disabled"]
    data = debug_json("llama-tiny", "--pipeline", RMS_PIPELINE, "--bisect-limit", "2", "--why", "fuse_rms_norm")
    (graph,) = data["graphs"]
    assert graph["passes"][1]["matches"] == 2 and len(graph["rewrites"]) == 2
    assert [m["reason"] for m in graph["near_misses"]].count("bisect limit reached") == 3
