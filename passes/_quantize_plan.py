"""The plan part of ``quantize_int4``: what each linear's weight becomes before the rewrite.

For every weight the pass will rewrite: its bits (4, ``head_bits`` for an LM head, 8 where
a ``budget`` moves it), its codes, scales and zero points (round-to-nearest, a scale search,
or GPTQ on calibration activations: graphopt/quant/), and its per-layer record, the numbers
the pass's stats sum. A weight still in its checkpoint (a lazy weight,
graphopt/lazy_weights.py) gets fake constants of the right shapes, linked to the quantizer
run on its data when the runtime's weights are written, reading it a block of rows at a time
(``groupwise.BLOCK_ELEMENTS``): rows quantize on their own, so the codes are the whole weight's
bit for bit, and Qwen2.5-0.5B's 151936 x 896 LM head (544 MB as fp32) is never read whole.
GPTQ and a budget calibrate on the graph run streamed, and read each lazy weight when its
input's Hessian is complete (``plan_weights``), so they too hold one float weight at a time.

The pass itself (matching linears, rewriting them, options) is passes/quantize_int4.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.fx as fx

from graphopt import ir, lazy_weights
from graphopt.quant import gptq, groupwise
from graphopt.quant import plan as quant_plan
from graphopt.quant.groupwise import Int4Weight, relative_error
from graphopt.quant.report import summarize_layers
from graphopt.rewrite import val
from graphopt.rewrite.linears import param_name

if TYPE_CHECKING:
    from graphopt.pass_manager import PassContext
    from graphopt.passes._int4_options import Int4Options, LinearMatch


def plan_weights(gm: fx.GraphModule, ctx: PassContext, options: Int4Options, matches: dict[str, LinearMatch],
                 heads: set[str]):
    """{weight target: (quantized weight, record)} for every weight in ``matches`` (``heads``:
    those of an LM head), and a line saying what it calibrated on.

    GPTQ and a budget calibrate: the graph runs on the calibration inputs and each weight is
    planned once its input's Hessian is complete. A weight still in its checkpoint is read
    then, for that weight alone (the graph runs streamed: graphopt/quant/plan.py), so a
    streamed checkpoint is never in memory whole; GPTQ keeps its codes, while a budget's
    round-to-nearest keeps only the numbers it chooses by and quantizes the chosen width as
    the weights are written, as without a budget."""
    if not matches:
        return {}, "none"
    bits_of = {key: options.head_bits if key in heads else 4 for key in matches}
    planned: dict[str, tuple] = {}
    calibration = "none"
    if options.search == "gptq" or options.budget:
        inputs = quant_plan.calibration_inputs(gm, ctx.example_inputs, options.calibration)
        if inputs:
            readers: dict[fx.Node, list[str]] = {}
            for key, m in matches.items():
                readers.setdefault(m.x, []).append(key)
            tokens = [0]

            def calibrated(x: fx.Node, h) -> None:
                tokens[0] = max(tokens[0], h[1])
                for key in readers[x]:
                    planned[key] = _plan_calibrated(matches[key], options, h, bits_of[key])

            quant_plan.hessians(gm, inputs, set(readers), calibrated)
            calibration = f"{'given token ids' if options.calibration else 'example inputs'}: {tokens[0]} tokens"
        else:  # a graph run on its own (no example inputs): nothing to calibrate on
            calibration = "none: no inputs to run the graph on, so round-to-nearest"
    plan = {key: planned[key] if key in planned else _plan_calibrated(m, options, None, bits_of[key])
            for key, m in matches.items()}
    if options.budget:
        records = [rec for _, rec in plan.values()]
        quant_plan.allocate_bits(records, options.budget)
        for key, (_, rec) in plan.items():
            rec["bytes_after"] = rec["bytes8"] if rec["bits"] == 8 else rec["bytes4"]
            rec["rel_error"] = rec["rel_error8"] if rec["bits"] == 8 else rec["rel_error4"]
            if rec["output_error"] is not None:
                rec["output_error"] = rec["error8"] if rec["bits"] == 8 else rec["error4"]
            q = rec.pop("_q8") if rec["bits"] == 8 else rec.pop("_q4")
            rec.pop("_q8", None), rec.pop("_q4", None)
            if q is None:  # read from its checkpoint to be measured: quantized again as it is written
                m = matches[key]
                quantize = _quantizer(m, options, None, rec["search"])
                q = quantize_lazily(ir.get_constant(m.weight),
                                    lambda weight, b=rec["bits"], fn=quantize: fn(b, weight))
            rec["group_size"] = q.group_size
            plan[key] = (q, rec)
    return plan, calibration


def _plan_calibrated(m: LinearMatch, options: Int4Options, h, bits: int):
    """``plan_one`` where a calibration (``h``) or a budget needs the weight's data: a lazy
    weight is read for it, and, where it will be quantized again as it is written
    (round-to-nearest or the scale search under a budget), its codes are not kept."""
    w = ir.get_constant(m.weight)
    if not lazy_weights.is_lazy(w) or (h is None and not options.budget):
        return plan_one(m, options, h, bits, both=bool(options.budget))
    q, record = plan_one(m, options, h, bits, both=bool(options.budget), data=lazy_weights.materialize(w))
    if options.budget and record["search"] != "gptq":
        record.update(_q4=None, _q8=None)
        q = None
    return q, record


def plan_one(m: LinearMatch, options: Int4Options, h, bits: int, both: bool = False,
             data: torch.Tensor | None = None):
    """(quantized weight, record) of one weight at ``bits`` (``data``: the weight's, when it is
    lazy and read for this); with ``both`` the record also holds the 4- and 8-bit versions and
    their errors for the budget to choose from."""
    w = data if data is not None else ir.get_constant(m.weight)
    name = param_name(m.weight)
    search = options.search if h is not None or options.search != "gptq" else "rtn"
    quantize = _quantizer(m, options, h, search)
    h, tokens = h if h is not None else (None, None)
    if lazy_weights.is_lazy(w):
        # Still in its checkpoint: quantized as it is written (round-to-nearest needs nothing else)
        q = quantize_lazily(w, lambda weight: quantize(bits, weight))
        return q, layer_record(name, w, q, options, m.weight.target, search, None)
    q = quantize(bits, w)
    record = layer_record(name, w, q, options, m.weight.target, search, h)
    if both and bits != 8:
        q8 = quantize(8, w)
        record.update(_q4=q, _q8=q8, bytes4=q.nbytes, bytes8=q8.nbytes, rel_error4=record["rel_error"],
                      rel_error8=relative_error(w, q8), error4=record["output_error"],
                      error8=gptq.output_error(w, q8.dequantize(), h) if h is not None else 0.0)
        if h is None:  # uncalibrated: rank by weight error instead
            record.update(error4=record["rel_error4"] ** 2, error8=record["rel_error8"] ** 2)
    elif both:
        error = record["output_error"] if h is not None else record["rel_error"] ** 2
        record.update(_q4=q, _q8=q, bytes4=q.nbytes, bytes8=q.nbytes, rel_error4=record["rel_error"],
                      rel_error8=record["rel_error"], error4=error, error8=error)
    return q, record


def _quantizer(m: LinearMatch, options: Int4Options, h, search: str) -> Callable[[int, torch.Tensor], Int4Weight]:
    """``quantize(bits, weight)`` for the weight of ``m`` as ``options`` ask (``h``: its input's
    ``(Hessian, tokens)`` for GPTQ)."""
    dtype = val(m.x).dtype if options.scale_dtype == "auto" else options.scale_dtype
    h, tokens = h if h is not None else (None, None)

    def quantize(b: int, weight: torch.Tensor) -> Int4Weight:
        if b == 8:
            return groupwise.quantize_int8(weight, options.group_8bit(weight.shape[1]), dtype,
                                           h if search == "gptq" else None, tokens, options.act_order)
        return groupwise.quantize_int4(weight, options.group_size, options.symmetric, dtype, search, h, tokens,
                                       options.act_order)

    return quantize


def quantize_lazily(w: torch.Tensor, quantize: Callable[[torch.Tensor], Int4Weight]) -> Int4Weight:
    """Fake constants shaped as the lazy weight ``w`` quantized, linked to ``quantize`` run on
    its data when the runtime's weights are written: one weight at a time, and that weight a
    block of rows at a time (``quantize`` must treat rows on their own, as round-to-nearest and
    the scale search do)."""
    q = _lazy_like(w, quantize(torch.ones(1, w.shape[1], dtype=w.dtype)))
    rows = max(1, groupwise.BLOCK_ELEMENTS // w.shape[1])

    def stream(source) -> tuple:
        return _fields(groupwise.quantize_blocks(lazy_weights.row_blocks(source, rows), w.shape[0], quantize))

    lazy_weights.derive_each(stream, [w], _fields(q), streamed=True)
    return q


def _fields(q: Int4Weight) -> tuple:
    return q.packed, q.scales, q.zeros


def _lazy_like(w: torch.Tensor, row: Int4Weight) -> Int4Weight:
    """Fake tensors shaped as ``w``'s quantized weight, from one row quantized for real (rows
    quantize independently, so each part is [N, what one row takes]); running the quantizer on
    the fake weight itself gives the same shapes at seconds a layer."""
    with lazy_weights.mode_of(w):
        parts = [None if t is None else torch.empty((w.shape[0], *t.shape[1:]), dtype=t.dtype) for t in _fields(row)]
    return Int4Weight(*parts, row.group_size, row.in_features, row.bits)


def layer_record(name: str, w: torch.Tensor, q: Int4Weight, options: Int4Options, key: str, search: str,
                 h) -> dict[str, Any]:
    return {
        "name": name,
        "shape": list(w.shape),
        "bits": q.bits,
        "group_size": q.group_size,
        "symmetric": options.symmetric or q.bits == 8,
        "scale_dtype": str(q.scales.dtype).removeprefix("torch."),
        "search": search,
        "rel_error": None if lazy_weights.is_lazy(w) else relative_error(w, q),  # lazy: known once written
        # share of the layer's output energy on the calibration activations that changed
        "output_error": gptq.output_error(w, q.dequantize(), h) if h is not None else None,
        "bytes_before": w.numel() * w.element_size(),
        "bytes_fp32": w.numel() * 4,
        "bytes_after": q.nbytes,
        "shared": False,
        "_key": key,
    }


_BUDGET_KEYS = ("bytes4", "bytes8", "rel_error4", "rel_error8", "error4", "error8")


def summarize(layers: list[dict[str, Any]]) -> dict[str, Any]:
    """Pass stats from the per-layer records (private keys dropped): see summarize_layers."""
    public = [{k: v for k, v in layer.items() if not k.startswith("_") and k not in _BUDGET_KEYS} for layer in layers]
    return summarize_layers(public)
