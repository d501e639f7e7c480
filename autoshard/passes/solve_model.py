"""The numbers one mesh's CP-SAT model is built from, and their exact float evaluation.

Contract
  A `MeshProblem` holds, for one mesh (DP, PP, TP, CP, EP) and micro-batch size, every cost
  the solver weighs, in seconds and bytes, as `Linear` forms over the mesh-wide one-hot
  `Choice`s (the placement of each op group, the ZeRO level): a constant, plus a coefficient
  per (choice, option), plus a coefficient per pair of options of two neighbouring choices
  (resharding between op groups). Per pipeline stage the solver picks a number of layers
  (contiguous, uneven allowed; the first stage holds the embedding, the last the head) and a
  recompute level. `evaluate` prices one complete `Assignment` in floats; `solve.py` builds the
  same sums in integers for CP-SAT, and the brute-force test enumerates assignments through
  `evaluate`, so the search and the model cannot drift apart.

Step time of an assignment (the 1F1B pipeline over m micro-batches, stage times t_i):
    step = (m - 1) * max_i t_i + sum_i t_i + max_i sync_i + fixed_s
    t_i  = n_i * layer_time[r_i] + [i = 0] embed_time + [i = p-1] head_time + p2p_s (p > 1)
Memory of stage i (1F1B keeps min(p - i, m) micro-batches of activations in flight):
    mem_i = n_i * layer_state + inflight_i * n_i * layer_act[r_i]
            + [i = 0] (embed_state + inflight_i * embed_act) + [i = p-1] (head_state + head_act
            + head_peak) + fixed_bytes  <= capacity
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import product
from typing import Iterator, Mapping

from autoshard.ir import Recompute

Option = tuple[str, str]  # (choice name, option name)


@dataclass(frozen=True, slots=True, kw_only=True)
class Choice:
    """One mesh-wide decision: exactly one of `options` is taken."""

    name: str
    options: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Linear:
    """const + sum of coef over taken options + sum of coef over taken pairs of options."""

    const: float = 0.0
    terms: tuple[tuple[Option, float], ...] = ()
    pairs: tuple[tuple[Option, Option, float], ...] = ()

    def value(self, taken: Mapping[str, str]) -> float:
        total = self.const + sum(c for (ch, o), c in self.terms if taken[ch] == o)
        return total + sum(c for (c1, o1), (c2, o2), c in self.pairs if taken[c1] == o1 and taken[c2] == o2)

    def __add__(self, other: Linear) -> Linear:
        return Linear(const=self.const + other.const, terms=self.terms + other.terms, pairs=self.pairs + other.pairs)

    def scaled(self, k: float) -> Linear:
        return Linear(const=self.const * k, terms=tuple((o, c * k) for o, c in self.terms),
                      pairs=tuple((a, b, c * k) for a, b, c in self.pairs))


ZERO = Linear()


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockCosts:
    """Per micro-batch (time, activations) and per device (state) costs of one block instance."""

    time: Mapping[Recompute, Linear]  # forward + backward (+ recomputation) seconds
    act: Mapping[Recompute, Linear]  # bytes saved for backward
    state: Linear = ZERO  # weights + gradients + optimizer bytes on one device
    sync: Linear = ZERO  # exposed gradient-synchronisation seconds
    peak: Linear = ZERO  # transient bytes (e.g. the fp32 logits) on top of the rest


@dataclass(frozen=True, slots=True, kw_only=True)
class MeshProblem:
    label: str
    layers: int
    pp: int
    microbatches: int
    capacity_bytes: float
    choices: tuple[Choice, ...]
    layer: BlockCosts
    embed: BlockCosts
    head: BlockCosts
    recomputes: tuple[Recompute, ...] = (Recompute.NONE,)
    p2p_s: float = 0.0
    fixed_s: float = 0.0
    fixed_bytes: float = 0.0
    meta: Mapping[str, object] = field(default_factory=dict)

    def inflight(self, stage: int) -> int:
        return min(self.pp - stage, self.microbatches)


@dataclass(frozen=True, slots=True, kw_only=True)
class Assignment:
    taken: Mapping[str, str]  # choice name -> option
    layers: tuple[int, ...]  # layers per stage
    recompute: tuple[Recompute, ...]  # per stage


@dataclass(frozen=True, slots=True, kw_only=True)
class Evaluation:
    step_s: float
    stage_s: tuple[float, ...]
    stage_bytes: tuple[float, ...]
    sync_s: float

    @property
    def peak_bytes(self) -> float:
        return max(self.stage_bytes)


def evaluate(problem: MeshProblem, a: Assignment) -> Evaluation:
    """The exact float step time and per-stage memory of one assignment (see the module doc)."""
    p, t = problem.pp, a.taken
    times, mems, syncs = [], [], []
    for i, (n, r) in enumerate(zip(a.layers, a.recompute)):
        first, last = i == 0, i == p - 1
        inflight = problem.inflight(i)
        time = n * problem.layer.time[r].value(t) + (problem.p2p_s if p > 1 else 0.0)
        mem = n * problem.layer.state.value(t) + inflight * n * problem.layer.act[r].value(t) + problem.fixed_bytes
        sync = n * problem.layer.sync.value(t)
        for present, block in ((first, problem.embed), (last, problem.head)):
            if present:
                time += block.time[r].value(t)
                mem += block.state.value(t) + inflight * block.act[r].value(t) + block.peak.value(t)
                sync += block.sync.value(t)
        times.append(time)
        mems.append(mem)
        syncs.append(sync)
    m = problem.microbatches
    step = (m - 1) * max(times) + sum(times) + max(syncs) + problem.fixed_s
    return Evaluation(step_s=step, stage_s=tuple(times), stage_bytes=tuple(mems), sync_s=max(syncs))


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


def all_assignments(problem: MeshProblem) -> Iterator[Assignment]:
    """Every assignment of `problem` (for brute force on small instances)."""
    names = [c.name for c in problem.choices]
    for options in product(*(c.options for c in problem.choices)):
        taken = dict(zip(names, options))
        for split in stage_splits(problem.layers, problem.pp):
            for rec in product(problem.recomputes, repeat=problem.pp):
                yield Assignment(taken=taken, layers=split, recompute=rec)


def brute_force(problem: MeshProblem) -> tuple[Assignment, Evaluation] | None:
    """The best feasible assignment by enumeration (None when nothing fits)."""
    best = None
    for a in all_assignments(problem):
        ev = evaluate(problem, a)
        if ev.peak_bytes <= problem.capacity_bytes and (best is None or ev.step_s < best[1].step_s):
            best = (a, ev)
    return best
