"""Pricing of sequence parallelism (plan key `sequence_parallel`), the pieces `passes/cost/cost.py` asks for.

Megatron-LM's sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", sec. 4.2.2), as runtime/tensor_parallel.py runs it.

The whole contract: docs/modules/cost.md (passes/cost/sequence_cost.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autoshard.hardware import DeviceProfile
from autoshard.ir import BlockKind, Mesh, Recompute
from autoshard.model_spec import ModelSpec
from autoshard.rules import sharding, tp_collectives
from autoshard.passes.cost.collectives import Collective, best_time
from autoshard.rules.ranks import group_stride


def sequence_divisors(parts: np.ndarray, spec: ModelSpec, kind: BlockKind, tp: int) -> np.ndarray:
    """`parts` (per role index + 1, index 0 no role: cost.py `_tp_divisor`) with tp for every op that
    runs on a sequence shard under sequence parallelism (`sharding.on_sequence_shard`)."""
    out = parts.copy()
    roles = (None, *sharding.table(spec))
    for i, role in enumerate(roles):
        if sharding.on_sequence_shard(spec, kind, role):
            out[i] = float(tp)
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class SequenceComm:
    """Seconds of the TP collectives of one block instance under sequence parallelism, one micro-batch.

    `forward`: exposed; `backward_overlapped`: (seconds of one collective, how many regions run it)
    that the regions' column-parallel backward GEMMs may hide; `backward_exposed`: the rest."""

    forward: float
    backward_overlapped: tuple[tuple[float, int], ...]
    backward_exposed: float


def tp_comm(spec: ModelSpec, hw: DeviceProfile, *, kind: BlockKind, tp: int, act_bytes: float,
            small_all_reduce_s: float, recompute: Recompute, vocab: bool = True) -> SequenceComm:
    """The collectives of docs/modules/cost.md (sequence_cost.py); `act_bytes`: the full activation of one micro-batch
    (tokens of this cp rank x hidden x bytes), `small_all_reduce_s`: the cross-entropy's; `vocab`: whether the
    embedding / head `kind` is vocab-parallel (else replicated: Gemma's scaled embedding, cut to the shard for free,
    its gradient gathered; a head tied to it gathers its input, its gradient cut for free)."""
    stride = group_stride(Mesh(tp=tp), "tp")
    ag = best_time(hw, Collective.ALL_GATHER, act_bytes, size=tp, stride=stride)
    rs = best_time(hw, Collective.REDUCE_SCATTER, act_bytes, size=tp, stride=stride)
    if kind is BlockKind.EMBED:
        return SequenceComm(forward=rs if vocab else 0.0, backward_overlapped=(), backward_exposed=ag)
    if kind is BlockKind.HEAD:
        return SequenceComm(forward=ag + small_all_reduce_s * vocab, backward_overlapped=(),
                            backward_exposed=rs if vocab else 0.0)
    inner = len(tp_collectives.region_output_widths(spec))  # all-reduced inside their region, as without SP
    inner_s = region_output_all_reduces(spec, hw, act_bytes=act_bytes, tp=tp, stride=stride)
    rows = tp_collectives.row_parallel_count(spec, BlockKind.LAYER) - inner
    regions = region_count(spec)
    return SequenceComm(forward=regions * ag + rows * rs + inner_s,
                        backward_overlapped=((rs, regions), (ag, _regathered(regions, recompute))),
                        backward_exposed=rows * ag + inner_s)


def region_output_all_reduces(spec: ModelSpec, hw: DeviceProfile, *, act_bytes: float, tp: int, stride: int,
                              low_latency: bool = False) -> float:
    """Seconds of one layer's all-reduces of the row-parallel linears inside a region (Mamba-1's x_proj,
    `tp_collectives.region_output_widths`), each of its own output width, with or without sequence parallelism;
    `act_bytes`: tokens x hidden x bytes."""
    return sum(best_time(hw, Collective.ALL_REDUCE, act_bytes * w / spec.hidden, size=tp, stride=stride,
                         low_latency=low_latency) for w in tp_collectives.region_output_widths(spec))


def region_count(spec: ModelSpec) -> int:
    """TP regions of one layer (attention and MLP; the Mamba-2 mixer)."""
    return sum(1 for r in sharding.table(spec) if r.block is BlockKind.LAYER and r.strategy is sharding.Strategy.REGION)


def _regathered(regions: int, recompute: Recompute) -> int:
    """Regions whose saved input is all-gathered again in backward: none under full recompute, all
    but the selectively recomputed module under selective (its recompute reruns the gather)."""
    if recompute is Recompute.FULL:
        return 0
    return regions - 1 if recompute is Recompute.SELECTIVE else regions
