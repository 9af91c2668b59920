"""The part of a tokenizer ``graphopt generate`` uses, on the ``tokenizers`` library alone.

transformers' tokenizer classes cost a warm ``graphopt generate`` on Qwen2.5-0.5B 157 MB and
4 s to import and load, where the ``tokenizers`` object under them costs 86 MB and 0.6 s. This
class reads the same ``tokenizer.json`` and ``tokenizer_config.json`` (the folder transformers
saved, ``gguf_cache``) and does what generation needs: a left-padded batch, decoding, the
special tokens. The ids are transformers' own (tests compare them on SmolLM2 and Qwen2.5).
A chat template needs transformers' renderer: ``graphopt generate --chat`` loads its tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np


class SlimTokenizer:
    """``tokenizer(texts, return_tensors="pt" | "np", padding=True, add_special_tokens=...)``,
    ``decode``, and the special tokens, padding on the left. Importing it imports no torch."""

    padding_side = "left"
    chat_template = None  # rendering one needs transformers (load_tokenizer(spec))

    def __init__(self, folder: str | Path) -> None:
        import tokenizers

        folder = Path(folder)
        self.backend = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        config = json.loads((folder / "tokenizer_config.json").read_text())
        self.eos_token = _content(config.get("eos_token"))
        self.pad_token = _content(config.get("pad_token")) or self.eos_token
        self.bos_token = _content(config.get("bos_token"))

    def _id(self, token: str | None) -> int | None:
        return self.backend.token_to_id(token) if token is not None else None

    @property
    def eos_token_id(self) -> int | None:
        return self._id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._id(self.pad_token)

    def __call__(self, texts: str | list[str], return_tensors: str | None = None, padding: bool = True,
                 add_special_tokens: bool = True) -> dict[str, Any]:
        single = isinstance(texts, str)
        rows = [e.ids for e in self.backend.encode_batch([texts] if single else list(texts),
                                                         add_special_tokens=add_special_tokens)]
        if return_tensors not in ("pt", "np"):
            return {"input_ids": rows[0] if single else rows}
        width = max(len(r) for r in rows)
        pad = self.pad_token_id if self.pad_token_id is not None else 0
        ids = np.array([[pad] * (width - len(r)) + r for r in rows], dtype=np.int64)
        mask = np.array([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=np.int64)
        if return_tensors == "pt":
            import torch

            ids, mask = torch.from_numpy(ids), torch.from_numpy(mask)
        return {"input_ids": ids, "attention_mask": mask}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)


def _content(token: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string, or {"content": ...}."""
    return token.get("content") if isinstance(token, dict) else token
