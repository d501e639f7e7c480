"""The numbers one CP-SAT model is built from, read off the cost model, and their evaluation.

Contract
  `mesh_problem(ct, spec, hw, layout, *, global_batch, seq_len, recomputes)` tabulates, for one
  layout (mesh, micro-batch, ZeRO level), what every possible pipeline stage costs: for stage
  i (0-based, fixing its activations in flight and whether it holds the embedding / head),
  every layer count n and recompute level r, its time per micro-batch, its peak memory and
  its tail (exposed gradient sync + optimizer step). The entries are compositions of
  `passes/cost.py`'s public component functions (block_time, block_activation_bytes,
  block_params, state_bytes, zero3_time, dp_sync_time, optimizer_time, p2p_time, logits_bytes,
  pipeline_time), composed the way `cost.estimate` composes them, so with one recompute level
  for every stage `evaluate` equals `estimate(..., stages=)` (tested).

  `evaluate(problem, assignment)` prices one assignment (layers and recompute per stage):
      step = pipeline_time(t_i, m) + max_i tail_i     (1F1B: sum t_i + (m - 1) max t_i)
  `brute_force(problem)` enumerates every assignment; the test compares it with CP-SAT.
Terms: n = layers of a stage; r = its recompute level; m = micro-batches per step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import product
from typing import Iterator

from autoshard.ir import BlockKind, Recompute, Stage
from autoshard.passes import cost
from autoshard.passes.cost import CompiledTable, Layout, MemoryBreakdown

KINDS = (BlockKind.EMBED, BlockKind.LAYER, BlockKind.HEAD)


@dataclass(frozen=True, slots=True, kw_only=True)
class MeshProblem:
    """Cost tables of every possible stage of one layout; index [i][r][n] (tail: [i][n])."""

    layout: Layout
    layers: int
    microbatches: int
    capacity_bytes: float
    recomputes: tuple[Recompute, ...]
    time_s: tuple[tuple[tuple[float, ...], ...], ...]
    mem_bytes: tuple[tuple[tuple[float, ...], ...], ...]
    tail_s: tuple[tuple[float, ...], ...]

    @property
    def pp(self) -> int:
        return self.layout.mesh.pp

    def min_layers(self, i: int) -> int:
        """Middle stages hold at least one layer; the first and last may hold only embed / head."""
        return self.layers if self.pp == 1 else (0 if i in (0, self.pp - 1) else 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class Assignment:
    layers: tuple[int, ...]  # layers per stage
    recompute: tuple[Recompute, ...]  # per stage

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
class _Blocks:
    """Per-instance numbers of the three blocks under one recompute level."""

    time: dict  # kind -> cost.BlockTime
    act: dict  # kind -> bytes per micro-batch
    params: dict  # kind -> parameters on one device


def _blocks(ct: CompiledTable, hw, layout: Layout, seq_len: int) -> _Blocks:
    return _Blocks(time={k: cost.block_time(ct, hw, layout, k, seq_len=seq_len) for k in KINDS},
                   act={k: cost.block_activation_bytes(ct, layout, k, seq_len=seq_len) for k in KINDS},
                   params={k: cost.block_params(ct, layout, k) for k in KINDS})


def stage_cost(ct: CompiledTable, hw, layout: Layout, blocks: _Blocks, *, n: int, embed: bool, head: bool,
               inflight: int, p2p: float, seq_len: int) -> tuple[float, MemoryBreakdown, float]:
    """(time per micro-batch, memory, tail) of one stage holding n layers (cost.estimate's terms)."""
    counts = {BlockKind.EMBED: int(embed), BlockKind.LAYER: n, BlockKind.HEAD: int(head)}
    tied = blocks.params[BlockKind.EMBED] if head and ct.spec.tied and not embed else 0.0
    params = sum(blocks.params[k] * c for k, c in counts.items()) + tied
    comp = sum(blocks.time[k].compute_s * c for k, c in counts.items())
    rest = sum((blocks.time[k].recompute_s + blocks.time[k].tp_comm_s + blocks.time[k].cp_comm_s) * c
               for k, c in counts.items())
    time = comp + rest + p2p + max(0.0, cost.zero3_time(hw, params, layout) - comp)
    bwd_last = sum(blocks.time[k].bwd_s * c for k, c in counts.items())
    state = cost.state_bytes(params, layout)
    mem = replace(state, activations=sum(blocks.act[k] * c for k, c in counts.items()) * inflight,
                  logits=cost.logits_bytes(ct, layout, seq_len=seq_len) if head else 0.0,
                  buffers=cost._buffers(ct, layout, seq_len, params))
    tail = max(0.0, cost.dp_sync_time(hw, params, layout) - bwd_last) + cost.optimizer_time(hw, params, layout)
    return time, mem, tail


def mesh_problem(ct: CompiledTable, hw, layout: Layout, *, global_batch: int, seq_len: int,
                 recomputes: tuple[Recompute, ...] = tuple(Recompute)) -> MeshProblem:
    """Tabulate every stage's cost for `layout` (see the module docstring)."""
    mesh, layers = layout.mesh, ct.spec.layers
    m = global_batch // (mesh.dp * layout.micro_batch)
    p2p = cost.p2p_time(ct, hw, layout, seq_len=seq_len)
    per_r = {r: _blocks(ct, hw, replace(layout, recompute=r), seq_len) for r in recomputes}
    times, mems, tails = [], [], []
    for i in range(mesh.pp):
        inflight, embed, head = min(mesh.pp - i, m), i == 0, i == mesh.pp - 1
        t_i, m_i, tail_i = [], [], []
        for r in recomputes:
            lay = replace(layout, recompute=r)
            row = [stage_cost(ct, hw, lay, per_r[r], n=n, embed=embed, head=head, inflight=inflight, p2p=p2p,
                              seq_len=seq_len) for n in range(layers + 1)]
            t_i.append(tuple(x[0] for x in row))
            m_i.append(tuple(x[1].total for x in row))
            tail_i = [x[2] for x in row]
        times.append(tuple(t_i))
        mems.append(tuple(m_i))
        tails.append(tuple(tail_i))
    return MeshProblem(layout=layout, layers=layers, microbatches=m, capacity_bytes=hw.memory_bytes,
                       recomputes=tuple(recomputes), time_s=tuple(times), mem_bytes=tuple(mems),
                       tail_s=tuple(tails))


def evaluate(problem: MeshProblem, a: Assignment) -> Evaluation:
    """Step time and per-stage memory of one assignment, from the tables."""
    idx = {r: k for k, r in enumerate(problem.recomputes)}
    times = tuple(problem.time_s[i][idx[r]][n] for i, (n, r) in enumerate(zip(a.layers, a.recompute)))
    mems = tuple(problem.mem_bytes[i][idx[r]][n] for i, (n, r) in enumerate(zip(a.layers, a.recompute)))
    tail = max(problem.tail_s[i][n] for i, n in enumerate(a.layers))
    step = cost.pipeline_time(times, problem.microbatches) + tail
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
        for rec in product(problem.recomputes, repeat=problem.pp):
            a = Assignment(layers=split, recompute=rec)
            ev = evaluate(problem, a)
            if ev.peak_bytes <= problem.capacity_bytes and (best is None or ev.step_s < best[1].step_s):
                best = (a, ev)
    return best
