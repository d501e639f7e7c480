"""Cost model: seconds and bytes of one training step for a parallel layout.

Contract
--------
`estimate(table, spec, hw, layout, *, global_batch, seq_len, stages=None) -> Estimate`

* `table` is the symbolic `CostTable` of the model (passes/capture/shapes) or the `CompiledTable` made
  from it once by `compile_table(table, spec)` (do that when pricing many layouts).
* `layout` is a `Layout`: mesh (dp, pp, tp, cp, ep), micro-batch size, ZeRO level 0-3, recompute.
* `stages` (optional) assigns layers to pipeline stages (ir.Stage), each with its own recompute
  level (`Stage.recompute`: the planner mixes levels per stage; `layout.recompute` is then only
  the plan's label); default: an even split, the first stages taking the remainder, embedding on
  the first stage and head on the last, every stage at `layout.recompute`.
* Runtime convention: rank order (pp, dp, ep, cp, tp), tp innermost (rules/ranks.py; every stride the
  cost modules pass is `ranks.group_stride` of its group's axes). A tp group is contiguous
  ranks (stride 1), cp stride tp, ep stride cp*tp, dp stride ep*cp*tp (the dense gradient group
  dp x ep x cp has stride tp; the experts' dp x cp spans the same ranks at ep times the spacing),
  pp stride dp*ep*cp*tp.
* Mixture of experts (`passes/cost/moe_cost.py`): EP folds into DP (the batch splits over dp x ep,
  `Layout.microbatches`); expert GEMMs at the rows each expert receives, times
  `layout.moe_imbalance` on the busiest rank; dispatch / combine all-to-alls per MoE layer on the
  ep group's link (`BlockTime.ep_comm_s`); expert parameters over ep, their gradients reduced and
  ZeRO-sharded over dp x cp, the dense ones over dp x ep x cp (`expert=` of the state and sync
  functions: the routed-expert share of `params`); expert activations at the worst case of
  dropless routing; MoE blocks whole on every tp rank (the sharding table's EXPERT / REPLICATE
  roles); MFU on the parameters a token meets (top-k experts).

Component functions (public, stable names, each in the module of what it prices: layout.py the
`Layout` and result types, compiled.py `compile_table`, block.py one block instance, state.py ZeRO /
dp sync / optimizer, pipeline.py p2p and the logits peak; the CP-SAT planner builds its model from them and
`estimate` is nothing but their composition, so both agree):

  compile_table(table, spec) -> CompiledTable          numeric evaluators of the SymPy table
  block_time(ct, hw, layout, kind, *, seq_len) -> BlockTime
        one instance of a block (one layer, the embedding, the head) for ONE micro-batch:
        forward, backward, recompute, TP and CP communication (all on the critical path)
  block_activation_bytes(ct, layout, kind, *, seq_len) -> float
        bytes one instance keeps alive for backward per micro-batch, after recompute
  block_params(ct, layout, kind) -> float              parameters of one instance on one device
  expert_block_params(ct, layout, kind) -> float       the routed-expert part of block_params
  state_bytes(params, layout, *, expert=0) -> MemoryBreakdown  weights, grads, optimizer under ZeRO
  zero2_staging_bytes(params, layout, *, expert=0)     ZeRO-2's gradient staging buckets (a stage's buffers)
  p2p_time(ct, hw, layout, *, seq_len) -> float        stage-to-stage sends per micro-batch
  dp_exposed_time(hw, params, layout, *, backward_s, forward_s) -> float
                                                       gradient sync of one stage left exposed
  tp_grad_sum_time(hw, spec, layout, layers) -> float  the tp all-reduces of proven-partial gradients (q/k norms)
  optimizer_time(hw, params, layout) -> float          Adam step on this device's shard (host under offload)
  offload_time(hw, params, layout) -> float            host-link copies of one micro-batch under offload
  logits_bytes(ct, layout, *, seq_len) -> float        fp32 logits peak of the head stage
  buffer_bytes(ct, layout, *, seq_len) -> float        communication staging buffers of a stage
  pipeline_time(stage_times, microbatches) -> float    1F1B makespan (arXiv 2602.09109 sec. 4.3)
  model_flops_per_token(ct, seq_len) -> float          paper's MFU convention

What TP shards comes from the family's sharding table (rules/sharding.py), the one the rewrite
carries out: each captured node's work and saved bytes are divided by the parts of its module's
role (`_tp_divisor`: heads, KV heads split by min(tp, kv_heads), MLP width, Mamba-2 heads and
groups, vocabulary; 1 for replicated roles such as the RMSNorms outside the mixer and the residual
adds), parameters per rank by `sharding.params_per_rank`, and a layer's forward TP all-reduces
are its row-parallel roles (`sharding.row_parallel_count`). CP splits every token-proportional cost by cp (load-balanced causal
split); LLaMA attention's s x s work divides by cp times (2cp+1)/(2cp), the full diagonal chunk
pairs of runtime/cp_attention.py (`cp_attention_overwork`). Recompute reruns the forward of what
the runtime checkpoints, the TP and CP collectives inside it included (`_recompute_time`).
Sequence parallelism (`Layout.sequence_parallel`): the ops on a tp shard of the sequence divided
by tp, all-gathers and reduce-scatters in place of the TP all-reduces (passes/cost/sequence_cost.py).

Precision (passes/cost/precision.py; Megatron-LM / MindSpeed mixed precision, arXiv 1910.02054 table 1):
bf16 weights (2 B/param), fp32 main gradients (4 B), fp32 master weights + Adam m + v (12 B).
ZeRO-1 shards the 12 B over dp x cp, ZeRO-2 also the gradients; ZeRO-3 is FSDP2's layout: fp32
sharded parameters (the masters), fp32 gradients and Adam m + v, (4 + 4 + 8) B / (dp x cp).
"""

from __future__ import annotations


from dataclasses import replace
from typing import Sequence

import numpy as np

from autoshard.errors import InvalidConfigError
from autoshard.hardware import DeviceProfile
from autoshard.cost_table import CostTable
from autoshard.ir import BlockKind, Precision, Recompute, Stage, check_schedule, even_stages
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
    FLOPs of arXiv 2405.21060 sec. 8.3 per token."""
    spec = ct.spec
    if ct.kinds:  # a mixed stack: 12 d s per attention layer, the SSD per Mamba-2 layer (read off its graph)
        n = sum(_active_layer_params(v) for v in ct.kinds) + sum(ct.block(k).params for k in (BlockKind.EMBED, BlockKind.HEAD))
        attention, mamba = ct.mixers
        return 6.0 * n + 12.0 * attention * spec.hidden * seq_len + (3.0 * _ssd_flops(spec, seq_len) * mamba if mamba else 0.0)
    n = moe_cost.active_params_per_token(spec, sum(blk.params * blk.count for blk in ct.blocks.values()))
    if spec.mixer is Mixer.ATTENTION:
        return 6.0 * n + 12.0 * spec.layers * spec.hidden * seq_len
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
    """Predicted step time, throughput, MFU and peak memory of one layout (see module docstring)."""
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
    parts_of = [block_segments(st, layout.recompute_layers) for st in stages]
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


def block_segments(stage: Stage, recompute_layers: int) -> tuple[tuple[Stage, Recompute], ...]:
    """`stage` as (part, recompute level) pairs under block recompute (`Layout.recompute_layers`, Megatron's
    `--recompute-method block`): its first `recompute_layers` layers at FULL, the rest (and the embedding and
    head, which block recompute leaves alone) at the stage's level; the stage whole where nothing differs."""
    k = min(recompute_layers, stage.layers)
    if k == 0 or stage.recompute is Recompute.FULL:
        return ((stage, stage.recompute),)
    first = Stage(first_layer=stage.first_layer, end_layer=stage.first_layer + k, embed=False, head=False,
                  recompute=Recompute.FULL)
    rest = replace(stage, first_layer=stage.first_layer + k)
    return (first, Recompute.FULL), (rest, stage.recompute)


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
    z3 = 0.0
    if layout.zero == 3:
        z3 = 2 * block_params(ct, layout, BlockKind.LAYER) * layout.numbers.gather_bytes
    return layout.micro_batch, layout.mesh.cp, layout.numbers.act_bytes, layout.mesh.tp > 1 or layout.mesh.pp > 1, z3


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
