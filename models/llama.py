"""A reference Llama-style decoder in plain torch, with an explicit KV cache.

The model is the pattern source for graphopt's LLM passes: every piece is written the way
Hugging Face writes it (RMSNorm as ``x * rsqrt(mean(x^2) + eps) * w`` in float32, rotate-half
rotary, grouped-query attention expanded with ``expand + reshape``, SwiGLU MLP), so that a
fusion that fires here fires on a real checkpoint too. Parameter names match
``transformers.LlamaForCausalLM`` without its ``model.`` prefix, so its state dict loads with
a prefix strip and the equivalence test needs no mapping table.

The cache is an argument and a result, never hidden state: ``forward`` takes
``past_key_values`` (one ``(k, v)`` pair per layer, each ``[B, num_kv_heads, S_past,
head_dim]``) and returns the new cache built by ``torch.cat`` along the sequence axis. That is
the graph shape the KV-cache passes rewrite, and it keeps the module a pure function that
``torch.export`` and ONNX export can trace.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

KVCache = tuple[tuple[Tensor, Tensor], ...]


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama model. ``num_heads`` must be a multiple of ``num_kv_heads`` (GQA)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def param_count(config: LlamaConfig) -> int:
    """Parameters of ``LlamaForCausalLM(config)``, computed without allocating any."""
    h, kv = config.hidden_size, config.num_kv_heads * config.head_dim
    attention = 2 * h * h + 2 * h * kv  # q and o are h x h; k and v are h x kv
    mlp = 3 * h * config.intermediate_size
    layer = attention + mlp + 2 * h  # two RMSNorm weights
    return config.num_layers * layer + 2 * config.vocab_size * h + h  # embed, lm_head, final norm


class RMSNorm(nn.Module):
    """Root-mean-square norm; statistics in float32, result cast back, then scaled."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for rotate-half RoPE, computed per call from the position ids."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.theta = config.rope_theta
        # Not persistent: it is a function of the config, and checkpoints do not carry it.
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self, device: torch.device | None = None) -> Tensor:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim
        return 1.0 / (self.theta**exponents)

    def reset_buffers(self) -> None:
        """Recompute ``inv_freq`` after the module was materialised from the meta device."""
        self.inv_freq = self._inv_freq(self.inv_freq.device)

    def forward(self, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        # In float32 whatever the model dtype: bf16 angles lose whole radians at long positions.
        freqs = position_ids[..., None].to(torch.float32) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` [B, H, S, D] by ``cos``/``sin`` [B, S, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def repeat_kv(x: Tensor, groups: int) -> Tensor:
    """[B, KV, S, D] -> [B, KV * groups, S, D], each KV head shared by ``groups`` query heads."""
    if groups == 1:
        return x
    b, kv, s, d = x.shape
    return x[:, :, None].expand(b, kv, groups, s, d).reshape(b, kv * groups, s, d)


def chunk_causal_mask(query_len: int, past_len: int, device: torch.device) -> Tensor:
    """Boolean [S, S_past + S] mask, True where attending is allowed (bottom-right causal)."""
    q = torch.arange(query_len, device=device)[:, None] + past_len
    k = torch.arange(past_len + query_len, device=device)[None, :]
    return k <= q


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        h, kv = config.hidden_size, config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(h, h, bias=False)
        self.k_proj = nn.Linear(h, kv, bias=False)
        self.v_proj = nn.Linear(h, kv, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, past: tuple[Tensor, Tensor] | None
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if past is not None:
            # The cache holds rotated keys, as Hugging Face's does: old keys never re-rotate.
            k = torch.cat((past[0], k), dim=2)
            v = torch.cat((past[1], v), dim=2)
        groups = self.num_heads // self.num_kv_heads
        keys, values = repeat_kv(k, groups), repeat_kv(v, groups)
        if past is None:
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=True)
        elif s == 1:
            # One new token may see every cached one: no mask at all.
            out = F.scaled_dot_product_attention(q, keys, values)
        else:
            # is_causal aligns top-left, which is wrong once keys outnumber queries.
            mask = chunk_causal_mask(s, past[0].shape[2], x.device)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        out = out.transpose(1, 2).reshape(b, s, -1)
        return self.o_proj(out), (k, v)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_eps)
        self.mlp = MLP(config)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, past: tuple[Tensor, Tensor] | None
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        attn, cache = self.self_attn(self.input_layernorm(x), cos, sin, past)
        x = x + attn
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, cache


class LlamaForCausalLM(nn.Module):
    """Llama decoder with an LM head.

    ``forward`` always returns ``(logits, new_past_key_values)``; a caller that wants only the
    logits takes ``[0]`` (the CLI wraps the model to do that). Returning the cache even when
    nobody asked keeps one graph shape for prefill and decode, and costs nothing: the
    concatenated k/v exist anyway.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(config)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self,
        input_ids: Tensor,
        past_key_values: KVCache | None = None,
        position_ids: Tensor | None = None,
    ) -> tuple[Tensor, KVCache]:
        """Logits [B, S, vocab] for ``input_ids`` [B, S], and the cache extended by S.

        With ``past_key_values=None`` this is a prefill (causal mask). With a cache, one new
        token decodes unmasked and a longer chunk uses a bottom-right causal mask.
        ``position_ids`` default to ``S_past .. S_past + S - 1`` for every batch row.
        """
        b, s = input_ids.shape
        if past_key_values is not None and len(past_key_values) != len(self.layers):
            raise ValueError(f"past_key_values has {len(past_key_values)} layers, the model {len(self.layers)}")
        past_len = 0 if past_key_values is None else past_key_values[0][0].shape[2]
        if position_ids is None:
            position_ids = torch.arange(past_len, past_len + s, device=input_ids.device).expand(b, s)
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(position_ids, x.dtype)
        cache = []
        for i, layer in enumerate(self.layers):
            x, layer_cache = layer(x, cos, sin, None if past_key_values is None else past_key_values[i])
            cache.append(layer_cache)
        return self.lm_head(self.norm(x)), tuple(cache)
