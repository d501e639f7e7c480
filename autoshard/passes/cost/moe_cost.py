"""Mixture-of-experts terms of the cost model: expert GEMMs, the ep all-to-all, expert state.

Contract: plain functions of the model spec and the layout's mesh, used by `passes/cost/cost.py`
(and through it by `sweep`, the planner and `show`); every one is neutral (factor 1, 0 s,
0 parameters) for a dense model or ep = 1 where that is what runs. They price what
`runtime/expert_parallel.py` runs.

The whole contract: docs/modules/cost.md (passes/cost/moe_cost.py).
"""

from __future__ import annotations

from autoshard.ir import Mesh
from autoshard.model_spec import ModelSpec
from autoshard.passes.cost.collectives import Collective, best_time
from autoshard.rules.ranks import group_stride

COUNT_BYTES = 8.0  # the per-expert counts exchanged first: int64 (torch.bincount)


def expert_flops_factor(spec: ModelSpec, mesh: Mesh, imbalance: float) -> float:
    """Expert work of the busiest rank over the captured (local, even) work: `imbalance` under ep, times the routed
    share of experts that take every token (`routed_share`)."""
    return float(imbalance) * routed_share(spec, mesh) if mesh.ep > 1 else 1.0


def routed_share(spec: ModelSpec, mesh: Mesh) -> float:
    """k / E for experts that take every token scaled by its router score (`ModelSpec.experts_scattered`: Llama-4's,
    which HF's forward runs densely, every expert on every token, as the graph is captured) under ep, which sends
    the routed rows alone (runtime/expert_parallel.py); else 1."""
    return spec.top_k / spec.experts if spec.experts_scattered and mesh.ep > 1 else 1.0


def expert_gemm_scale(spec: ModelSpec, mesh: Mesh, imbalance: float) -> tuple[float, float]:
    """(divisor of the experts dim, factor on the rows dim) of an expert GEMM under ep."""
    return float(mesh.ep), float(mesh.ep) * expert_flops_factor(spec, mesh, imbalance)


def expert_memory_factor(spec: ModelSpec, mesh: Mesh) -> float:
    """Worst-case rows received over the mean (docs/modules/cost.md): ep*min(k, E/ep)/k, 1 at ep 1; times the
    routed share (`routed_share`)."""
    if not spec.is_moe or mesh.ep == 1:
        return 1.0
    return mesh.ep * min(spec.top_k, spec.experts // mesh.ep) / spec.top_k * routed_share(spec, mesh)


def expert_params(spec: ModelSpec, mesh: Mesh) -> float:
    """Routed-expert parameters of one layer held by one device: E/ep experts (not split by tp)."""
    return spec.expert_params / mesh.ep if spec.is_moe else 0.0


def ep_comm_time(hw, spec: ModelSpec, mesh: Mesh, *, tokens: float, imbalance: float,
                 act_bytes: float) -> tuple[float, float]:
    """(forward, backward) seconds of one MoE layer's all-to-alls for `tokens` local tokens."""
    if not spec.is_moe or mesh.ep == 1:
        return 0.0, 0.0
    stride = group_stride(mesh, "ep")
    rows = tokens * spec.top_k * spec.hidden * act_bytes * float(imbalance)  # the routed rows
    a2a = best_time(hw, Collective.ALL_TO_ALL, rows, size=mesh.ep, stride=stride)
    counts = best_time(hw, Collective.ALL_TO_ALL, spec.experts * COUNT_BYTES, size=mesh.ep, stride=stride)
    return counts + 2 * a2a, 2 * a2a


def active_params_per_token(spec: ModelSpec, total: float) -> float:
    """Parameters a token meets: all but the (E - k)/E of the experts it is not routed to."""
    if not spec.is_moe:
        return float(total)
    return float(total) - spec.layers * spec.expert_params * (spec.experts - spec.top_k) / spec.experts
