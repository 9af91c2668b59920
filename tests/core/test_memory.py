"""A model too large for the memory available fails before loading, in one line that says
what it needs, what is available and what would fit; a model that fits is untouched."""

import pytest
import torch

import graphopt
from graphopt import memory
from graphopt.memory import MemoryNeeded
from graphopt.sources import load_checkpoint, load_model
from graphopt.sources.gguf_needs import needed_bytes
from tests.models.gguf_helpers import T, write_tiny


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHOPT_CACHE_DIR", str(tmp_path / "cache"))
    return write_tiny(tmp_path / "tiny.gguf", "qwen2", {"ffn_down": T.Q4_K})


def fake_room(monkeypatch, room: int) -> None:
    monkeypatch.setattr(memory, "available_bytes", lambda: room)


def test_the_estimate_counts_the_runtime_and_the_weights_as_held(tiny):
    own, none = needed_bytes(tiny, "file")
    dense, alternatives = needed_bytes(tiny, "dequantize")
    assert none == [] and own < dense
    assert alternatives == [("on the file's own quantized weights (without --dequantize)", own)]
    assert own > memory.RUNTIME_BYTES  # the weights are in it


def test_dequantized_too_large_names_the_files_own_weights(tiny, monkeypatch):
    own, _ = needed_bytes(tiny, "file")
    fake_room(monkeypatch, own + 1)
    with pytest.raises(MemoryNeeded) as raised:
        load_model(str(tiny), gguf_weights="dequantize")
    message = str(raised.value)
    assert "\n" not in message and "tiny.gguf on its weights dequantized to float32 needs about" in message
    assert "it would fit on the file's own quantized weights (without --dequantize)" in message
    load_model(str(tiny))  # its own weights fit: loads


def test_a_checkpoint_that_does_not_fit_fails_before_exporting(tiny, monkeypatch):
    fake_room(monkeypatch, 10 << 20)
    checkpoint = load_checkpoint(str(tiny))
    built = []
    checkpoint.build = lambda: built.append(1)
    with pytest.raises(MemoryNeeded, match="free memory or use a machine with more"):
        graphopt.generate(checkpoint, torch.tensor([[5, 9]]), 2, options={"target": "onnxruntime",
                                                                          "fallback": "error"})
    assert built == []


def test_the_cli_says_it_in_one_error_line(tiny, monkeypatch, capsys):
    from graphopt.cli import main

    fake_room(monkeypatch, 10 << 20)
    monkeypatch.setattr("sys.argv", ["graphopt", "generate", str(tiny), "-p", "t1t2", "-n", "2"])
    with pytest.raises(SystemExit) as exit_info:
        main.main()
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "needs about" in errors[0] and "GRAPHOPT_MEMORY_CHECK=off" in errors[0], errors


def test_the_check_can_be_turned_off(tiny, monkeypatch):
    fake_room(monkeypatch, 10 << 20)
    monkeypatch.setenv("GRAPHOPT_MEMORY_CHECK", "off")
    out = graphopt.generate(load_checkpoint(str(tiny)), torch.tensor([[5, 9]]), 2, options={"target": "onnxruntime"})
    assert len(out.token_ids(0)) == 2
