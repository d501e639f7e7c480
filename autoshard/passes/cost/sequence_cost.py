"""Pricing of sequence parallelism (plan key `sequence_parallel`), the pieces `passes/cost/cost.py` asks for.

Megatron-LM's sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", sec. 4.2.2), as runtime/tensor_parallel.py runs it:

* Work and saved activations: the ops that run on a tp shard of the sequence, the `sequence`
  roles of the sharding table (the RMSNorms outside the TP regions) and the layer's own ops (the
  residual adds), are divided by tp (`sequence_divisors`), like the TP-split roles are by their
  parts. Their saved outputs are what the paper's table 2 moves from 10 sbh per layer to 10 sbh / t:
  the norms' inputs (the residual stream) and their outputs, which the column-parallel linears
  keep as the sequence shard and all-gather again in backward.
* Full recompute keeps each layer's input, now a sequence shard: / tp (`full_recompute_divisor`).
* Pipeline sends carry the sequence shard: / tp (Megatron sends the SP-sharded hidden states).
* Collectives (`tp_comm`), per micro-batch; A the activation (tokens x hidden x act bytes),
  AG / RS an all-gather / reduce-scatter of A over tp (`collectives.best_time`; ring volumes
  (N-1)/N A each, together those of the all-reduce they replace):
    layer  forward   per region: AG of its input; per row-parallel linear: RS of its output
           backward  per region: RS of its input gradient, and AG of its saved input again
                     (when not recomputed: recompute reruns the forward gather instead); per
                     row-parallel linear: AG of its output gradient
    embed  forward RS of the vocab-parallel lookup; backward AG of its gradient
    head   forward AG of the final norm's output (and the vocab-parallel cross-entropy's small
           all-reduces, as without SP); backward RS of the LM head's input gradient
  Overlap, as for the TP collectives without SP (cost.py `_tp_backward_exposed`, Megatron's
  `LinearWithGradAccumulationAndAsyncCommunication`): the backward RS of a region's input gradient
  runs under its column-parallel weight-gradient GEMMs, the AG of its saved input under the input-
  gradient GEMMs (as many FLOPs as the weight-gradient ones: priced with the same group time); the
  rest is exposed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autoshard.hardware import DeviceProfile
from autoshard.ir import BlockKind, Mesh, Recompute
from autoshard.model_spec import ModelSpec
from autoshard.rules import sharding
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
            small_all_reduce_s: float, recompute: Recompute) -> SequenceComm:
    """The collectives of the module docstring; `act_bytes`: the full activation of one micro-batch
    (tokens of this cp rank x hidden x bytes), `small_all_reduce_s`: the cross-entropy's."""
    stride = group_stride(Mesh(tp=tp), "tp")
    ag = best_time(hw, Collective.ALL_GATHER, act_bytes, size=tp, stride=stride)
    rs = best_time(hw, Collective.REDUCE_SCATTER, act_bytes, size=tp, stride=stride)
    if kind is BlockKind.EMBED:
        return SequenceComm(forward=rs, backward_overlapped=(), backward_exposed=ag)
    if kind is BlockKind.HEAD:
        return SequenceComm(forward=ag + small_all_reduce_s, backward_overlapped=(), backward_exposed=rs)
    rows = sharding.row_parallel_count(spec, BlockKind.LAYER)
    regions = region_count(spec)
    return SequenceComm(forward=regions * ag + rows * rs,
                        backward_overlapped=((rs, regions), (ag, _regathered(regions, recompute))),
                        backward_exposed=rows * ag)


def region_count(spec: ModelSpec) -> int:
    """TP regions of one layer (attention and MLP; the Mamba-2 mixer)."""
    return sum(1 for r in sharding.table(spec) if r.block is BlockKind.LAYER and r.strategy is sharding.Strategy.REGION)


def _regathered(regions: int, recompute: Recompute) -> int:
    """Regions whose saved input is all-gathered again in backward: none under full recompute, all
    but the selectively recomputed module under selective (its recompute reruns the gather)."""
    if recompute is Recompute.FULL:
        return 0
    return regions - 1 if recompute is Recompute.SELECTIVE else regions
