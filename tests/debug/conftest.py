"""Shared pieces of the ``graphopt debug`` tests: an in-process CLI runner (so passes
planted into the registry with monkeypatch are visible), planted passes, and a small
Hugging Face Llama given as a config.json path."""

from __future__ import annotations

import json
import shlex

import pytest
from typer.testing import CliRunner

from graphopt.registry import scoped_passes
from graphopt.cli.main import app
from tests.debug.planted import DropsVal, Explode, RewriteEps

RMS_PIPELINE = "canonicalize,fuse_rms_norm"


def debug(*args: str, expect_code: int = 0):
    """``graphopt debug ARGS`` in this process; returns the result after checking its exit code."""
    result = CliRunner().invoke(app, ["debug", *args])
    if result.exit_code != expect_code:
        raise AssertionError(f"exit code {result.exit_code} != {expect_code}\n{result.output}\n{result.exception!r}")
    return result


def debug_json(*args: str, expect_code: int = 0) -> dict:
    return json.loads(debug(*args, "--json", expect_code=expect_code).stdout)


def rerun(command: str, *extra: str) -> dict:
    """Run a printed ``graphopt debug ...`` command line (with ``extra`` flags) and read its JSON."""
    argv = shlex.split(command)
    assert argv[:2] == ["graphopt", "debug"], command
    return debug_json(*argv[2:], *extra)


@pytest.fixture
def planted():
    """Registers wrong-on-purpose passes for one test; returns them by name."""
    passes = {"rewrite_eps": RewriteEps(wrong=2), "explode": Explode(), "drops_val": DropsVal()}
    with scoped_passes(*passes.values()):
        yield passes


@pytest.fixture(scope="session")
def hf_llama_config(tmp_path_factory) -> str:
    """A two-layer transformers Llama, as the config.json path the CLI takes."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("hf_llama") / "config.json"
    transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=64).to_json_file(str(path))
    return str(path)
