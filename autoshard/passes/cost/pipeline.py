"""Pipeline parallelism's own terms: stage-to-stage sends, the sequence-parallel boundary, the
logits peak of the last stage and the step time of a schedule over stage times.

Part of the cost model: passes/cost/cost.py composes these into `estimate`.
"""

from __future__ import annotations


from dataclasses import replace
from typing import Sequence

import numpy as np

from autoshard.hardware import DeviceProfile
from autoshard.ir import BlockKind, Precision, Recompute
from autoshard.rules import schedules
from autoshard.passes.cost.collectives import Collective, best_time, group_link, steps, volume
from autoshard.rules import sharding
from autoshard.passes.cost.precision import precision_numbers, resolve_precision
from autoshard.passes.cost.compiled import CompiledTable
from autoshard.passes.cost.layout import Layout
from autoshard.passes.cost.block import _tokens, block_time
from autoshard.rules.ranks import group_stride


def p2p_time(ct: CompiledTable, hw: DeviceProfile, layout: Layout, *, seq_len: int) -> float:
    """Stage-to-stage traffic of one micro-batch on the critical path: the activation forward and
    its gradient back. 1F1B / GPipe (v = 1): blocking sends (Megatron's send_forward_recv_backward),
    all of it. With v > 1 chunks per rank each micro-batch crosses v times as many boundaries, but
    Megatron-Core's interleaved schedule posts them asynchronously (`overlap_p2p_comm`, on in its
    interleaved recipes): each send runs while the next chunk computes, so only what outlasts one
    chunk's forward (backward) compute is exposed (`_chunk_compute`). autoshard's runtime (torch
    pipelining) waits for each step's sends: it is slower than this when p2p outlasts compute."""
    if layout.mesh.pp == 1:
        return 0.0
    terms = p2p_terms(hw, layout)
    fwd, bwd = (0.0, 0.0) if terms[-1] == 1 else _chunk_compute(ct, hw, layout, seq_len)
    return float(p2p_seconds(ct, *terms, fwd, bwd, seq_len=seq_len))


def p2p_terms(hw: DeviceProfile, layout: Layout) -> tuple:
    """What `p2p_time` reads of a pipelined (pp > 1) `layout` besides the chunk compute, which does not depend on
    the shape: (micro-batch, cp, activation bytes per value, the shard the stages exchange (tp under sequence
    parallelism, else 1), the send's link latency and bandwidth, boundary crossings per micro-batch)."""
    mesh = layout.mesh
    link = group_link(hw, size=2, stride=group_stride(mesh, "pp"))  # a send: collective_time's link
    return (layout.micro_batch, mesh.cp, layout.numbers.act_bytes, mesh.tp if layout.sequence_parallel else 1,
            link.latency, link.bandwidth, schedules.p2p_factor(layout.schedule, layout.virtual_stages))


def p2p_seconds(ct: CompiledTable, micro_batch, cp, act_bytes, shard, latency, bandwidth, crossings, fwd, bwd, *,
                seq_len: int):
    """`p2p_time` from its `p2p_terms` and the chunk's forward / backward compute (`_chunk_compute`, read only
    where crossings > 1); numbers or numpy arrays (the planner's bounds price many layouts at once)."""
    act = micro_batch * seq_len / cp * ct.spec.hidden * act_bytes / shard  # the sequence shard under SP (/ tp)
    send = (steps(Collective.SEND_RECV, 2) * latency  # collective_time(SEND_RECV) on the link's terms
            + volume(Collective.SEND_RECV, act, 2) / bandwidth)
    # blocking sends (v = 1) both ways; interleaving: v x the sends, each exposed beyond a chunk's compute
    return np.where(crossings == 1, 2 * send, crossings * (np.maximum(0.0, send - fwd) + np.maximum(0.0, send - bwd)))


def sequence_boundary_time(ct: CompiledTable, hw: DeviceProfile, layout: Layout, *, seq_len: int,
                           boundaries: int) -> float:
    """A sequence-parallel stage of a pipeline whose stages differ in sequence parallelism, per
    micro-batch: every boundary carries the whole (tokens, hidden) activation, so at each of its
    `boundaries` stage boundaries it all-gathers over tp (what it sends forward; the gradient of what
    it received, backward) and keeps its slice of the other direction for free
    (runtime/stages.py; Megatron-LM's gather / scatter_to_sequence_parallel_region). Blocking:
    on the critical path."""
    act = _tokens(layout, seq_len) * ct.spec.hidden * layout.numbers.act_bytes
    return boundaries * best_time(hw, Collective.ALL_GATHER, act, size=layout.mesh.tp,
                                    stride=group_stride(layout.mesh, "tp"))


def _chunk_compute(ct: CompiledTable, hw: DeviceProfile, layout: Layout, seq_len: int) -> tuple[float, float]:
    """(forward, backward) compute seconds of the smallest model chunk (layers // (pp x v) layers) for
    one micro-batch: what an asynchronous stage-to-stage send overlaps."""
    per_chunk = max(1, ct.spec.layers // (layout.mesh.pp * layout.virtual_stages))
    base = layout if layout.recompute is Recompute.NONE else replace(layout, recompute=Recompute.NONE)
    bt = block_time(ct, hw, base, BlockKind.LAYER, seq_len=seq_len)
    return per_chunk * bt.fwd_s, per_chunk * bt.bwd_s


def logits_bytes(ct: CompiledTable, layout: Layout, *, seq_len: int, hw: DeviceProfile | None = None) -> float:
    """Transient peak of the loss on the head stage (vocab-parallel over TP, tokens split over CP),
    beyond the fp32 log-softmax the graph saves: the logits the LM head writes (activation bytes:
    2 B in bf16). runtime/loss.py's in-place cross-entropy (Megatron-LM's fused vocab-parallel one)
    holds them and one fp32 copy, which becomes the log-softmax it keeps (the graph's log-softmax bytes)
    and then the gradient, on every device; `hw` resolves an AUTO precision."""
    precision = layout.precision if hw is None else resolve_precision(layout.precision, hw)
    per_value = 2.0 if precision is Precision.AUTO else precision_numbers(precision).act_bytes
    vocab_parallel = sharding.vocab_parallel(ct.spec, BlockKind.HEAD, layout.strategies)
    return _tokens(layout, seq_len) * ct.spec.vocab / (layout.mesh.tp if vocab_parallel else 1) * per_value


def pipeline_time(stage_times: Sequence[float], microbatches: int, *, schedule: str = "1f1b",
                  virtual_stages: int = 1) -> float:
    """Pipeline makespan: every stage runs all micro-batches, the slowest stage sets the pace, and
    fill/drain costs a fraction f of one pass through the other stages (rules/schedules.py):
    m * max(t) + f * (sum(t) - max(t)). 1F1B / GPipe f = 1: sum(t) + (m - 1) max(t), with equal
    stages (m + p - 1) t, the bubble (p - 1)/(m + p - 1) (arXiv 2104.04473); interleaved f = 1/v;
    zero-bubble (ZB-H1) f = 1/3."""
    f = float(schedules.bubble_fraction(schedule, virtual_stages, microbatches=microbatches, pp=len(stage_times)))
    top = max(stage_times)
    return float(microbatches * top + f * (sum(stage_times) - top))
