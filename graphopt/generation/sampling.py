"""Choosing the next token from logits, and when a sequence is finished.

``Sampler``: greedy argmax, or temperature / top-k / top-p (nucleus) sampling from a seeded
generator, so a sampled run repeats exactly. ``StopConditions``: EOS token ids, stop strings
(they need the tokenizer's ``decode``), and the rows already finished; the loop in
``graphopt.generation.loop`` asks it after every token.

Both take torch tensors or numpy arrays (a kept ONNX Runtime decoder runs without torch) and
answer in the kind they were given: the functions they call are spelled alike in both
(``array_module``). Sampling draws from torch's generator either way, so a seed gives the same
tokens whichever runner produced the logits.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from graphopt.errors import GraphoptError

if TYPE_CHECKING:
    from torch import Tensor


def array_module(x: Any):
    """torch or numpy, whichever ``x`` belongs to: where, isin, concat, zeros_like and asarray
    take the same arguments in both (numpy >= 2)."""
    return sys.modules[type(x).__module__.partition(".")[0]]


class Sampler:
    """Greedy argmax, or temperature / top-k / top-p sampling from a seeded generator."""

    def __init__(self, do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
                 seed: int | None = None, device="cpu", top_p: float | None = None) -> None:
        if do_sample and temperature <= 0:
            raise GraphoptError(f"temperature must be > 0 when sampling, got {temperature}; use do_sample=False "
                                "for greedy decoding")
        if top_k is not None and top_k < 1:
            raise GraphoptError(f"top_k must be >= 1, got {top_k}")
        if top_p is not None and not 0 < top_p <= 1:
            raise GraphoptError(f"top_p must be in (0, 1], got {top_p}")
        self.do_sample, self.temperature, self.top_k, self.top_p = do_sample, temperature, top_k, top_p
        self.generator = None
        if do_sample:
            import torch

            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(0 if seed is None else seed)

    def __call__(self, logits: Tensor) -> Tensor:
        """[B, V] logits of the last position -> [B, 1] next tokens."""
        if not self.do_sample:
            return logits.argmax(-1)[:, None]
        import torch

        if not isinstance(logits, torch.Tensor):  # numpy logits: drawn by torch, handed back as numpy
            return self(torch.from_numpy(logits)).numpy()
        scores = logits.float() / self.temperature
        if self.top_k is not None and self.top_k < scores.shape[-1]:
            kth = torch.topk(scores, self.top_k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p is not None and self.top_p < 1:
            ordered, order = scores.sort(dim=-1, descending=True)
            probs = ordered.softmax(-1)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            drop_sorted = probs.cumsum(-1) - probs >= self.top_p
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            scores = scores.masked_fill(drop, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator)


@dataclass
class StopConditions:
    """When a row stops: one of ``eos_token_ids`` sampled, or its new text contains a stop string.

    ``decode`` (token ids -> text) is needed only for ``stop_strings``. A finished row gets
    ``pad_token_id`` from then on, as transformers' ``generate`` does.
    """

    eos_token_ids: Sequence[int] = ()
    stop_strings: Sequence[str] = ()
    decode: Callable[[list[int]], str] | None = None
    pad_token_id: int | None = None
    _tail: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.stop_strings and self.decode is None:
            raise GraphoptError("stop strings need a tokenizer to read the text; pass decode= (tokenizer.decode)")
        # Tokens to decode to see a stop string end: each token adds at least one character.
        self._tail = max((len(s) for s in self.stop_strings), default=0) + 2

    @property
    def pad(self) -> int:
        if self.pad_token_id is not None:
            return self.pad_token_id
        return self.eos_token_ids[0] if self.eos_token_ids else 0

    def update(self, token: Tensor, finished: Tensor, new_tokens: list[Tensor]) -> tuple[Tensor, Tensor]:
        """(token with finished rows padded, finished after it) for ``token`` [B, 1]."""
        xp = array_module(token)
        token = xp.where(finished[:, None], self.pad, token)
        done = finished | False  # a new array either way
        if self.eos_token_ids:
            done |= xp.isin(token[:, 0], xp.asarray(list(self.eos_token_ids), device=token.device))
        if self.stop_strings:
            tail = xp.concat([*new_tokens[-self._tail + 1:], token], axis=1) if new_tokens else token
            for row in [r for r, d in enumerate(done.tolist()) if not d]:
                text = self.decode(tail[row].tolist())
                done[row] = any(s in text for s in self.stop_strings)
        return token, done
