"""Model state and its synchronisation: weights, gradients and optimizer state under ZeRO (and
offload), the data-parallel gradient sync overlapped with backward, the optimizer step.

Part of the cost model: passes/cost/cost.py composes these into `estimate`.
"""

from __future__ import annotations

import functools


import numpy as np

from autoshard.errors import InvalidConfigError
from autoshard.hardware import DeviceProfile
from autoshard.passes.cost.collectives import Collective, best_time
from autoshard.rules.buckets import gradient_bucket_params
from autoshard.rules import sharding
from autoshard.rules.ranks import group_stride
from autoshard.passes.cost.layout import Layout, MemoryBreakdown, OPTIM_TRAFFIC


def _dp_group(layout: Layout, *, experts: bool = False) -> int:
    """Ranks that reduce a gradient and share its ZeRO shards: dp x ep x cp for the dense parameters
    (the ep peers are data-parallel replicas), dp x cp for the routed experts."""
    mesh = layout.mesh
    return mesh.dp * mesh.cp * (1 if experts else mesh.ep)


def _sync_groups(params, layout: Layout, expert) -> tuple:
    """(parameters, group size, stride) of each gradient-sync group of a stage that holds `params`
    parameters, `expert` of them routed experts (runtime/dist_model.py GradSyncs): the dense ones
    over dp x ep x cp (stride tp), the experts over dp x cp, which spans the same ranks at ep times
    the spacing (stride ep*tp in the rank order (pp, dp, ep, cp, tp); exact for cp = 1). One group
    when ep = 1."""
    mesh = layout.mesh
    dense = group_stride(mesh, "dp", "ep", "cp")
    if mesh.ep == 1 or not np.any(expert):
        return ((params, _dp_group(layout), dense),)
    return ((params - expert, _dp_group(layout), dense),
            (expert, _dp_group(layout, experts=True), group_stride(mesh, "dp", "cp")))


def _group_time(hw: DeviceProfile, op: Collective, groups: tuple, per_param: float):
    """Seconds of `op` over every sync group, one after the other (they share the device's links)."""
    return sum(best_time(hw, op, p * per_param, size=n, stride=s) for p, n, s in groups)


def _zeros_like(x):
    return np.zeros_like(x, dtype=float) if isinstance(x, np.ndarray) else 0.0


def state_bytes(params: float, layout: Layout, *, expert: float = 0.0) -> MemoryBreakdown:
    """Weights, gradients and optimizer state of `params` parameters under the ZeRO level,
    sharded over the dp x ep x cp group (Rajbhandari et al. 2020, ZeRO, sec. 5), the `expert` of
    them that are routed experts over dp x cp; none of it on the device under offload (FSDP2's
    CPUOffloadPolicy keeps the ZeRO-3 shards in host memory). What a rank keeps between steps; the
    transient ZeRO-2 adds while a step runs is `zero2_staging_bytes`. `layout.reuse_fp32_param` (MindSpeed's
    `--reuse-fp32-param`): a master is its bf16 weight, which the rank holds anyway, plus a residual, so the
    optimizer keeps master_bytes - param_bytes (2 B) of it per parameter (MindSpeed's docs: saves
    sizeof(bf16) x parameters / dp under the distributed optimizer, x parameters without it)."""
    if layout.offload_optimizer:  # the shards live in host memory; a block is gathered on the device as it runs (buffer_bytes)
        return MemoryBreakdown(weights=0.0, grads=0.0, optimizer=0.0)
    groups, z, nb = _sync_groups(params, layout, expert), layout.zero, layout.numbers

    def held(per_param: float, level: int):
        return sum(p * per_param / (n if z >= level else 1.0) for p, n, _ in groups)

    if z == 3:  # FSDP2 (runtime/zero3.py): the fp32 shard is the master, the optimizer keeps Adam m, v
        return MemoryBreakdown(weights=held(nb.sharded_weight_bytes, 3), grads=held(nb.grad_bytes, 3),
                               optimizer=held(nb.optim_bytes - nb.master_bytes, 3))
    reused = nb.param_bytes if layout.reuse_fp32_param and nb.master_bytes else 0.0
    return MemoryBreakdown(weights=params * nb.param_bytes, grads=held(nb.grad_bytes, 2),
                           optimizer=held(nb.optim_bytes - reused, 1))


def zero2_staging_bytes(params, layout: Layout, *, expert=0.0):
    """ZeRO-2's gradient staging during a micro-batch's backward (runtime/data_parallel.py GradSync; DeepSpeed
    stage 2's double-buffered `ipg_buffer` under overlap_comm): each sync group holds at most two buckets'
    fp32 gradients at once (`gradient_bucket_params`), one filling while the other is reduce-scattered in
    place, never more than its own parameters. The other levels reduce inside the persistent gradient buffer."""
    if layout.zero != 2:
        return _zeros_like(params)
    return sum(np.minimum(p, 2 * _bucket_params(n)) * layout.numbers.grad_bytes
               for p, n, _ in _sync_groups(params, layout, expert))


def tp_grad_sum_time(hw: DeviceProfile, spec, layout: Layout, layers):
    """Per-step seconds of the tp all-reduces of partial gradients, for a stage of `layers` layers (a number or a
    numpy array): those the placement propagation proves partial (passes/capture/tp_proof.py: replicated parameters
    used on this rank's heads only, Qwen3's per-head q/k norms, one KV head's projections; `spec.grad_sum`,
    `spec.grad_sum_numel` elements per layer), and the slices several tp ranks hold (GQA's KV heads at tp >
    kv_heads, Mamba-2's whole groups: `sharding.partial_grad_sizes`, the ZeRO-3 dp shard of each under ZeRO-3; a
    hybrid's per layer as the stack's average, exact over the whole stack). The
    runtime (runtime/tensor_parallel.py `partial_grad_reducer`) all-reduces each such gradient over tp once per
    step, before the data-parallel sync, on the critical path; one collective per parameter and layer, priced as
    collectives.best_time prices any."""
    tp = layout.mesh.tp
    if tp == 1:
        return 0.0 * layers
    stride = group_stride(layout.mesh, "tp")
    sizes = sharding.partial_grad_sizes(spec, tp, layout.strategies)
    shard = _dp_group(layout) if layout.zero == 3 else 1
    each = sum(on * best_time(hw, Collective.ALL_REDUCE, n / shard * layout.numbers.grad_bytes, size=tp,
                              stride=stride) for n, on in sizes)  # a hybrid's part: the share of layers holding it
    if spec.grad_sum:
        each += len(spec.grad_sum) * best_time(hw, Collective.ALL_REDUCE, spec.grad_sum_numel / len(spec.grad_sum)
                                               * layout.numbers.grad_bytes, size=tp, stride=stride)
    return layers * each


def dp_exposed_time(hw: DeviceProfile, params, layout: Layout, *, backward_s, forward_s, expert=0.0):
    """Per-step gradient sync of one stage left on the critical path (numbers or numpy arrays), as
    Megatron-LM's distributed optimizer overlaps it (`overlap_grad_reduce`, `overlap_param_gather`):
    the gradient all-reduce / reduce-scatter behind the last micro-batch's backward, the all-gather
    of the updated weights behind the next step's first forward. `expert`: the routed-expert share
    of `params`, synced over its own group after the dense one (`_sync_groups`).

    Two limits on that overlap (`_dp_sync_exposed`): the gradients are reduced in buckets
    (`dp_bucket_params`), and the bucket holding the first layers is only ready when the backward
    ends (the weights' first bucket is needed before the forward starts), so at least one bucket's
    collective is always exposed; and with v model chunks per rank (interleaved pipelines) a
    chunk's gradients are final when its last backward runs, which for all but the rank's first
    chunk is long before the drain ends: only the first chunk's share (1/v of the bytes, behind
    1/v of the backward) is left over."""
    groups = _sync_groups(params, layout, expert)
    if layout.zero == 3 or all(n == 1 for _, n, _ in groups):
        return _zeros_like(backward_s)
    nb = layout.numbers
    if layout.zero == 0:
        return _dp_sync_exposed(hw, Collective.ALL_REDUCE, groups, nb.grad_bytes, layout, overlap_s=backward_s)
    ag = _dp_sync_exposed(hw, Collective.ALL_GATHER, groups, nb.param_bytes, layout, overlap_s=forward_s)
    rs = 0.0 if layout.zero == 2 else _dp_sync_exposed(hw, Collective.REDUCE_SCATTER, groups, nb.grad_bytes, layout,
                                                       overlap_s=backward_s)
    return rs + ag


def dp_bucket_params(layout: Layout, *, experts: bool = False) -> float:
    """Parameters per gradient bucket of the data-parallel sync: Megatron-Core's DDP default
    max(40M, 1M x data-parallel size) (megatron/core/distributed/distributed_data_parallel.py:
    the bucket grows with the group so that the ring's per-rank latency stays amortised);
    `experts`: of the routed experts' group (dp x cp)."""
    return _bucket_params(_dp_group(layout, experts=experts))


def _bucket_params(group: int) -> float:
    return float(gradient_bucket_params(group))


def _dp_sync_exposed(hw: DeviceProfile, op: Collective, groups: tuple, bytes_per_param: float, layout: Layout, *,
                     overlap_s):
    """Exposed seconds of one data-parallel collective over a stage's sync `groups` (`_sync_groups`; see
    `dp_exposed_time`): the rank's first chunk (1/v of the parameters) against 1/v of the compute it
    overlaps, each group in its buckets (`bucketed_time`), and never less than that chunk's last
    bucket (the larger of the groups' last buckets)."""
    v = layout.virtual_stages
    whole = sum(bucketed_time(hw, op, p / v, bytes_per_param, size=n, stride=s) for p, n, s in groups)
    # a group of one rank costs a scalar 0 beside the others' arrays: broadcast, not stack
    last = functools.reduce(np.maximum, [np.asarray(best_time(hw, op, np.minimum(p / v, _bucket_params(n)) *
                                                              bytes_per_param, size=n, stride=s)) for p, n, s in groups])
    out = np.maximum(last, whole - overlap_s / v)
    return out if isinstance(out, np.ndarray) and out.ndim else float(out)


def bucketed_time(hw: DeviceProfile, op: Collective, params, bytes_per_param: float, *, size: int, stride: int):
    """Seconds of a data-parallel collective over `params` parameters run as Megatron runs it, one
    collective per bucket of max(40M, 1M x size) parameters (`dp_bucket_params`), each paying the
    ring's (N - 1) step latencies: the step's gradient sync (numbers or numpy arrays)."""
    buckets = np.maximum(1.0, np.ceil(params / _bucket_params(size)))
    return buckets * best_time(hw, op, params / buckets * bytes_per_param, size=size, stride=stride)


def zero2_time(hw: DeviceProfile, params: float, layout: Layout, *, expert: float = 0.0) -> float:
    """ZeRO-2 communication of one micro-batch of one stage: the reduce-scatter of its gradients
    (runtime/data_parallel.py drops the full gradient after each micro-batch, DeepSpeed stage 2);
    it overlaps that micro-batch's backward."""
    if layout.zero != 2:
        return 0.0
    return _group_time(hw, Collective.REDUCE_SCATTER, _sync_groups(params, layout, expert), layout.numbers.grad_bytes)


def zero3_time(hw: DeviceProfile, params: float, layout: Layout, *, expert: float = 0.0, blocks=1) -> float:
    """ZeRO-3 communication of one micro-batch of one stage: all-gather the weights in forward
    and again in backward, reduce-scatter the gradients, one collective of each per block (FSDP2
    wraps every transformer block, the embedding and the head: `blocks` of them, each paying the
    ring's (N - 1) step latencies; NCCL has no tree for these, `hw.log_collectives`)."""
    if layout.zero != 3:
        return 0.0
    k = np.maximum(1.0, blocks)
    groups, nb = [(p / k, n, st) for p, n, st in _sync_groups(params, layout, expert)], layout.numbers
    return k * (2 * _group_time(hw, Collective.ALL_GATHER, groups, nb.gather_bytes)
                + _group_time(hw, Collective.REDUCE_SCATTER, groups, nb.grad_bytes))


def _shard(params, layout: Layout, expert):
    """Parameters of this device's ZeRO shard (ZeRO >= 1)."""
    return sum(p / n for p, n, _ in _sync_groups(params, layout, expert))


def offload_time(hw: DeviceProfile, params: float, layout: Layout, *, expert: float = 0.0) -> float:
    """Host-link traffic of one micro-batch of one stage under offload (ZeRO-Offload, arXiv 2101.06840,
    sec. 4; FSDP2 CPUOffloadPolicy): this device's weight shard copied host -> device before each of
    ZeRO-3's two gathers, its gradient shard device -> host after the reduce-scatter."""
    if not layout.offload_optimizer:
        return 0.0
    link = _host(hw, "host_link_bandwidth")
    return _shard(params, layout, expert) * (2 * layout.numbers.sharded_weight_bytes + layout.numbers.grad_bytes) / link


def _host(hw: DeviceProfile, field: str) -> float:
    value = getattr(hw, field)
    if value is None:
        raise InvalidConfigError(f"hardware profile {hw.name!r} has no {field}: optimizer offload cannot be priced "
                                 f"there; add {field} (bytes/s, with its source) to the profile or plan without offload")
    return value


def zero_exposed_time(hw: DeviceProfile, params, layout: Layout, *, compute_s, backward_s, expert=0.0, blocks=1):
    """ZeRO traffic of one micro-batch of one stage that its own work does not hide: ZeRO-3's
    weight gathers and gradient reduce-scatter (and under offload their host copies) behind its
    compute, ZeRO-2's gradient reduce-scatter behind its backward (numbers or numpy arrays;
    `expert`: the routed-expert share of `params`; `blocks`: the stage's FSDP units, layers,
    embedding and head, one ZeRO-3 collective each)."""
    z3 = (zero3_time(hw, params, layout, expert=expert, blocks=blocks)
          + offload_time(hw, params, layout, expert=expert))
    z2 = zero2_time(hw, params, layout, expert=expert)
    if np.ndim(z3) == 0 and np.ndim(z2) == 0 and z3 == 0 and z2 == 0:  # no ZeRO traffic, none exposed (the work
        # is never negative): zeros of the shape, read-only, no memory held (the planner keeps them per layout)
        return np.broadcast_to(0.0, np.broadcast_shapes(np.shape(compute_s), np.shape(backward_s)))
    return np.maximum(0.0, z3 - compute_s) + np.maximum(0.0, z2 - backward_s)


def optimizer_time(hw: DeviceProfile, params: float, layout: Layout, *, expert: float = 0.0) -> float:
    """Adam on this device's shard: memory-bound, OPTIM_TRAFFIC bytes per parameter (under offload
    on the host, at the host memory bandwidth per device)."""
    shard = _shard(params, layout, expert) if layout.zero >= 1 else params
    if layout.offload_optimizer:
        return shard * OPTIM_TRAFFIC / (_host(hw, "host_memory_bandwidth") * hw.vector_efficiency)
    return shard * OPTIM_TRAFFIC / (hw.hbm_bandwidth * hw.vector_efficiency)
