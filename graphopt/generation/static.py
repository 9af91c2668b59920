"""The compiled static-cache step runner (targets that run graph nodes in order: eager, triton).

:func:`compile_static_step` puts a step (graphopt.generation.runner's adapters) through the
compile front half (graphopt.compiler.front_half) with a dynamic past length, at the
pipeline's ``static_step`` stage (graphopt.pipeline: the configured fusions, then
``static_kv_cache``, which turns the cache's cats into in-place updates of caches this module
allocates, and ``cuda_graphs``, which marks the capturable regions), and lowers the result to
the target: a graph with identical shapes at every position, so one compilation serves every
decode step.
:class:`StaticRunner` drives those graphs over one set of :class:`CacheBuffers`.

The graphs take no attention mask, so a padded batch is decoded in groups of one prompt
length (graphopt.generation.api does that and says so).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
from torch import Tensor, nn

from graphopt import ir
from graphopt.compiler import Optimized, front_half, lower, note_pipeline
from graphopt.config import Options
from graphopt.errors import GraphoptError
from graphopt.generation.runner import positions, step_adapter
from graphopt.ops.kv_cache import StaticCacheSpec, spec_of
from graphopt.report import CompileReport, record
from graphopt.targets import in_order_targets, resolve_target

# Targets that run a graph's nodes in order, so an in-place kv_cache_update happens before
# the attention that reads the cache (graphopt.targets' runs_in_order). ONNX Runtime orders by
# data dependencies only; its runner decodes with its own decoder (backends/onnxruntime/decoder/decoder.py).
IN_PLACE_TARGETS = in_order_targets()


@dataclass
class StaticStep:
    """A compiled step and the interface static_kv_cache gave it."""

    fn: Callable
    spec: StaticCacheSpec
    gm: fx.GraphModule
    report: CompileReport
    compile_s: float


def _static_example_inputs(spec: StaticCacheSpec, input_ids: Tensor, position_ids: Tensor, device) -> list:
    inputs: list[Any] = [input_ids, position_ids]
    for c in spec.caches:
        inputs.append(torch.zeros(c.shape, dtype=c.dtype, device=device))
    inputs.append(torch.zeros((), dtype=torch.long, device=device))
    if spec.block_table_shape is not None:
        inputs.append(torch.zeros(spec.block_table_shape, dtype=torch.long, device=device))
    for c in spec.caches:
        if c.scales_shape is not None:
            inputs.append(torch.ones(c.scales_shape, dtype=torch.float32, device=device))
    return inputs


def layout_options(config: Options, max_length: int) -> Options:
    """``config`` with static_kv_cache's ``max_length`` set (its other options are the user's)."""
    mine = dict(config.pass_options.get("static_kv_cache", {}))
    mine["max_length"] = max_length
    return config.replace(pass_options={**config.pass_options, "static_kv_cache": mine})


def _in_place_target(config: Options, report: CompileReport) -> Options:
    """The config to lower with: targets that cannot order an in-place update go to eager (noted)."""
    try:
        target, _ = resolve_target(config)
    except GraphoptError:
        return config  # lower() reports the unavailable target and falls back itself
    if target.name in IN_PLACE_TARGETS:
        return config
    report.add_fallback(f"target:{target.name}", f"target {target.name} does not run graphs with an in-place "
                        "kv_cache_update; the static-cache step runs on eager")
    return config.replace(target="eager")


def compile_static_step(adapter: nn.Module, input_ids: Tensor, position_ids: Tensor, past: list[Tensor],
                        config: Options, max_length: int) -> StaticStep:
    """Export ``adapter`` at these inputs (past length dynamic), optimize, make the cache static, lower.

    Raises GraphoptError when the step cannot get a static cache (the near misses say why).
    """
    start = time.perf_counter()
    report = CompileReport(target="eager", requested_target=config.target, frontend="export")

    def to_target(optimized: Optimized) -> StaticStep:
        report.frozen_weights = optimized.program.frozen_weights
        report.nodes_in = ir.node_count(optimized.program.gm)
        result = optimized.result
        spec = spec_of(result.gm)
        if spec is None:
            reasons = "; ".join(m.reason for m in result.near_misses if m.pass_name == "static_kv_cache")
            reasons = reasons or next((f["reason"] for f in result.fallbacks), "static_kv_cache did not fire")
            raise GraphoptError(f"no static KV cache for {type(adapter).__name__}: {reasons}")
        note_pipeline(report, result)
        device = past[0].device if past else input_ids.device
        examples = _static_example_inputs(spec, input_ids, position_ids, device)
        fn = lower(result.gm, examples, _in_place_target(config, report), report)
        return StaticStep(fn, spec, result.gm, report, 0.0)

    dynamic = torch.export.Dim.DYNAMIC
    step = front_half(adapter, layout_options(config, max_length), to_target, args=(input_ids, position_ids, past),
                      stage="static_step", dynamic_shapes=(None, None, [{2: dynamic}] * len(past)))
    report.compile_s = step.compile_s = time.perf_counter() - start
    record(report)
    return step


class CacheBuffers:
    """The static cache buffers of a runner, allocated once, shared by every step graph (and zeroed
    for each later generate call that reuses the runner)."""

    def __init__(self, spec: StaticCacheSpec, device: torch.device) -> None:
        self.spec = spec
        self.caches = [torch.zeros(c.shape, dtype=c.dtype, device=device) for c in spec.caches]
        self.scales = [torch.zeros(c.scales_shape, dtype=torch.float32, device=device)
                       for c in spec.caches if c.scales_shape is not None]
        self.block_table = None
        if spec.block_table_shape is not None:
            # One contiguous run of blocks per sequence; any permutation would do (the tests use one).
            self.block_table = torch.arange(spec.block_table_shape[0] * spec.block_table_shape[1],
                                            device=device).view(spec.block_table_shape)
        self.pos = torch.zeros((), dtype=torch.long, device=device)
        self.device = torch.device(device)

    def zero_(self) -> None:
        """Back to a fresh call's state (the block table never changes)."""
        for t in (*self.caches, *self.scales, self.pos):
            t.zero_()

    def compatible(self, spec: StaticCacheSpec) -> bool:
        mine = self.spec
        return ([(c.shape, c.dtype, c.scales_shape) for c in mine.caches]
                == [(c.shape, c.dtype, c.scales_shape) for c in spec.caches]
                and mine.block_table_shape == spec.block_table_shape)

    def inputs(self, spec: StaticCacheSpec, input_ids: Tensor, position_ids: Tensor, pos: int) -> list:
        """The step graph's inputs in its order; ``pos`` is written into the one position tensor."""
        self.pos.fill_(pos)
        args: list[Any] = [input_ids, position_ids, *self.caches, self.pos]
        if spec.block_table_index is not None:
            args.append(self.block_table)
        return args + self.scales


def _first(out: Any) -> Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


class StepCache:
    """Compiled step graphs by input signature; ``compiles`` counts the misses."""

    def __init__(self, compile_fn: Callable) -> None:
        self.compile_fn, self.graphs, self.compiles, self.compile_s = compile_fn, {}, 0, 0.0

    def get(self, input_ids: Tensor, position_ids: Tensor, past: list[Tensor]):
        key = tuple((tuple(t.shape), t.dtype, t.device) for t in (input_ids, position_ids))
        if key not in self.graphs:
            step = self.compile_fn(input_ids, position_ids, past)
            self.graphs[key] = step
            self.compiles += 1
            self.compile_s += step.compile_s
        return self.graphs[key]


class StaticRunner:
    """Compiled prefill and decode graphs over one set of static cache buffers."""

    pads = False

    def __init__(self, model: nn.Module, config: Options, max_length: int, target: str) -> None:
        from graphopt.cuda_graphs import wrap_step

        self.step_fn, self.wrap_step, self.target = step_adapter(model), wrap_step, target
        self.graphs = StepCache(lambda ids, pos, past: compile_static_step(self.step_fn, ids, pos, past, config,
                                                                            max_length))
        self.runners: dict[int, Callable] = {}
        self.compiles = self.prefill_compiles = 0
        self.cuda_graphs = ""

    def prepare(self, input_ids: Tensor, attention_mask: Tensor | None) -> None:
        """Compile the prefill graph (raises GraphoptError, or what export raised, when it cannot)."""
        batch, prompt = input_ids.shape
        before = self.graphs.compiles
        self.probe = example_past(self.step_fn, input_ids)
        self.first = self.graphs.get(input_ids, positions(batch, 0, prompt, input_ids.device), self.probe)
        self.prefill_compiles += self.graphs.compiles - before
        buffers = getattr(self, "buffers", None)
        if buffers is not None and buffers.device == input_ids.device and buffers.compatible(self.first.spec):
            buffers.zero_()  # a runner reused by a later generate call: same addresses, so captured graphs replay
        else:
            self.buffers = CacheBuffers(self.first.spec, input_ids.device)

    def prefill(self, input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        batch, prompt = input_ids.shape
        args = self.buffers.inputs(self.first.spec, input_ids, positions(batch, 0, prompt, input_ids.device), 0)
        return _first(self.first.fn(*args))[:, -1]

    def prepare_step(self, token: Tensor, position: int) -> None:
        before = self.graphs.compiles
        step = self.graphs.get(token, positions(token.shape[0], position, 1, token.device), self.probe)
        self.compiles += self.graphs.compiles - before
        if not self.buffers.compatible(step.spec):
            raise GraphoptError("the decode step's static cache differs from the prefill's; this is a graphopt bug")
        if id(step) not in self.runners:
            self.runners[id(step)], self.cuda_graphs = self.wrap_step(step.fn, step.gm, step.spec)
        self.next = step, self.runners[id(step)]

    def step(self, token: Tensor, position: int) -> Tensor:
        step, run = self.next
        args = self.buffers.inputs(step.spec, token, positions(token.shape[0], position, 1, token.device), position)
        return _first(run(*args))[:, -1]

    @property
    def compile_s(self) -> float:
        return self.graphs.compile_s

    @property
    def reports(self) -> list[CompileReport]:
        return [g.report for g in self.graphs.graphs.values()]


def example_past(step: nn.Module, input_ids: Tensor) -> list[Tensor]:
    """Zero past K/V shaped like the model's cache, with a length unlike any step's (so the
    exported length symbol is not merged with a static size): the model's own cache from a
    one-token probe tells the number of layers, heads and head size."""
    batch, prompt = input_ids.shape
    _, *present = step(input_ids[:, :1], positions(batch, 0, 1, input_ids.device), [])
    length = next(n for n in range(3, 64) if n not in (prompt, prompt + 1))
    return [torch.zeros(t.shape[0], t.shape[1], length, t.shape[3], dtype=t.dtype, device=t.device) for t in present]
