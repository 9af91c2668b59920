"""Run a function on N ranks of one machine, each a process in a gloo (CPU) or nccl
process group, and return rank 0's result.

``torch.multiprocessing`` with the spawn start method, so the parent's threads and
OpenMP state do not leak into the ranks. Each rank gets ``threads`` intra-op threads
(one by default: ranks share the machine's cores, and oversubscribing them makes the
collectives wait on descheduled peers).
"""

from __future__ import annotations

import os
import socket
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from graphopt.errors import GraphoptError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, backend: str, threads: int,
               fn: Callable, args: tuple, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=str(threads))
    torch.set_num_threads(threads)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        out = fn(rank, world, *args)
        results.put((rank, "ok", out))
    except BaseException as error:  # noqa: BLE001  the parent re-raises it with the rank's traceback
        results.put((rank, "error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
        raise
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world: int, *args: Any, backend: str = "gloo", threads: int = 1) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` ranks; their return values by rank.

    ``fn`` must be importable by name (a module-level function): spawned processes import it.
    """
    if world < 1:
        raise GraphoptError(f"--tp must be at least 1, got {world}")
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = _free_port()
    try:
        mp.start_processes(_rank_main, args=(world, port, backend, threads, fn, args, results),
                           nprocs=world, join=True, start_method="spawn")
    except mp.ProcessRaisedException as error:
        first = str(error).strip().splitlines()[-1]
        raise GraphoptError(f"a tensor-parallel rank failed: {first}") from error
    by_rank: dict[int, Any] = {}
    while not results.empty():
        rank, status, out = results.get()
        by_rank[rank] = out
    return [by_rank.get(r) for r in range(world)]
