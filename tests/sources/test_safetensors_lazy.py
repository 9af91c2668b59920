"""A safetensors checkpoint directory with its weights left in the files (safetensors_lazy): the
model is built on fake weights, and the ONNX exporter reads each tensor from the file as it writes
it. The exported model gives the eager model's logits, no more than a few tensors are ever read
at once, a checkpoint's own dtype is kept where it is asked for, and --int4 (round-to-nearest)
quantizes each weight as it is written, to the same codes as the in-memory path."""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch

from graphopt import lazy_weights
from graphopt.config import Options
from graphopt.errors import ModelLoadError
from graphopt.sources import load_checkpoint, load_model
from graphopt.sources import safetensors_lazy
from graphopt.sources.safetensors_file import read_header

transformers = pytest.importorskip("transformers")
ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

LAYERS = 4
RTN = {"quantize_int4": {"search": "rtn"}}


def save(folder, kind: str, dtype: torch.dtype):
    """A tiny Llama (untied head) or Qwen2 (tied head, q/k/v biases) in ``dtype``, as save_pretrained writes it."""
    common = dict(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config = (transformers.LlamaConfig(**common, tie_word_embeddings=False) if kind == "llama"
              else transformers.Qwen2Config(**common, tie_word_embeddings=True))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # trained-like norms, not all ones
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    model.to(dtype).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def llama_bf16(tmp_path_factory):
    return save(tmp_path_factory.mktemp("llama_bf16"), "llama", torch.bfloat16)


@pytest.fixture(scope="module")
def qwen_fp32(tmp_path_factory):
    return save(tmp_path_factory.mktemp("qwen_fp32"), "qwen2", torch.float32)


@pytest.fixture(scope="module")
def qwen_fp16(tmp_path_factory):
    return save(tmp_path_factory.mktemp("qwen_fp16"), "qwen2", torch.float16)


def eager_logits(folder, ids: torch.Tensor) -> np.ndarray:
    """The model as transformers loads it (every weight in memory), in float32."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.numpy()


def export(loaded, path, config: Options | None = None, **kwargs):
    from graphopt.export.model import export_model

    return export_model(loaded.module, loaded.example_inputs, str(path), config=config or Options.parse({}),
                        input_names=["input_ids"], output_names=["logits"], validate_model=False, **kwargs)


def run_onnx(path, ids: torch.Tensor) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {"input_ids": ids.numpy()})[0]


def initializers(path) -> dict[str, np.ndarray]:
    from onnx import numpy_helper

    model = onnx.load(str(path))
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


IDS = torch.tensor([[3, 17, 42, 99, 5, 150, 7, 64], [1, 2, 3, 4, 5, 6, 7, 8]])


@pytest.mark.parametrize("fixture", ["llama_bf16", "qwen_fp32"])
def test_the_streamed_export_gives_the_eager_models_logits(fixture, request, tmp_path):
    folder = request.getfixturevalue(fixture)
    loaded = load_model(str(folder), batch=2, seq_len=8, stream_weights=True)
    assert lazy_weights.has_lazy_weights(loaded.module)
    assert not any(p.device.type == "meta" for p in loaded.module.parameters())
    export(loaded, tmp_path / "m.onnx")
    got, want = run_onnx(tmp_path / "m.onnx", IDS), eager_logits(folder, IDS)
    # float32 throughout (a bf16 file is widened exactly); the fused ops reorder sums: 1e-4 relative
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_building_reads_no_weight_and_the_export_reads_a_few_at_a_time(llama_bf16, tmp_path, monkeypatch):
    """Each tensor read from the file is watched until it is freed: the writer holds a handful at
    once (it writes on up to 4 threads), never the model's 39."""
    alive: list[weakref.ref] = []
    most = [0]
    reads = []
    load = safetensors_lazy.SafetensorsTensor.load

    def watched(self):
        tensor = load(self)
        alive[:] = [r for r in alive if r() is not None]
        alive.append(weakref.ref(tensor))
        most[0] = max(most[0], len(alive))
        reads.append(self.key)
        return tensor

    monkeypatch.setattr(safetensors_lazy.SafetensorsTensor, "load", watched)
    loaded = load_model(str(llama_bf16), batch=2, seq_len=8, stream_weights=True)
    assert reads == []  # built on fake weights
    tensors = len(read_header(llama_bf16 / "model.safetensors"))
    assert tensors == 9 * LAYERS + 3
    export(loaded, tmp_path / "m.onnx")
    assert sorted(set(reads)) == sorted(read_header(llama_bf16 / "model.safetensors"))
    assert most[0] <= 6 < tensors


def test_a_half_checkpoint_keeps_its_bytes_when_asked_for_its_dtype(qwen_fp16, llama_bf16, tmp_path):
    from safetensors import safe_open

    with safe_open(str(qwen_fp16 / "model.safetensors"), framework="pt") as handle:
        table = handle.get_tensor("model.embed_tokens.weight")
        down = handle.get_tensor("model.layers.0.mlp.down_proj.weight")
    loaded = load_model(str(qwen_fp16), batch=2, seq_len=8, dtype=torch.float16, stream_weights=True)
    export(loaded, tmp_path / "m.onnx")
    values = initializers(tmp_path / "m.onnx")
    halves = [v for v in values.values() if v.dtype == np.float16]
    assert halves and not any(v.dtype == np.float32 and v.ndim == 2 for v in values.values())
    assert any(v.shape == table.shape and np.array_equal(v, table.numpy()) for v in halves)  # the file's bytes
    assert any(np.array_equal(v, down.numpy().T) for v in halves)  # a MatMul's [K, N], the same halves
    got, want = run_onnx(tmp_path / "m.onnx", IDS), eager_logits(qwen_fp16, IDS)
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
    # bf16: ONNX Runtime's CPU provider has no bf16 MatMul, so only the source keeps it: the file's words
    model = load_model(str(llama_bf16), dtype=torch.bfloat16, single_output=False, stream_weights=True).module
    weight = lazy_weights.materialize(model.model.layers[1].self_attn.q_proj.weight)
    with safe_open(str(llama_bf16 / "model.safetensors"), framework="pt") as handle:
        stored = handle.get_tensor("model.layers.1.self_attn.q_proj.weight")
    assert weight.dtype == torch.bfloat16 and torch.equal(weight.view(torch.int16), stored.view(torch.int16))


@pytest.mark.parametrize("fixture,symmetric", [("llama_bf16", True), ("qwen_fp32", False)])
def test_int4_rtn_streamed_matches_the_in_memory_path_bit_for_bit(fixture, symmetric, request, tmp_path):
    folder = request.getfixturevalue(fixture)
    config = Options.parse({"pass_options": {"quantize_int4": {"search": "rtn", "symmetric": symmetric}}})
    streamed = load_model(str(folder), batch=2, seq_len=8, stream_weights=True)
    in_memory = load_model(str(folder), batch=2, seq_len=8)
    assert not lazy_weights.has_lazy_weights(in_memory.module)
    lazy_result = export(streamed, tmp_path / "lazy.onnx", config=config, int4=True)
    export(in_memory, tmp_path / "whole.onnx", config=config, int4=True)
    assert not lazy_result.fallbacks
    lazy, whole = initializers(tmp_path / "lazy.onnx"), initializers(tmp_path / "whole.onnx")
    assert sorted(lazy) == sorted(whole)
    quantized = [n for n, v in lazy.items() if v.dtype == np.uint8]
    # every linear's codes (q/k/v and gate/up merged) and the head's, and the 4-bit zero points
    assert len(quantized) == (4 * LAYERS + 1) + (0 if symmetric else 4 * LAYERS)
    for name in lazy:
        assert np.array_equal(lazy[name], whole[name]), name
    assert np.array_equal(run_onnx(tmp_path / "lazy.onnx", IDS), run_onnx(tmp_path / "whole.onnx", IDS))


@pytest.mark.parametrize("fixture,bits", [("llama_bf16", 4), ("qwen_fp32", 8)])
def test_quantized_embeddings_stream_to_the_in_memory_codes(fixture, bits, request, tmp_path):
    """--embedding-bits on a streamed checkpoint: the table is quantized as it is written (the
    whole INT4 pass failed on the fake table before), to the in-memory export's codes; Qwen2's
    tied table at 8 bits reads its 8-bit head's codes."""
    folder = request.getfixturevalue(fixture)
    config = Options.parse({"pass_options": {"quantize_int4": {"search": "rtn", "embedding_bits": bits}}})
    lazy_result = export(load_model(str(folder), batch=2, seq_len=8, stream_weights=True), tmp_path / "lazy.onnx",
                         config=config, int4=True)
    export(load_model(str(folder), batch=2, seq_len=8), tmp_path / "whole.onnx", config=config, int4=True)
    assert not lazy_result.fallbacks
    stats = next(r for r in lazy_result.passes if r["name"] == "quantize_int4")["stats"]
    assert stats["embeddings"] == 1
    lazy, whole = initializers(tmp_path / "lazy.onnx"), initializers(tmp_path / "whole.onnx")
    assert sorted(lazy) == sorted(whole)
    assert not any(v.shape == (160, 64) and v.dtype.kind == "f" for v in lazy.values())  # no float table
    for name in lazy:
        assert np.array_equal(lazy[name], whole[name]), name


@pytest.mark.parametrize("int4", [{"search": "gptq"}, {"search": "rtn", "budget": 0.25},
                                  {"search": "gptq", "budget": 0.25, "calibration": list(range(3, 60))}])
def test_gptq_and_a_budget_calibrate_on_the_streamed_checkpoint(int4, llama_bf16, tmp_path, monkeypatch):
    """GPTQ and an --int4-budget run the graph streamed on their calibration inputs and read each
    weight when its input's Hessian is complete: a few weights alive at a time, never the model's
    39, and the file is the in-memory export's, bit for bit (the budget's choices included)."""
    alive: list[weakref.ref] = []
    most = [0]
    load, load_rows = safetensors_lazy.SafetensorsTensor.load, safetensors_lazy.SafetensorsTensor.load_rows

    def watch(tensor):
        alive[:] = [r for r in alive if r() is not None]
        alive.append(weakref.ref(tensor))
        most[0] = max(most[0], len(alive))
        return tensor

    monkeypatch.setattr(safetensors_lazy.SafetensorsTensor, "load", lambda self: watch(load(self)))
    monkeypatch.setattr(safetensors_lazy.SafetensorsTensor, "load_rows",
                        lambda self, start, stop: watch(load_rows(self, start, stop)))
    config = Options.parse({"pass_options": {"quantize_int4": int4}})
    streamed = export(load_model(str(llama_bf16), batch=2, seq_len=8, stream_weights=True), tmp_path / "lazy.onnx",
                      config=config, int4=True)
    monkeypatch.undo()
    assert not streamed.fallbacks and most[0] <= 6 < len(read_header(llama_bf16 / "model.safetensors"))
    in_memory = export(load_model(str(llama_bf16), batch=2, seq_len=8), tmp_path / "whole.onnx", config=config,
                       int4=True)
    stats = [next(p for p in r.passes if p["name"] == "quantize_int4")["stats"] for r in (streamed, in_memory)]
    assert stats[0]["calibration"] == stats[1]["calibration"] != "none"
    bits = [[layer["bits"] for layer in s["layers"]] for s in stats]
    assert bits[0] == bits[1] and (not int4.get("budget") or bits[0].count(8) > 1)  # the budget moved some to 8
    lazy, whole = initializers(tmp_path / "lazy.onnx"), initializers(tmp_path / "whole.onnx")
    assert sorted(lazy) == sorted(whole)
    for name in lazy:
        assert np.array_equal(lazy[name], whole[name]), name


def test_a_checkpoint_directory_decodes_on_its_streamed_decoder(qwen_fp32, tmp_path, monkeypatch):
    import graphopt

    monkeypatch.setenv("GRAPHOPT_CACHE_DIR", str(tmp_path / "cache"))
    checkpoint = load_checkpoint(str(qwen_fp32))
    assert checkpoint is not None and checkpoint.identity.startswith("safetensors;")
    ids = torch.tensor([[5, 9, 14, 3, 77]])
    out = graphopt.generate(checkpoint, ids, 8, options={"target": "onnxruntime"})
    assert out.target == "onnxruntime" and out.fallback is None
    model = transformers.AutoModelForCausalLM.from_pretrained(qwen_fp32, dtype=torch.float32).eval()
    want = model.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert out.token_ids(0) == want[0, ids.shape[1]:].tolist()


def test_a_changed_weights_file_is_another_checkpoint(tmp_path):
    folder = save(tmp_path / "m", "qwen2", torch.float32)
    first = load_checkpoint(str(folder)).identity
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes())  # same bytes, a new modification time
    assert load_checkpoint(str(folder)).identity != first


def test_a_truncated_weights_file_is_one_line(tmp_path):
    folder = save(tmp_path / "m", "qwen2", torch.float32)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ModelLoadError, match="cut short") as info:
        load_model(str(folder), stream_weights=True)
    assert "\n" not in str(info.value) and "re-save the checkpoint" in str(info.value)


def test_int4_reads_each_weight_a_block_of_rows_at_a_time(llama_bf16, tmp_path, monkeypatch):
    """The quantizer reads a streamed weight in blocks of rows (16 here) and never whole: not the
    LM head, nor a merged QKV or gate/up (their parts read where the block falls), each read
    covering all rows (the ONNX cleanup reads a tiny model's weights again: the codes are
    computed anew), and the codes are the in-memory export's, bit for bit."""
    from graphopt.quant import groupwise

    monkeypatch.setattr(groupwise, "BLOCK_ELEMENTS", 16 * 64)
    whole, rows = [], {}
    load, load_rows = safetensors_lazy.SafetensorsTensor.load, safetensors_lazy.SafetensorsTensor.load_rows

    def spy_load(self):
        whole.append(self.key)
        return load(self)

    def spy_rows(self, start, stop):
        rows.setdefault(self.key, []).append(stop - start)
        return load_rows(self, start, stop)

    quantized = []
    quantize_int8 = groupwise.quantize_int8

    def spy_int8(w, *args, **kwargs):
        quantized.append(tuple(w.shape))
        return quantize_int8(w, *args, **kwargs)

    monkeypatch.setattr(safetensors_lazy.SafetensorsTensor, "load", spy_load)
    monkeypatch.setattr(safetensors_lazy.SafetensorsTensor, "load_rows", spy_rows)
    monkeypatch.setattr(groupwise, "quantize_int8", spy_int8)
    config = Options.parse({"pass_options": RTN})
    export(load_model(str(llama_bf16), batch=2, seq_len=8, stream_weights=True), tmp_path / "lazy.onnx",
           config=config, int4=True)
    header = read_header(llama_bf16 / "model.safetensors")
    linears = [k for k in header if k.endswith("proj.weight") or k == "lm_head.weight"]
    assert len(linears) == 7 * LAYERS + 1
    assert not set(whole) & set(linears)  # read by rows only: the head too
    for key in linears:
        assert max(rows[key]) <= 16 and sum(rows[key]) % header[key].shape[0] == 0, key
    assert [s for s in quantized if s[0] > 1] and max(s[0] for s in quantized) <= 16  # the 8-bit head, in blocks
    monkeypatch.undo()
    export(load_model(str(llama_bf16), batch=2, seq_len=8), tmp_path / "whole.onnx", config=config, int4=True)
    lazy, in_memory = initializers(tmp_path / "lazy.onnx"), initializers(tmp_path / "whole.onnx")
    assert sorted(lazy) == sorted(in_memory)
    for name in lazy:
        assert np.array_equal(lazy[name], in_memory[name]), name


@pytest.mark.parametrize("int4", [False, True])
def test_the_validation_reference_reads_a_nodes_weights_at_a_time(int4, llama_bf16, monkeypatch):
    """graphopt export's check against eager runs the optimized graph of a streamed model node by
    node on both input sets at once: each weight is read once (for both sets), no more than one
    node's weights are alive at a time, and the outputs are those of the graph with every
    weight read in, bit for bit."""
    from graphopt.compiler import front_half
    from graphopt.export.model import dims_for
    from graphopt.export.validate import reference_outputs, resample_like
    from graphopt.pipeline import with_int4

    loaded = load_model(str(llama_bf16), batch=2, seq_len=8, stream_weights=True)
    gm = front_half(loaded.module, with_int4(Options.parse({"pass_options": RTN}), int4), lambda o: o.gm,
                    args=loaded.example_inputs, dynamic_shapes=tuple(dims_for([{0: "batch", 1: "sequence"}])),
                    trace_repeated_once=True)
    input_sets = [list(loaded.example_inputs), resample_like(loaded.example_inputs)]
    alive: list[weakref.ref] = []
    most, rows = [0], {}
    load, load_rows = safetensors_lazy.SafetensorsTensor.load, safetensors_lazy.SafetensorsTensor.load_rows

    def watch(key, tensor):
        alive[:] = [r for r in alive if r() is not None]
        alive.append(weakref.ref(tensor))
        most[0] = max(most[0], len(alive))
        rows[key] = rows.get(key, 0) + tensor.shape[0]
        return tensor

    monkeypatch.setattr(safetensors_lazy.SafetensorsTensor, "load", lambda self: watch(self.key, load(self)))
    monkeypatch.setattr(safetensors_lazy.SafetensorsTensor, "load_rows",
                        lambda self, start, stop: watch(self.key, load_rows(self, start, stop)))
    streamed = reference_outputs(gm, input_sets)
    monkeypatch.undo()
    header = read_header(llama_bf16 / "model.safetensors")
    assert rows == {key: entry.shape[0] for key, entry in header.items()}  # each weight read once, all sets
    assert most[0] <= 3 < len(header)  # q, k and v of a merged projection at most
    lazy_weights.load_constants(gm)
    with torch.no_grad():
        expected = [gm(*inputs) for inputs in input_sets]
    for got, want in zip(streamed, expected):
        assert all(torch.equal(a, b) for a, b in zip(torch.utils._pytree.tree_leaves(got),
                                                     torch.utils._pytree.tree_leaves(want)))


def test_a_validated_streamed_export_matches_eager(qwen_fp32, tmp_path):
    from graphopt.export.model import export_model

    loaded = load_model(str(qwen_fp32), batch=2, seq_len=8, stream_weights=True)
    result = export_model(loaded.module, loaded.example_inputs, str(tmp_path / "m.onnx"), config=Options.parse({}),
                          input_names=["input_ids"], output_names=["logits"])
    rows = result.files[0].validation
    assert len(rows) == 2 and all(r["rel_err"] < 1e-4 and r["top1_agreement"] == 1.0 for r in rows)


def test_a_streamed_export_writes_its_weights_beside_the_model(qwen_fp32, tmp_path):
    """Weights still in their checkpoint go to m.onnx.data one at a time, whatever the model's
    size (inline, the protobuf would hold them all, then its serialized bytes); an in-memory
    export under the same name then writes inline and removes the stale .data file."""
    streamed = export(load_model(str(qwen_fp32), batch=2, seq_len=8, stream_weights=True), tmp_path / "m.onnx",
                      int4=True)
    assert streamed.files[0].files == [str(tmp_path / "m.onnx.data"), str(tmp_path / "m.onnx")]
    got = run_onnx(tmp_path / "m.onnx", IDS)
    in_memory = export(load_model(str(qwen_fp32), batch=2, seq_len=8), tmp_path / "m.onnx", int4=True, force=True)
    assert in_memory.files[0].files == [str(tmp_path / "m.onnx")] and not (tmp_path / "m.onnx.data").exists()
    assert np.array_equal(run_onnx(tmp_path / "m.onnx", IDS), got)


def test_gptq_decodes_a_checkpoint_directory_on_its_streamed_weights(qwen_fp32, tmp_path, monkeypatch):
    """graphopt generate DIR --int4 --calibration-text: the decoder's GPTQ calibrates on the
    weights left in the file (its graph updates its KV cache in place, so the calibration sets
    run one after another) and decodes as the same model loaded in memory does. Its export runs
    in a forked child, as graphopt generate's does (GPTQ's matmuls on OpenMP threads there)."""
    import graphopt

    options = {"target": "onnxruntime", "int4": True, "pass_options": {"quantize_int4": {"search": "gptq"}}}
    ids = torch.tensor([[5, 9, 14, 3, 77]])
    monkeypatch.setenv("GRAPHOPT_CACHE_DIR", str(tmp_path / "streamed"))
    streamed = graphopt.generate(load_checkpoint(str(qwen_fp32)), ids, 8, options=options)
    assert streamed.fallback is None and not any("into memory" in n for n in streamed.notes)
    monkeypatch.setenv("GRAPHOPT_CACHE_DIR", str(tmp_path / "in_memory"))
    module = load_model(str(qwen_fp32), single_output=False).module
    assert not lazy_weights.has_lazy_weights(module)
    assert graphopt.generate(module, ids, 8, options=options).token_ids(0) == streamed.token_ids(0)
