"""Tiny .gguf files for tests, written with the ``gguf`` package the way llama.cpp's converter
lays a model out: gguf tensor names, Llama's q/k rows permuted for its rotary, quantized
2-D weights and float norms, and a small vocabulary."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

gguf = __import__("pytest").importorskip("gguf")
T = gguf.GGMLQuantizationType

# the GGUF config keys transformers reads for these architectures
VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 96, 64, 256, 3, 4, 2  # INTER: K-quant rows need 256


def random_blocks(qtype: int, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Valid random blocks of a K-quant (gguf has no quantizer for them): random bytes with
    finite float16 super-block scales."""
    elements, size = gguf.constants.GGML_QUANT_SIZES[T(qtype)]
    raw = rng.integers(0, 256, (rows, cols // elements, size), dtype=np.uint8)
    scale_at = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.Q3_K: (108,), T.Q2_K: (80, 82)}[qtype]
    for offset in scale_at:
        halves = (rng.standard_normal((rows, cols // elements)) * 0.002).astype(np.float16)
        raw[..., offset:offset + 2] = halves.view(np.uint8).reshape(rows, cols // elements, 2)
    return raw.reshape(rows, -1)


def quantized(values: np.ndarray, qtype: int, rng: np.random.Generator) -> np.ndarray:
    """``values`` [rows, cols] in ``qtype``: gguf's own quantizer, or random blocks for K-quants."""
    try:
        return gguf.quants.quantize(values.astype(np.float32), T(qtype))
    except NotImplementedError:
        return random_blocks(qtype, *values.shape, rng)


def permute_for_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's reordering of q/k rows (transformers undoes it when loading)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny(path: Path, arch: str = "llama", types: dict[str, int] | None = None, seed: int = 0,
               tied: bool = True) -> Path:
    """A 3-layer model of ``arch`` (llama or qwen2) with random weights. ``types`` maps a
    tensor kind (``attn_q``, ``ffn_down``, ``token_embd``, ...) to its ggml type (Q8_0 default)."""
    types = types or {}
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(VOCAB)
    writer.add_tokenizer_model("gpt2")
    # a byte-level vocabulary: "t", the digits, "t0".."t9" by merges, then filler
    digits = [str(i) for i in range(10)]
    tokens = ["<s>", "</s>", "t", "Ġ", *digits, *[f"t{d}" for d in digits]]
    tokens += [f"x{i}" for i in range(VOCAB - len(tokens))]
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3] + [1] * (VOCAB - 2))
    writer.add_token_merges([f"t {d}" for d in digits])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    head_dim = HIDDEN // HEADS

    def add(name: str, kind: str, values: np.ndarray) -> None:
        qtype = types.get(kind, T.Q8_0) if values.ndim == 2 else T.F32
        if qtype == T.F32:
            writer.add_tensor(name, values.astype(np.float32))
        else:
            data = quantized(values, qtype, rng)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=T(qtype))

    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32) * 0.05  # noqa: E731
    add("token_embd.weight", "token_embd", normal(VOCAB, HIDDEN))
    add("output_norm.weight", "norm", 1 + normal(HIDDEN))
    if not tied:
        add("output.weight", "output", normal(VOCAB, HIDDEN))
    for i in range(LAYERS):
        q, k = normal(HEADS * head_dim, HIDDEN), normal(KV_HEADS * head_dim, HIDDEN)
        if arch == "llama":
            q, k = permute_for_rotary(q, HEADS), permute_for_rotary(k, KV_HEADS)
        add(f"blk.{i}.attn_q.weight", "attn_q", q)
        add(f"blk.{i}.attn_k.weight", "attn_k", k)
        add(f"blk.{i}.attn_v.weight", "attn_v", normal(KV_HEADS * head_dim, HIDDEN))
        add(f"blk.{i}.attn_output.weight", "attn_output", normal(HIDDEN, HIDDEN))
        add(f"blk.{i}.ffn_gate.weight", "ffn_gate", normal(INTER, HIDDEN))
        add(f"blk.{i}.ffn_up.weight", "ffn_up", normal(INTER, HIDDEN))
        add(f"blk.{i}.ffn_down.weight", "ffn_down", normal(HIDDEN, INTER))
        add(f"blk.{i}.attn_norm.weight", "norm", 1 + normal(HIDDEN))
        add(f"blk.{i}.ffn_norm.weight", "norm", 1 + normal(HIDDEN))
        if arch == "qwen2":
            for part, width in (("q", HEADS * head_dim), ("k", KV_HEADS * head_dim), ("v", KV_HEADS * head_dim)):
                add(f"blk.{i}.attn_{part}.bias", "bias", normal(width))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def transformers_model(path: Path):
    """The file as transformers loads it: dequantized to float32 (the reference)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             dtype=torch.float32).eval()
