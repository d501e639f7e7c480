"""Mixture-of-experts terms of the cost model: expert GEMMs, the ep all-to-all, expert state.

Contract: plain functions of the model spec and the layout's mesh, used by `passes/cost/cost.py`
(and through it by `sweep`, the planner and `show`); every one is neutral (factor 1, 0 s,
0 parameters) for a dense model or ep = 1 where that is what runs. They price what
`runtime/expert_parallel.py` runs:

* Expert work. The captured `_grouped_mm` nodes (passes/capture/shapes) count the rows of this rank's
  T*k (token, expert) pairs. Under ep the rank computes, instead, the rows its E/ep experts
  receive from the whole ep group: T*k on average (each of the ep peers sends it 1/ep of its
  pairs), and `imbalance` times that on the busiest rank, which sets the pace (the all-to-all
  waits for it). So expert GEMM FLOPs scale by `imbalance` (`expert_flops_factor`), and each
  expert's GEMM grows: E/ep experts of ep*T*k/E rows instead of E of T*k/E
  (`expert_gemm_scale`), which GEMM efficiency rewards. At ep = 1 every expert is local: the
  total work is exact whatever the routing, the factor is 1.
* Which ops and parameters are routed experts, and that tensor parallelism does not split a MoE
  block (router, experts, shared expert whole on every tp rank), is the sharding table's
  (rules/sharding.py: the EXPERT and REPLICATE roles of `_moe_block`); the cost model reads it
  there (`CompiledBlock.expert`, `sharding.params_per_rank`).
* Dispatch and combine (`ep_comm_time`): per MoE layer and micro-batch, forward runs one
  all-to-all of the E per-expert counts (int64) and two all-to-alls of T*k*hidden activations
  (dispatch, combine); backward the two activation all-to-alls again (the autograd transpose).
  Priced by the collective model (`collectives.best_time`, ALL_TO_ALL moves (ep-1)/ep of the
  buffer) on the link the ep group spans: ranks are (pp, dp, ep, cp, tp) row-major, so ep
  peers are cp*tp apart. The busiest rank receives `imbalance` times the mean.
* Memory is bounded at the worst case of dropless routing, whatever `imbalance` the time
  assumes (`expert_memory_factor`): a rank can receive at most ep*T*min(k, E/ep) pairs (every
  token of the ep group sends min(k, E/ep) of its k pairs to it), ep*min(k, E/ep)/k times the
  mean; its saved expert activations are taken at that bound, so no routing can exceed the
  memory a plan was given.
* Expert parameters (`expert_params`): E/ep experts per rank; their gradients and optimizer
  state are reduced and ZeRO-sharded over dp x cp, the dense ones over dp x ep x cp
  (`passes/cost/cost.py state_bytes(..., expert=)`), as the runtime does.
* Precision: the all-to-alls move activations at the layout's activation bytes
  (passes/cost/precision.py: 2 under bf16-mixed, 4 under fp32); state bytes per parameter likewise.
"""

from __future__ import annotations

from autoshard.ir import Mesh
from autoshard.model_spec import ModelSpec
from autoshard.passes.cost.collectives import Collective, best_time
from autoshard.rules.ranks import group_stride

COUNT_BYTES = 8.0  # the per-expert counts exchanged first: int64 (torch.bincount)


def expert_flops_factor(mesh: Mesh, imbalance: float) -> float:
    """Expert work of the busiest rank over the captured (local, even) work: `imbalance` under ep."""
    return float(imbalance) if mesh.ep > 1 else 1.0


def expert_gemm_scale(mesh: Mesh, imbalance: float) -> tuple[float, float]:
    """(divisor of the experts dim, factor on the rows dim) of an expert GEMM under ep."""
    return float(mesh.ep), float(mesh.ep) * expert_flops_factor(mesh, imbalance)


def expert_memory_factor(spec: ModelSpec, mesh: Mesh) -> float:
    """Worst-case rows received over the mean (module docstring): ep*min(k, E/ep)/k, 1 at ep 1."""
    if not spec.is_moe or mesh.ep == 1:
        return 1.0
    return mesh.ep * min(spec.top_k, spec.experts // mesh.ep) / spec.top_k


def expert_params(spec: ModelSpec, mesh: Mesh) -> float:
    """Routed-expert parameters of one layer held by one device: E/ep experts (not split by tp)."""
    return spec.expert_params / mesh.ep if spec.is_moe else 0.0


def ep_comm_time(hw, spec: ModelSpec, mesh: Mesh, *, tokens: float, imbalance: float,
                 act_bytes: float) -> tuple[float, float]:
    """(forward, backward) seconds of one MoE layer's all-to-alls for `tokens` local tokens."""
    if not spec.is_moe or mesh.ep == 1:
        return 0.0, 0.0
    stride = group_stride(mesh, "ep")
    rows = tokens * spec.top_k * spec.hidden * act_bytes * expert_flops_factor(mesh, imbalance)
    a2a = best_time(hw, Collective.ALL_TO_ALL, rows, size=mesh.ep, stride=stride)
    counts = best_time(hw, Collective.ALL_TO_ALL, spec.experts * COUNT_BYTES, size=mesh.ep, stride=stride)
    return counts + 2 * a2a, 2 * a2a


def active_params_per_token(spec: ModelSpec, total: float) -> float:
    """Parameters a token meets: all but the (E - k)/E of the experts it is not routed to."""
    if not spec.is_moe:
        return float(total)
    return float(total) - spec.layers * spec.expert_params * (spec.experts - spec.top_k) / spec.experts
