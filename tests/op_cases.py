"""One small call per graphopt op, straight to the op (independent of the passes): what each
target's tests lower and compare with the op's reference implementation.

``OP_CASES[name] = (graphopt op, function of the tensors, tensors)``. Shapes are not powers
of two; values are seeded, random and never zero (a zero would hide a dropped multiply).
"""

from __future__ import annotations

import torch

g = torch.ops.graphopt
_GEN = torch.Generator().manual_seed(0)


def nonzero_random(*shape: int) -> torch.Tensor:
    """Seeded random fp32 with no element near zero."""
    t = torch.randn(*shape, generator=_GEN)
    return torch.where(t.abs() < 1e-3, torch.full_like(t, 1e-3), t)


def int4_weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed, scales) of a symmetric group-32 INT4 weight [n, k]."""
    from graphopt.quant.groupwise import quantize_int4

    q = quantize_int4(nonzero_random(n, k) * 0.05, 32, True, "float32", "rtn")
    return q.packed, q.scales


def int8_weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of a symmetric group-32 INT8 weight [n, k]."""
    from graphopt.quant.groupwise import quantize_int8

    q = quantize_int8(nonzero_random(n, k) * 0.05, 32, "float32")
    return q.packed, q.scales


def block_weight(n: int, k: int, bits: int, zeros: bool, offsets: bool) -> list[torch.Tensor | None]:
    """[codes, scales, zeros, offsets] of a random block-quantized weight [n, k] (blocks of 32),
    as a checkpoint's Q4_1 (4 bits, zero points, offsets) or Q8_0 (8 bits) arrive."""
    from graphopt.ops.quant_blocks import BlockQuantized, pack_codes, pack_zero_points

    gen = torch.Generator().manual_seed(n * k + bits)
    groups = k // 32
    codes = torch.randint(0, 1 << bits, (n, groups, 32), generator=gen, dtype=torch.uint8).numpy()
    zero = torch.randint(0, 1 << bits, (n, groups), generator=gen, dtype=torch.uint8).numpy()
    blocks = BlockQuantized(bits, 32, k, zeros, offsets, codes=pack_codes(codes, bits),
                            scales=(nonzero_random(n, groups) * 0.02).numpy(),
                            zeros=pack_zero_points(zero, bits), offsets=(nonzero_random(n, groups) * 0.01).numpy())
    return [torch.from_numpy(getattr(blocks, f)) if getattr(blocks, f) is not None else None
            for f in ("codes", "scales", "zeros", "offsets")]


def int4_experts(experts: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed [E, n, k / 2], scales [E, n, k / 32]) of symmetric group-32 INT4 expert weights."""
    from graphopt.quant.groupwise import quantize_int4

    q = quantize_int4(nonzero_random(experts * n, k) * 0.3, 32, True, "float32", "rtn")
    return q.packed.reshape(experts, n, -1), q.scales.reshape(experts, n, -1)


def _kv_cache_update(cache, new, pos):
    g.kv_cache_update(cache, new, pos)
    return cache * 1  # the op mutates its cache: return what it wrote


def _rope_kv_cache_update(q, k, v, cos, sin, k_cache, v_cache, pos):
    q_rot = g.rope_kv_cache_update(q, k, v, cos, sin, k_cache, v_cache, pos)
    return q_rot, k_cache * 1, v_cache * 1  # the rotated query and what the op wrote


_r = nonzero_random
OP_CASES = {
    "rms_norm": ("graphopt.rms_norm", lambda x, w: g.rms_norm(x, w, 1e-6), (_r(2, 3, 40), _r(40))),
    "add_rms_norm": ("graphopt.add_rms_norm", lambda x, r, w: g.add_rms_norm(x, r, w, 1e-6, 1.0),
                     (_r(2, 3, 40), _r(2, 3, 40), _r(40))),
    "softmax_rms_norm": ("graphopt.softmax_rms_norm", lambda x, w: g.softmax_rms_norm(x, w, 1e-6),
                         (_r(3, 24), _r(24))),
    "layer_norm": ("graphopt.layer_norm", lambda x, w, b: g.layer_norm(x, w, b, 1e-5),
                   (_r(2, 3, 40), _r(40), _r(40))),
    "add_layer_norm": ("graphopt.add_layer_norm", lambda x, r, w, b: g.add_layer_norm(x, r, w, b, 1e-5),
                       (_r(2, 3, 40), _r(2, 3, 40), _r(40), _r(40))),
    "swiglu": ("graphopt.swiglu", lambda gu: g.swiglu(gu), (_r(2, 3, 48),)),
    "geglu": ("graphopt.geglu", lambda gu: g.geglu(gu, "tanh"), (_r(2, 3, 48),)),
    "bias_gelu": ("graphopt.bias_gelu", lambda x, b: g.bias_gelu(x, b), (_r(2, 3, 40), _r(40))),
    "rope": ("graphopt.rope", lambda x, c, s: g.rope(x, c, s), (_r(1, 3, 5, 24), _r(1, 5, 16), _r(1, 5, 16))),
    "attention_prefill": ("graphopt.attention", lambda q, k, v: g.attention(q, k, v, None, None, True),
                          (_r(1, 4, 5, 16), _r(1, 2, 7, 16), _r(1, 2, 7, 16))),
    "attention_decode": ("graphopt.attention", lambda q, k, v: g.attention(q, k, v),
                         (_r(2, 4, 1, 16), _r(2, 2, 7, 16), _r(2, 2, 7, 16))),
    # Scores of std ~1 against a cap of 1: the tanh changes the result, so a dropped cap shows.
    "attention_softcap_prefill": ("graphopt.attention", lambda q, k, v: g.attention(q, k, v, None, None, True, 1.0),
                                  (_r(1, 4, 5, 16), _r(1, 2, 5, 16), _r(1, 2, 5, 16))),
    "attention_softcap_decode": ("graphopt.attention", lambda q, k, v: g.attention(q, k, v, None, None, False, 1.0),
                                 (_r(2, 4, 1, 16), _r(2, 2, 7, 16), _r(2, 2, 7, 16))),
    "qkv_proj": ("graphopt.qkv_proj", lambda x, w, b: g.qkv_proj(x, w, b, [16, 8, 8]),
                 (_r(2, 5, 24), _r(32, 24), _r(32))),
    "kv_cache_update": ("graphopt.kv_cache_update", _kv_cache_update,
                        (_r(1, 2, 9, 16), _r(1, 2, 3, 16), torch.tensor(4))),
    "rope_kv_cache_update": ("graphopt.rope_kv_cache_update", _rope_kv_cache_update,
                             (_r(1, 4, 3, 24), _r(1, 2, 3, 24), _r(1, 2, 3, 24), _r(1, 3, 16), _r(1, 3, 16),
                              _r(1, 2, 9, 24), _r(1, 2, 9, 24), torch.tensor(4))),
    "cache_attention": ("graphopt.cache_attention", lambda q, k, v, n: g.cache_attention(q, k, v, n),
                        (_r(2, 4, 1, 16), _r(2, 2, 9, 16), _r(2, 2, 9, 16), torch.tensor([5, 9]))),
    "int4_linear": ("graphopt.int4_linear", lambda x, packed, scales: g.int4_linear(x, packed, scales, None, 32),
                    (_r(3, 64), *int4_weight(24, 64))),
    "int8_linear": ("graphopt.int8_linear", lambda x, codes, scales: g.int8_linear(x, codes, scales, 32),
                    (_r(3, 64), *int8_weight(24, 64))),
    "quantized_embedding": ("graphopt.quantized_embedding",
                            lambda ids, codes, scales: g.quantized_embedding(codes, scales, ids, 4, 32, 64,
                                                                             torch.float32),
                            (torch.tensor([[3, 0, 23], [5, 5, 1]]), *int4_weight(24, 64))),
    "quantized_linear": ("graphopt.quantized_linear",
                         lambda x, codes, scales, zeros, offsets: g.quantized_linear(x, codes, scales, zeros, offsets,
                                                                                      4, 32),
                         (_r(3, 64), *block_weight(24, 64, 4, True, True))),
    "quantized_gather": ("graphopt.quantized_gather",
                         lambda ids, codes, scales: g.quantized_gather(codes, scales, None, None, ids, 8, 32,
                                                                       torch.float32),
                         (torch.tensor([[3, 0, 23], [5, 5, 1]]), *block_weight(24, 64, 8, False, False)[:2])),
    "moe": ("graphopt.moe", lambda x, wr, gu, d, sgu, sd, sg: g.moe(x, wr, gu, d, 2, True, sgu, sd, sg),
            (_r(5, 24), _r(4, 24), _r(4, 20, 24) * 0.3, _r(4, 24, 10) * 0.3,  # router, experts
             _r(12, 24) * 0.3, _r(24, 6) * 0.3, _r(1, 24))),  # shared expert and its gate
    # QMoE needs hidden and inter in whole groups of 32: 96 and 32.
    "int4_moe": ("graphopt.int4_moe",
                 lambda x, wr, gu, gus, d, ds: g.int4_moe(x, wr, gu, gus, None, d, ds, None, 32, 2, True),
                 (_r(5, 96), _r(4, 96), *int4_experts(4, 64, 96), *int4_experts(4, 96, 32))),
}
