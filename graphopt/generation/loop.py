"""The decode loop: the one place tokens are chosen, stopped on, timed and compared.

A target contributes a step runner (``graphopt.generation.runner.StepRunner``): it owns a KV
cache and turns ``prefill(ids, mask)`` and ``step(token, position)`` into the logits of the
last position. :func:`drive` runs one or more runners in lockstep on one batch: each prefill
and each step is timed alone (``prepare`` / ``prepare_step``, where compilation happens, left
out), and the runners take turns step by step, so on a shared machine the noise falls on all
of them alike. That is how ``generate_with_reference`` puts a target next to eager, except
for a runner that sets torch's threads for its loop (``decoding()``, the onnxruntime
decoder), which decodes alone first (generation/api.py ``_drive``).

The loop runs on torch tensors or, for a runner that takes numpy arrays (a kept ONNX Runtime
decoder, ``in_place.ArrayRunner``), on numpy arrays without importing torch: ``input_ids``
says which, and the result's arrays are of the same kind.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

from graphopt.generation.sampling import Sampler, StopConditions, array_module

if TYPE_CHECKING:
    from torch import Tensor

    from graphopt.report import CompileReport

# on_token(token [B, 1], live [B]): called with every token chosen by the first runner;
# ``live`` marks the rows that were still generating when it was chosen.
TokenCallback = Callable[["Tensor", "Tensor"], None]


@dataclass
class GenerateResult:
    sequences: Tensor  # [B, prompt_len + new tokens]; finished rows padded
    prompt_len: int
    ms_per_token: list[float] = field(default_factory=list)  # one per decode step (compilation excluded)
    prefill_ms: float = 0.0
    compiles: int = 0  # graph compilations during the decode steps
    prefill_compiles: int = 0
    compile_s: float = 0.0  # wall time of all compilations / exports (prefill and decode)
    compile_stages: dict[str, float] = field(default_factory=dict)  # seconds per build stage, where a runner times them
    fallback: str | None = None  # why decoding ran eagerly, if it did
    cuda_graphs: str = ""  # what CUDA graph capture did, or why not
    reports: list[CompileReport] = field(default_factory=list)
    target: str = "eager"  # the target whose runner decoded
    new_lengths: list[int] = field(default_factory=list)  # new tokens per row, its stop token included
    notes: list[str] = field(default_factory=list)  # how the batch was decoded, when that is not plain

    @property
    def new_tokens(self) -> Tensor:
        return self.sequences[:, self.prompt_len:]

    def token_ids(self, row: int) -> list[int]:
        """Row ``row``'s new tokens up to its stop (no padding after it)."""
        return self.new_tokens[row, :self.new_lengths[row]].tolist()

    def median_ms(self, first: int, last: int) -> float | None:
        """Median ms/token over decode steps ``first..last`` (1-based, inclusive)."""
        window = self.ms_per_token[first - 1:last]
        return statistics.median(window) if window else None


def _sync(xp, device) -> None:
    if xp.__name__ == "torch" and device.type == "cuda":
        xp.cuda.synchronize(device)


class _Lane:
    """One runner's state in the loop: its tokens, finished rows and timings."""

    def __init__(self, runner, sampler: Sampler, input_ids: Tensor) -> None:
        self.runner, self.sampler = runner, sampler
        self.result = GenerateResult(input_ids, input_ids.shape[1], target=runner.target)
        self.tokens: list[Tensor] = []
        xp = array_module(input_ids)
        self.finished = xp.zeros_like(input_ids[:, 0], dtype=xp.bool)
        self.lengths = xp.zeros_like(input_ids[:, 0], dtype=xp.int64)
        self.current: Tensor | None = None

    def accept(self, stop: StopConditions, on_token: TokenCallback | None) -> bool:
        """Take the token just chosen; True while some row still generates."""
        live = ~self.finished
        token, self.finished = stop.update(self.current, self.finished, self.tokens)
        self.lengths += live
        self.tokens.append(token)
        self.current = token
        if on_token is not None:
            on_token(token, live)
        return not bool(self.finished.all())


def drive(runners: Sequence, input_ids: Tensor, attention_mask: Tensor | None, max_new_tokens: int,
          samplers: Sequence[Sampler], stop: StopConditions | None = None,
          on_token: TokenCallback | None = None) -> list[GenerateResult]:
    """Decode up to ``max_new_tokens`` after ``input_ids`` [B, S] with each runner, in lockstep.

    ``attention_mask`` [B, S] (1 = token, 0 = left padding) goes to runners that take one
    (``runner.pads``); the caller splits a padded batch for the others. A runner stops when all
    its rows met ``stop``; the first runner's tokens go to ``on_token`` as they come.
    """
    stop = stop or StopConditions()
    xp, device = array_module(input_ids), input_ids.device
    lanes = [_Lane(r, s, input_ids) for r, s in zip(runners, samplers)]
    prompt = input_ids.shape[1]
    no_grad = xp.no_grad() if xp.__name__ == "torch" else contextlib.nullcontext()
    with no_grad, contextlib.ExitStack() as threads:
        for lane in lanes:
            lane.runner.prepare(input_ids, attention_mask)
        if all(hasattr(lane.runner, "decoding") for lane in lanes):
            # A runner's say over torch's threads for the loop (the onnxruntime decoder's: one
            # thread, backends/onnxruntime/decoder/decoder.py). Only when every runner has one: an
            # eager runner stepped in lockstep needs torch's threads.
            for lane in lanes:
                threads.enter_context(lane.runner.decoding())
        for lane in lanes:
            start = time.perf_counter()
            lane.current = lane.sampler(lane.runner.prefill(input_ids, attention_mask))
            _sync(xp, device)
            lane.result.prefill_ms = (time.perf_counter() - start) * 1e3
        active = list(lanes)
        for i in range(max_new_tokens):
            active = [lane for lane in active if lane.accept(stop, on_token if lane is lanes[0] else None)]
            if i == max_new_tokens - 1:
                break
            for lane in active:
                lane.runner.prepare_step(lane.current, prompt + i)  # compiles on a new signature: the first step
                start = time.perf_counter()
                lane.current = lane.sampler(lane.runner.step(lane.current, prompt + i))
                _sync(xp, device)
                lane.result.ms_per_token.append((time.perf_counter() - start) * 1e3)
    for lane in lanes:
        runner, result = lane.runner, lane.result
        result.sequences = xp.concat([input_ids, *lane.tokens], axis=1)
        result.new_lengths = lane.lengths.tolist()
        result.compiles, result.prefill_compiles = runner.compiles, runner.prefill_compiles
        result.compile_s, result.cuda_graphs = runner.compile_s, runner.cuda_graphs
        result.compile_stages = dict(getattr(runner, "compile_stages", {}))
        result.reports, result.notes = list(runner.reports), list(getattr(runner, "notes", []))
    return [lane.result for lane in lanes]


def merge_groups(input_ids: Tensor, groups: list[tuple[list[int], GenerateResult]], pad: int) -> GenerateResult:
    """One result for a batch decoded as groups of rows: each row's new tokens after its prompt
    (the batch's own, padding kept), timings summed step by step (a step of the batch is one
    step of every group), compile counts from the last group (runners count cumulatively)."""
    import torch

    batch, prompt = input_ids.shape
    longest = max(r.new_tokens.shape[1] for _, r in groups)
    new = torch.full((batch, longest), pad, dtype=input_ids.dtype, device=input_ids.device)
    lengths = [0] * batch
    steps = [0.0] * max(len(r.ms_per_token) for _, r in groups)
    for rows, r in groups:
        new[rows, :r.new_tokens.shape[1]] = r.new_tokens.to(input_ids.dtype)
        for row, n in zip(rows, r.new_lengths):
            lengths[row] = n
        for k, ms in enumerate(r.ms_per_token):
            steps[k] += ms
    last = groups[-1][1]
    return GenerateResult(torch.cat([input_ids, new], dim=1), prompt, steps, sum(r.prefill_ms for _, r in groups),
                            last.compiles, last.prefill_compiles, last.compile_s, dict(last.compile_stages),
                            last.fallback, last.cuda_graphs, last.reports, last.target, lengths, list(last.notes))
