"""The generator makes valid models: they run eagerly, give finite outputs of the shapes and
dtypes the case declares, rebuild identically from their source, and stay valid when shrunk."""

import re

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphopt.fuzz.case import RandomDraw
from graphopt.fuzz.generate import Settings, generate, kinds
from graphopt.fuzz.source import TORCH_DTYPES, load_source, materialize, module_source
from graphopt.fuzz.strategies import cases

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def run_eagerly(case):
    module, inputs, source = materialize(case)
    with torch.no_grad():
        outputs = module(*inputs)
    return module, inputs, source, outputs


def assert_valid(case):
    _, inputs, _, outputs = run_eagerly(case)
    values = case.values()
    assert len(outputs) >= len(case.outputs) >= 1
    for value_id, out in zip(case.outputs, outputs):
        declared = values[value_id]
        assert tuple(out.shape) == declared.shape, (value_id, module_source(case))
        assert out.dtype == TORCH_DTYPES[declared.dtype], (value_id, module_source(case))
    for out in outputs:
        assert torch.isfinite(out.float()).all(), module_source(case)
    for inp, x in zip(case.inputs, inputs):
        assert tuple(x.shape) == inp.value.shape and x.dtype == TORCH_DTYPES[inp.value.dtype]


@FAST
@given(cases())
def test_generated_models_run_with_the_declared_shapes_and_dtypes(case):
    assert_valid(case)


@FAST
@given(cases(Settings(max_steps=6)), st.data())
def test_removing_any_step_or_output_leaves_a_valid_model(case, data):
    step = data.draw(st.sampled_from(case.steps))
    smaller = case.without_step(step.id)
    if smaller.steps and smaller.outputs:
        assert step.id not in {s.id for s in smaller.steps}
        assert_valid(smaller)
    if len(case.outputs) > 1:
        assert_valid(case.without_output(case.outputs[0]))


def test_every_step_kind_and_dtype_is_generated():
    seen_kinds, seen_dtypes = set(), set()
    for i in range(300):
        case = generate(RandomDraw(f"coverage/{i}"))
        seen_kinds |= {s.kind for s in case.steps}
        seen_dtypes.add(case.dtype)
    assert seen_kinds == set(kinds())
    assert seen_dtypes == {"float32", "float16", "bfloat16"}


def test_source_is_a_readable_reproducible_module():
    case = generate(RandomDraw("source/0"), Settings(min_steps=4))
    source = module_source(case)
    assert source == module_source(case)  # deterministic text
    assert "class FuzzModel(nn.Module)" in source and "def make_inputs()" in source and "def make()" in source
    first, second = load_source(source).make(), load_source(source).make()
    for (name, a), (_, b) in zip(first[0].state_dict().items(), second[0].state_dict().items()):
        assert torch.equal(a, b), name  # seeded weights
    for a, b in zip(first[1], second[1]):
        assert torch.equal(a, b)  # seeded inputs


def test_same_seed_same_case_other_seed_other_case():
    a, b = generate(RandomDraw("s/1")), generate(RandomDraw("s/1"))
    assert a == b
    assert generate(RandomDraw("s/2")) != a


def test_every_rms_norm_spelling_fuse_rms_norm_knows_is_planted():
    """rsqrt(v), v.pow(-0.5), 1 / sqrt(v), x / sqrt(v) and F.rms_norm: each is planted somewhere
    in a seed's first graphs, so the fuzzer tests every spelling the pass accepts."""
    from graphopt.fuzz.runner import case_for

    sources = "\n".join(module_source(case_for(7, i)) for i in range(30))
    normed = [line.split(" = ", 1)[1] for line in sources.splitlines() if re.match(r"\s*t\d+_normed = ", line)]
    spellings = {"rsqrt": r"\* torch\.rsqrt\(", "pow": r"\.pow\(-0\.5\)$", "reciprocal": r"\* \(1 / torch\.sqrt\(",
                 "div": r"^\w+ / torch\.sqrt\("}
    for name, pattern in spellings.items():
        assert any(re.search(pattern, rhs) for rhs in normed), name
    assert "F.rms_norm(" in sources
