"""Timers for benchmarks/triton_kernels.py that separate a kernel's device time from its launch.

``triton.testing.do_bench`` flushes the L2 before each call and times it with CUDA events, so
its number is the kernel plus any time the GPU waits for the host to launch it: for a 2 µs
INT4 GEMV behind 100 µs of Python that is the launch, not the kernel. These timers answer
the two questions apart:

- :func:`graph_ms`: device time per call, from a CUDA graph that replays the calls back to
  back (no host in the loop). The calls rotate over several independent copies of the
  inputs, together larger than the L2, so each call streams its bytes from HBM as a model's
  successive layers do, instead of re-reading a cache-resident weight.
- :func:`host_us`: host time per call (Python, argument checks, the launch itself), which a
  captured decode step never pays.
- :class:`ReplayRecorder`: keeps the replay of each CUDA graph graphopt captures, so a
  benchmark can time the captured decode step alone, without the generate loop around it.
- :func:`kernel_ms_per_step`: the device time of one uncaptured decode step's kernels
  (torch.profiler), which the captured step is measured against.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def graph_ms(fns: list[Callable[[], object]], rounds: int = 4, replays: int = 10) -> float:
    """Device milliseconds per call: ``rounds`` passes over ``fns`` (one per input copy) captured
    in one CUDA graph (graphopt's own capture: a warm-up run on a side stream first), replayed
    ``replays`` times; the median replay over the calls in it."""
    from graphopt.cuda_graphs import TorchGraphs

    for fn in fns:  # compile, autotune and allocate outside the capture
        fn()
    torch.cuda.synchronize()

    def calls() -> None:
        for _ in range(rounds):
            for fn in fns:
                fn()

    replay, _ = TorchGraphs().capture(calls, [])
    return replay_ms(replay, replays) / (rounds * len(fns))


def replay_ms(replay: Callable[[], None], replays: int = 10) -> float:
    """Median device milliseconds of one ``replay()`` (after two warm-up replays)."""
    replay(), replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def host_us(fn: Callable[[], object], calls: int = 200) -> float:
    """Host microseconds per call, launches queued without waiting for the device: the median
    over 10 batches of ``calls / 10``, the device drained between batches so the launch queue
    stays short (host time, not queue back-pressure). Without CUDA it times the calls alone."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    sync()
    per_batch = max(1, calls // 10)
    batches = []
    for _ in range(10):
        start = time.perf_counter()
        for _ in range(per_batch):
            fn()
        batches.append((time.perf_counter() - start) / per_batch * 1e6)
        sync()
    return statistics.median(batches)


class ReplayRecorder:
    """While active, every graph ``graphopt.cuda_graphs.TorchGraphs`` captures is also kept here
    as its ``replay`` callable, newest last."""

    def __init__(self) -> None:
        self.replays: list[Callable[[], None]] = []

    def __enter__(self) -> "ReplayRecorder":
        from graphopt.cuda_graphs import TorchGraphs

        self._original = original = TorchGraphs.capture
        recorder = self

        def capture(self, fn, args):
            replay, outputs = original(self, fn, args)
            recorder.replays.append(replay)
            return replay, outputs

        TorchGraphs.capture = capture
        return self

    def __exit__(self, *exc) -> None:
        from graphopt.cuda_graphs import TorchGraphs

        TorchGraphs.capture = self._original


def kernel_ms_per_step(model, ids, new_tokens: int) -> float:
    """Device time of one uncaptured decode step: the sum of its kernels (torch.profiler).

    Two runs of different lengths, differenced, so the prefill's kernels cancel out.
    """
    import graphopt
    from torch.profiler import ProfilerActivity, profile

    torch._dynamo.reset()
    graphopt.reset()
    options = {"target": "triton", "disable_passes": ["cuda_graphs"]}
    graphopt.generate(model, ids, 4, options=options)  # compile outside the profiles

    def kernel_ms(n: int) -> float:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graphopt.generate(model, ids, n, options=options)
        return sum(e.self_device_time_total for e in prof.key_averages()) / 1e3

    short = max(2, new_tokens // 4)
    return (kernel_ms(new_tokens) - kernel_ms(short)) / (new_tokens - short)
