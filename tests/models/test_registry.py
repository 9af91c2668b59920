"""The named-model registry: listing, unknown names, example inputs."""

from __future__ import annotations

import pytest
import torch

from graphopt import models


def test_list_models_names_every_size():
    infos = {m.name: m for m in models.list_models()}
    assert {"llama-tiny", "llama-small", "bert-tiny", "bert-small"} <= set(infos)
    assert infos["llama-small"].family == "llama"
    assert 150e6 < infos["llama-small"].params < 160e6
    assert all(m.description for m in infos.values())


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="llama-tiny") as info:
        models.build("llama-huge")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", ["llama-tiny", "bert-tiny"])
def test_example_inputs_run_the_model(name):
    model = models.build(name)
    args = models.example_inputs(name, batch=2, seq_len=8)
    assert args[0].shape == (2, 8) and args[0].dtype == torch.long
    assert int(args[0].max()) < model.config.vocab_size
    torch.testing.assert_close(models.example_inputs(model, batch=2, seq_len=8)[0], args[0])
    with torch.no_grad():
        model(*args)


def test_example_inputs_refuse_sequences_past_the_model_limit():
    with pytest.raises(ValueError, match="seq_len"):
        models.example_inputs("bert-tiny", seq_len=1000)
