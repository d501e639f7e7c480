"""One block instance for one micro-batch: compute per node (roofline, GEMM efficiency, fused
kernels, fp8), TP and CP communication on the critical path, recompute, the activations it keeps
for backward and its parameters on one device.

Part of the cost model: passes/cost/cost.py composes these into `estimate`.
"""

from __future__ import annotations


from typing import Sequence

import numpy as np

from autoshard.errors import InvalidConfigError
from autoshard.hardware import DeviceProfile
from autoshard.ir import BlockKind, Precision, Recompute
from autoshard.model_spec import Mixer, ModelSpec
from autoshard.passes.cost import fused_regions, moe_cost
from autoshard.passes.cost.collectives import Collective, best_time
from autoshard.passes.cost import sequence_cost
from autoshard.rules import sharding, tp_collectives
from autoshard.rules.kernels import runs_fused
from autoshard.rules.sharding import selective_module
from autoshard.rules.ranks import group_stride
from autoshard.passes.cost.layout import BlockTime, Layout
from autoshard.passes.cost.compiled import CompiledBlock, CompiledTable


def _tp_divisor(blk: CompiledBlock, spec: ModelSpec, tp: int, sequence_parallel: bool = False,
                strategies=()) -> np.ndarray:
    """Per node: what TP divides its work and saved bytes by, its role's parts (the sharding table with
    the layout's intra-op choices: a replicated LM head divides nothing); under sequence parallelism tp
    for the ops on a sequence shard (passes/cost/sequence_cost.py)."""
    mine = sharding.block_strategies(strategies, blk.kind)  # what of them the block's roles read (`node_stem`)
    key = ("tp_divisor", tp, sequence_parallel, mine)
    if key not in blk.memo:
        parts = np.array([1.0, *sharding.role_divisors(spec, tp, mine, blk.kind)])
        if sequence_parallel and tp > 1:
            parts = sequence_cost.sequence_divisors(parts, spec, blk.kind, tp)
        blk.memo[key] = parts[blk.role + 1]
    return blk.memo[key]


def gemm_efficiency(hw: DeviceProfile, m: np.ndarray, n: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Achievable fraction of peak for GEMMs of these shapes: hw.gemm_efficiency times, per
    dimension, d / (d + hw.gemm_half_dim): thin or small GEMMs underfill the tiles (the paper's
    observation that TP's smaller GEMMs run less efficiently)."""
    return hw.gemm_efficiency * shape_factor(hw.gemm_half_dim, m, n, k)


def shape_factor(half_dim: float, m: np.ndarray, n: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Per GEMM, the product over its dimensions of d / (d + half_dim)."""
    f = np.ones_like(m)
    for d in (m, n, k):
        d = np.maximum(d, 1.0)
        f = f * d / (d + half_dim)
    return f


def float8_gemm_seconds(hw: DeviceProfile, flops: np.ndarray, dims: np.ndarray, *, cast_bytes: float) -> np.ndarray:
    """Seconds of float8 GEMMs (torchao's `Float8Linear`, passes/cost/precision.py "fp8"): the GEMM at the FP8
    tensor-core rate, `hw.fp8_peak_flops` x `hw.fp8_gemm_efficiency` x the shape factor with
    `hw.fp8_gemm_half_dim`, then the casts of its two operands (batch x (m k + k n) elements, `cast_bytes`
    each) at the vector rate; the cast kernels run before the GEMM that reads them. `dims`: [..., (batch,
    m, n, k), node] as in `_node_times_many`."""
    if hw.fp8_peak_flops is None:
        raise InvalidConfigError(fp8_refusal(hw))
    batch, m, n, k = (dims[:, i] for i in range(4))
    shape = shape_factor(hw.fp8_gemm_half_dim, m, n, k)
    cast_s = batch * (m * k + k * n) * cast_bytes / (hw.hbm_bandwidth * hw.vector_efficiency)
    return flops / (hw.fp8_peak_flops * hw.fp8_gemm_efficiency * shape) + cast_s


def fp8_refusal(hw: DeviceProfile) -> str:
    """Why precision fp8 cannot be priced on `hw` (a profile without an FP8 tensor-core peak)."""
    return (f"precision 'fp8' on {hw.name}: the profile has no FP8 tensor cores (no fp8_peak_flops; FP8 GEMMs need "
            "Hopper-class GPUs: h100, h200); plan with precision 'bf16-mixed' (or 'auto'), or give a profile "
            "with fp8_peak_flops, fp8_gemm_efficiency and fp8_gemm_half_dim and their sources")


def _fused_scales(ct: CompiledTable, hw: DeviceProfile, layout: Layout, kind: BlockKind, seq_len: int):
    """Per-node factors on the traced bytes and saved bytes: the fused kernels a training run on the device runs
    (passes/cost/fused_regions.py; rules/kernels.runs_fused: the compiled-layer fusions only where the runtime
    compiles the layers) and the precision (tables are traced in bf16)."""
    blk = ct.block(kind)
    key = ("fused_scales", layout.micro_batch, seq_len, hw, layout.numerics)  # the same for every mesh
    memo = blk.shaped.at(seq_len)
    if key not in memo:
        vals = blk.evaluate(layout.micro_batch, seq_len)
        prec = layout.numbers
        byte_scale, saved_scale = fused_regions.fused_scales(
            blk.region, blk.region_kernels, blk.region_sizes, blk.fwd, vals[1], vals[2],
            fused=lambda kernel: runs_fused(kernel, hw.kernels, ct.layers_compiled),
            tokens=float(layout.micro_batch * seq_len), act_bytes=2.0)
        memo[key] = (byte_scale * prec.traced_scale, saved_scale * prec.traced_scale)
    return memo[key]


def _flash(ct: CompiledTable, hw: DeviceProfile) -> bool:
    """Whether the attention GEMMs (the s x s ones) are priced as the flash kernel: on a device that runs it, in
    every layer kind holding them (a hybrid's attention layers too: HF's sdpa call is the same)."""
    return hw.fuses("flash_attention")


def _node_times(ct: CompiledTable, hw: DeviceProfile, layout: Layout, kind: BlockKind, seq_len: int) -> np.ndarray:
    """Roofline seconds per node of one block instance and one micro-batch on one device."""
    return _node_times_many(ct, hw, (layout,), kind, seq_len)[0]


def _node_times_many(ct: CompiledTable, hw: DeviceProfile, layouts: Sequence[Layout], kind: BlockKind,
                     seq_len: int) -> np.ndarray:
    """`_node_times` of each of `layouts` (which share the micro-batch and precision), [layout, node]: one
    numpy pass for them all, each entry the same float operations as for its layout alone (elementwise; a
    layout without expert parallelism has its expert factors at 1.0, which changes no bit)."""
    blk = ct.block(kind)
    if not len(blk.fwd):
        return np.zeros((len(layouts), 0))
    first = layouts[0]
    vals = blk.evaluate(first.micro_batch, seq_len)

    def column(values) -> np.ndarray:  # one value per layout, [layout, 1]
        return np.array(values, dtype=np.float64)[:, None]

    cp = column([lay.mesh.cp for lay in layouts])
    div = np.stack([_tp_divisor(blk, ct.spec, lay.mesh.tp, lay.sequence_parallel, lay.strategies) for lay in layouts])
    overwork = column([cp_attention_overwork(ct.spec, lay.mesh.cp) for lay in layouts])
    flops = vals[0] / div / cp * np.where(blk.quadratic, overwork, 1.0)
    byte_scale, _ = _fused_scales(ct, hw, first, kind, seq_len)
    nbytes = vals[1] * byte_scale / div / cp
    if blk.delta_rule is not None and blk.delta_rule.any():  # runtime/cp_delta.py runs the rule three times
        runs = np.where(blk.delta_rule, column([CP_DELTA_RUNS if lay.mesh.cp > 1 else 1.0 for lay in layouts]), 1.0)
        flops, nbytes = flops * runs, nbytes * runs
    peak = hw.peak_flops * first.numbers.flops_scale
    dims = np.repeat(vals[None, 3:7], len(layouts), axis=0)  # [layout, (batch, m, n, k), node]
    idx = np.arange(dims.shape[2])
    has_tp = blk.tp_dim >= 0
    dims[:, blk.tp_dim[has_tp], idx[has_tp]] /= div[:, has_tp]
    has_cp = blk.cp_dim >= 0
    dims[:, blk.cp_dim[has_cp], idx[has_cp]] /= cp
    if blk.expert is not None and blk.expert.any() and any(lay.mesh.ep > 1 for lay in layouts):  # passes/cost/moe_cost.py
        busiest = np.where(blk.expert, column([moe_cost.expert_flops_factor(ct.spec, lay.mesh, lay.moe_imbalance)
                                               for lay in layouts]), 1.0)
        flops, nbytes = flops * busiest, nbytes * busiest  # the busiest rank's rows set the pace
        per_expert, rows = (column(x) for x in zip(*(moe_cost.expert_gemm_scale(ct.spec, lay.mesh, lay.moe_imbalance)
                                                        for lay in layouts)))
        grow = blk.expert & blk.is_gemm & has_cp  # E/ep experts, each receiving ep x imbalance the rows
        dims[:, 0, grow] /= per_expert
        dims[:, blk.cp_dim[grow], idx[grow]] *= rows
    mem_t = nbytes / (hw.hbm_bandwidth * hw.vector_efficiency)
    eff = gemm_efficiency(hw, dims[:, 1], dims[:, 2], dims[:, 3])
    gemm_t = np.where(blk.is_gemm, flops / (peak * eff), 0.0)
    if first.precision is Precision.FP8 and blk.float8 is not None and blk.float8.any():
        gemm_t = np.where(blk.float8, float8_gemm_seconds(hw, flops, dims, cast_bytes=first.numbers.cast_bytes), gemm_t)
    if _flash(ct, hw):  # the attention nodes as the flash kernel runs them (passes/cost/fused_regions.py)
        attn = blk.is_gemm & blk.quadratic
        share = fused_regions.attention_tile_fraction(ct.spec, seq_len)  # causal, or a sliding window's band
        flash = fused_regions.flash_attention_flops(flops, blk.fwd, share=share)
        gemm_t = np.where(attn, flash / (peak * hw.attention_efficiency), gemm_t)
    return np.maximum(gemm_t, mem_t)


def cp_attention_overwork(spec: ModelSpec, cp: int) -> float:
    """Factor on the ideal 1/cp share of the s x s attention work that a CP rank really does.
    runtime/cp_attention.py `local_causal_attention`: the sequence is cut into 2cp chunks of c
    tokens; rank i runs query chunks i and 2cp-1-i against their whole key prefixes, the diagonal
    chunk pair computed in full under a boolean mask: (i+1) + (2cp-i) = 2cp+1 chunk pairs, where
    an exact causal split is 2cp*2cp/2/cp = 2cp pairs. So (2cp+1)/(2cp) (1.25 at cp2, 1.125 at
    cp4); the mask's slower kernel path (docs/context_parallel.md, measured) is not priced. A model whose layers
    pass a state (`ModelSpec.cp_contiguous`: a hybrid's attention beside Mamba scans or short convolutions) cuts the
    sequence into cp contiguous chunks: the last rank runs its chunk against the whole prefix, cp chunk pairs where
    the ideal share is cp / 2, so 2. Only the quadratic nodes take the factor (a scan is linear in S)."""
    if cp == 1:
        return 1.0
    return 2.0 if spec.cp_contiguous else (2 * cp + 1) / (2 * cp)


def _tokens(layout: Layout, seq_len: int) -> float:
    return layout.micro_batch * seq_len / layout.mesh.cp


def _tp_comm(ct: CompiledTable, hw: DeviceProfile, layout: Layout, kind: BlockKind, seq_len: int, *,
             low_latency: bool = False) -> tuple:
    """(forward, backward) seconds of TP collectives of one block instance, one micro-batch
    (Megatron-LM, Narayanan et al. 2021 sec. 2.3: all-reduce after each row-parallel GEMM in
    forward, after each column-parallel input in backward; HF's gathered linears add their all-gathers,
    `_gather_comm`). `low_latency`: NCCL's LL protocol too
    (the serving model's decode steps, collectives.best_time)."""
    tp = layout.mesh.tp
    if tp == 1:
        return 0.0, 0.0
    act = _tokens(layout, seq_len) * ct.spec.hidden * layout.numbers.act_bytes
    ar = best_time(hw, Collective.ALL_REDUCE, act, size=tp, stride=group_stride(layout.mesh, "tp"), low_latency=low_latency)
    if kind is BlockKind.LAYER:
        n, entries = tp_collectives.row_parallel_count(ct.spec, BlockKind.LAYER), tp_collectives.tp_entry_count(ct.spec)
        sync = _group_sync(ct, hw, layout, seq_len, low_latency=low_latency)
        gather_f, gather_b = _gather_comm(ct, hw, layout, seq_len, low_latency=low_latency)
        inner = len(tp_collectives.region_output_widths(ct.spec))  # Mamba-1's x_proj: summed at its own width
        inner_s = sequence_cost.region_output_all_reduces(ct.spec, hw, act_bytes=act, tp=tp,
                                                          stride=group_stride(layout.mesh, "tp"), low_latency=low_latency)
        return (n - inner) * ar + inner_s + sync + gather_f, (entries - inner) * ar + inner_s + sync + gather_b
    if not sharding.vocab_parallel(ct.spec, kind, layout.strategies):
        return 0.0, 0.0  # replicated embedding / LM head and loss (the plan's choice): no collective
    if kind is BlockKind.EMBED:
        return ar, 0.0  # vocab-parallel lookup: partial sums all-reduced in forward
    small = best_time(hw, Collective.ALL_REDUCE, _tokens(layout, seq_len) * 3 * 4, size=tp, stride=group_stride(layout.mesh, "tp"),
                      low_latency=low_latency)
    return small, ar  # vocab-parallel CE (max, sum, target) forward; LM-head input grad backward


def _gather_comm(ct: CompiledTable, hw: DeviceProfile, layout: Layout, seq_len: int, *,
                 low_latency: bool = False) -> tuple[float, float]:
    """(forward, backward) seconds of the all-gathers of one layer's gathered linears (HF's colwise_gather_output:
    its output gathered whole in forward, its gradient sliced; rowwise_split_input: its whole input sliced in
    forward, its gradient gathered in backward), each of tokens x the linear's width (`tp_collectives.gathered_widths`)."""
    tokens, tp = _tokens(layout, seq_len) * layout.numbers.act_bytes, layout.mesh.tp
    stride = group_stride(layout.mesh, "tp")
    return tuple(sum(best_time(hw, Collective.ALL_GATHER, tokens * w, size=tp, stride=stride, low_latency=low_latency)
                     for w in tp_collectives.gathered_widths(ct.spec, strategy))
                 for strategy in (sharding.Strategy.COLWISE, sharding.Strategy.ROWWISE))


def _group_sync(ct: CompiledTable, hw: DeviceProfile, layout: Layout, seq_len: int, *,
                low_latency: bool = False) -> float:
    """Mamba-2 with its groups kept whole (tp does not divide them, or the plan chose "groups": "whole"):
    the gated norm's fp32 per-group sums of squares added over tp, once forward and once backward
    (runtime/ssd.py); else 0."""
    spec, tp = ct.spec, layout.mesh.tp
    if not sharding.groups_whole(spec, tp, layout.strategies):
        return 0.0
    return best_time(hw, Collective.ALL_REDUCE, _tokens(layout, seq_len) * spec.groups * 4, size=tp, stride=group_stride(layout.mesh, "tp"),
                     low_latency=low_latency)


def _cp_comm(ct: CompiledTable, hw: DeviceProfile, layout: Layout, kind: BlockKind, seq_len: int) -> tuple:
    """(forward, backward) seconds of CP communication of one block instance, one micro-batch, not overlapped,
    each collective all-gathered in forward and reduce-scattered in backward, all inside the layer's sequence
    mixers: attention's K/V (runtime/cp_attention.py, `_cp_kv_bytes`), and each scan's or conv's state passing
    (`_passed_bytes`: Mamba-2's chunk-final SSM states, fp32, O(d * d_state * CP), arXiv 2602.09109, and its conv
    halo, runtime/cp_mamba.py; Mamba-1's, runtime/cp_scan.py; a gated DeltaNet's, runtime/cp_delta.py; a short
    convolution's halo, runtime/cp_conv.py)."""
    mesh = layout.mesh
    if mesh.cp == 1 or kind is not BlockKind.LAYER:
        return 0.0, 0.0
    stride = group_stride(mesh, "cp")
    gathered = [_cp_kv_bytes(ct.spec, layout, seq_len), *(n * mesh.cp for n in _passed_bytes(ct.spec, layout))]
    return tuple(sum(best_time(hw, op, n, size=mesh.cp, stride=stride) for n in gathered if n)
                 for op in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER))


def _cp_kv_bytes(spec: ModelSpec, layout: Layout, seq_len: int) -> float:
    """Bytes of the whole sequence's K and V of one layer's attention on a tp rank, which every cp rank gathers
    (0 without attention): a uniform attention stack's from the spec, a hybrid's from its attention parts."""
    if not spec.parts:
        width = 2 * spec.kv_heads * spec.attention_head_dim if spec.mixer is Mixer.ATTENTION else 0
    else:
        width = sum(p.size("kv") + p.size("v") if p.kind in ("attention", "attention_whole") else
                    2 * spec.kv_heads * spec.attention_head_dim if p.kind == "mla" else 0 for p in spec.parts)
    if not width:
        return 0.0
    return layout.micro_batch * seq_len * width / sharding.kv_parts(spec, layout.mesh.tp) * layout.numbers.act_bytes


def _passed_bytes(spec: ModelSpec, layout: Layout) -> list[float]:
    """Bytes each rank contributes to the all-gathers of the layer's state passing: per Mamba-2 mixer its fp32 final
    state and log-decay per head, and its last conv - 1 pre-conv tokens; per Mamba-1 scan its fp32 final state and
    log-decay per channel and state entry, and its conv halo; per gated DeltaNet its fp32 final state and transition
    per value head, and its conv halo over [q; k; v] (a per-channel one, "kda", alike); per short convolution its conv
    halo."""
    b, tp, act = layout.micro_batch, layout.mesh.tp, layout.numbers.act_bytes
    out = []
    ssd = [(p.size("heads"), p.size("head_dim"), p.size("state"), p.size("groups"), p.size("inner"), p.size("conv"))
           for p in spec.parts if p.kind == "ssd"]
    if spec.mixer is Mixer.SSD and not spec.parts:
        ssd.append((spec.heads, spec.head_dim, spec.state, spec.groups, spec.intermediate, spec.conv))
    for heads, head_dim, state, groups, inner, conv in ssd:
        groups_local = groups / (1 if sharding.groups_whole(spec, tp, layout.strategies) else tp)
        out += [b * heads / tp * (head_dim * state + 1) * 4.0, b * (conv - 1) * (inner / tp + 2 * groups_local * state) * act]
    for p in spec.parts:
        if p.kind == "delta":  # runtime/cp_delta.py: its final state from zero (dk x dv) and transition (dk x dk)
            dk, dv = p.size("key") / p.size("k_heads"), p.size("value") / p.size("v_heads")
            out += [b * p.size("v_heads") / tp * dk * (dv + dk) * 4.0,
                    b * (p.size("conv") - 1) * (2 * p.size("key") + p.size("value")) / tp * act]
        elif p.kind == "kda":  # a gated DeltaNet whose decay is per channel: the same state per head, dk = dv
            hd = p.size("qkv") / p.size("heads")
            out += [b * p.size("heads") / tp * hd * 2 * hd * 4.0, b * (p.size("conv") - 1) * 3 * p.size("qkv") / tp * act]
        elif p.kind == "mamba1":
            inner = p.size("inner") / tp
            out += [b * inner * _scan_state(p) * 2 * 4.0, b * (p.size("conv") - 1) * inner * act]
        elif p.kind == "short_conv":
            out.append(b * (p.size("conv") - 1) * p.size("width") / tp * act)
    return out


def _scan_part(spec: ModelSpec):
    """The Mamba-1 selective scan part of `spec`'s layers (models/layered.py "mamba1"), or None."""
    return next((p for p in spec.parts if p.kind == "mamba1"), None)


def _scan_state(scan) -> int:
    """A Mamba-1 scan's state size n: its x_proj gives dt_rank + 2 n (B and C)."""
    return (scan.size("x_out") - scan.size("dt_rank")) // 2


# runs of a gated delta rule (forward and backward) under cp (runtime/cp_delta.py): from zero (the slice's final
# state), on zero values from the identity (its transition; values dk wide, about the same work), from the entering
# state (the output). Measured on this 2-core CPU (HF's torch chunked rule, 4 heads of 64, fwd + bwd): 3.1, 2.7 and
# 2.1 runs' time at 256, 512 and 1024 tokens per rank (the first two runs' backward goes through their final states
# alone), so 3 prices the upper end
CP_DELTA_RUNS = 3.0

# fp32 passes over a (b, d, L, n) tensor that a Mamba-1 scan's entering state costs a CP rank in torch ops
# (runtime/cp_scan.py `_from_start`: A x the summed dt, exp, times the state, read through C: 6 counted; backward:
# that forward again, checkpointed, and its gradients: 19 counted, 27 measured on a 2-core CPU, 24 taken)
CP_SCAN_PASSES = (6, 24)


def _cp_scan_work(ct: CompiledTable, hw: DeviceProfile, layout: Layout, kind: BlockKind, seq_len: int) -> tuple:
    """(forward, backward) seconds a CP rank spends on what the state entering its slice adds to a Mamba-1 scan's
    output (memory-bound elementwise work, `CP_SCAN_PASSES`): 0 without cp or such a scan."""
    scan = _scan_part(ct.spec)
    if layout.mesh.cp == 1 or kind is not BlockKind.LAYER or scan is None:
        return 0.0, 0.0
    one = _tokens(layout, seq_len) * scan.size("inner") / layout.mesh.tp * _scan_state(scan) * 4.0
    return tuple(passes * one / (hw.hbm_bandwidth * hw.vector_efficiency) for passes in CP_SCAN_PASSES)


def _recompute_time(ct: CompiledTable, layout: Layout, kind: BlockKind, t: np.ndarray, tp_f: float,
                    cp_f: float, ep_f: float = 0.0) -> float:
    """Seconds of forward rerun in backward, as the runtime checkpoints (passes/rewrite.py
    `_checkpointed`, runtime/tensor_parallel.py `_checkpoint_forward`, runtime/stages.py): full
    reruns the whole layer, its TP all-reduces (RowParallelLinear o_proj and down_proj / out_proj),
    its CP collectives and its MoE dispatch / combine all-to-alls (`ep_f`) included; selective reruns the attention module / Mamba-2 mixer, whose
    forward holds one TP all-reduce (o_proj / out_proj) and all the CP collectives (the K/V
    all-gather of cp_attention.py, the halo and state all-gathers of cp_mamba.py)."""
    blk = ct.block(kind)
    if kind is not BlockKind.LAYER or layout.recompute is Recompute.NONE:
        return 0.0
    fwd = blk.fwd if len(t) else np.zeros(0, dtype=bool)
    if layout.recompute is Recompute.FULL:
        return float(t[fwd].sum()) + tp_f + cp_f + ep_f
    spec = ct.spec
    inside = tp_collectives.row_parallel_count(spec, BlockKind.LAYER, under=selective_module(spec))
    return float(t[fwd & blk.rerun].sum()) + tp_f * inside / max(1, tp_collectives.row_parallel_count(spec, kind)) + cp_f


def block_time(ct: CompiledTable, hw: DeviceProfile, layout: Layout, kind: BlockKind, *,
               seq_len: int) -> BlockTime:
    """One instance of block `kind` (one layer / the embedding / the head), one micro-batch. Memoised
    on what it depends on (the mesh's tp, cp and ep, not its dp nor pp: every group it prices is
    tp, cp or ep; not ZeRO, the schedule, nor the choices of the other blocks): the planner asks for
    it for many layouts that share those."""
    return block_times(ct, hw, (layout,), kind, seq_len=seq_len)[0]


def block_times(ct: CompiledTable, hw: DeviceProfile, layouts: Sequence[Layout], kind: BlockKind, *,
                seq_len: int) -> list[BlockTime]:
    """`block_time` of each of `layouts`; those not memoised yet are priced together, the node times of
    the ones that share a micro-batch and precision in one numpy pass (`_node_times_many`). The node
    times are memoised too (they do not depend on the recompute level)."""
    memo = ct.block(kind).shaped.at(seq_len)
    layer = kind is BlockKind.LAYER  # only a layer recomputes: the others' times are the same at every level
    keys = [(_node_key(hw, lay, kind, seq_len), lay.recompute if layer else Recompute.NONE) for lay in layouts]
    memo_node_times(ct, hw, kind, {node: lay for (node, rec), lay in zip(keys, layouts)
                                   if (node, rec) not in memo and node not in memo}, seq_len=seq_len)
    for key, lay in zip(keys, layouts):
        if key not in memo:
            memo[key] = _block_time(ct, hw, lay, kind, seq_len, memo[key[0]])
    return [memo[key] for key in keys]


def memo_node_times(ct: CompiledTable, hw: DeviceProfile, kind: BlockKind, todo: dict, *, seq_len: int) -> None:
    """Memoise the node times (`_node_times`) of block `kind` for each key of `todo` ({`node_key`: a layout with
    that key}) not memoised yet, those of the layouts that share a micro-batch and precision in one numpy pass
    (`_node_times_many`); `ct.block(kind).shaped.at(seq_len)[key]` then holds them."""
    memo = ct.block(kind).shaped.at(seq_len)
    groups: dict = {}  # (micro-batch, precision) -> {node times key: layout}
    for node, lay in todo.items():
        if node not in memo:
            groups.setdefault((lay.micro_batch, lay.numerics), {})[node] = lay
    for group in groups.values():
        for node, t in zip(group, _node_times_many(ct, hw, tuple(group.values()), kind, seq_len)):
            memo[node] = t


def _node_key(hw: DeviceProfile, layout: Layout, kind: BlockKind, seq_len: int) -> tuple:
    """What a block's node times depend on; its `block_time` depends on the recompute level too."""
    return node_key(hw, node_stem(layout, kind), seq_len)


def node_stem(layout: Layout, kind: BlockKind) -> tuple:
    """What of `layout` block `kind`'s node times depend on (`node_key` adds the device and the sequence length):
    the same for every plan, so the planner keeps it over plans (passes/solve/bounds.py)."""
    mesh = layout.mesh
    return (mesh.tp, mesh.cp, mesh.ep, layout.micro_batch, layout.numerics, layout.sequence_parallel,
            sharding.block_strategies(layout.strategies, kind), layout.moe_imbalance)


def node_key(hw: DeviceProfile, stem: tuple, seq_len: int) -> tuple:
    """The memo key of the node times of a block whose layout has `node_stem` `stem`."""
    return ("node_times", hw, *stem, seq_len)


def _block_time(ct: CompiledTable, hw: DeviceProfile, layout: Layout, kind: BlockKind, seq_len: int,
                t: np.ndarray) -> BlockTime:
    """`block_time` from the block's node times `t` (`_node_times`)."""
    blk = ct.block(kind)
    fwd, bwd = fwd_bwd_s(blk, t)
    cp_f, cp_b = _cp_comm(ct, hw, layout, kind, seq_len)
    work_f, work_b = _cp_scan_work(ct, hw, layout, kind, seq_len)
    fwd, bwd = fwd + work_f, bwd + work_b
    if layout.sequence_parallel and layout.mesh.tp > 1:
        tp_f, tp_b = _sequence_tp_comm(ct, hw, layout, kind, seq_len, t)
    else:
        tp_f, tp_b = _tp_comm(ct, hw, layout, kind, seq_len)
        if kind is BlockKind.LAYER and tp_b > 0:  # the input-gradient all-reduces overlap weight gradients
            n, gather_b = tp_collectives.tp_entry_count(ct.spec), _gather_comm(ct, hw, layout, seq_len)[1]
            tp_b = _tp_backward_exposed(blk, t, (tp_b - gather_b) / max(1, n), n) + gather_b
    shard = layout.mesh.tp if layout.sequence_parallel else 1  # each tp rank dispatches its shard of the tokens
    ep_f, ep_b = (0.0, 0.0) if kind is not BlockKind.LAYER else moe_cost.ep_comm_time(
        hw, ct.spec, layout.mesh, tokens=_tokens(layout, seq_len) / shard, imbalance=layout.moe_imbalance,
        act_bytes=layout.numbers.act_bytes)
    return BlockTime(fwd_s=fwd, bwd_s=bwd, recompute_s=_recompute_time(ct, layout, kind, t, tp_f, cp_f + work_f, ep_f),
                     tp_comm_s=tp_f + tp_b, cp_comm_s=cp_f + cp_b, ep_comm_s=ep_f + ep_b)


def fwd_bwd_s(blk: CompiledBlock, t: np.ndarray) -> tuple[float, float]:
    """(forward, backward) seconds of a block instance from its node times `t` (`BlockTime.fwd_s`, `bwd_s`)."""
    if not len(t):
        return 0.0, 0.0
    return float(t[blk.fwd].sum()), float(t[~blk.fwd].sum())


def _sequence_tp_comm(ct: CompiledTable, hw: DeviceProfile, layout: Layout, kind: BlockKind, seq_len: int,
                      t: np.ndarray) -> tuple[float, float]:
    """(forward, exposed backward) TP seconds under sequence parallelism (passes/cost/sequence_cost.py),
    with Mamba-2's gated-norm sync in a layer when its groups are kept whole (as without SP)."""
    tp = layout.mesh.tp
    sync = _group_sync(ct, hw, layout, seq_len) if kind is BlockKind.LAYER else 0.0
    small = best_time(hw, Collective.ALL_REDUCE, _tokens(layout, seq_len) * 3 * 4, size=tp,
                      stride=group_stride(layout.mesh, "tp"))
    act = _tokens(layout, seq_len) * ct.spec.hidden * layout.numbers.act_bytes
    comm = sequence_cost.tp_comm(ct.spec, hw, kind=kind, tp=tp, act_bytes=act, small_all_reduce_s=small,
                                 recompute=layout.recompute,
                                 vocab=kind is BlockKind.LAYER or sharding.vocab_parallel(ct.spec, kind, layout.strategies))
    hidden = sum(_tp_backward_exposed(ct.block(kind), t, s, n) for s, n in comm.backward_overlapped if n)
    whole_f = whole_b = 0.0
    if kind is BlockKind.LAYER and sharding.whole_modules(ct.spec):  # HF's gathered attention (runs whole)
        stride = group_stride(layout.mesh, "tp")
        gather_f, gather_b = _gather_comm(ct, hw, layout, seq_len)  # its linears' output / input gathers
        entry = best_time(hw, Collective.ALL_GATHER, act, size=tp, stride=stride)  # its input leaves the shard
        inputs = len(tp_collectives.gathered_widths(ct.spec, sharding.Strategy.COLWISE))  # each gathered linear's input
        whole_f = entry + gather_f  # gradient all-reduced in backward, as without sequence parallelism
        whole_b = inputs * best_time(hw, Collective.ALL_REDUCE, act, size=tp, stride=stride) + gather_b
    return comm.forward + sync + whole_f, hidden + comm.backward_exposed + sync + whole_b


def _tp_backward_exposed(blk: CompiledBlock, t: np.ndarray, all_reduce_s: float, count: int) -> float:
    """Backward TP all-reduces left on the critical path: each input-gradient all-reduce of a
    column-parallel group (attention's q/k/v, the MLP's gate/up, Mamba-2's in_proj) runs while the
    same group's weight-gradient GEMMs compute (Megatron-LM's async tensor-parallel all-reduce,
    `LinearWithGradAccumulationAndAsyncCommunication`: dgrad all-reduce overlapped with wgrad), so
    only what outlasts them is exposed."""
    groups = list(blk.wgrad_groups.values())[:count]
    hidden = sum(max(0.0, all_reduce_s - float(t[mask].sum())) for mask in groups)
    return hidden + (count - len(groups)) * all_reduce_s


def block_activation_bytes(ct: CompiledTable, layout: Layout, kind: BlockKind, *, seq_len: int,
                           hw: DeviceProfile | None = None) -> float:
    """Bytes one block instance keeps for backward per micro-batch on one device (read off the
    joint graph's saved tensors; sharded by TP as above, by CP over tokens), after recompute; with
    `hw`, what the device's fused kernels save instead of the traced ops (passes/cost/fused_regions.py)."""
    blk = ct.block(kind)
    mesh, spec = layout.mesh, ct.spec
    if kind is BlockKind.LAYER and layout.recompute is Recompute.FULL:  # only the block input (a sequence shard
        shard = mesh.tp if layout.sequence_parallel else 1  # under sequence parallelism)
        return _tokens(layout, seq_len) * spec.hidden * layout.numbers.act_bytes / shard
    if not len(blk.fwd):
        return 0.0
    vals = blk.evaluate(layout.micro_batch, seq_len)
    if hw is not None:
        scale = _fused_scales(ct, hw, layout, kind, seq_len)[1]
    else:
        scale = layout.numbers.traced_scale
    saved = vals[2] * scale / _tp_divisor(blk, spec, mesh.tp, layout.sequence_parallel, layout.strategies) / mesh.cp
    if blk.expert is not None and mesh.ep > 1:  # worst case of dropless routing (passes/cost/moe_cost.py)
        saved = np.where(blk.expert, saved * moe_cost.expert_memory_factor(spec, mesh), saved)
    keep = blk.fwd.copy()
    if kind is BlockKind.LAYER and layout.recompute is Recompute.SELECTIVE:
        keep &= ~blk.rerun  # the checkpoint keeps the module's input: the norm's output, kept anyway
    total = float(saved[keep].sum())
    if kind is BlockKind.LAYER and mesh.cp > 1:  # the gathered K/V of the other CP ranks stay alive for the
        total += _cp_kv_bytes(spec, layout, seq_len) * (mesh.cp - 1) / mesh.cp  # attention backward
    return total


def block_params(ct: CompiledTable, layout: Layout, kind: BlockKind) -> float:
    """Parameters of one instance of block `kind` held by one device (TP-sharded as the sharding
    table says, before ZeRO; of the routed experts, which the table keeps whole on every tp rank,
    the E/ep this ep rank holds)."""
    held = sharding.params_per_rank(ct.spec, kind, ct.block(kind).params, layout.mesh.tp, layout.strategies)
    if kind is BlockKind.LAYER and ct.spec.is_moe:
        held -= ct.spec.expert_params - expert_block_params(ct, layout, kind)
    return held


def expert_block_params(ct: CompiledTable, layout: Layout, kind: BlockKind) -> float:
    """The part of `block_params` that is routed experts (reduced and ZeRO-sharded over dp x cp)."""
    return moe_cost.expert_params(ct.spec, layout.mesh) if kind is BlockKind.LAYER else 0.0
