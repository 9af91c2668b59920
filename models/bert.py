"""A reference BERT-style encoder in plain torch.

Post-norm transformer layers (residual add, then LayerNorm), biased q/k/v/o projections and
an erf-GELU MLP: the patterns behind ONNX Runtime's SkipLayerNormalization, BiasGelu and
packed-QKV attention fusions, which the encoder passes and the ONNX export target. The
layout follows ``transformers.BertModel`` (without its pooler) closely enough that a test maps
one state dict onto the other and proves the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class BertConfig:
    """Shape of a BERT encoder."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")


def param_count(config: BertConfig) -> int:
    """Parameters of ``BertModel(config)``, computed without allocating any."""
    h, i = config.hidden_size, config.intermediate_size
    embeddings = (config.vocab_size + config.max_position + config.type_vocab_size) * h + 2 * h
    attention = 4 * (h * h + h)
    mlp = h * i + i + i * h + h
    layer = attention + mlp + 2 * 2 * h  # two LayerNorms, weight and bias each
    return embeddings + config.num_layers * layer


def padding_mask(attention_mask: Tensor) -> Tensor:
    """[B, S] of 1 (token) / 0 (padding) -> boolean [B, 1, 1, S], True where keys may be seen.

    Boolean rather than additive ``-inf``: SDPA takes either, and a boolean mask cannot turn
    a row into NaN when added to a score in low precision.
    """
    return attention_mask.bool()[:, None, None, :]


class SelfAttention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads, self.head_dim = config.num_heads, h // config.num_heads
        self.query = nn.Linear(h, h)
        self.key = nn.Linear(h, h)
        self.value = nn.Linear(h, h)
        self.output = nn.Linear(h, h)

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        b, s, _ = x.shape

        def heads(t: Tensor) -> Tensor:
            return t.view(b, s, self.num_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.output(out.transpose(1, 2).reshape(b, s, -1))


class EncoderLayer(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.layer_norm_eps
        self.attention = SelfAttention(config)
        self.attention_norm = nn.LayerNorm(h, eps=eps)
        self.intermediate = nn.Linear(h, config.intermediate_size)
        self.output = nn.Linear(config.intermediate_size, h)
        self.output_norm = nn.LayerNorm(h, eps=eps)

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        x = self.attention_norm(x + self.attention(x, mask))
        # approximate="none": BERT uses the erf form, which ORT's Gelu/BiasGelu compute.
        mlp = self.output(F.gelu(self.intermediate(x), approximate="none"))
        return self.output_norm(x + mlp)


class BertModel(nn.Module):
    """BERT encoder: embeddings, embedding LayerNorm, post-norm layers. No pooler."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, h)
        self.position_embeddings = nn.Embedding(config.max_position, h)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, h)
        self.embedding_norm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_layers))

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
    ) -> Tensor:
        """Last hidden state [B, S, H] for ``input_ids`` [B, S].

        ``attention_mask`` [B, S] marks real tokens with 1 and padding with 0; padded keys are
        hidden from every query. Hidden states at padded positions are computed but
        meaningless. ``token_type_ids`` default to segment 0.
        """
        s = input_ids.shape[1]
        positions = torch.arange(s, device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        if token_type_ids is None:
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        x = self.embedding_norm(x)
        mask = None if attention_mask is None else padding_mask(attention_mask)
        for layer in self.layers:
            x = layer(x, mask)
        return x
