"""The packed copy of a kept decoder (prepacked_copy.py): the first session saves ONNX Runtime's
packed weights beside the model, later sessions map them instead of packing again, compute the
same numbers, and a copy for another machine, a damaged copy or a cache that cannot be written
falls back to packing in memory with a note."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from graphopt.backends.onnxruntime.runtime import prepacked_copy
from graphopt.backends.onnxruntime.runtime.prepacked_copy import copy_path, open_packed
from graphopt.backends.onnxruntime.runtime.session import create_session

K, N = 1024, 8192  # 8 MB of 8-bit codes per weight


def _write_model(folder: Path, weights: int = 2) -> Path:
    """``weights`` MatMulNBits (8-bit codes, block 32, no zero points) on one input, saved with
    external data as the decoder cache saves a decoder."""
    import onnx_ir as ir

    rng = np.random.default_rng(0)
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1, K]))
    nodes, inits = [], []
    for i in range(weights):
        codes = ir.Value(name=f"codes{i}", const_value=ir.tensor(rng.integers(0, 256, (N, K // 32, 32), dtype=np.uint8)))
        scales = ir.Value(name=f"scales{i}", const_value=ir.tensor(rng.random((N, K // 32), dtype=np.float32) * 0.01))
        inits += [codes, scales]
        node = ir.Node("com.microsoft", "MatMulNBits", [x, codes, scales], attributes=[
            ir.AttrInt64("K", K), ir.AttrInt64("N", N), ir.AttrInt64("bits", 8), ir.AttrInt64("block_size", 32),
            ir.AttrInt64("accuracy_level", 4)])
        node.outputs[0].name = f"y{i}"
        nodes.append(node)
    graph = ir.Graph([x], [n.outputs[0] for n in nodes], nodes=nodes, initializers=inits,
                     opset_imports={"": 20, "com.microsoft": 1})
    path = folder / "model.onnx"
    ir.save(ir.Model(graph, ir_version=10), path, external_data="model.onnx.data")
    return path


def _open(model, options):
    return create_session(str(model), "cpu", arena=False, spin=False, options=options)


def _run(session) -> list[np.ndarray]:
    x = np.random.default_rng(1).standard_normal((1, K), dtype=np.float32)
    return session.run(None, {"x": x})


def test_the_first_session_saves_the_packed_weights_and_the_next_maps_them(tmp_path):
    model = _write_model(tmp_path)
    plain = _run(_open(model, None))
    first, note = open_packed(model, _open)
    copy = copy_path(model)
    assert note == f"saved the weights ONNX Runtime packed in {copy.name}: later runs map them"
    assert copy.is_file() and copy.with_name(copy.name + ".data").is_file()
    saved = onnx.load(copy, load_external_data=False)
    packed = [e.key for i in saved.graph.initializer for e in i.external_data if e.key.startswith("prepacked")]
    assert packed, "ONNX Runtime saved no packed weights in the copy"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".packing-")] == []  # staging cleaned up
    stamp = copy.stat().st_mtime_ns
    second, note = open_packed(model, _open)
    assert note == f"mapped the weights ONNX Runtime packed from {copy.name}"
    assert copy.stat().st_mtime_ns == stamp  # opened, not saved again
    for a, b, c in zip(plain, _run(first), _run(second)):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


_ANON_GROWTH = """
import sys
from graphopt.backends.onnxruntime.runtime.session import create_session
def anon():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon")) << 10
before = anon()
session = create_session(sys.argv[1], "cpu", arena=False)
print(anon() - before)
"""


def _anonymous_growth(model: Path) -> int:
    out = subprocess.run([sys.executable, "-c", _ANON_GROWTH, str(model)], capture_output=True, text=True,
                         check=True, timeout=300)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RssAnon from /proc")
def test_a_session_on_the_copy_holds_no_packed_weights_of_its_own(tmp_path):
    """Plain, each session packs the weights into memory of its own; on the copy it maps them."""
    model = _write_model(tmp_path, weights=16)  # 128 MB of codes: well above the ~25 MB a session starts with
    open_packed(model, _open)
    weights = 16 * N * K
    assert _anonymous_growth(model) > 0.8 * weights  # measured here: 1.38x
    assert _anonymous_growth(copy_path(model)) < 0.3 * weights  # measured here: 0.21x


def test_a_copy_packed_on_another_machine_is_not_used(tmp_path, monkeypatch):
    model = _write_model(tmp_path, weights=1)
    open_packed(model, _open)
    mine = copy_path(model)
    monkeypatch.setattr(prepacked_copy, "machine_tag", lambda: "another-cpu")
    session, note = open_packed(model, _open)
    assert note.startswith("saved") and copy_path(model) != mine and copy_path(model).is_file()


def test_a_damaged_copy_is_packed_again(tmp_path):
    model = _write_model(tmp_path, weights=1)
    open_packed(model, _open)
    copy_path(model).write_bytes(b"not a model")
    session, note = open_packed(model, _open)
    assert "could not be opened" in note and note.endswith("later runs map them")
    np.testing.assert_array_equal(_run(session)[0], _run(_open(model, None))[0])
    assert onnx.load(copy_path(model), load_external_data=False).graph.node  # a whole copy again


def test_a_cache_that_cannot_keep_the_copy_packs_in_memory(tmp_path, monkeypatch):
    model = _write_model(tmp_path, weights=1)

    def read_only(*args, **kwargs):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(prepacked_copy.tempfile, "mkdtemp", read_only)
    session, note = open_packed(model, _open)
    assert note.startswith("could not keep the packed weights beside model.onnx: read-only")
    assert not copy_path(model).exists()
    np.testing.assert_array_equal(_run(session)[0], _run(_open(model, None))[0])
