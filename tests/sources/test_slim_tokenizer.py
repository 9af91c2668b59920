"""The slim tokenizer graphopt generate uses gives transformers' ids, padding, decoding and
special tokens, from the folder a .gguf's tokenizer is kept in, without transformers' classes."""

import pytest

from graphopt.sources.tokenizers import load_tokenizer, smollm2_gguf
from tests.models.gguf_helpers import write_tiny

TEXTS = ["The capital of France is", "def foo(x):\n    return x**2  # héllo 世界", "t1t2 t9", "  x"]


def gguf_files(tmp_path):
    files = [write_tiny(tmp_path / "tiny.gguf", "qwen2")]
    real = smollm2_gguf()
    return files + ([real] if real is not None else [])


def test_slim_and_transformers_agree(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHOPT_CACHE_DIR", str(tmp_path / "cache"))
    for path in gguf_files(tmp_path):
        slim, full = load_tokenizer(str(path), slim=True), load_tokenizer(str(path))
        assert type(slim).__name__ == "SlimTokenizer" and slim.padding_side == "left"
        for special in (True, False):
            a = slim(TEXTS, return_tensors="pt", padding=True, add_special_tokens=special)
            b = full(TEXTS, return_tensors="pt", padding=True, add_special_tokens=special)
            assert a["input_ids"].tolist() == b["input_ids"].tolist(), path
            assert a["attention_mask"].tolist() == b["attention_mask"].tolist(), path
        ids = full(TEXTS[1])["input_ids"]
        assert slim.decode(ids, skip_special_tokens=True) == full.decode(ids, skip_special_tokens=True)
        assert (slim.eos_token_id, slim.pad_token_id) == (full.eos_token_id, full.pad_token_id)


def test_without_a_cache_it_is_transformers_own(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHOPT_CACHE_DIR", "off")
    tokenizer = load_tokenizer(str(write_tiny(tmp_path / "tiny.gguf", "qwen2")), slim=True)
    assert type(tokenizer).__name__ != "SlimTokenizer"


def test_a_damaged_folder_is_read_again(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHOPT_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tiny(tmp_path / "tiny.gguf", "qwen2")
    load_tokenizer(str(path), slim=True)
    (kept,) = (tmp_path / "cache").rglob("tokenizer.json")
    kept.write_text("{ not json")
    tokenizer = load_tokenizer(str(path), slim=True)
    assert tokenizer("t1")["input_ids"] == load_tokenizer(str(path))("t1")["input_ids"]


def test_a_first_slim_load_converts_in_a_child_and_imports_no_transformers_here(tmp_path):
    """The child keeps the converted tokenizer and sends nothing back: a tokenizer object sent
    to this process would import transformers here to unpickle it."""
    import subprocess
    import sys

    path = write_tiny(tmp_path / "tiny.gguf", "qwen2")
    code = ("import sys; from graphopt.sources.tokenizers import load_tokenizer; "
            f"t = load_tokenizer({str(path)!r}, slim=True); "
            "print(type(t).__name__, 'transformers' in sys.modules)")
    env = {**__import__("os").environ, "GRAPHOPT_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["SlimTokenizer", "False"]
