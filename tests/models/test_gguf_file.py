"""graphopt's GGUF reader: the metadata and tensor bytes ``gguf``'s own reader sees, and one
clear error for a file that is not a GGUF or is cut short."""

import numpy as np
import pytest

from graphopt.sources.gguf_file import GGUFFile, GGUFFormatError
from tests.models.gguf_helpers import T, gguf, write_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("gguf") / "tiny.gguf", "qwen2", {"ffn_down": T.Q6_K})


def test_metadata_and_tensors_match_ggufs_reader(tiny):
    ours, theirs = GGUFFile(tiny), gguf.GGUFReader(str(tiny))
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):
            continue  # the header's counts, not metadata
        value = ours.metadata[key]
        expected = field.contents()
        if isinstance(expected, list):
            assert list(value) == expected, key
        else:
            assert value == pytest.approx(expected) if isinstance(expected, float) else value == expected, key
    assert set(ours.tensors) == {t.name for t in theirs.tensors}
    for tensor in theirs.tensors:
        info = ours.tensors[tensor.name]
        assert info.type == int(tensor.tensor_type) and info.nbytes == int(tensor.n_bytes)
        assert np.array_equal(ours.data(tensor.name).reshape(-1).view(np.uint8),
                              np.asarray(tensor.data).reshape(-1).view(np.uint8))


def test_strings_are_read_when_asked(tiny):
    tokens = GGUFFile(tiny).metadata["tokenizer.ggml.tokens"]
    assert len(tokens) == 96 and tokens[2] == "t" and tokens[14] == "t0" and list(tokens)[-1] == "x71"


def test_release_lets_the_pages_go_and_the_bytes_stay_readable(tiny):
    file = GGUFFile(tiny)
    before = file.data("blk.0.ffn_down.weight").copy()
    file.release("blk.0.ffn_down.weight")
    assert np.array_equal(file.data("blk.0.ffn_down.weight"), before)


def test_a_file_that_is_no_gguf_is_refused(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(GGUFFormatError, match="is not a GGUF file"):
        GGUFFile(path)


def test_a_file_cut_short_is_refused_with_where(tiny, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny.read_bytes()[:-4096])
    with pytest.raises(GGUFFormatError, match="cut short"):
        GGUFFile(cut)
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(tiny.read_bytes()[:200])
    with pytest.raises(GGUFFormatError, match="cut short or damaged"):
        GGUFFile(header_only)


def test_a_file_is_parsed_once_until_it_changes(tmp_path):
    from graphopt.sources.gguf_file import open_gguf

    path = write_tiny(tmp_path / "tiny.gguf", "llama", {"ffn_down": T.Q8_0})
    first = open_gguf(path)
    assert open_gguf(str(path)) is first
    write_tiny(path, "llama", {"ffn_down": T.Q6_K})  # rewritten in place: same inode, other bytes
    again = open_gguf(path)
    assert again is not first and again.tensors["blk.0.ffn_down.weight"].type == T.Q6_K
