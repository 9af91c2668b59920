"""Graphs and inputs for the tensorrt tests: one small call per graphopt op, and the
pipeline's optimized graphs for the reference models."""

from __future__ import annotations

import functools

import torch

from graphopt import models
from graphopt.compiler import run_pipeline
from graphopt.config import Options
from graphopt.frontend import capture_aten_graphs

g = torch.ops.graphopt
_GEN = torch.Generator().manual_seed(0)


def random(*shape):
    """Seeded random fp32, never zero (a zero would hide a dropped multiply)."""
    t = torch.randn(*shape, generator=_GEN)
    return torch.where(t.abs() < 1e-3, torch.full_like(t, 1e-3), t)


def _int4_weight(n: int, k: int):
    from graphopt.quantization import quantize_int4

    q = quantize_int4(random(n, k) * 0.05, 32, True, "float32", "rtn")
    return q.packed, q.scales


def _kv_cache_update(cache, new, pos):
    g.kv_cache_update(cache, new, pos)
    return cache * 1


# (graphopt op, function calling it, inputs). Shapes are not powers of two.
CASES = {
    "rms_norm": ("graphopt.rms_norm", lambda x, w: g.rms_norm(x, w, 1e-6), (random(2, 3, 40), random(40))),
    "add_rms_norm": ("graphopt.add_rms_norm", lambda x, r, w: g.add_rms_norm(x, r, w, 1e-6, 1.0),
                     (random(2, 3, 40), random(2, 3, 40), random(40))),
    "softmax_rms_norm": ("graphopt.softmax_rms_norm", lambda x, w: g.softmax_rms_norm(x, w, 1e-6),
                         (random(3, 24), random(24))),
    "layer_norm": ("graphopt.layer_norm", lambda x, w, b: g.layer_norm(x, w, b, 1e-5),
                   (random(2, 3, 40), random(40), random(40))),
    "add_layer_norm": ("graphopt.add_layer_norm", lambda x, r, w, b: g.add_layer_norm(x, r, w, b, 1e-5),
                       (random(2, 3, 40), random(2, 3, 40), random(40), random(40))),
    "swiglu": ("graphopt.swiglu", lambda gu: g.swiglu(gu), (random(2, 3, 48),)),
    "geglu": ("graphopt.geglu", lambda gu: g.geglu(gu, "tanh"), (random(2, 3, 48),)),
    "bias_gelu": ("graphopt.bias_gelu", lambda x, b: g.bias_gelu(x, b), (random(2, 3, 40), random(40))),
    "rope": ("graphopt.rope", lambda x, c, s: g.rope(x, c, s), (random(1, 3, 5, 24), random(1, 5, 16),
                                                                random(1, 5, 16))),
    "attention": ("graphopt.attention", lambda q, k, v: g.attention(q, k, v, None, None, True),
                  (random(1, 4, 5, 16), random(1, 2, 7, 16), random(1, 2, 7, 16))),
    "qkv_proj": ("graphopt.qkv_proj", lambda x, w, b: g.qkv_proj(x, w, b, [16, 8, 8]),
                 (random(2, 5, 24), random(32, 24), random(32))),
    "kv_cache_update": ("graphopt.kv_cache_update", _kv_cache_update,
                        (random(1, 2, 9, 16), random(1, 2, 3, 16), torch.tensor(4))),
    "int4_linear": ("graphopt.int4_linear", lambda x, packed, scales: g.int4_linear(x, packed, scales, None, 32),
                    (random(3, 64), *_int4_weight(24, 64))),
}


@functools.cache
def _optimized(name: str):
    model = models.build(name)
    inputs = models.example_inputs(model, batch=2, seq_len=8)
    (captured,) = capture_aten_graphs(model, inputs)
    result, _ = run_pipeline(captured.gm, Options.parse({"target": "eager"}), captured.example_inputs)
    return result.gm, captured.example_inputs


def optimized_graph(name: str):
    """(the default pipeline's graph for ``name`` at batch 2, seq 8; its capture inputs).
    Cached: callers copy the graph before changing it."""
    return _optimized(name)


def fresh_inputs(name: str) -> tuple:
    """Other inputs of the same shapes: new token ids, and for BERT a mask that pads the
    end of the second sequence, so the mask path computes something."""
    ids = models.example_inputs(name, batch=2, seq_len=8, seed=1)
    if name.startswith("bert"):
        ids, mask = ids
        mask = mask.clone()
        mask[1, -3:] = 0
        return ids, mask
    return ids
