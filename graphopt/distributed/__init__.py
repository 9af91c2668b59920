"""Tensor parallelism through torch.distributed: shard a Llama across ranks (``shard``),
launch ranks on one machine (``launch``), and compare a sharded graphopt run with the
unsharded model (``tp_run``). The fused all-reduce + add + RMSNorm op lives in
``graphopt.ops.collectives``, its pass in ``passes/fuse_all_reduce_add_rms_norm.py``.
"""

from graphopt.distributed.shard import RowParallelLinear, check_divisible, shard_llama  # noqa: F401
