"""Run a function on N ranks of one machine, each a process in a gloo process group on the
CPU, and return every rank's result.

gloo is the only backend: the ranks keep their tensors on the CPU and no rank picks a GPU, so
there is no NCCL or RCCL launch. ``torch.multiprocessing``'s spawn start method, so the
parent's threads and OpenMP state do not leak into the ranks. Each rank gets ``threads``
intra-op threads (one by default: ranks share the machine's cores, and oversubscribing them
makes the collectives wait on descheduled peers).

No run hangs silently. Every collective waits at most ``timeout`` seconds (the process group's
timeout, which gloo's collectives and the rendezvous honour), then raises in its rank. Each rank
sends its result or its failure back over its own pipe, which the parent reads as they arrive,
so a large result never blocks a rank; the parent also watches each process, so a rank that dies
without a word (the out-of-memory killer) is seen at once. On the first failure the parent gives
the others a moment to report, stops the rest, and raises one line that names the rank and the
collective (graphopt.distributed.failures).
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time
from multiprocessing.connection import wait
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from graphopt.distributed.failures import FLIGHT_RECORDER_ENTRIES, RankFailure, describe, died, one_line
from graphopt.errors import GraphoptError

BACKEND = "gloo"
DEFAULT_TIMEOUT_S = 60.0  # a minute: a TP run's ranks reach each collective within seconds of each other
REPORT_GRACE_S = 2.0  # after a first failure, how long the other ranks get to say what they saw
STOP_GRACE_S = 2.0  # between SIGTERM and SIGKILL for a rank still running


class RankFailed(GraphoptError):
    """A tensor-parallel rank failed, timed out in a collective or died; ``str(e)`` names it,
    ``failures`` holds every rank's report (``detail``: its traceback)."""

    def __init__(self, line: str, failures: list[RankFailure]) -> None:
        super().__init__(line)
        self.failures = failures


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, timeout: float, threads: int,
               fn: Callable, args: tuple, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=str(threads))
    # the flight recorder names the collective a failure happened in
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", FLIGHT_RECORDER_ENTRIES)
    torch.set_num_threads(threads)
    initialised = False
    try:
        dist.init_process_group(BACKEND, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout))
        initialised = True
        result = fn(rank, world, *args)
        out.send(("ok", result))
    except BaseException as error:  # noqa: BLE001  the parent turns it into the run's one line
        try:
            out.send(("failed", describe(rank, error, initialised)))
            out.close()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            # a process group that failed may block in its teardown: leave without one
            os._exit(1)
    out.close()
    dist.destroy_process_group()


def _stop(procs: list) -> None:
    """SIGTERM every rank still running, then SIGKILL those that ignore it."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def spawn(fn: Callable[..., Any], world: int, *args: Any, threads: int = 1,
          timeout: float = DEFAULT_TIMEOUT_S) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks; their return values by rank.

    ``fn`` must be importable by name (a module-level function): spawned processes import it.
    ``timeout``: seconds a collective (or the rendezvous) may wait for its peers before it fails.
    Raises ``RankFailed`` with one line naming the rank (and the collective) when any rank fails.
    """
    if world < 1:
        raise GraphoptError(f"--tp must be at least 1, got {world}")
    if not timeout > 0:
        raise GraphoptError(f"--tp-timeout must be more than 0 seconds, got {timeout}")
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs, pipes = [], {}
    try:
        for rank in range(world):
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_rank_main, name=f"graphopt-tp-rank-{rank}",
                            args=(rank, world, port, timeout, threads, fn, args, writer))
            p.start()
            writer.close()  # the rank holds the only writer: its end closing is EOF here
            procs.append(p)
            pipes[reader] = rank
        results, failures = _gather(procs, pipes)
        if failures:
            raise RankFailed(one_line(failures, world, timeout), failures)
        for p in procs:  # every rank has answered; one stuck in its exit is not waited for long
            p.join(timeout)
        return [results[r] for r in range(world)]
    finally:
        _stop(procs)
        for reader in pipes:
            reader.close()


def _gather(procs: list, pipes: dict) -> tuple[dict[int, Any], list[RankFailure]]:
    """Read every rank's answer as it comes; stop at the first failure plus ``REPORT_GRACE_S``.
    A rank whose process ended and whose pipe is drained without an answer died."""
    results: dict[int, Any] = {}
    failures: list[RankFailure] = []
    accounted: set[int] = set()
    running = {p.sentinel: rank for rank, p in enumerate(procs)}
    deadline = None
    while len(accounted) < len(procs):
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            break
        for ready in wait([*pipes, *running], left):
            if ready in running:
                procs[running.pop(ready)].join()
                continue
            rank = pipes.pop(ready)
            try:
                status, payload = ready.recv()
            except EOFError:  # it ended without a word: its exit code says how, below
                continue
            finally:
                ready.close()
            accounted.add(rank)
            if status == "ok":
                results[rank] = payload
            else:
                failures.append(payload)
        open_ranks = set(pipes.values())
        for rank, p in enumerate(procs):
            # its pipe is drained only after its last message, so no answer is lost here
            if rank not in accounted and rank not in open_ranks and p.exitcode is not None:
                accounted.add(rank)
                failures.append(died(rank, p.exitcode))
        if failures and deadline is None:
            deadline = time.monotonic() + REPORT_GRACE_S
    return results, failures
