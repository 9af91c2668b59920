"""CUDA Graph planning: ``ops on one CUDA/HIP device, static shapes, no host sync  ->  regions
marked for capture (meta["graphopt_cuda_graph"] = region), every other op explained``.

Why: a decode step is hundreds of small kernels; replaying them as one CUDA (or HIP) graph
removes the per-launch CPU cost, which dominates at batch 1. Capture records kernels with
fixed pointers and shapes, so only some ops qualify. This pass decides which, and says
why for each op that does not; ``graphopt.cuda_graphs`` captures and replays the regions
at run time (once per shape bucket, one memory pool, static input buffers, the static
KV cache passed by address and never copied).

An op is left out when it
- syncs with the host (``.item()``, ``nonzero``, ``masked_select``, ``unique``, ...): capture
  would record a wait that never returns the value;
- has a data-dependent or dynamic shape (an unbacked or symbolic size): a graph replays fixed shapes;
- touches a CPU tensor, or tensors on two devices: a graph replays one device's stream;
- is a collective over a process group that is not NCCL (RCCL on ROCm builds): gloo and
  the others move data on the host. An NCCL collective (functional ``all_reduce``, the fused
  ``graphopt.all_reduce_add_rms_norm``, ...) and the ``wait_tensor`` after it are ordinary
  GPU stream work on each rank's one device, so they are captured with their neighbours
  (the runtime's warm-up run before capture creates the communicator; every rank captures
  and replays the same collectives in the same order, since every rank runs the same graph).
Consecutive capturable ops form a region; the ops left out run eagerly between regions.
On a graph with no CUDA/HIP tensor (the CPU) the pass marks nothing and says so.
Preconditions: every node has ``meta["val"]`` (fake tensors carry the device).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.cuda_graphs import PLAN, REGION, CapturePlan, plan_of
from graphopt.pass_manager import NearMiss, PassContext, PassResult

aten = torch.ops.aten
SKIPPED = "graphopt_cuda_graph_skip"  # node meta: why an op runs eagerly
WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default

HOST_SYNC = {
    aten._local_scalar_dense.default: "reads a value on the host (.item())",
    aten.item.default: "reads a value on the host (.item())",
    aten.nonzero.default: "nonzero's output size depends on the data (host sync)",
    aten.masked_select.default: "masked_select's output size depends on the data (host sync)",
    aten._unique2.default: "unique's output size depends on the data (host sync)",
    aten.unique_consecutive.default: "unique's output size depends on the data (host sync)",
    aten.unique_dim.default: "unique's output size depends on the data (host sync)",
    aten.equal.default: "equal returns a Python bool (host sync)",
    aten.is_nonzero.default: "is_nonzero returns a Python bool (host sync)",
    aten.repeat_interleave.Tensor: "repeat_interleave with tensor repeats sizes its output from the data",
    aten._assert_async.msg: "an assert on device data syncs to raise",
}


@dataclass
class Options:
    # a replay costs about one launch, so a shorter region gains nothing from capture
    min_region_ops: int = field(default=1, metadata={
        "help": "capture only regions of at least this many ops; shorter ones run eagerly"})

    def __post_init__(self) -> None:
        if not isinstance(self.min_region_ops, int) or self.min_region_ops < 1:
            raise ValueError(f"min_region_ops must be an int >= 1, got {self.min_region_ops!r}")


def _tensors(value: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    fx.node.map_aggregate(value, lambda x: out.append(x) if isinstance(x, torch.Tensor) else None)
    return out


def _is_dynamic(value: Any) -> bool:
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return True
    return any(not isinstance(s, int) for t in _tensors(value) for s in t.shape)


def _devices(node: fx.Node) -> set[torch.device]:
    """Devices of the op's tensors, less constant 0-d CPU tensors: those reach a GPU kernel as
    scalar arguments, which capture records once, and being constants they never change."""
    values = [node.meta.get("val")] + [a.meta.get("val") for a in node.all_input_nodes
                                       if not (a.op == "get_attr" and _is_cpu_scalar(a.meta.get("val")))]
    return {t.device for v in values for t in _tensors(v)}


def _is_cpu_scalar(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 0 and value.device.type == "cpu"


def group_name_of(node: fx.Node) -> str | None:
    """The process group a collective runs over: the argument its schema names ``group_name``
    (functional collectives, graphopt's fused all-reduce ops), else None."""
    schema = getattr(node.target, "_schema", None)
    for i, arg in enumerate(schema.arguments if schema is not None else ()):
        if arg.name == "group_name":
            return node.args[i] if i < len(node.args) else node.kwargs.get("group_name", arg.default_value)
    return None


def collective_reason(node: fx.Node) -> str | None:
    """Why a collective (or the wait on one) cannot be captured; None for other ops and for
    collectives over an NCCL group."""
    if node.target is WAIT_TENSOR:
        source = node.args[0]
        if isinstance(source, fx.Node) and SKIPPED in source.meta:
            return f"waits on {source.name}, which runs eagerly"
        return None
    group = group_name_of(node)
    if group is None:
        return None
    try:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _resolve_process_group

        backend = dist.get_backend(_resolve_process_group(group))
    except Exception as error:  # noqa: BLE001  no such group here (a graph compiled elsewhere)
        return f"collective over process group {group!r}, which this process cannot resolve ({type(error).__name__})"
    if backend != "nccl":  # RCCL registers as nccl on ROCm builds
        return (f"collective over a {backend} process group: only NCCL/RCCL collectives are GPU stream work "
                "a graph can record")
    return None


def skip_reason(node: fx.Node, device: torch.device) -> str | None:
    """Why ``node`` cannot be captured on ``device``, or None when it can."""
    if node.target in HOST_SYNC:
        return HOST_SYNC[node.target]
    collective = collective_reason(node)
    if collective is not None:
        return collective
    if "val" not in node.meta:
        return "no meta['val']: shapes and devices are unknown"
    for value in [node.meta["val"], *[a.meta.get("val") for a in node.all_input_nodes]]:
        if _is_dynamic(value):
            return f"dynamic shape {ir.describe_val(value)}: a graph replays fixed shapes"
    devices = _devices(node)
    cpu = sorted(str(d) for d in devices if d.type == "cpu")
    if cpu:
        return f"touches a CPU tensor ({', '.join(cpu)}): a graph replays one GPU stream"
    if len(devices) > 1:
        return f"spans devices {', '.join(sorted(map(str, devices)))}"
    if devices and next(iter(devices)) != device:
        return f"runs on {next(iter(devices))}, the graph's other ops on {device}"
    return None


def graph_device(gm: fx.GraphModule) -> torch.device | None:
    """The first CUDA/HIP device any value of the graph lives on (torch names HIP devices cuda)."""
    for node in gm.graph.nodes:
        for t in _tensors(node.meta.get("val")):
            if t.device.type == "cuda":
                return t.device
    return None


class CudaGraphs:
    name = "cuda_graphs"
    summary = "mark regions of static-shape, sync-free GPU ops for CUDA/HIP graph capture"
    Options = Options
    requires: tuple[str, ...] = ()

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        options = ctx.options_for(self)
        previous = plan_of(gm)
        for node in gm.graph.nodes:  # marks from an earlier run describe a graph that has changed since
            node.meta.pop(REGION, None)
            node.meta.pop(SKIPPED, None)
        device = graph_device(gm)
        if device is None:
            where = sorted({str(t.device) for n in gm.graph.nodes for t in _tensors(n.meta.get("val"))}) or ["no device"]
            note = f"the graph runs on {', '.join(where)}: CUDA graphs need a CUDA or HIP device"
            gm.meta[PLAN] = CapturePlan(None, note=note)
            miss = NearMiss(self.name, "graph", "graph", note + "; nothing captured")
            return PassResult(gm, modified=False, stats={"matches": 0, "regions": 0}, near_misses=[miss])
        plan, misses = CapturePlan(str(device)), []
        run: list[fx.Node] = []
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            reason = skip_reason(node, device)
            if reason is None and node.target is operator.getitem and SKIPPED in node.args[0].meta:
                reason = f"reads an output of {node.args[0].name}, which runs eagerly"
            if reason is None:
                run.append(node)
                continue
            node.meta[SKIPPED] = reason
            plan.skipped.append((node.name, reason))
            misses.append(NearMiss(self.name, node.name, node.name, reason))
            self._close(run, plan, options, misses)
            run = []
        self._close(run, plan, options, misses)
        if not plan.regions:
            plan.note = "no run of capturable ops"
        gm.meta[PLAN] = plan
        # A run that finds the plan an earlier run left has changed nothing: it matches no new
        # region, so a fixpoint driver stops and --print-ir-after-change stays quiet.
        unchanged = previous == plan
        stats = {"matches": 0 if unchanged else len(plan.regions), "regions": len(plan.regions),
                 "captured_ops": sum(map(len, plan.regions)), "eager_ops": len(plan.skipped)}
        return PassResult(gm, modified=bool(plan.regions) and not unchanged, stats=stats, near_misses=misses)

    def _close(self, run: list[fx.Node], plan: CapturePlan, options: Options, misses: list[NearMiss]) -> None:
        """Turn a finished run of capturable ops into a region (or explain why not)."""
        ops = [n for n in run if n.target is not operator.getitem]
        if not run:
            return
        if len(ops) < options.min_region_ops:
            reason = f"region of {len(ops)} op(s) is below min_region_ops={options.min_region_ops}"
            for n in run:
                n.meta[SKIPPED] = reason
                plan.skipped.append((n.name, reason))
            misses.append(NearMiss(self.name, run[0].name, run[-1].name, reason))
            return
        index = len(plan.regions)
        for n in run:
            n.meta[REGION] = index
        plan.regions.append([n.name for n in run])


cuda_graphs = CudaGraphs()
