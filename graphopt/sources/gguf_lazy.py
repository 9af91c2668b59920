"""A ``.gguf`` file as a transformers model whose weights stay in the file until a runtime asks.

``lazy_model(path)`` reads the file's metadata (``gguf_file.GGUFFile``: a fraction of a second
where transformers' reader takes 7-19 s), builds the transformers config it describes and the
model from that config with fake parameters (no memory), and links each parameter to its tensor
in the file (``graphopt.lazy_weights``): quantized ones offer their blocks as they are
(``block_quantized``), and every one can be read as float32 (``load``).

What transformers knows is used as transformers has it: the config keys
(``GGUF_CONFIG_MAPPING``), the tensor names (``get_gguf_hf_weights_map``, from gguf's own name
tables) and the per-architecture tensor processors that undo llama.cpp's conversions (Llama's
q/k row permutation, Gemma's norm offset, ...). A processor is applied to a quantized tensor's
rows only when it is a row permutation, which is checked by running it on row indices: a
permutation of whole rows moves whole blocks, so the file's codes stay exact. Any other
transform (a transpose, a value change) makes that tensor dense: it is dequantized and
transformed as transformers would, and the model says so.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from graphopt import lazy_weights

from graphopt.sources import gguf_blocks as blocks_mod
from graphopt.sources.gguf_file import GGUFFile, open_gguf
from graphopt.ops.quant_blocks import BlockFormat, BlockQuantized
from graphopt.sources import gguf_prepack

# Architectures whose GGUF config transformers derives with steps this module does not repeat
# (T5's encoder-decoder split, LFM2's per-layer heads, GPT-OSS's rope scaling keys, ...):
# they load through transformers' own dequantizing reader instead.
UNSUPPORTED = ("t5", "t5encoder", "lfm2", "gpt-oss", "gpt_oss", "minimax-m2")
_RENAMED = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}


def gguf_config(file: GGUFFile) -> dict[str, Any]:
    """The config dict transformers' ``load_gguf_checkpoint`` derives from this file."""
    from transformers.integrations import GGUF_CONFIG_DEFAULTS_MAPPING
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES, GGUF_TO_TRANSFORMERS_MAPPING

    md = file.metadata
    architecture = str(md.get("general.architecture", ""))
    name = md.get("general.name")
    names = [name] if name is not None else []
    if architecture in UNSUPPORTED:
        raise NotImplementedError(f"GGUF architecture {architecture}")
    updated = _RENAMED.get(architecture, architecture)
    if "llama" in architecture and "mistral" in names:  # transformers' rule, as it spells it
        updated = "mistral"
    if architecture not in GGUF_SUPPORTED_ARCHITECTURES and updated not in GGUF_SUPPORTED_ARCHITECTURES:
        raise NotImplementedError(f"GGUF architecture {architecture}")
    config: dict[str, Any] = {}
    if "stablelm" in architecture:
        config["use_qkv_bias"] = any(t in n for n in file.tensors for t in ("attn_q.bias", "attn_k.bias", "attn_v.bias"))
        config["use_parallel_residual"] = not any("ffn_norm" in n for n in file.tensors)
    config["tie_word_embeddings"] = "output.weight" not in file.tensors or architecture in ("falcon", "bloom")
    for key, value in GGUF_CONFIG_DEFAULTS_MAPPING.get(updated, GGUF_CONFIG_DEFAULTS_MAPPING.get(architecture) or {}).items():
        config.setdefault(key, value)
    renames = GGUF_TO_TRANSFORMERS_MAPPING["config"]
    for key, value in md.items():
        key = key.replace(architecture, updated)
        prefix, _, config_key = key.partition(".")
        if prefix not in renames or config_key not in renames[prefix]:
            continue
        target = renames[prefix][config_key]
        if target in (-1, None):
            continue
        value = _plain(value)
        if isinstance(value, str) and architecture in value:
            value = value.replace(architecture, updated)
        config[target] = value
    if config.get("model_type") == "gemma3":
        config["model_type"] = "gemma3_text"
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in md:
        config["vocab_size"] = len(md["tokenizer.ggml.tokens"])
    return config


def _plain(value: Any) -> Any:
    """A metadata value as transformers' reader gives it: a one-element array as its element,
    arrays as lists."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    elif hasattr(value, "tolist"):  # a StringArray
        value = value.tolist()
    if isinstance(value, list) and len(value) == 1:
        return value[0]
    return value


# Each type's layout; a Q4_1 / Q4_K tensor whose zero points fold has none (GGUFTensor.block_format).
FORMATS = {blocks_mod.Q4_0: BlockFormat(4, 32, False, False), blocks_mod.Q4_1: BlockFormat(4, 32, True, True),
           blocks_mod.Q5_0: BlockFormat(8, 32, False, False), blocks_mod.Q5_1: BlockFormat(8, 32, False, True),
           blocks_mod.Q8_0: BlockFormat(8, 32, False, False), blocks_mod.Q4_K: BlockFormat(4, 32, True, True),
           blocks_mod.Q5_K: BlockFormat(8, 32, False, True), blocks_mod.Q6_K: BlockFormat(8, 16, False, False)}


F32, F16, BF16 = 0, 1, 30  # the ggml types a GGUF stores as plain floats


class GGUFTensor:
    """One parameter's tensor in the file, a ``lazy_weights`` source: ``load()`` reads it as
    transformers would (dequantized, then its architecture's processor); a quantized tensor
    of a supported type also gives its blocks as they are (``block_quantized``), with the
    processor's row permutation applied to whole rows of blocks."""

    def __init__(self, file: GGUFFile, gguf_name: str, shape: tuple[int, ...], dtype: torch.dtype, processor,
                 rows: np.ndarray | None, packed: bool) -> None:
        self.file, self.gguf_name, self.shape, self.dtype = file, gguf_name, tuple(shape), dtype
        self.processor, self.rows, self.packed = processor, rows, packed
        self.ggml_type = file.tensors[gguf_name].type

    def load(self) -> torch.Tensor:
        raw = self.file.data(self.gguf_name)
        if self.ggml_type == BF16:  # numpy has no bfloat16: the raw words are the high half of a float32
            values = (raw.astype(np.uint32) << 16).view(np.float32)
        elif raw.dtype.kind == "f":
            values = np.asarray(raw, np.float32)
        else:
            from gguf import GGMLQuantizationType, dequantize

            values = dequantize(raw, GGMLQuantizationType(self.ggml_type))
        values = values.reshape(self.file.tensors[self.gguf_name].shape)
        values = self.processor.process(weights=values, name=self.gguf_name).weights
        out = torch.from_numpy(np.array(values, np.float32)).reshape(self.shape).to(self.dtype)
        self.file.release(self.gguf_name)
        return out

    def block_format(self) -> BlockFormat | None:
        fmt = FORMATS.get(self.ggml_type) if self.packed else None
        return dataclasses.replace(fmt, zeros=False) if fmt is not None and self.fold else fmt

    @functools.cached_property
    def fold(self) -> bool | None:
        """Whether this Q4_1 / Q4_K tensor's zero points fold into its offsets
        (``gguf_blocks.folds_exactly``, over all its rows), None for other types."""
        if not self.packed or self.ggml_type not in blocks_mod.FOLDABLE:
            return None
        fold = blocks_mod.fold_of(self.file.data(self.gguf_name), self.ggml_type, self.shape[-1])
        self.file.release(self.gguf_name)
        return fold

    def fingerprint(self) -> str:
        """What the tensor's bytes depend on, for cache keys (``lazy_weights.fingerprint``)."""
        rows = "" if self.rows is None else ";rows=" + ",".join(map(str, self.rows[:8])) + f"..{len(self.rows)}"
        return f"gguf:{self.file.identity_key}:{self.gguf_name}:{self.ggml_type}:{self.packed}{rows}"

    def block_quantized(self, rows: slice | None = None):
        """The blocks (of ``rows`` only: a head written in row blocks reads each block's rows).
        A field ``gguf_prepack`` re-laid out already is read from its file; the others are
        decoded from the file's blocks when read."""
        decoded = functools.cache(lambda: self._decoded(rows))  # the file's blocks, re-laid out when first read
        fmt = self.block_format()
        fields = {name: self._field(name, rows, decoded) for name in gguf_prepack.FIELDS}
        return BlockQuantized(fmt.bits, fmt.group_size, self.shape[-1], fmt.zeros, fmt.offsets, **fields)

    def _field(self, name: str, rows: slice | None, decoded):
        def read():
            # The file's row order -> the processor's, then the block's rows: only those are read.
            wanted = self.rows if rows is None or self.rows is None else self.rows[rows]
            kept = gguf_prepack.prepacked(self.file.identity_key, self.gguf_name, name,
                                          rows if self.rows is None else wanted)
            return getattr(decoded(), name) if kept is None else kept
        return read

    def _decoded(self, rows: slice | None):
        raw = self.file.data(self.gguf_name)
        if self.rows is not None:
            raw = raw[self.rows]
        if rows is not None:
            raw = raw[rows]
        return blocks_mod.relayout(raw, self.ggml_type, self.shape[-1], lambda: self.file.release(self.gguf_name),
                                   fold=self.fold)


def row_permutation(processor, name: str, shape: tuple[int, ...]) -> tuple[bool, np.ndarray | None]:
    """Whether the architecture's processor only reorders this tensor's rows, and the order
    (None when it leaves them as they are): it is run on a probe whose every row holds its
    own index, which a row permutation moves whole and anything else changes."""
    if len(shape) != 2:
        return False, None
    rows = shape[0]
    probe = np.repeat(np.arange(rows, dtype=np.float64)[:, None], 2, axis=1)
    try:
        out = np.asarray(processor.process(weights=probe.copy(), name=name).weights)
    except Exception:  # noqa: BLE001  (a processor that needs the real width is no row permutation)
        return False, None
    if out.shape != probe.shape or not np.array_equal(out[:, 0], out[:, 1]):
        return False, None
    order = out[:, 0].astype(np.int64)
    if not np.array_equal(order, out[:, 0]) or not np.array_equal(np.sort(order), np.arange(rows)):
        return False, None
    return True, (None if np.array_equal(order, np.arange(rows)) else order)


@dataclass
class LazyGGUF:
    """A .gguf file as a transformers model with lazy parameters (``lazy_model``)."""

    model: Any
    file: GGUFFile
    notes: list[str]
    dequantized: dict[str, str]  # GGUF tensor name -> why it is read as floats, not blocks


def lazy_model(path: str | Path, dtype: torch.dtype = torch.float32) -> LazyGGUF:
    """The file's model: its config and architecture from the metadata, every parameter a
    lazy tensor read from the file (``GGUFTensor``). Raises NotImplementedError for an
    architecture this module does not map, ValueError for a file whose tensors do not cover
    the model's parameters."""
    import transformers
    from accelerate import init_empty_weights
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    file = open_gguf(path)
    config_dict = gguf_config(file)
    model_type = config_dict.pop("model_type")
    config = transformers.AutoConfig.for_model(model_type, **config_dict)
    with init_empty_weights(include_buffers=False):  # buffers (rotary tables) are computed, not read
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()  # the LM head reads the table: one parameter, one source
    processor = TENSOR_PROCESSORS.get(file.architecture, TensorProcessor)(config={**config_dict, "model_type": model_type})
    names = tensor_names(model, processor, file)
    params = dict(model.named_parameters(remove_duplicate=False))
    sources: dict[str, GGUFTensor] = {}
    dequantized: dict[str, str] = {}
    for gguf_name, info in file.tensors.items():
        hf_name = names.get(gguf_name)
        if hf_name not in params:
            continue
        shape = tuple(params[hf_name].shape)
        packed, rows = False, None
        if blocks_mod.supported(info.type):
            packed, rows = row_permutation(processor, gguf_name, shape)
            if not packed:
                dequantized[gguf_name] = "transformers transforms it beyond reordering its rows"
        elif info.type not in (F32, F16, BF16):
            dequantized[gguf_name] = f"{_type_name(info.type)} has no kernel here"
        sources[hf_name] = GGUFTensor(file, gguf_name, shape, params[hf_name].dtype, processor, rows, packed)
    ids = {id(p): name for name, p in params.items() if name in sources}
    missing = [name for name, p in params.items() if id(p) not in ids]
    if missing:
        raise ValueError(f"{path} has no tensor for the model's {missing[0]} ({len(missing)} parameters missing)")
    lazy_weights.replace_parameters(model, sources)
    notes = []
    if dequantized:
        kinds = sorted({_type_name(file.tensors[n].type) for n in dequantized})
        notes.append(f"{len(dequantized)} quantized tensors ({', '.join(kinds)}) run dequantized: "
                     f"{next(iter(dequantized.values()))}")
    return LazyGGUF(model, file, notes, dequantized)


def _type_name(ggml_type: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"ggml type {ggml_type}"


# transformers' model_type -> the architecture name gguf's tables use, where they differ
# (as transformers' get_gguf_hf_weights_map spells them)
_GGUF_ARCH = {"cohere": "command-r", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "gemma3_text": "gemma3",
              "gemma4_text": "gemma4", "umt5": "t5", "minimax_m2": "minimax-m2", "gpt_oss": "gpt-oss"}


def tensor_names(model, processor, file: GGUFFile) -> dict[str, str]:
    """{GGUF tensor name: transformers parameter name}, from gguf's own name table.

    transformers' ``get_gguf_hf_weights_map`` gives the same map but builds gguf's table once
    per submodule (17 s for a 30-layer model here); this builds it once and tries each
    parameter's name with its leading modules dropped, which is what that recursion finds."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    model_type = model.config.model_type
    wanted = _GGUF_ARCH.get(model_type, model_type)
    arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == wanted), None)
    if arch is None:
        raise NotImplementedError(f"gguf has no tensor names for architecture {model_type}")
    table = get_tensor_name_map(arch, model.config.num_hidden_layers)
    found: dict[str, str] = {}
    for hf_name in model.state_dict():
        name = processor.preprocess_name(hf_name)
        stem, suffix = name, ""
        if name.endswith((".weight", ".bias")):
            stem, suffix = name.rsplit(".", 1)
            suffix = "." + suffix
        atoms = stem.split(".")
        for start in range(len(atoms)):
            gguf_name = table.get_name(".".join(atoms[start:]))
            if gguf_name is not None:
                found.setdefault(gguf_name + suffix, hf_name)
                break
        else:
            processor.perform_fallback_tensor_mapping(found, suffix, "", hf_name)
    return found


def gguf_tokenizer(file: GGUFFile, model_type: str):
    """The tokenizer the file describes, as transformers' ``AutoTokenizer.from_pretrained(...,
    gguf_file=...)`` builds it (the same converter and class), from this reader's metadata:
    transformers' own path reads the file with gguf's reader first (19 s for a 151k vocabulary)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (GGUF_TOKENIZER_MAPPING, _SPECIAL_TOKENS,
                                                                      convert_gguf_tokenizer)
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

    md = file.metadata
    grouped = {group: {name: _plain_array(md[f"tokenizer.{key}"]) for key, name in renames.items()
                       if f"tokenizer.{key}" in md}
               for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokenizer, config = grouped["tokenizer"], grouped["tokenizer_config"]
    kind = tokenizer.get("tokenizer_type")
    if kind == "llama":
        config.setdefault("add_bos_token", True)  # transformers' rule for files without the flag
    elif kind == "gemma4":
        config["add_bos_token"] = False
    for name, key in _SPECIAL_TOKENS.items():
        token_id = md.get(f"tokenizer.ggml.{key}")
        config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(file.architecture, tokenizer)
    class_name = TOKENIZER_MAPPING_NAMES.get(model_type) or "PreTrainedTokenizerFast"
    cls = tokenizer_class_from_name(class_name if isinstance(class_name, str) else class_name[-1])
    return cls(tokenizer_object=backend, **config, **extra)


def _plain_array(value):
    """Arrays as lists (transformers' reader gives lists), scalars as they are."""
    if isinstance(value, np.ndarray) or hasattr(value, "tolist"):
        return value.tolist()
    return value
