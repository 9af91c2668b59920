"""Planted patterns make their pass fire, and every perturbation of them makes it stop and
say why in a near miss. Each (pattern, perturbation) pair is compiled on the eager target."""

import pytest

from graphopt.fuzz.case import RandomDraw
from graphopt.fuzz.generate import Settings, expectations, generate
from graphopt.fuzz.patterns_block import ATTN_PERTURB, GELU_PERTURB, MLP_PERTURB
from graphopt.fuzz.patterns_moe import MOE_PERTURB
from graphopt.fuzz.patterns_norm import ADD_PERTURB, LN_PERTURB, RMS_PERTURB, SOFTMAX_PERTURB
from graphopt.fuzz.runner import check_case, fuzz_pipeline

PERTURBATIONS = {
    "plant_rms_norm": RMS_PERTURB,
    "plant_add_rms_norm": ADD_PERTURB,
    "plant_softmax_rms_norm": SOFTMAX_PERTURB,
    "plant_layer_norm": LN_PERTURB,
    "plant_bias_gelu": GELU_PERTURB,
    "plant_gated_mlp": MLP_PERTURB,
    "plant_attention": ATTN_PERTURB,
    "plant_moe": MOE_PERTURB,
}
CASES = [(kind, perturb) for kind, table in PERTURBATIONS.items() for perturb in table]


def one_step_case(kind, perturb, skip=0):
    """A deterministic single-step case planting ``kind`` with ``perturb`` (the skip-th found)."""
    for i in range(500):
        case = generate(RandomDraw(f"{kind}/{i}"), Settings(min_steps=1, max_steps=1, only=(kind,)), name=kind)
        if len(case.steps) == 1 and case.steps[0].p.get("perturb") == perturb:
            if skip == 0:
                return case
            skip -= 1
    raise AssertionError(f"the generator never planted {kind} with perturbation {perturb}")


@pytest.mark.parametrize("kind, perturb", CASES, ids=[f"{k.removeprefix('plant_')}-{p}" for k, p in CASES])
def test_planted_pattern_fires_or_reports_a_near_miss(kind, perturb):
    case = one_step_case(kind, perturb)
    (outcome,) = check_case(case, ["eager"], fuzz_pipeline())
    assert outcome.status == "ok", outcome.line()
    assert not outcome.fallbacks, outcome.fallbacks
    expected = expectations(case)
    assert expected and any(e.fires == 0 for e in expected) == (PERTURBATIONS[kind][perturb] is not None)
    for e in expected:
        reasons = [m.reason for m in outcome.near_misses if m.pass_name == e.pass_name]
        assert outcome.hits.get(e.pass_name, 0) == e.fires, (e, case.steps[0].params)
        assert e.explained_by(reasons), (e, reasons)
