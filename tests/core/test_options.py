"""Options: unknown keys and values fail with one line that lists the valid ones."""

import pytest
import torch

from graphopt.config import Options, describe_options
from graphopt.errors import OptionsError


def test_defaults():
    opts = Options.parse(None)
    assert opts.target == "auto" and opts.fallback == "eager" and opts.freeze_weights


def test_unknown_key_lists_valid_options():
    with pytest.raises(OptionsError) as err:
        Options.parse({"tagret": "eager"})
    message = str(err.value)
    assert "\n" not in message and "'tagret'" in message and "target" in message and "fallback" in message


def test_bad_value_lists_choices():
    with pytest.raises(OptionsError, match="choose one of: auto, eager, onnxruntime, triton, tensorrt"):
        Options.parse({"target": "tpu"})


@pytest.mark.parametrize("key, value", [("verify", "maybe"), ("bisect_limit", 1.5), ("tolerance", "x"), ("pipeline", 3)])
def test_wrong_types_fail(key, value):
    with pytest.raises(OptionsError, match=key):
        Options.parse({key: value})


def test_cli_text_values_are_converted():
    opts = Options.parse({"verify": "false", "bisect_limit": "3", "tolerance": "1e-3",
                          "disable_passes": "a,b", "pass_options": '{"fuse_rms_norm": {}}'})
    assert opts.verify is False and opts.bisect_limit == 3 and opts.tolerance == 1e-3
    assert opts.disable_passes == ["a", "b"] and opts.pass_options == {"fuse_rms_norm": {}}


def test_every_option_is_described():
    rows = describe_options()
    assert {r["name"] for r in rows} == set(Options.names())
    assert all(r["help"] for r in rows)


def test_torch_compile_surfaces_the_option_error():
    torch._dynamo.reset()
    compiled = torch.compile(torch.nn.Linear(2, 2), backend="graphopt", options={"tagret": "eager"})
    with pytest.raises(Exception) as err:
        compiled(torch.randn(1, 2))
    assert "unknown graphopt option 'tagret'; valid options:" in str(err.value)


def test_unknown_pass_in_pipeline_fails_clearly():
    torch._dynamo.reset()
    compiled = torch.compile(torch.nn.Linear(2, 2), backend="graphopt", options={"pipeline": ["fuse_everything"]})
    with pytest.raises(Exception, match="unknown pass 'fuse_everything'; known passes:"):
        compiled(torch.randn(1, 2))


def test_unknown_pass_option_fails_clearly():
    torch._dynamo.reset()
    compiled = torch.compile(torch.nn.Linear(2, 2), backend="graphopt",
                             options={"pass_options": {"fuse_rms_norm": {"speed": 11}}})
    with pytest.raises(Exception, match="unknown option.*speed.*fuse_rms_norm"):
        compiled(torch.randn(1, 2))
