"""Cost model: seconds and bytes of one training step for a parallel layout.

Contract
--------
`estimate(table, spec, hw, layout, *, global_batch, seq_len, stages=None) -> Estimate`

The whole contract: docs/modules/cost.md (passes/cost/cost.py).
"""

from __future__ import annotations


from dataclasses import replace
from typing import Sequence

import numpy as np

from autoshard.errors import InvalidConfigError
from autoshard.hardware import DeviceProfile
from autoshard.cost_table import CostTable
from autoshard.ir import BlockKind, Precision, Recompute, Stage, check_schedule, chunk_layers, even_stages
from autoshard.model_spec import Mixer, ModelSpec
from autoshard.passes.cost import moe_cost
from autoshard.rules import schedules
from autoshard.rules.validity import plan_violation
from autoshard.passes.cost.precision import resolve_precision
# the pieces `estimate` composes (each imported from its own module by whoever else uses it)
from autoshard.passes.cost.layout import Estimate, Layout, MemoryBreakdown, TimeBreakdown
from autoshard.passes.cost.compiled import CompiledTable, compile_table, mixed_violation, stage_blocks
from autoshard.passes.cost.block import (_node_times, _tp_comm, _tp_divisor, block_activation_bytes, block_params,
                                         block_time, expert_block_params)
from autoshard.passes.cost.state import (dp_exposed_time, optimizer_time, state_bytes, tp_grad_sum_time,
                                         zero2_staging_bytes, zero_exposed_time)
from autoshard.passes.cost.pipeline import logits_bytes, p2p_time, pipeline_time


def model_flops_per_token(ct: CompiledTable, seq_len: int) -> float:
    """Training FLOPs per token in the paper's MFU convention: 6N + 12 L d s for LLaMA
    (PaLM, arXiv 2204.02311 app. B), N the parameters a token meets (a mixture of experts: its
    top-k experts only, Megatron-Core's MoE convention); for Mamba-2, 6N plus 3x the SSD forward
    FLOPs of arXiv 2405.21060 sec. 8.3 per token; a Mamba-1 selective scan (read off the graph, `ct.scans`): 3x
    its forward FLOPs (9 d n per token, state-spaces/mamba issue 110) instead of the attention term."""
    spec = ct.spec
    scan, no_attention = ct.scans
    if ct.kinds:  # a mixed stack: 12 d s per attention layer, the SSD per Mamba-2 layer (read off its graph)
        n = sum(_active_layer_params(v) for v in ct.kinds) + sum(ct.block(k).params for k in (BlockKind.EMBED, BlockKind.HEAD))
        attention, mamba = ct.mixers
        return 6.0 * n + 12.0 * attention * spec.hidden * seq_len + (3.0 * _ssd_flops(spec, seq_len) * mamba if mamba else 0.0) \
            + 3.0 * scan
    n = moe_cost.active_params_per_token(spec, sum(blk.params * blk.count for blk in ct.blocks.values()))
    if spec.mixer is Mixer.ATTENTION:
        return 6.0 * n + 12.0 * (spec.layers - no_attention) * spec.hidden * seq_len + 3.0 * scan
    return 6.0 * n + 3.0 * _ssd_flops(spec, seq_len) * spec.layers


def _active_layer_params(view: CompiledTable) -> float:
    """Parameters a token meets in one kind's layers (`view`: the kind's table): all of them but, in a MoE kind,
    the (E - k)/E of each layer's experts it is not routed to."""
    blk, spec = view.block(BlockKind.LAYER), view.spec
    skipped = spec.expert_params * (spec.experts - spec.top_k) / spec.experts if spec.is_moe else 0.0
    return (blk.params - skipped) * blk.count


def _ssd_flops(spec: ModelSpec, seq_len: int) -> float:
    """Forward FLOPs per token of one Mamba-2 layer's SSD (arXiv 2405.21060 sec. 8.3)."""
    h, p, nst = spec.heads, spec.head_dim, spec.state
    chunk = min(spec.chunk, seq_len)
    return 2 * (h * chunk * nst + h * chunk * p + h * p * nst + h * p * nst / chunk + h * p * nst)


# --------------------------------------------------------------------------------------------
# Composition


def resolved(layout: Layout, hw: DeviceProfile) -> Layout:
    """`layout` with precision AUTO replaced by the device's default (fp32 on cpu, else bf16-mixed)."""
    if layout.precision is not Precision.AUTO:  # concrete already (resolve_precision would keep it)
        return layout
    return replace(layout, precision=resolve_precision(layout.precision, hw))


def estimate(table: CostTable | CompiledTable, spec: ModelSpec, hw: DeviceProfile, layout: Layout, *,
             global_batch: int, seq_len: int, stages: Sequence[Stage] | None = None) -> Estimate:
    """Predicted step time, throughput, MFU and peak memory of one layout (docs/modules/cost.md)."""
    ct = compile_table(table, spec)
    layout = resolved(layout, hw)
    mesh = layout.mesh
    _check(spec, layout, global_batch, seq_len)
    m = layout.microbatches(global_batch)
    if stages is None:
        stages = even_stages(spec.layers, mesh.pp, recompute=layout.recompute)
    stages = tuple(stages)
    if len(stages) != mesh.pp or sum(st.layers for st in stages) != spec.layers:
        raise InvalidConfigError(f"{len(stages)} stages with {sum(st.layers for st in stages)} layers given; "
                                 f"expected pp={mesh.pp} stages covering all {spec.layers} layers")
    parts_of = [block_segments(st, layout.recompute_layers, chunk_layers(st.layers, rank=i, pp=mesh.pp,
                                                                      virtual_stages=layout.virtual_stages,
                                                                      schedule=layout.schedule))
                for i, st in enumerate(stages)]
    levels = {lv: replace(layout, recompute=lv) for segs in parts_of for _, lv in segs}  # each stage's own
    for lay in levels.values():
        why = mixed_violation(ct, lay)
        if why:
            raise InvalidConfigError(why)
    bts: dict = {}  # (recompute, kind's table, block) -> its numbers, asked as the stages hold them
    p2p = p2p_time(ct, hw, layout, seq_len=seq_len)

    times, parts, peaks = [], [], []
    for i, (st, segs) in enumerate(zip(stages, parts_of)):
        held = [(view, k, c, lv) for seg, lv in segs for view, k, c in stage_blocks(ct, seg)]
        for view, k, _, lv in held:
            if (lv, id(view), k) not in bts:
                bts[lv, id(view), k] = (block_time(view, hw, levels[lv], k, seq_len=seq_len),
                                        block_activation_bytes(view, levels[lv], k, seq_len=seq_len, hw=hw),
                                        block_params(view, layout, k),
                                        expert_block_params(view, layout, k))
        counts = [(bts[lv, id(view), k], c) for view, k, c, lv in held]
        bt = [(b[0], c) for b, c in counts]
        if st.head and spec.tied and not st.embed:
            counts_params = block_params(ct, layout, BlockKind.EMBED)  # tied LM head keeps a copy of the embedding
        else:
            counts_params = 0.0
        params = sum(b[2] * c for b, c in counts) + counts_params
        experts = sum(b[3] * c for b, c in counts)  # the routed-expert share of `params` (MoE)
        comp = sum(b.compute_s * c for b, c in bt)
        reco = sum(b.recompute_s * c for b, c in bt)
        tpc = sum(b.tp_comm_s * c for b, c in bt)
        cpc = sum(b.cp_comm_s * c for b, c in bt)
        epc = sum(b.ep_comm_s * c for b, c in bt)
        bwd_last = sum(b.bwd_s * c for b, c in bt)
        fwd_first = sum(b.fwd_s * c for b, c in bt)
        zexp = float(zero_exposed_time(hw, params, layout, compute_s=comp, backward_s=bwd_last, expert=experts,
                                       blocks=sum(c for _, c in counts)))
        t = comp + reco + tpc + cpc + epc + p2p + zexp
        times.append(t)
        parts.append((comp, reco, tpc, cpc, epc, p2p, zexp, params, experts, bwd_last, fwd_first))
        in_flight = schedules.in_flight(layout.schedule, i, mesh.pp, m, layout.virtual_stages)
        stage_act = sum(b[1] * c for b, c in counts) * in_flight
        mem = state_bytes(params, layout, expert=experts)
        buffers = buffer_bytes(ct, layout, seq_len=seq_len) + zero2_staging_bytes(params, layout, expert=experts)
        logit = logits_bytes(ct, layout, seq_len=seq_len, hw=hw) if st.head else 0.0
        peaks.append(MemoryBreakdown(weights=mem.weights, grads=mem.grads, optimizer=mem.optimizer,
                                     activations=stage_act, logits=logit, buffers=float(buffers)))

    slow = int(np.argmax(times))
    comp, reco, tpc, cpc, epc, p2p_s, zexp = parts[slow][:7]
    pipe = pipeline_time(times, m, schedule=layout.schedule, virtual_stages=layout.virtual_stages)
    # DP sync and the optimizer step are per stage and run in parallel across stages: take the
    # stage where they end last. The gradient reduce overlaps the last micro-batch's backward,
    # the weight all-gather the first forward (`dp_exposed_time`).
    tail = []
    for st, (*_, prm_i, exp_i, bwd_last, fwd_first) in zip(stages, parts):
        exposed = float(dp_exposed_time(hw, prm_i, layout, backward_s=bwd_last, forward_s=fwd_first, expert=exp_i)
                        + tp_grad_sum_time(hw, spec, layout, st.layers))  # the proven grad sums (q/k norms)
        tail.append((exposed, optimizer_time(hw, prm_i, layout, expert=exp_i)))
    dp_exposed, opt = max(tail, key=lambda x: x[0] + x[1])
    step = pipe + dp_exposed + opt
    breakdown = TimeBreakdown(compute=comp * m, recompute=reco * m, tp_comm=tpc * m, cp_comm=cpc * m, ep_comm=epc * m,
                              p2p=p2p_s * m, pp_bubble=pipe - m * (comp + reco + tpc + cpc + epc + p2p_s + zexp),
                              dp_comm_exposed=dp_exposed + zexp * m, optimizer=opt)
    peak = max(peaks, key=lambda mb: mb.total)
    tokens = global_batch * seq_len
    mfu = model_flops_per_token(ct, seq_len) * tokens / (step * mesh.size * hw.peak_flops)
    return Estimate(layout=layout, step_time_s=step, tokens_per_s=tokens / step, mfu=mfu,
                    memory_gb=peak.total / 1e9, mean_memory_gb=sum(mb.total for mb in peaks) / len(peaks) / 1e9,
                    memory=peak, fits=peak.total <= hw.memory_bytes,
                    time=breakdown, microbatches=m, stages=stages, stage_times_s=tuple(times),
                    stage_memory_gb=tuple(mb.total / 1e9 for mb in peaks))


def block_segments(stage: Stage, recompute_layers: int, chunks: tuple[int, ...] | None = None
                   ) -> tuple[tuple[Stage, Recompute], ...]:
    """`stage` as (part, recompute level) pairs under block recompute (`Layout.recompute_layers`, Megatron's
    `--recompute-method block`): the first `recompute_layers` layers of each of its model chunks (`chunks`: their
    layer counts, `ir.chunk_layers`; None: the stage is one chunk) at FULL, the rest (and the embedding and head,
    which block recompute leaves alone) at the stage's level; the stage whole where nothing differs. Per chunk as
    Megatron runs it: each model chunk is a TransformerBlock of its own, whose `_checkpointed_forward` reruns its
    first `recompute_num_layers` layers (megatron/core/transformer/transformer_block.py; NeMo's activation
    recomputation guide: "with virtual pipelining, recompute_num_layers is per virtual pipeline stage")."""
    chunks = (stage.layers,) if chunks is None else chunks
    if min(recompute_layers, stage.layers) == 0 or stage.recompute is Recompute.FULL:
        return ((stage, stage.recompute),)
    out, start = [], stage.first_layer
    for j, c in enumerate(chunks):
        k = min(recompute_layers, c)
        if k:
            out.append((Stage(first_layer=start, end_layer=start + k, embed=False, head=False,
                              recompute=Recompute.FULL), Recompute.FULL))
        embed, head = stage.embed and j == 0, stage.head and j == len(chunks) - 1
        if c > k or embed or head or len(chunks) == 1:
            out.append((replace(stage, first_layer=start + k, end_layer=start + c, embed=embed, head=head),
                        stage.recompute))
        start += c
    return tuple(out)


def as_stack_runs(ct: CompiledTable, hw: DeviceProfile, layout: Layout) -> Layout:
    """`layout` as the profile's training stack runs the model of `ct` (compile_table's; hardware.StackRecipe, `hw.recipe` of
    its sequence mixer): its block recompute, sequence parallelism where tp > 1, and reused fp32 copy; `layout`
    itself where the stack has no recipe for that mixer. A mixed stack of layer kinds is refused by name where the
    stack has any recipe (its kinds' recipes would differ layer by layer). An `autoshard` plan runs its own
    layout: the runtime runs none of these, and the planner never prices them."""
    if ct.kinds and hw.recipes:
        raise InvalidConfigError(f"{ct.spec.name}: a stack of several layer kinds, and {hw.name}'s stack ({hw.stack}) "
                                 f"has recipes per sequence mixer ({', '.join(r.mixer for r in hw.recipes)}); a run "
                                 "of that stack cannot be priced layer by layer: price the plan's own layout")
    recipe = hw.recipe(ct.spec.mixer.value)
    if recipe is None:
        return layout
    return replace(layout, recompute_layers=recipe.recompute_layers, reuse_fp32_param=recipe.reuse_fp32_param,
                   sequence_parallel=layout.sequence_parallel or (recipe.sequence_parallel and layout.mesh.tp > 1))


def buffer_bytes(ct: CompiledTable, layout: Layout, *, seq_len: int) -> float:
    """Communication staging: two activation-sized TP/p2p buffers, and the gathered weights of
    one layer in flight (twice, prefetch) under ZeRO-3."""
    return staging_bytes(ct, *buffer_terms(ct, layout), seq_len=seq_len)


def buffer_terms(ct: CompiledTable, layout: Layout) -> tuple:
    """What `buffer_bytes` reads of `layout`, which does not depend on the shape: (micro-batch, cp, activation
    bytes per value, whether the TP / p2p buffers exist, ZeRO-3's gathered-weight bytes)."""
    return (*staged_terms(layout), gathered_bytes(ct, layout))


def staged_terms(layout: Layout) -> tuple:
    """`buffer_terms` less ZeRO-3's gathered weights (what does not depend on the model's blocks)."""
    return layout.micro_batch, layout.mesh.cp, layout.numbers.act_bytes, layout.mesh.tp > 1 or layout.mesh.pp > 1


def gathered_bytes(ct: CompiledTable, layout: Layout) -> float:
    """ZeRO-3's gathered weights of one layer in flight, twice (prefetch); 0 below ZeRO-3."""
    return 2 * block_params(ct, layout, BlockKind.LAYER) * layout.numbers.gather_bytes if layout.zero == 3 else 0.0


def staging_bytes(ct: CompiledTable, micro_batch, cp, act_bytes, staged, z3, *, seq_len: int):
    """`buffer_bytes` from its `buffer_terms` (numbers, or numpy arrays of them: the planner's bounds price
    many layouts at once, with the same float operations)."""
    act = micro_batch * seq_len / cp * ct.spec.hidden * act_bytes  # _tokens(layout, seq_len) * hidden * bytes
    return 2 * act * staged + z3


def _check(spec: ModelSpec, layout: Layout, global_batch: int, seq_len: int) -> None:
    """The plan validator's rules (rules/validity.py), ZeRO-3 included: the cost model prices it."""
    why = plan_violation(spec, layout.mesh, global_batch=global_batch, seq_len=seq_len,
                         micro_batch=layout.micro_batch, zero=layout.zero, zeros=(0, 1, 2, 3),
                         sequence_parallel=layout.sequence_parallel, strategies=layout.strategies)
    if why:
        raise InvalidConfigError(why)
    mesh = layout.mesh
    check_schedule(layout.schedule, layout.virtual_stages, pp=mesh.pp)
    schedules.check_chunks(layout.schedule, layout.virtual_stages, pp=mesh.pp, layers=spec.layers,
                           microbatches=layout.microbatches(global_batch))


# Pieces the inference cost model (passes/serving/inference_cost.py) prices forward passes with.
node_times = _node_times
tp_comm_times = _tp_comm
tp_divisor = _tp_divisor
