"""A .gguf's quantized tensors re-laid out ahead of the export (sources/gguf_prepack.py): the
fields read back are the ones decoding the blocks gives, byte for byte, in the processor's
row order (llama's permuted q/k rows) and for row slices (a head written in row blocks);
a field not written yet is decoded as before; the decoder export reads them and the folder
goes when it is done."""

import numpy as np
import pytest

from graphopt import lazy_weights
from graphopt.sources import gguf_blocks, gguf_prepack
from graphopt.sources.gguf_file import file_identity
from graphopt.sources.gguf_lazy import lazy_model
from tests.models.gguf_helpers import T, write_tiny

TYPES = {"attn_q": T.Q4_0, "attn_k": T.Q5_1, "attn_v": T.Q8_0, "ffn_gate": T.Q4_1, "ffn_up": T.Q5_0,
         "token_embd": T.Q8_0, "attn_output": T.Q5_0}
DOWN = {"llama": T.Q6_K, "qwen2": T.Q4_K}  # K-quants need rows of 256: only ffn_down has them here


@pytest.fixture(params=["llama", "qwen2"])
def tiny(request, tmp_path):
    return write_tiny(tmp_path / f"{request.param}.gguf", request.param, {**TYPES, "ffn_down": DOWN[request.param]})


def _block_sources(path):
    params = lazy_model(path).model.named_parameters()
    return {name: lazy_weights.source_of(p) for name, p in params
            if lazy_weights.block_format(lazy_weights.source_of(p)) is not None}


def _fields(source, rows=None):
    blocks = source.block_quantized(rows)
    return {f: getattr(blocks, f) for f in gguf_prepack.FIELDS}


def _assert_same(got, want, name):
    for field in gguf_prepack.FIELDS:
        if want[field] is None:
            assert got[field] is None, (name, field)
        else:
            assert got[field].dtype == want[field].dtype and np.array_equal(got[field], want[field]), (name, field)


def test_prepacked_fields_are_the_decoded_ones(tiny, tmp_path, monkeypatch):
    sources = _block_sources(tiny)
    assert {s.ggml_type for s in sources.values()} >= {T.Q4_0, T.Q5_1, T.Q8_0, T.Q4_1, T.Q5_0}
    assert any(s.rows is not None for s in sources.values()) == (tiny.stem == "llama")  # q/k rows permuted
    halves = {name: slice(1, s.shape[0] // 2) for name, s in sources.items()}
    decoded = {name: (_fields(s), _fields(s, halves[name])) for name, s in sources.items()}

    written = gguf_prepack.prepack(str(tiny), str(tmp_path / "packed"))
    assert written == len({s.gguf_name for s in sources.values()})
    gguf_prepack.use(file_identity(tiny), tmp_path / "packed")
    monkeypatch.setattr(gguf_blocks, "relayout", lambda *a, **k: pytest.fail("decoded a prepacked tensor"))
    for name, source in _block_sources(tiny).items():
        whole, half = decoded[name]
        _assert_same(_fields(source), whole, name)
        _assert_same(_fields(source, halves[name]), half, name)


def test_a_field_not_written_yet_is_decoded(tiny, tmp_path):
    sources = _block_sources(tiny)
    decoded = {name: _fields(s) for name, s in sources.items()}
    folder = tmp_path / "packed"
    gguf_prepack.prepack(str(tiny), str(folder))
    removed = sorted(folder.glob("*.codes.npy"))[:3] + sorted(folder.glob("*.scales.npy"))[-2:]
    for path in removed:
        path.unlink()
    (folder / "blk.0.ffn_up.weight.codes.npy.123.part").write_bytes(b"half a field")  # a writer cut short
    gguf_prepack.use(file_identity(tiny), folder)
    for name, source in _block_sources(tiny).items():
        _assert_same(_fields(source), decoded[name], name)


def test_the_decoder_export_reads_the_prepack_and_its_folder_goes(tmp_path, monkeypatch):
    pytest.importorskip("onnxruntime")
    from graphopt.backends.onnxruntime.decoder import from_checkpoint
    from graphopt.config import Options
    from graphopt.sources import load_checkpoint

    monkeypatch.setenv("GRAPHOPT_CACHE_DIR", str(tmp_path / "cache"))
    tiny = write_tiny(tmp_path / "tiny.gguf", "qwen2", {"ffn_down": T.Q4_K, "attn_q": T.Q5_0})
    checkpoint = load_checkpoint(str(tiny))
    folders = []
    real_run = checkpoint.prepack.run

    def run(folder):
        folders.append(folder)
        return real_run(folder)

    checkpoint.prepack.run = run
    served = tmp_path / "served.txt"
    real_prepacked = gguf_prepack.prepacked

    def prepacked(identity, tensor, field, rows=None):  # runs in the export's child: it tells through a file
        found = real_prepacked(identity, tensor, field, rows)
        with open(served, "a") as out:
            out.write(f"{found is not None}\n")
        return found

    monkeypatch.setattr(gguf_prepack, "prepacked", prepacked)

    def start_prepack(ck, key):  # the prepack child's work, done before the export needs it
        ck.prepack.run(str(from_checkpoint._prepack_dir(key)))
        return _Done()

    monkeypatch.setattr(from_checkpoint, "_start_prepack", start_prepack)
    runner = from_checkpoint.checkpoint_runner(checkpoint, Options.parse({"target": "onnxruntime"}), 32)
    assert runner.compile_s > 0 and len(folders) == 1
    answers = served.read_text().split()
    assert answers and set(answers) == {"True"}  # every field came from the prepack
    assert not any((tmp_path / "cache" / "prepack").iterdir())  # and its folder is gone


class _Done:
    def cancel(self):
        pass
