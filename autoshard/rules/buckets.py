"""Gradient buckets: how many parameters one data-parallel gradient bucket holds.

One rule for the runtime's buckets (runtime/data_parallel.py) and the cost model's
(passes/cost/cost.py), so the planner prices the collectives the runtime issues.
"""

from __future__ import annotations


def gradient_bucket_params(group: int) -> int:
    """Parameters per gradient bucket of a data-parallel group of `group` ranks: Megatron-Core DDP's
    default max(40M, 1M x group) (megatron/core/distributed/distributed_data_parallel.py: the bucket
    grows with the group so that the ring's per-rank latency stays amortised). The runtime cuts its
    buckets by it (`GradSync`) and the cost model prices the sync's collectives and ZeRO-2's staging
    buffers with it (`state.dp_bucket_params`, `state.zero2_staging_bytes`)."""
    return max(40_000_000, 1_000_000 * group)
