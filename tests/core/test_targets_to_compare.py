"""targets_to_compare: what a benchmark runs when not told: eager and auto's first choice."""

import pytest

from graphopt import targets


@pytest.mark.parametrize("hardware, second", [("cpu", "onnxruntime"), ("cuda", "triton"), ("rocm", "triton")])
def test_eager_and_autos_first_choice_per_hardware(monkeypatch, hardware, second):
    monkeypatch.setattr(targets, "detect_hardware", lambda: hardware)
    assert targets.targets_to_compare() == ["eager", second]


def test_a_requested_list_is_kept_as_given():
    assert targets.targets_to_compare("onnxruntime,eager") == ["onnxruntime", "eager"]
