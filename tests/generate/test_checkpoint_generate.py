"""graphopt.generate on a Checkpoint (a .gguf on its own weights): the decoder is exported in a
child process and kept; the next call opens it without building the model; the tokens are the
ones the lazy module decodes to on the same target."""

import pytest
import torch

import graphopt
from graphopt.sources import load_checkpoint, load_model
from tests.models.gguf_helpers import T, write_tiny

pytest.importorskip("onnxruntime")


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHOPT_CACHE_DIR", str(tmp_path / "cache"))
    return write_tiny(tmp_path / "tiny.gguf", "qwen2", {"ffn_down": T.Q4_K, "attn_q": T.Q5_0})


def test_a_checkpoint_decodes_and_its_decoder_is_kept(tiny):
    ids = torch.tensor([[5, 9, 14, 3]])
    checkpoint = load_checkpoint(str(tiny))
    built = []
    build = checkpoint.build
    checkpoint.build = lambda: built.append(1) or build()
    first = graphopt.generate(checkpoint, ids, 6, options={"target": "onnxruntime"})
    assert first.target == "onnxruntime" and first.fallback is None
    assert built == []  # built in the child, never here
    assert any("kept the exported decoder" in n for n in first.notes)
    second = graphopt.generate(checkpoint, ids, 6, options={"target": "onnxruntime"})
    assert any("loaded the decoder exported by an earlier run" in n for n in second.notes)
    assert second.token_ids(0) == first.token_ids(0) and built == []
    module = load_model(str(tiny), single_output=False).module  # the same lazy model, decoded as a module
    assert graphopt.generate(module, ids, 6, options={"target": "onnxruntime"}).token_ids(0) == first.token_ids(0)


def test_a_checkpoint_on_the_eager_target_builds_and_reads_its_weights(tiny):
    ids = torch.tensor([[5, 9, 14, 3]])
    out = graphopt.generate(load_checkpoint(str(tiny)), ids, 4, options={"target": "eager"})
    assert out.target == "eager" and len(out.token_ids(0)) == 4
    assert any("read" in n and "checkpoint tensors into memory" in n for n in out.notes)


def test_a_changed_file_is_another_checkpoint(tiny):
    first = load_checkpoint(str(tiny)).identity
    write_tiny(tiny, "qwen2", {"ffn_down": T.Q4_K}, seed=1)
    assert load_checkpoint(str(tiny)).identity != first


def test_a_padded_numpy_batch_decodes_on_the_kept_decoder_as_each_prompt_alone(tiny):
    """numpy ids in, numpy ids out: the kept decoder's runner works on numpy arrays, a
    left-padded batch in one pass, each row giving what its prompt gives alone."""
    np = pytest.importorskip("numpy")
    checkpoint = load_checkpoint(str(tiny))
    prompts = [[5, 9, 14, 3, 7], [8, 2]]
    alone = [graphopt.generate(checkpoint, np.array([p]), 5, options={"target": "onnxruntime"}).token_ids(0)
             for p in prompts]
    ids = np.array([prompts[0], [0, 0, 0] + prompts[1]])
    mask = np.array([[1] * 5, [0, 0, 0, 1, 1]])
    out = graphopt.generate(checkpoint, ids, 5, attention_mask=mask, options={"target": "onnxruntime"})
    assert isinstance(out.sequences, np.ndarray) and out.sequences.shape == (2, 10)
    assert [out.token_ids(0), out.token_ids(1)] == alone


def test_a_warm_cli_run_imports_no_torch(tiny, tmp_path):
    """The second `graphopt generate MODEL.gguf` opens the kept decoder and decodes it with
    numpy and onnxruntime alone: importing torch would cost 2.7 s and 170 MB of a warm start."""
    import json
    import os
    import subprocess
    import sys

    script = ("import json, sys\nfrom graphopt.cli.main import main\nsys.argv = ['graphopt'] + sys.argv[1:]\n"
              "try:\n    main()\nexcept SystemExit:\n    pass\n"
              "print(json.dumps({'torch': 'torch' in sys.modules}))\n")
    env = dict(os.environ)  # the fixture's GRAPHOPT_CACHE_DIR: a fresh cache, so the first run exports
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", script, "generate", str(tiny), "-p", "t1t2", "-n", "3", "--json"],
                              capture_output=True, text=True, env=env, timeout=600)
        assert done.returncode == 0, done.stderr
        lines = done.stdout.strip().splitlines()
        runs.append((json.loads("\n".join(lines[:-1])), json.loads(lines[-1])))
    (first, _), (warm, warm_imports) = runs
    assert warm["outputs"][0]["token_ids"] == first["outputs"][0]["token_ids"]
    assert any("loaded the decoder exported by an earlier run" in n for n in warm["notes"])
    assert warm_imports == {"torch": False}


def test_an_export_started_early_is_taken_up_and_one_for_other_options_is_stopped(tiny, monkeypatch):
    """graphopt generate starts the decoder's export before it converts the tokenizer
    (start_checkpoint); generate with the same options waits for that child, not a second one."""
    import graphopt.forked as forked_module
    from graphopt.backends.onnxruntime.decoder import from_checkpoint
    from graphopt.config import Options
    from graphopt.generation.checkpoint import start_checkpoint

    ids = torch.tensor([[5, 9, 14, 3]])
    checkpoint = load_checkpoint(str(tiny))
    start_checkpoint(checkpoint, Options.parse({"target": "onnxruntime", "int4": True}))  # another decoder
    start_checkpoint(checkpoint, Options.parse({"target": "onnxruntime"}))
    assert len(from_checkpoint._STARTED) == 2
    other, _ = from_checkpoint._STARTED[_key(checkpoint, {"target": "onnxruntime", "int4": True})]
    exported = []
    real = forked_module.run_forked  # checkpoint_runner imports it from there when it is called
    monkeypatch.setattr(forked_module, "run_forked", lambda *a: exported.append(1) or real(*a))
    first = graphopt.generate(checkpoint, ids, 6, options={"target": "onnxruntime"})
    assert exported == [] and from_checkpoint._STARTED == {}
    assert any("kept the exported decoder" in n for n in first.notes)
    assert not other._child.is_alive()
    second = graphopt.generate(checkpoint, ids, 6, options={"target": "onnxruntime"})
    assert second.token_ids(0) == first.token_ids(0)


def _key(checkpoint, options: dict) -> str:
    from graphopt.backends.onnxruntime.decoder import decoder_cache
    from graphopt.config import Options

    return decoder_cache.checkpoint_key(checkpoint.identity, Options.parse(options).to_dict())


def test_a_kept_decoder_opened_early_is_taken_up(tiny, monkeypatch):
    """On a warm run start_checkpoint opens the kept decoder's session in a thread while the
    tokenizer loads; generate takes that session up instead of opening a second, and an error
    while opening reaches generate's caller."""
    from graphopt.backends.onnxruntime.decoder import from_checkpoint, in_place
    from graphopt.config import Options
    from graphopt.errors import GraphoptError
    from graphopt.generation.checkpoint import start_checkpoint

    ids = torch.tensor([[5, 9, 14, 3]])
    checkpoint = load_checkpoint(str(tiny))
    first = graphopt.generate(checkpoint, ids, 6, options={"target": "onnxruntime"})  # exports and keeps it
    opened = []
    real = in_place.kept_decoder_session
    monkeypatch.setattr(in_place, "kept_decoder_session", lambda *a: opened.append(1) or real(*a))
    start_checkpoint(checkpoint, Options.parse({"target": "onnxruntime"}))
    assert list(from_checkpoint._OPENING) == [_key(checkpoint, {"target": "onnxruntime"})]
    warm = graphopt.generate(checkpoint, ids, 6, options={"target": "onnxruntime"})
    assert opened == [1] and from_checkpoint._OPENING == {}
    assert warm.token_ids(0) == first.token_ids(0)
    assert any("loaded the decoder exported by an earlier run" in n for n in warm.notes)
    assert any(n.startswith("mapped the weights ONNX Runtime packed") for n in warm.notes), warm.notes

    def broken(*args):
        raise GraphoptError("the kept decoder is unreadable")

    monkeypatch.setattr(in_place, "kept_decoder_session", broken)
    start_checkpoint(checkpoint, Options.parse({"target": "onnxruntime"}))
    with pytest.raises(GraphoptError, match="unreadable"):
        graphopt.generate(checkpoint, ids, 6, options={"target": "onnxruntime"})
