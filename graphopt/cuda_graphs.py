"""Capture and replay CUDA graphs (HIP graphs on ROCm builds, through the same torch API)
for the regions ``passes/cuda_graphs.py`` marked.

The graph is cut into segments in node order: each region becomes a
:class:`CapturedRegion`, the ops between regions run eagerly, and segments run strictly in
the original order (an in-place ``kv_cache_update`` must run before the attention that
reads the cache, and no data edge says so). A region is captured once per bucket, the
bucket being the shapes, dtypes, devices and strides of its inputs plus the addresses of
its static inputs; a call outside every bucket captures a new one, all in one memory pool
(``torch.cuda.graph_pool_handle()``), so buckets share memory instead of each reserving
its own. Static inputs (the KV cache buffers, their scales, the block table and the
position tensor, which ``graphopt.generate`` allocates once and updates in place) are
recorded by address and never copied; other inputs are copied into the bucket's input
buffers before each replay. Outputs that leave the step are cloned, because the next
replay overwrites the graph's output buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch import Tensor

from graphopt.ops.kv_cache import StaticCacheSpec

# The plan passes/cuda_graphs.py leaves on a graph for this runtime: each captured node's
# region index, and the CapturePlan on the graph.
REGION = "graphopt_cuda_graph"  # node meta: the region index of a captured op
PLAN = "graphopt_cuda_graph_plan"  # graph meta: the CapturePlan


@dataclass
class CapturePlan:
    """Where capture applies: region i is the list of node names marked ``REGION == i``."""

    device: str | None  # "cuda:0" (HIP builds say cuda too), or None when the graph has no GPU tensor
    regions: list[list[str]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (node, reason)
    note: str = ""

    def summary(self) -> str:
        if not self.regions:
            return f"no CUDA graph captured: {self.note or 'no capturable op'}"
        return (f"{len(self.regions)} CUDA graph region(s), {sum(map(len, self.regions))} ops on {self.device}; "
                f"{len(self.skipped)} ops run eagerly")


def plan_of(gm: fx.GraphModule) -> CapturePlan | None:
    """The plan passes/cuda_graphs.py left on ``gm``, or None when it did not run."""
    return getattr(gm, "meta", {}).get(PLAN)


class TorchGraphs:
    """Capture with ``torch.cuda.CUDAGraph`` (a HIP graph on ROCm) into one shared pool."""

    def __init__(self) -> None:
        self._pool = None

    def pool(self) -> Any:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def capture(self, fn: Callable, args: Sequence[Any]) -> tuple[Callable[[], None], Any]:
        """(replay, outputs): ``replay()`` reruns the recorded kernels, writing ``outputs``."""
        # One real run on a side stream first: lazy initialisation (cuBLAS handles, autotuning)
        # must not happen during capture. It repeats the step's cache write with the same
        # values, which is harmless: the write is idempotent.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn(*args)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool()):
            outputs = fn(*args)
        return graph.replay, outputs


class CapturedRegion:
    """``fn`` replayed from a captured graph per input bucket; ``static`` input positions by address."""

    def __init__(self, fn: Callable, static: set[int], backend: Any, name: str = "region") -> None:
        self.fn, self.static, self.backend, self.name = fn, set(static), backend, name
        self.buckets: dict[tuple, tuple[Callable, list, Any]] = {}
        self.captures = 0

    def key(self, args: Sequence[Any]) -> tuple:
        parts = []
        for i, a in enumerate(args):
            if isinstance(a, Tensor):
                parts.append((tuple(a.shape), a.dtype, str(a.device), a.stride(),
                               a.data_ptr() if i in self.static else None))
            else:
                parts.append(("value", a))  # baked into the capture: a new value is a new bucket
        return tuple(parts)

    def __call__(self, *args: Any) -> Any:
        key = self.key(args)
        entry = self.buckets.get(key)
        if entry is None:
            buffers = [a.clone() if isinstance(a, Tensor) and i not in self.static else a for i, a in enumerate(args)]
            replay, outputs = self.backend.capture(self.fn, buffers)
            entry = self.buckets[key] = (replay, buffers, outputs)
            self.captures += 1
        else:
            for i, (buffer, a) in enumerate(zip(entry[1], args)):
                if isinstance(a, Tensor) and i not in self.static:
                    buffer.copy_(a)
        entry[0]()
        return entry[2]


@dataclass
class Segment:
    fn: Callable
    inputs: list[fx.Node]  # values of the whole graph this segment reads
    outputs: list[fx.Node]  # values it defines that later segments or the graph output read
    region: int | None


def split_segments(gm: fx.GraphModule) -> list[Segment]:
    """Consecutive ops with the same region mark (or none) as small GraphModules, in node order."""
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    groups: list[list[fx.Node]] = []
    for node in ops:
        if groups and groups[-1][0].meta.get(REGION) == node.meta.get(REGION):
            groups[-1].append(node)
        else:
            groups.append([node])
    segments = []
    for group in groups:
        members = set(group)
        graph, env, inputs = fx.Graph(), {}, []

        def value(n: fx.Node) -> fx.Node:
            if n not in env:
                if n.op == "get_attr":
                    env[n] = graph.get_attr(n.target)  # weights stay attributes: static addresses
                else:
                    env[n] = graph.placeholder(n.name)
                    inputs.append(n)
            return env[n]

        for node in group:
            for arg in node.all_input_nodes:
                if arg not in members:
                    value(arg)
            env[node] = graph.node_copy(node, lambda n: env[n])
        outputs = [n for n in group if any(u not in members for u in n.users)]
        graph.output(tuple(env[n] for n in outputs))
        segments.append(Segment(fx.GraphModule(gm, graph), inputs, outputs, group[0].meta.get(REGION)))
    return segments


class SegmentRunner:
    """Runs ``gm`` segment by segment, regions through :class:`CapturedRegion`."""

    def __init__(self, gm: fx.GraphModule, static_inputs: set[str], backend: Any) -> None:
        self.gm = gm
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.output = next(n for n in gm.graph.nodes if n.op == "output")
        self.segments = split_segments(gm)
        self.regions: list[CapturedRegion] = []
        for seg in self.segments:
            if seg.region is not None:
                static = {i for i, n in enumerate(seg.inputs) if n.op == "placeholder" and n.name in static_inputs}
                seg.fn = CapturedRegion(seg.fn, static, backend, f"region{seg.region}")
                self.regions.append(seg.fn)

    @property
    def captures(self) -> int:
        return sum(r.captures for r in self.regions)

    def __call__(self, *args: Any) -> Any:
        env: dict[fx.Node, Any] = dict(zip(self.placeholders, args))
        for seg in self.segments:
            outs = seg.fn(*[env[n] if n in env else _attr(self.gm, n) for n in seg.inputs])
            env.update(zip(seg.outputs, outs))
        result = fx.node.map_arg(self.output.args[0], lambda n: env[n] if n in env else _attr(self.gm, n))
        # Region outputs are the graph's buffers, rewritten by the next replay: hand out copies.
        return fx.node.map_aggregate(result, lambda x: x.clone() if isinstance(x, Tensor) else x)


def _attr(gm: fx.GraphModule, node: fx.Node) -> Any:
    value: Any = gm
    for atom in node.target.split("."):
        value = getattr(value, atom)
    return value


def static_input_names(gm: fx.GraphModule, spec: StaticCacheSpec) -> set[str]:
    """Placeholders generate owns and updates in place: caches, scales, block table, position."""
    indices = {c.index for c in spec.caches} | {c.scales_index for c in spec.caches if c.scales_index is not None}
    indices |= {spec.pos_index} | ({spec.block_table_index} if spec.block_table_index is not None else set())
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return {placeholders[i].name for i in indices}


def wrap_step(fn: Callable, gm: fx.GraphModule, spec: StaticCacheSpec, backend: Any = None) -> tuple[Callable, str]:
    """``fn`` with its marked regions captured, and one line on what was captured or why not."""
    plan = plan_of(gm)
    if plan is None:
        return fn, "no CUDA graph captured: the cuda_graphs pass did not run"
    if not plan.regions:
        return fn, plan.summary()
    if backend is None:
        if not torch.cuda.is_available():
            return fn, "no CUDA graph captured: no CUDA or HIP runtime in this process"
        backend = TorchGraphs()
    static = static_input_names(gm, spec)
    if fn is gm:  # the eager target runs the FX graph itself: capture region by region
        runner = SegmentRunner(gm, static, backend)
        return runner, plan.summary()
    if len(plan.regions) == 1 and not plan.skipped:  # a target's whole compiled step is one region
        placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        region = CapturedRegion(fn, {i for i, n in enumerate(placeholders) if n in static}, backend, "step")
        return _cloning(region), plan.summary()
    return fn, ("no CUDA graph captured: the target compiled the step as one callable and "
                f"{len(plan.skipped)} op(s) cannot be captured (first: {plan.skipped[0][0]}: {plan.skipped[0][1]})")


def _cloning(fn: Callable) -> Callable:
    def run(*args: Any) -> Any:
        return fx.node.map_aggregate(fn(*args), lambda x: x.clone() if isinstance(x, Tensor) else x)

    return run
