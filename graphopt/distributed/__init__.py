"""Tensor parallelism through torch.distributed, on gloo ranks of one machine.

- ``shard``: shard a Llama across ranks (Megatron's layout, functional or DTensor weights).
- ``launch``: start N gloo ranks, gather their results; a collective past its timeout or a
  dead rank fails the run at once.
- ``failures``: each rank's failure and the one line the launcher raises (rank, collective).
- ``tp_run``: a sharded graphopt run compared with the unsharded model (``graphopt run --tp``).
- ``tp_generate``: greedy decoding on the shards compared with TP=1.
- ``cli``: what ``--tp`` prints (only the CLI imports it).

The fused all-reduce + add + RMSNorm op lives in ``graphopt.ops.collectives``, its pass in
``passes/fuse_all_reduce_add_rms_norm.py``.
"""

from graphopt.distributed.shard import RowParallelLinear, check_divisible, shard_llama  # noqa: F401
