"""torch's intra-op thread count, set for a block and given back after it."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch computes on ``count`` threads inside the block; the caller's count comes back
    after it, also when the block raises. The count is process-wide: torch work in other
    threads of the process follows it meanwhile."""
    threads = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
