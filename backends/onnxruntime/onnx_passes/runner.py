"""The ONNX-level passes' protocol and the one runner that reports them as FX passes are reported.

An ONNX pass is an object with ``name``, a one-line ``summary`` and ``run(model) ->
OnnxPassResult`` (how many rewrites it made, its counts by kind, and the reason for each
candidate it refused), on an ``onnx_ir.Model`` in place. ``run_onnx_passes`` runs a list of
them and times each, and gives back the same ``PassRecord`` and ``NearMiss`` entries the
PassManager makes for an FX pass, named ``onnx:<name>``; the export hands them to the graph's
compile report (``report.passes``, ``graphopt debug``). A pass that raises is recorded as failed
and the error goes on to the export's caller, as before: an ONNX rewrite that breaks is an
export that failed, which the target's fallback handles.

``record_run`` is the step under ``run_onnx_passes``: it times and records any rewrite that
returns an ``OnnxPassResult``, so one that runs on another form of the model than onnx_ir's
(``transposed_weights``: the protobuf a CPU session is made from) is reported the same way.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from graphopt.pass_manager import NearMiss, PassRecord

PREFIX = "onnx:"  # report names: onnx:tidy_attention_layout, beside the FX passes' fuse_rms_norm


@dataclass
class Refusal:
    """A candidate an ONNX pass looked at and left as it was, with the reason."""

    node: str  # the node the candidate starts from ("graph" for the whole model)
    reason: str


@dataclass
class OnnxPassResult:
    changed: int  # rewrites made; 0: the model is as it was
    stats: dict[str, int] = field(default_factory=dict)
    near_misses: list[Refusal] = field(default_factory=list)


class OnnxPass(Protocol):
    name: str
    summary: str

    def run(self, model: Any) -> OnnxPassResult: ...


@dataclass
class OnnxPassRun:
    """What ``run_onnx_passes`` did: one record per pass in order, and every refusal."""

    records: list[PassRecord] = field(default_factory=list)
    near_misses: list[NearMiss] = field(default_factory=list)

    def extend(self, other: "OnnxPassRun") -> None:
        self.records += other.records
        self.near_misses += other.near_misses


def node_count(model: Any) -> int:
    return sum(1 for _ in model.graph)


def run_onnx_passes(model: Any, passes: Sequence[OnnxPass]) -> OnnxPassRun:
    """Run ``passes`` in order on ``model`` (onnx_ir, in place); their records and near misses."""
    done = OnnxPassRun()
    for p in passes:
        done.extend(record_run(p.name, functools.partial(p.run, model), functools.partial(node_count, model)))
    return done


def record_run(name: str, run: Callable[[], OnnxPassResult], count_nodes: Callable[[], int]) -> OnnxPassRun:
    """``run()`` timed and recorded as the pass ``onnx:<name>``, with ``count_nodes()`` of the
    model it rewrites before and after; an error is recorded as failed and raised again."""
    done = OnnxPassRun()
    record = PassRecord(PREFIX + name, nodes_before=count_nodes())
    done.records.append(record)
    start = time.perf_counter()
    try:
        result = run()
    except Exception as error:
        record.time_ms = (time.perf_counter() - start) * 1e3
        record.status, record.error = "failed", f"{type(error).__name__}: {error}"
        record.nodes_after = count_nodes()
        raise
    record.time_ms = (time.perf_counter() - start) * 1e3
    record.matches = int(result.changed)
    record.stats = {"matches": int(result.changed), **{k: int(v) for k, v in result.stats.items()}}
    record.status = "changed" if result.changed else "unchanged"
    record.nodes_after = count_nodes()
    record.near_misses = len(result.near_misses)
    done.near_misses += [NearMiss(record.name, m.node, m.node, m.reason) for m in result.near_misses]
    return done
