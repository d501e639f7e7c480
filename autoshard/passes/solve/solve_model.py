"""The numbers one CP-SAT model is built from, read off the cost model, and their evaluation.

The whole contract: docs/modules/solve.md (passes/solve/solve_model.py).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from itertools import product
from typing import Iterator

import numpy as np

from autoshard.ir import BlockKind, Recompute, Stage, end_chunks, stage_rank
from autoshard.passes.cost import cost
from autoshard.passes.cost.block import block_activation_bytes, block_params, block_time, expert_block_params
from autoshard.passes.cost.pipeline import logits_bytes, p2p_time, pipeline_time, sequence_boundary_time
from autoshard.passes.cost.state import (dp_exposed_time, optimizer_time, state_bytes, tp_grad_sum_time,
                                         zero2_staging_bytes, zero_exposed_time)
from autoshard.passes.solve import layer_ranges
from autoshard.rules import schedules, sharding
from autoshard.passes.cost.compiled import CompiledTable
from autoshard.passes.cost.layout import Layout

KINDS = (BlockKind.EMBED, BlockKind.LAYER, BlockKind.HEAD)


@dataclass(frozen=True, slots=True, kw_only=True)
class MeshProblem:
    """Cost tables of every possible stage of one layout: numpy arrays indexed [i, r, n]
    (tail: [i, n]); read-only."""

    layout: Layout
    layers: int
    microbatches: int
    capacity_bytes: float
    recomputes: tuple[Recompute, ...]
    time_s: np.ndarray  # (pp, O, layers + 1) seconds per micro-batch
    mem_bytes: np.ndarray  # (pp, O, layers + 1) peak bytes per device (inf: the option cannot go on the stage)
    tail_s: np.ndarray  # (pp, O, layers + 1) exposed DP sync + optimizer step
    bubble: float = 1.0  # the schedule's bubble fraction f: step = m max t + f (sum t - max t) + tail
    # the layouts a stage may take (`stage_variants`: one, or the per-stage sequence parallelism / groups of
    # `layout.stage_choices`); the options O are (recompute level, variant) pairs, `options`
    variants: tuple[Layout, ...] = ()
    # a mixed stack (layers of several kinds): the kind index of every layer; the tables' last axis is then a
    # stage's layer range [start, end), column start * (layers + 1) + end (passes/solve/layer_ranges.py), not its count
    sequence: tuple[int, ...] = ()

    @property
    def pp(self) -> int:
        return self.layout.mesh.pp

    @property
    def options(self) -> tuple[tuple[Recompute, int], ...]:
        """(recompute level, variant index) of every option, in the order of the tables' second axis."""
        return tuple((r, v) for v in range(max(1, len(self.variants))) for r in self.recomputes)

    def option(self, recompute: Recompute, variant: int = 0) -> int:
        return variant * len(self.recomputes) + self.recomputes.index(recompute)

    def assignment(self, layers, options) -> Assignment:
        """The assignment with `layers` per stage, stage i at option index `options[i]`."""
        opts = [self.options[int(o)] for o in options]
        return Assignment(layers=tuple(int(n) for n in layers), recompute=tuple(r for r, _ in opts),
                          variant=tuple(v for _, v in opts) if len(self.variants) > 1 else ())

    def columns(self, layers) -> tuple[int, ...]:
        """The tables' column of each stage of a split with `layers` per stage: its count, or for a mixed stack
        its range's index (`layer_ranges.range_column`)."""
        if not self.sequence:
            return tuple(int(n) for n in layers)
        return layer_ranges.range_columns(layers, self.layers)

    def min_layers(self, i: int) -> int:
        """Every model chunk holds a layer, except that the first and last may hold only the
        embedding / head: v per rank, v - 1 on a rank holding either (v virtual stages; under the
        zero-bubble V both sit on rank 0 and rank pp - 1 needs v). ir.chunk_layers places the layers."""
        return stage_min_layers(self.layout, self.layers, i)


def stage_min_layers(layout: Layout, layers: int, i: int) -> int:
    """`MeshProblem.min_layers` of stage i of `layout`, a model of `layers` layers."""
    v = layout.virtual_stages
    if layout.mesh.pp == 1:
        return layers
    return v - min(1, end_chunks(i, pp=layout.mesh.pp, virtual_stages=v, schedule=layout.schedule))


@dataclass(frozen=True, slots=True, kw_only=True)
class Assignment:
    layers: tuple[int, ...]  # layers per stage
    recompute: tuple[Recompute, ...]  # per stage
    variant: tuple[int, ...] = ()  # per stage: its index in MeshProblem.variants (none: 0 everywhere)

    def variant_of(self, i: int) -> int:
        return self.variant[i] if self.variant else 0

    def stages(self) -> tuple[Stage, ...]:
        out, start, p = [], 0, len(self.layers)
        for i, (n, r) in enumerate(zip(self.layers, self.recompute)):
            out.append(Stage(first_layer=start, end_layer=start + n, embed=i == 0, head=i == p - 1, recompute=r))
            start += n
        return tuple(out)


@dataclass(frozen=True, slots=True, kw_only=True)
class Evaluation:
    step_s: float
    stage_s: tuple[float, ...]
    stage_bytes: tuple[float, ...]
    tail_s: float

    @property
    def peak_bytes(self) -> float:
        return max(self.stage_bytes)


@dataclass(frozen=True, slots=True, kw_only=True)
class MeshResult:
    """What the search of one mesh problem found (`planner.solve_mesh`; a mixed stack's by `ranges.range_search`)."""

    status: str  # optimal / feasible / infeasible / unknown
    assignment: Assignment | None
    step_s: float  # evaluated in floats from the tables (math.inf when nothing fits)
    bound_s: float  # CP-SAT's lower bound, converted back to seconds
    wall_s: float

    @property
    def gap(self) -> float:
        if not math.isfinite(self.step_s) or self.step_s <= 0:
            return 0.0
        return max(0.0, (self.step_s - self.bound_s) / self.step_s)


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockNumbers:
    """Per-instance numbers of the three blocks for one (mesh, micro-batch), every recompute
    level: they do not depend on the ZeRO level, so the planner computes them once for all levels.
    Arrays are indexed [r, kind] with kinds in KINDS order."""

    recomputes: tuple[Recompute, ...]
    compute_s: np.ndarray  # forward + backward
    other_s: np.ndarray  # recompute + TP + CP communication
    bwd_s: np.ndarray
    fwd_s: np.ndarray
    act_bytes: np.ndarray
    params: np.ndarray  # [kind] parameters on one device (TP-sharded, before ZeRO)
    p2p_s: float
    logits_bytes: float
    # a mixed stack: the columns are the embedding, one per layer kind (passes/cost/compiled.py `CompiledTable.kinds`)
    # and the head, and `experts` the routed-expert parameters of one instance of each (None: one kind of layer)
    experts: np.ndarray | None = None
    # `_stage_columns`' terms that do not depend on the p2p (shared by the copies `replace` makes)
    memo: dict = field(default_factory=dict, compare=False, repr=False)


def block_numbers(ct: CompiledTable, hw, layout: Layout, *, seq_len: int,
                  recomputes: tuple[Recompute, ...] = tuple(Recompute), memo: dict | None = None) -> BlockNumbers:
    """The block numbers of `layout`'s mesh and micro-batch (its ZeRO / recompute are ignored). `memo`: a dict
    the caller keeps over layouts: all but the p2p depend on the mesh's tp, cp and ep only (not dp, pp, nor
    the schedule), so layouts that share those share them."""
    layout = cost.resolved(layout, hw)
    if memo is None:
        return _block_numbers(ct, hw, layout, seq_len=seq_len, recomputes=recomputes)
    mesh = layout.mesh
    key = ("block numbers", hw, seq_len, recomputes, mesh.tp, mesh.cp, mesh.ep, layout.micro_batch, layout.numerics,
           layout.sequence_parallel, layout.strategies, layout.moe_imbalance)
    core = memo.get(key)
    if core is None:
        core = memo[key] = _block_numbers(ct, hw, layout, seq_len=seq_len, recomputes=recomputes)
    p2p = p2p_time(ct, hw, layout, seq_len=seq_len)
    return core if p2p == core.p2p_s else replace(core, p2p_s=p2p)


def _block_numbers(ct: CompiledTable, hw, layout: Layout, *, seq_len: int,
                   recomputes: tuple[Recompute, ...]) -> BlockNumbers:
    if ct.kinds:  # a column per layer kind, each priced through its own table, between the embedding and the head
        parts = [_block_numbers(view, hw, layout, seq_len=seq_len, recomputes=recomputes) for view in ct.kinds]
        first = parts[0]

        def cols(name):
            return np.concatenate([getattr(first, name)[..., :1], *(getattr(b, name)[..., 1:2] for b in parts),
                                   getattr(first, name)[..., 2:]], axis=-1)

        experts = [expert_block_params(view, layout, BlockKind.LAYER) for view in ct.kinds]
        return replace(first, compute_s=cols("compute_s"), other_s=cols("other_s"), bwd_s=cols("bwd_s"),
                       fwd_s=cols("fwd_s"), act_bytes=cols("act_bytes"), params=cols("params"),
                       experts=np.array([0.0, *experts, 0.0]), memo={})
    comp, other, bwd, fwd, act = (np.zeros((len(recomputes), len(KINDS))) for _ in range(5))
    for ri, r in enumerate(recomputes):
        lay = replace(layout, recompute=r)
        for ki, k in enumerate(KINDS):
            if ri and k is not BlockKind.LAYER:  # only a layer recomputes: the first level's numbers
                for a in (comp, bwd, fwd, other, act):
                    a[ri, ki] = a[0, ki]
                continue
            bt = block_time(ct, hw, lay, k, seq_len=seq_len)
            comp[ri, ki], bwd[ri, ki], fwd[ri, ki] = bt.compute_s, bt.bwd_s, bt.fwd_s
            other[ri, ki] = bt.recompute_s + bt.comm_s
            act[ri, ki] = block_activation_bytes(ct, lay, k, seq_len=seq_len, hw=hw)
    return BlockNumbers(recomputes=tuple(recomputes), compute_s=comp, other_s=other, bwd_s=bwd, fwd_s=fwd,
                        act_bytes=act,
                        params=np.array([block_params(ct, layout, k) for k in KINDS]),
                        p2p_s=p2p_time(ct, hw, layout, seq_len=seq_len),
                        logits_bytes=logits_bytes(ct, layout, seq_len=seq_len, hw=hw))


def _stage_columns(ct: CompiledTable, hw, layout: Layout, blocks: BlockNumbers, *, embed: bool, head: bool,
                   seq_len: int, p2p_s: float | None = None, tails: bool = True
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
    """(time [r, n], activations per micro-batch [r, n], other memory [n], tail [n], params [n]) of
    a stage holding n = 0..layers layers, with or without the embedding / head: cost.estimate's
    per-stage terms, evaluated for every n at once. `p2p_s`: the stage's boundary traffic when not
    the layout's own (a sequence-parallel stage among stages that are not); `tails`: False, no tail (None)."""
    memo = blocks.memo  # what depends on the blocks (not their p2p) and the layout's fields named in each key
    n, params, experts, comp, bwd_last, fwd_first, comp_other, act, units = _stage_sums(ct, layout, blocks, embed, head)
    mesh = layout.mesh
    key = ("zero", embed, head, mesh, layout.zero, layout.offload_optimizer)
    if key not in memo:
        state = state_bytes(params, layout, expert=experts)
        memo[key] = (zero_exposed_time(hw, params, layout, compute_s=comp, backward_s=bwd_last, expert=experts,
                                            blocks=units),
                     state.weights + state.grads + state.optimizer + (blocks.logits_bytes if head else 0.0)
                     + zero2_staging_bytes(params, layout, expert=experts)
                     + cost.buffer_bytes(ct, layout, seq_len=seq_len))
    zexp, other_mem = memo[key]
    time = comp_other + (blocks.p2p_s if p2p_s is None else p2p_s) + zexp
    tail = stage_tails(ct, hw, layout, blocks, embed=embed, head=head) if tails else None
    return time, act, np.broadcast_to(other_mem, n.shape), tail, params


def range_class_index(ct: CompiledTable) -> np.ndarray | None:
    """A mixed stack: the class of each layer range column (`layer_ranges.range_classes`): `_stage_columns` and
    `stage_entries` price the classes, `array[..., range_class_index(ct)]` is the table over the ranges. None: one
    kind of layer, the columns are the layer counts themselves."""
    return layer_ranges.range_classes(ct.layer_kinds, len(ct.kinds))[1] if ct.kinds else None


def _stage_sums(ct: CompiledTable, layout: Layout, blocks: BlockNumbers, embed: bool, head: bool) -> tuple:
    """(n, params, experts, compute [r, n], backward and forward at the first level, compute + other [r, n],
    activations [r, n], FSDP units) of a stage holding n = 0..layers layers (a mixed stack: each class of layer
    ranges, `range_class_index`), kept on `blocks`."""
    key = ("counts", embed, head, ct.spec.layers)
    if key not in blocks.memo and ct.kinds:  # a mixed stack: a column per class of layer ranges (`range_class_index`)
        held, _ = layer_ranges.range_classes(ct.layer_kinds, len(ct.kinds))  # [kind, class]
        edge = np.ones((1, held.shape[1]))
        counts = np.concatenate([edge * float(embed), held, edge * float(head)])  # [column, class]
        tied = blocks.params[0] if head and ct.spec.tied and not embed else 0.0
        comp = blocks.compute_s @ counts
        blocks.memo[key] = (counts[1:-1].sum(axis=0), blocks.params @ counts + tied, blocks.experts @ counts, comp,
                            blocks.bwd_s[0] @ counts, blocks.fwd_s[0] @ counts, comp + blocks.other_s @ counts,
                            blocks.act_bytes @ counts, counts.sum(axis=0))
    if key not in blocks.memo:
        n = np.arange(ct.spec.layers + 1, dtype=float)
        counts = np.stack([np.full_like(n, float(embed)), n, np.full_like(n, float(head))])  # [kind, n]
        tied = blocks.params[0] if head and ct.spec.tied and not embed else 0.0
        comp = blocks.compute_s @ counts  # [r, n]
        # experts: MoE, reduced over dp x cp apart; backward / forward: the last backward and first forward the
        # gradient sync overlaps do not depend on the recompute level
        blocks.memo[key] = (n, blocks.params @ counts + tied, n * expert_block_params(ct, layout, BlockKind.LAYER),
                            comp, blocks.bwd_s[0] @ counts, blocks.fwd_s[0] @ counts, comp + blocks.other_s @ counts,
                            blocks.act_bytes @ counts, counts.sum(axis=0))
    return blocks.memo[key]


def stage_tails(ct: CompiledTable, hw, layout: Layout, blocks: BlockNumbers, *, embed: bool, head: bool) -> np.ndarray:
    """[n]: the tail (exposed gradient sync + optimizer step) of a stage holding n = 0..layers layers, with or
    without the embedding / head (`mesh_problem`'s `tail_s`); `blocks`' first recompute level must be the
    tables' (none: the backward and forward the sync overlaps). Kept on `blocks`."""
    key = ("tail", embed, head, layout.mesh, layout.zero, layout.offload_optimizer, layout.virtual_stages)
    if key not in blocks.memo:
        n, params, experts, _, bwd_last, fwd_first, *_ = _stage_sums(ct, layout, blocks, embed, head)
        tail = (dp_exposed_time(hw, params, layout, backward_s=bwd_last, forward_s=fwd_first, expert=experts)
                + optimizer_time(hw, params, layout, expert=experts) + tp_grad_sum_time(hw, ct.spec, layout, n))
        blocks.memo[key] = np.broadcast_to(tail, n.shape)
    return blocks.memo[key]


@functools.lru_cache(maxsize=4096)
def stage_variants(layout: Layout) -> tuple[Layout, ...]:
    """The uniform layouts a pipeline stage of `layout` may take: `layout` itself, or with
    `layout.stage_choices` each combination of sequence parallelism off / on and Mamba-2 groups
    split / whole, the layout's own (off, split) first."""
    if not layout.stage_choices:
        return (layout,)
    base = replace(layout, stage_choices=())
    sps = (False, True) if "sequence_parallel" in layout.stage_choices else (layout.sequence_parallel,)
    groups = ((), (("groups", "whole"),)) if "groups" in layout.stage_choices else ((),)
    return tuple(replace(base, sequence_parallel=sp, strategies=tuple(sorted(base.strategies + g)))
                 for sp in sps for g in groups)


def stage_numbers(ct: CompiledTable, hw, layout: Layout, *, seq_len: int,
                  recomputes: tuple[Recompute, ...] = tuple(Recompute), memo: dict | None = None
                  ) -> tuple[BlockNumbers, ...]:
    """`block_numbers` of every variant of `layout` (`stage_variants`); `memo` as `block_numbers`'."""
    return tuple(block_numbers(ct, hw, v, seq_len=seq_len, recomputes=recomputes, memo=memo)
                 for v in stage_variants(layout))


def mesh_problem(ct: CompiledTable, hw, layout: Layout, *, global_batch: int, seq_len: int,
                 recomputes: tuple[Recompute, ...] = tuple(Recompute),
                 blocks: BlockNumbers | tuple[BlockNumbers, ...] | None = None) -> MeshProblem:
    """Tabulate every stage's cost for `layout` (docs/modules/solve.md), for every option (recompute
    level, variant) of a stage. `blocks`: the layout's `block_numbers` / `stage_numbers`, when the
    caller already has them (they are shared by ZeRO levels).

    Stages that choose their sequence parallelism (`layout.stage_choices`): a sequence-parallel stage
    pays the whole sequence's p2p (the boundaries of a pipeline whose stages differ carry it) and
    `sequence_boundary_time` at its boundaries; an assignment where every stage is on is what the
    layout with `sequence_parallel=True` prices lower (the shard crosses): the planner takes it from
    there. A variant the plan validator refuses on a stage (a replicated embedding / head with the
    first / last stage sequence-parallel) has infinite memory there."""
    layout = cost.resolved(layout, hw)
    mesh, layers = layout.mesh, ct.spec.layers
    m = layout.microbatches(global_batch)
    if ct.kinds:  # selective recompute is not priced per layer kind yet (cost.mixed_violation)
        recomputes = tuple(r for r in recomputes if r is not Recompute.SELECTIVE)
    variants = stage_variants(layout)
    if blocks is None:
        blocks = stage_numbers(ct, hw, layout, seq_len=seq_len, recomputes=recomputes)
    blocks = (blocks,) if isinstance(blocks, BlockNumbers) else tuple(blocks)
    if len(blocks) != len(variants) or any(b.recomputes != tuple(recomputes) for b in blocks):
        raise ValueError(f"block numbers for {len(blocks)} variants x {blocks[0].recomputes}, tables asked for "
                         f"{len(variants)} x {tuple(recomputes)}")
    width = (layers + 1) ** 2 if ct.kinds else layers + 1  # columns: a stage's layer ranges, or its layer counts
    times, mems, tails = (np.empty((mesh.pp, len(variants) * len(recomputes), width)) for _ in range(3))
    for i, o, time, mem, tail in stage_entries(ct, hw, layout, blocks, microbatches=m, seq_len=seq_len):
        times[i, o], mems[i, o], tails[i, o] = time, mem, tail
    for a in (times, mems, tails):
        a.flags.writeable = False
    return MeshProblem(layout=layout, layers=layers, microbatches=m, capacity_bytes=hw.memory_bytes,
                       recomputes=tuple(recomputes), time_s=times, mem_bytes=mems, tail_s=tails,
                       bubble=float(schedules.bubble_fraction(layout.schedule, layout.virtual_stages,
                                                                 microbatches=m, pp=mesh.pp)),
                       variants=variants if len(variants) > 1 else (), sequence=ct.layer_kinds)


def stage_entries(ct: CompiledTable, hw, layout: Layout, blocks: tuple[BlockNumbers, ...], *, microbatches: int,
                  seq_len: int, tails: bool = True) -> Iterator[tuple]:
    """`mesh_problem`'s tables of a resolved `layout` (`blocks`: its `stage_numbers`), a stage and variant at a
    time: (stage i, the variant's slice of the options, time [r, column], peak memory [r, column] (inf: the
    variant cannot go on the stage), tail [column], or None without `tails`); a mixed stack's columns are its
    layer ranges (priced per class of ranges, `range_class_index`, and taken to the ranges once per group of
    stages; a range that ends before it starts is no stage: infinite time and memory)."""
    index = range_class_index(ct)
    for stages, o, time, act, other, valid, tail in stage_groups(ct, hw, layout, blocks, seq_len=seq_len, tails=tails):
        if index is not None:
            time, act, other = _to_ranges(ct, time), _to_ranges(ct, act), np.asarray(other)[..., index]
            tail = tail[..., index] if tail is not None else None
        for i in stages:
            # activations of the micro-batches in flight under the layout's schedule
            mem = act * schedules.in_flight(layout.schedule, i, layout.mesh.pp, microbatches,
                                            layout.virtual_stages) + other
            yield i, o, time, mem if valid else np.full_like(mem, np.inf), tail


def _stage_choice_ok(ct: CompiledTable, tp: int, strategies, sequence_parallel: tuple[bool, ...]) -> bool:
    """Whether the plan validator allows `strategies` with sequence parallelism on the chunks `sequence_parallel`
    says (`sharding.choice_violation` of `ct.spec`), kept in `ct.memo`: the planner asks it for every stage of many
    layouts."""
    key = ("stage choice ok", tp, strategies, sequence_parallel)
    if key not in ct.memo:
        ct.memo[key] = sharding.choice_violation(ct.spec, tp, strategies, sequence_parallel=sequence_parallel,
                                                 chunks=len(sequence_parallel)) is None
    return ct.memo[key]


def _to_ranges(ct: CompiledTable, per_class: np.ndarray) -> np.ndarray:
    """A mixed stack's table per class of layer ranges [..., class] taken to its range columns [..., (L + 1)^2],
    infinite where a range ends before it starts (no stage)."""
    index = _padded_index(ct.layer_kinds, len(ct.kinds))
    pad = np.full(per_class.shape[:-1] + (1,), np.inf)
    return np.concatenate([per_class, pad], axis=-1)[..., index]


@functools.lru_cache(maxsize=16)
def _padded_index(sequence: tuple[int, ...], kinds: int) -> np.ndarray:
    """`range_class_index` with the ranges that end before they start sent one column past the classes."""
    held, index = layer_ranges.range_classes(sequence, kinds)
    out = np.where(layer_ranges.range_lengths(len(sequence)) < 0, held.shape[1], index)
    out.flags.writeable = False
    return out


def stage_groups(ct: CompiledTable, hw, layout: Layout, blocks: tuple[BlockNumbers, ...], *, seq_len: int,
                 tails: bool = True) -> list[tuple]:
    """`stage_entries`' tables grouped by the stages that share them: [(stages, the variant's slice of the options,
    time [r, column], activations per micro-batch [r, column], other memory [column], whether the variant may go
    on these stages, tail [column] or None)]; a stage's peak memory is its activations times the micro-batches it
    holds in flight, plus the other memory (the middle stages of a pipeline differ in that number only)."""
    mesh, recomputes = layout.mesh, blocks[0].recomputes
    chunks = mesh.pp * layout.virtual_stages
    ranks = [stage_rank(c, pp=mesh.pp, virtual_stages=layout.virtual_stages, schedule=layout.schedule)
             for c in range(chunks)]
    mixed = "sequence_parallel" in layout.stage_choices
    # per rank: the boundaries its chunks cross (a chunk not first nor last has two), its chunks sequence-parallel
    crossings = [0] * mesh.pp
    for c, r in enumerate(ranks):
        crossings[r] += (c > 0) + (c < chunks - 1)
    groups: dict = {}
    for v, (lay, blk) in enumerate(zip(stage_variants(layout), blocks)):
        # a stage taking sequence parallelism where others do not: its boundaries' all-gathers, its choices' rules
        boundary = (sequence_boundary_time(ct, hw, lay, seq_len=seq_len, boundaries=1)
                    if mixed and lay.sequence_parallel else None)
        for i in range(mesh.pp):
            p2p, valid = None, True
            if boundary is not None:
                p2p = blocks[0].p2p_s + crossings[i] * boundary
                valid = _stage_choice_ok(ct, mesh.tp, lay.strategies, tuple(r == i for r in ranks))
            groups.setdefault((v, i == 0, i == mesh.pp - 1, p2p, valid), []).append(i)
    out = []
    for (v, first, last, p2p, valid), stages in groups.items():
        lay, blk = stage_variants(layout)[v], blocks[v]
        time, act, other, tail, _ = _stage_columns(ct, hw, lay, blk, embed=first, head=last, seq_len=seq_len,
                                                   p2p_s=p2p, tails=tails)
        out.append((tuple(stages), slice(v * len(recomputes), (v + 1) * len(recomputes)), time, act, other, valid,
                    tail))
    return out


def evaluate(problem: MeshProblem, a: Assignment) -> Evaluation:
    """Step time and per-stage memory of one assignment, from the tables."""
    opts = [problem.option(r, a.variant_of(i)) for i, r in enumerate(a.recompute)]
    cols = problem.columns(a.layers)
    times = tuple(float(problem.time_s[i, o, n]) for i, (n, o) in enumerate(zip(cols, opts)))
    mems = tuple(float(problem.mem_bytes[i, o, n]) for i, (n, o) in enumerate(zip(cols, opts)))
    tail = max(float(problem.tail_s[i, o, n]) for i, (n, o) in enumerate(zip(cols, opts)))
    lay = problem.layout
    step = pipeline_time(times, problem.microbatches, schedule=lay.schedule,
                              virtual_stages=lay.virtual_stages) + tail
    return Evaluation(step_s=step, stage_s=times, stage_bytes=mems, tail_s=tail)


def stage_splits(layers: int, pp: int) -> Iterator[tuple[int, ...]]:
    """Every contiguous split of `layers` over `pp` stages (middle stages hold >= 1 layer)."""
    if pp == 1:
        yield (layers,)
        return
    lows = [0] + [1] * (pp - 2) + [0]

    def rec(i: int, left: int) -> Iterator[tuple[int, ...]]:
        if i == pp - 1:
            yield (left,)
            return
        for n in range(lows[i], left - sum(lows[i + 1:]) + 1):
            for rest in rec(i + 1, left - n):
                yield (n, *rest)

    yield from rec(0, layers)


def brute_force(problem: MeshProblem) -> tuple[Assignment, Evaluation] | None:
    """The best assignment that fits, by enumerating all of them (small instances only)."""
    best = None
    for split in stage_splits(problem.layers, problem.pp):
        if any(n < problem.min_layers(i) for i, n in enumerate(split)):
            continue  # a model chunk would hold no layer (virtual stages)
        for opts in product(range(len(problem.options)), repeat=problem.pp):
            a = problem.assignment(split, opts)
            ev = evaluate(problem, a)
            if ev.peak_bytes <= problem.capacity_bytes and (best is None or ev.step_s < best[1].step_s):
                best = (a, ev)
    return best


# -- the exact search over the slowest-stage time -------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class SplitSearch:
    """What `split_search` found: the best assignment beating the cutoff (None if none was found),
    its step time, a lower bound on every assignment not better than it, and whether the bound
    meets it (proven: nothing in the tables beats `step_s`, or nothing beats the cutoff)."""

    assignment: Assignment | None
    step_s: float
    bound_s: float
    proven: bool
    steps: int  # min-plus passes run


def min_stage_sum(fastest: np.ndarray, layers: int) -> tuple[float, tuple[int, ...] | None]:
    """The smallest sum over stages of fastest[i, n_i] with sum n_i = layers (min-plus DP over the
    stages), and the layer counts reaching it (on ties each stage keeps the smallest count, deciding
    from the last stage back), or (inf, None)."""
    return min_stage_sums(fastest[None], layers)[0]


def min_stage_sums(fastest: np.ndarray, layers: int) -> list[tuple[float, tuple[int, ...] | None]]:
    """`min_stage_sum` of each table fastest[j] ([j, i, n]), the DPs run side by side. A stage's pass
    visits only its counts n finite in some table (a column range) and the running totals k of layers
    the stages so far can hold and the rest can complete (a row range): every other candidate is
    infinite or leads to no split, and a choice outside these ranges is never read. So each value is
    the same float sum, and each choice the same count, as a pass over every (k, n). The candidates
    best[k - n] + fastest[n] are read through a sliding window over best padded with inf (k - n < 0:
    infinite, as no split)."""
    size, count = layers + 1, len(fastest)
    finite = np.isfinite(fastest).any(axis=0)  # [i, n]: finite in some table
    if not finite.any(axis=1).all():
        return [(math.inf, None)] * count
    los, his = finite.argmax(axis=1), size - finite[:, ::-1].argmax(axis=1)  # per stage: [lo, hi), the finite counts
    least = np.cumsum(los).tolist()  # [i]: the fewest / most layers stages 0..i hold
    most = np.cumsum(his - 1).tolist()
    if not least[-1] <= layers <= most[-1]:
        return [(math.inf, None)] * count
    best = np.full((count, size), np.inf)
    best[:, 0] = 0.0
    choices = []
    for i, (lo, hi) in enumerate(zip(los.tolist(), his.tolist())):
        k0 = max(least[i], layers - (most[-1] - most[i]))  # the running totals the later stages can complete
        k1 = min(most[i], layers - (least[-1] - least[i])) + 1
        padded = np.empty((count, hi + size))  # padded[:, hi + x] = best[:, x], inf before
        padded[:, :hi] = np.inf
        padded[:, hi:] = best
        window = np.lib.stride_tricks.sliding_window_view(padded, hi - lo, axis=1)  # [j, s, u] = padded[j, s + u]
        # [j, k, n]: stages so far k - n, this one n (s = k + 1, u = hi - 1 - (n - lo): padded[hi + k - n])
        cand = window[:, k0 + 1:k1 + 1, ::-1] + fastest[:, i, None, lo:hi]
        arg = cand.argmin(axis=2)  # the smallest n on ties
        best = np.full((count, size), np.inf)
        best[:, k0:k1] = cand.min(axis=2)
        choice = np.zeros((count, size), dtype=np.int64)
        choice[:, k0:k1] = arg + lo
        choices.append(choice)
    counts, k, tables = [], np.full(count, layers), np.arange(count)
    for choice in reversed(choices):  # each table's counts, from the last stage back (an infinite one's are not read)
        counts.append(choice[tables, k])
        k = np.maximum(k - counts[-1], 0)
    counts = np.stack(counts[::-1], axis=1).tolist()
    return [(float(best[j, layers]), tuple(counts[j])) if np.isfinite(best[j, layers]) else (math.inf, None)
            for j in range(count)]


def _passes(fastest, values: np.ndarray, layers: int, needed=None):
    """Lazily, for each value v of `values` in order, `min_stage_sum(fastest(v), layers)`: the tables are
    built and their DPs run a chunk of values at a time (1, 2, 4, ... 64: a search that stops early wastes
    little; one that runs long makes few numpy calls). `fastest(vs)` takes the chunk's values as an array
    [j, 1, 1] and returns the tables [j, i, n]. `needed(vs)`: how many of the chunk's leading values the caller
    may still read (it stops at the first it would not; what it decides on stays true of every later value):
    the passes stop there."""
    start, size = 0, 1
    while start < len(values):
        chunk = values[start:start + size]
        if needed is not None:
            chunk = chunk[:needed(chunk)]
            if not len(chunk):
                return
        yield from min_stage_sums(fastest(chunk[:, None, None]), layers)
        if len(chunk) < size:  # cut short by `needed`: no later value is read
            return
        start, size = start + size, min(2 * size, 64)


def split_search(problem: MeshProblem, ok: np.ndarray, *, floor: float, cutoff_s: float = math.inf,
                 max_steps: int = 1000) -> SplitSearch:
    """The fastest assignment, exactly, by branch and bound over the slowest-stage time T and the
    largest tail U. `ok[i, o, n]`: the entries allowed (they fit, and are not too slow for the
    cutoff); `floor`: the smallest T any assignment has (`planner._bottleneck`).

    For caps (T, U), with every entry slower than T or whose tail exceeds U removed, each stage
    takes its fastest allowed option (recompute level, variant), and `min_stage_sum` gives the
    smallest sum S(T, U). value(T, U) = (m - f) T + f S(T, U) + U (f the schedule's bubble fraction,
    1 for 1F1B) is at least the step time of the assignment found, and at an optimum's own (max t,
    max tail) at most the optimum, so min over (T, U) is the optimum. T runs up the distinct table
    times from `floor` that an optimum's slowest stage can have: some optimum has every stage at its
    fastest option among those with a tail no larger than its own max tail (making each stage faster
    under that cap never raises the step), so T runs over each (stage, count)'s fastest times, and
    where a stage's options differ in tail (its variants: the DP sync overlaps another backward, groups
    whole hold more parameters) over the times of the options no other option beats in both time and
    tail (U likewise over their tails);
    it stops once (m - f) T + f S(inf, inf) + min tail reaches the best step found (or the cutoff);
    for each T, U runs up the distinct tails below the found assignment's max tail while
    (m - f) T + f S(T, inf) + U is below it. After `max_steps` min-plus passes it stops unproven,
    with the bound (m - f) T + f S + min tail."""
    m, L, p, f = problem.microbatches, problem.layers, problem.pp, problem.bubble
    short = np.arange(L + 1)[None, :] < np.array([problem.min_layers(i) for i in range(p)])[:, None]  # [i, n]
    t = np.where(ok & ~short[:, None, :], problem.time_s, np.inf)  # [i, o, n]
    tail = problem.tail_s
    fastest, level = t.min(axis=1), t.argmin(axis=1)  # [i, n]
    # a stage's tail depends on its option (groups kept whole hold more parameters), not only its layer count
    varied = len(problem.variants) > 1 and bool((tail != tail[:, :1, :]).any())
    if not varied:  # one option per (stage, count) matters, its fastest: search over those alone
        t, tail = fastest[:, None, :], tail[:, :1, :]
    total, _ = min_stage_sum(fastest, L)
    live = np.isfinite(t)
    tail_lo = float(max(row[mask].min(initial=math.inf) for row, mask in zip(tail, live)))
    best_a, best = None, math.inf
    steps = 1

    def found(layers, arg) -> float:
        nonlocal best_a, best
        pick = arg if varied else level
        a = problem.assignment(layers, [pick[i, n] for i, n in enumerate(layers)])
        ev = evaluate(problem, a)
        if ev.step_s < best and ev.step_s < cutoff_s:
            best_a, best = a, ev.step_s
        return ev.tail_s

    if varied:  # an optimum takes, per stage, its fastest option under the optimum's max tail: only the options
        # no other beats in both time and tail (each a new running minimum of the times in tail order) matter
        order = np.argsort(tail, axis=1, kind="stable")
        ranked = np.take_along_axis(t, order, axis=1)
        before = np.concatenate([np.full_like(ranked[:, :1], np.inf),
                                 np.minimum.accumulate(ranked, axis=1)[:, :-1]], axis=1)
        live = np.zeros_like(live)
        np.put_along_axis(live, order, np.isfinite(ranked) & (ranked < before), axis=1)
    times = np.unique(t[live & (t >= floor)])
    # with every entry slower than a cap T removed, a (stage, count)'s fastest option is its fastest one if that
    # is at most T (else none is)
    def open_caps(caps):  # the leading caps whose value can still beat the goal: the loop below stops at the others
        return int(np.count_nonzero((m - f) * caps + f * total + tail_lo < min(best, cutoff_s)))

    for cap, (s_t, layers) in zip(times, _passes(lambda caps: np.where(fastest <= caps, fastest, np.inf), times, L,
                                                 open_caps)):
        goal = min(best, cutoff_s)
        if (m - f) * cap + f * total + tail_lo >= goal:
            return SplitSearch(assignment=best_a, step_s=best,
                               bound_s=min(goal, (m - f) * cap + f * total + tail_lo), proven=True, steps=steps)
        if steps >= max_steps:
            return SplitSearch(assignment=best_a, step_s=best, bound_s=(m - f) * cap + f * total + tail_lo,
                               proven=False, steps=steps)
        steps += 1
        if layers is None:
            continue
        capped = np.where(t <= cap, t, np.inf)  # [i, o, n]
        top = found(layers, capped.argmin(axis=1))
        tails = np.unique(tail[np.isfinite(capped) & live & (tail < top)])
        tails = tails[tails >= tail_lo]

        def under(us, capped=capped):  # the entries whose tail exceeds us removed too
            return np.where(tail <= us, capped, np.inf)

        def open_tails(us, cap=cap, s_t=s_t):  # likewise, the tails whose value can still beat it
            return int(np.count_nonzero((m - f) * cap + f * s_t + us < min(best, cutoff_s)))

        for u, (s_u, layers) in zip(tails, _passes(lambda us: under(us[..., None]).min(axis=2), tails, L,
                                                   open_tails)):
            if (m - f) * cap + f * s_t + u >= min(best, cutoff_s):
                break
            if steps >= max_steps:  # every (T', U) left has T' >= cap
                return SplitSearch(assignment=best_a, step_s=best, bound_s=(m - f) * cap + f * total + tail_lo,
                                   proven=False, steps=steps)
            steps += 1
            if layers is not None:
                found(layers, under(u).argmin(axis=1))
    goal = min(best, cutoff_s)
    return SplitSearch(assignment=best_a, step_s=best, bound_s=goal, proven=True, steps=steps)
