"""The CP-SAT planner: `solve(spec, hw, *, devices, global_batch, seq_len) -> Plan`.

This is the only module that imports OR-Tools (when CP-SAT first runs: `_cpsat`).

The whole contract: docs/modules/solve.md (passes/solve/planner.py).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import time
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Callable

import numpy as np

from autoshard.errors import InfeasiblePlanError, InvalidConfigError
from autoshard.ir import (Fp8Recipe, Plan, Precision, Recompute, Schedule, Stage, check_schedule, chunk_layers,
                          even_stages, is_positive_int, stage_rank)
from autoshard.passes.cost import cost
from autoshard.passes.cost.compiled import compile_table, mixed_violation
from autoshard.passes.cost.compiled import CompiledTable
from autoshard.passes.cost.layout import Layout
from autoshard.errors import AutoshardError
from autoshard.rules.validity import (RUNTIME_SCHEDULES, RUNTIME_SEQUENCE_PARALLEL, RUNTIME_ZERO, mesh_micro_batches,
                                     sequence_parallel_violation, zero_violation)
from autoshard.passes.cost.precision import resolve_precision
from autoshard.rules.schedules import check_chunks, microbatches_per_step
from autoshard.passes.solve import ranges
from autoshard.passes.solve.bounds import Bounds, LazyBounds, refined_step_bound
from autoshard.passes.solve.mixed_bounds import mixed_bounds
from autoshard.rules.sharding import choices, strategy_options
from autoshard.passes.solve.solve_model import (Assignment, MeshProblem, MeshResult, SplitSearch, evaluate,
                                                mesh_problem, min_stage_sum, split_search, stage_numbers,
                                                stage_variants)

Progress = Callable[[int, int, float], None]  # (layouts visited, layouts in total, best step so far)


def solve_mesh(problem: MeshProblem, *, time_limit_s: float = 10.0, hint: Assignment | None = None,
               cutoff_s: float = math.inf, max_steps: int = 1000) -> MeshResult:
    """The fastest assignment of `problem` that fits and beats `cutoff_s` (exact search, else CP-SAT).

    `time_limit_s` is CP-SAT's deterministic-time budget (its own work units, about a second
    each on a laptop core, the same on every machine and run), so a cut-short search still gives
    the same answer every time; it reports status "feasible" and the gap. Entries that cannot
    fit, or whose stage alone makes the step slower than `cutoff_s` (m * t_i > cutoff), are
    removed from the domains before the model is built; "cut" means nothing beats the cutoff.
    `max_steps`: min-plus passes the exact split search may run first (0: CP-SAT alone); when it
    proves its assignment optimal CP-SAT is not called. A mixed stack's problem (`problem.sequence`: stages
    are layer ranges) is solved by its own exact search (passes/solve/ranges.py), always proven."""
    if problem.sequence:
        return _solve_ranges(problem, cutoff_s=cutoff_s)
    L = problem.layers
    m_mb = problem.microbatches
    ok = problem.mem_bytes <= problem.capacity_bytes
    if math.isfinite(cutoff_s):
        ok &= problem.time_s * m_mb <= cutoff_s * (1 + 1e-12)
    for i, (lo, hi) in enumerate(_layer_ranges(problem)):
        if not ok[i, :, lo:hi + 1].any():
            status = "infeasible" if not ok.any(axis=(1, 2))[i] or not math.isfinite(cutoff_s) else "cut"
            return MeshResult(status=status, assignment=None, step_s=math.inf, bound_s=math.inf, wall_s=0.0)
    floor, hint_b = _bottleneck(problem, ok)
    if floor is None:
        return MeshResult(status="cut" if math.isfinite(cutoff_s) else "infeasible", assignment=None,
                          step_s=math.inf, bound_s=math.inf, wall_s=0.0)
    exact = None
    if max_steps > 0:
        t0 = time.perf_counter()
        exact = split_search(problem, ok, floor=floor, cutoff_s=cutoff_s, max_steps=max_steps)
        if exact.proven:
            status = "optimal" if exact.assignment is not None else ("cut" if math.isfinite(cutoff_s) else "infeasible")
            return MeshResult(status=status, assignment=exact.assignment, step_s=exact.step_s,
                              bound_s=exact.bound_s, wall_s=time.perf_counter() - t0)
        hint = exact.assignment or hint_b or hint
        lower = exact.bound_s
    else:
        hint = hint_b or hint
        fastest = np.where(ok, problem.time_s, np.inf).min(axis=1)
        f = problem.bubble
        lower = (m_mb - f) * floor + f * min_stage_sum(fastest, L)[0] + _min_tail(problem, ok)
    if lower >= cutoff_s * (1 - 1e-12):  # no assignment can beat the cutoff: skip CP-SAT
        return MeshResult(status="cut", assignment=None, step_s=math.inf, bound_s=lower, wall_s=0.0)
    return _merge(_cpsat(problem, _domains(problem, ok), floor=floor, cutoff_s=cutoff_s, hint=hint,
                         time_limit_s=time_limit_s), exact)


def _solve_ranges(problem: MeshProblem, *, cutoff_s: float) -> MeshResult:
    """`solve_mesh` of a mixed stack: the exact search over the stages' layer ranges (`ranges.range_search`)."""
    t0 = time.perf_counter()
    ok = problem.mem_bytes <= problem.capacity_bytes
    if math.isfinite(cutoff_s):
        ok &= problem.time_s * problem.microbatches <= cutoff_s * (1 + 1e-12)
    a, step, bound = ranges.range_search(problem, ok, cutoff_s=cutoff_s)
    status = "optimal" if a is not None else ("cut" if math.isfinite(cutoff_s) else "infeasible")
    return MeshResult(status=status, assignment=a, step_s=step, bound_s=bound, wall_s=time.perf_counter() - t0)


def _layer_ranges(problem: MeshProblem) -> list[tuple[int, int]]:
    """Per stage, the least and most layers it can hold (the others at their least)."""
    mins = [problem.min_layers(i) for i in range(problem.pp)]
    return [(lo, problem.layers - (sum(mins) - lo)) for lo in mins]


def _domains(problem: MeshProblem, ok: np.ndarray) -> list[list[int]]:
    """Per stage, the allowed table entries `ok` within its layer range, as CP-SAT's indices r * (L + 1) + n."""
    out = []
    for i, (lo, hi) in enumerate(_layer_ranges(problem)):
        rs, ks = np.nonzero(ok[i, :, lo:hi + 1])  # row-major: by recompute level, then layer count
        out.append((rs * (problem.layers + 1) + ks + lo).tolist())
    return out


def _merge(cp: MeshResult, exact: SplitSearch | None) -> MeshResult:
    """CP-SAT's result, or the exact search's assignment when CP-SAT found nothing better."""
    if exact is None or exact.assignment is None or (cp.assignment is not None and cp.step_s < exact.step_s):
        return cp if exact is None else replace(cp, bound_s=min(cp.step_s, max(cp.bound_s, exact.bound_s)))
    bound = min(exact.step_s, max(exact.bound_s, cp.bound_s if cp.assignment is not None else exact.bound_s))
    status = "optimal" if cp.status == "optimal" or bound >= exact.step_s else "feasible"
    return MeshResult(status=status, assignment=exact.assignment, step_s=exact.step_s, bound_s=bound, wall_s=cp.wall_s)


def _cpsat(problem: MeshProblem, domains: list, *, floor: float, cutoff_s: float, hint: Assignment | None,
           time_limit_s: float) -> MeshResult:
    """The CP-SAT model of one layout over the allowed table entries `domains` (see `solve_mesh`).
    OR-Tools is imported here, when a layout first needs it (~1.5 s: the exact split search proves
    most optima without it, and a plan that never calls CP-SAT does not pay for the import)."""
    from ortools.sat.python import cp_model

    statuses = {cp_model.OPTIMAL: "optimal", cp_model.FEASIBLE: "feasible", cp_model.INFEASIBLE: "infeasible",
                cp_model.MODEL_INVALID: "invalid", cp_model.UNKNOWN: "unknown"}
    p, L, R = problem.pp, problem.layers, len(problem.options)
    m_mb = problem.microbatches
    unit = float(problem.time_s.max()) * 1e-6 or 1.0
    time_int = np.rint(problem.time_s / unit).astype(np.int64)
    tail_int = np.rint(problem.tail_s / unit).astype(np.int64)
    m = cp_model.CpModel()
    n, times, tails, recs = [], [], [], []
    for i, allowed in enumerate(domains):
        idx = m.NewIntVarFromDomain(cp_model.Domain.FromValues(allowed), f"idx{i}")
        ks = sorted({v % (L + 1) for v in allowed})
        n_i = m.NewIntVarFromDomain(cp_model.Domain.FromValues(ks), f"n{i}")
        r_i = m.NewIntVar(0, R - 1, f"r{i}")
        m.Add(idx == r_i * (L + 1) + n_i)
        table = time_int[i].reshape(-1).tolist()
        t = m.NewIntVar(0, max(table[v] for v in allowed), f"t{i}")
        m.AddElement(idx, table, t)
        tail_table = tail_int[i].reshape(-1).tolist()  # per (option, layer count), as the times
        tail = m.NewIntVar(0, max(tail_table[v] for v in allowed), f"tail{i}")
        m.AddElement(idx, tail_table, tail)
        n.append(n_i), times.append(t), tails.append(tail), recs.append(r_i)
    m.Add(sum(n) == L)
    t_max = m.NewIntVar(max(0, int(floor / unit) - 1), int(time_int.max()), "t_max")
    m.AddMaxEquality(t_max, times)
    tail_max = m.NewIntVar(0, int(tail_int.max()), "tail_max")
    m.AddMaxEquality(tail_max, tails)
    # (m - f) t_max + f sum t + tail, times the denominator q of the bubble fraction f = k / q
    f = Fraction(problem.bubble).limit_denominator(64)
    k, q = f.numerator, f.denominator
    objective = (q * m_mb - k) * t_max + k * sum(times) + q * tail_max
    if math.isfinite(cutoff_s):  # rounding moves the integer objective by at most q (m + p + 1) / 2 units
        m.Add(objective <= q * (math.floor(cutoff_s / unit) + m_mb + p + 1))
    m.Minimize(objective)
    if hint is not None:
        for i in range(p):
            m.AddHint(n[i], hint.layers[i])
            m.AddHint(recs[i], problem.option(hint.recompute[i], hint.variant_of(i)))
    solver = cp_model.CpSolver()
    solver.parameters.max_deterministic_time = max(0.01, float(time_limit_s))
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    status = solver.Solve(m)
    name = statuses.get(status, "unknown")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        name = "cut" if status == cp_model.INFEASIBLE and math.isfinite(cutoff_s) else name
        return MeshResult(status=name, assignment=None, step_s=math.inf, bound_s=math.inf, wall_s=solver.WallTime())
    a = problem.assignment([solver.Value(v) for v in n], [solver.Value(r) for r in recs])
    step = evaluate(problem, a).step_s
    bound = min(step, solver.BestObjectiveBound() * unit / q)
    return MeshResult(status=name, assignment=a, step_s=step, bound_s=bound, wall_s=solver.WallTime())


def _bottleneck(problem: MeshProblem, ok: np.ndarray) -> tuple[float | None, Assignment | None]:
    """The smallest slowest-stage time T any assignment can have (binary search over the table's
    times: with every entry slower than T or not fitting removed, can the layers still be spread
    over the stages?), and an assignment reaching it (each stage at its fewest layers, the rest
    handed out in stage order, every stage at its fastest fitting recompute level), or None when
    the stages' feasible layer counts have holes. CP-SAT gets T as a bound on its max and the
    assignment as a hint: 1F1B's (m - 1) * max t dominates, so both are close to the optimum."""
    p, L = problem.pp, problem.layers
    t = np.where(ok, problem.time_s, np.inf)
    fastest = t.min(axis=1)  # [i, n]
    mins = [problem.min_layers(i) for i in range(p)]

    def spread(cap: float):
        lo, hi = [], []
        for i in range(p):
            ks = np.nonzero(fastest[i, mins[i]:] <= cap)[0]
            if not len(ks):
                return None
            lo.append(mins[i] + int(ks[0])), hi.append(mins[i] + int(ks[-1]))
        return (lo, hi) if sum(lo) <= L <= sum(hi) else None

    values = np.unique(fastest[np.isfinite(fastest)])
    if not len(values) or spread(values[-1]) is None:
        return None, None
    left, right = 0, len(values) - 1
    while left < right:
        mid = (left + right) // 2
        left, right = (left, mid) if spread(values[mid]) is not None else (mid + 1, right)
    cap = float(values[left])
    lo, hi = spread(cap)
    layers, extra = list(lo), L - sum(lo)
    for i in range(p):
        take = min(extra, hi[i] - lo[i])
        layers[i] += take
        extra -= take
    if any(fastest[i, k] > cap for i, k in enumerate(layers)):
        return cap, None
    return cap, problem.assignment(layers, [int(np.argmin(t[i, :, k])) for i, k in enumerate(layers)])


def _min_tail(problem: MeshProblem, ok: np.ndarray) -> float:
    """max over stages of the smallest tail a stage can have (over its fitting options and layer
    counts): a lower bound on max tail_i."""
    return float(max(problem.tail_s[i][ok[i]].min() for i in range(problem.pp)))


def min_peak_bytes(problem: MeshProblem) -> float:
    """The smallest peak memory per device over every assignment (binary search on the cap)."""
    p, L = problem.pp, problem.layers
    stage_min = problem.mem_bytes.min(axis=1)  # [i, n]: the best recompute level per layer count

    def fits(cap: float) -> bool:
        # stages are independent given their layer counts: can the layers be spread so each fits?
        lo, hi = [], []
        for i in range(p):
            ks = [k for k in range(problem.min_layers(i), L + 1) if stage_min[i, k] <= cap]
            if not ks:
                return False
            lo.append(ks[0]), hi.append(ks[-1])
        return sum(lo) <= L <= sum(hi)

    values = np.unique(stage_min)
    left, right = 0, len(values) - 1
    while left < right:
        mid = (left + right) // 2
        left, right = (left, mid) if fits(values[mid]) else (mid + 1, right)
    return float(values[left])


# -- the search over layouts -------------------------------------------------------------------
def candidate_layouts(spec, *, devices: int, global_batch: int, seq_len: int,
                      zeros: tuple[int, ...] = RUNTIME_ZERO, micro_batches: tuple[int, ...] = (1, 2, 4, 8),
                      schedules: tuple = RUNTIME_SCHEDULES, offload: bool = False,
                      sequence_parallel: tuple[bool, ...] = RUNTIME_SEQUENCE_PARALLEL,
                      moe_imbalance: float = 1.0, precision: Precision = Precision.AUTO,
                      fp8_recipe: Fp8Recipe | None = None, meshes: Callable | None = None) -> CandidateLayouts:
    """Every (mesh, micro-batch, intra-op strategy, ZeRO, schedule) the planner searches: the valid
    (mesh, micro-batch) pairs of `validity.mesh_micro_batches` (the divisibility rules `sweep` uses)
    times, under tp > 1, sequence parallelism on / off (`sequence_parallel`, the values the runtime
    runs: `validity.RUNTIME_SEQUENCE_PARALLEL`) and every combination of the sharding table's intra-op
    choices that goes with it (`sharding.strategy_options`: embedding / head vocab-parallel or
    replicated, Mamba-2 groups split or whole) times the ZeRO levels the runtime runs that go with the
    mesh (`validity.zero_violation`) times, for pp > 1, the pipeline schedules and virtual stages the
    runtime runs (`validity.RUNTIME_SCHEDULES`); `offload`: ZeRO-3 also with optimizer offload (where
    the device profile prices the host link); `moe_imbalance`: the busiest expert's load over the mean
    (passes/cost/moe_cost.py), the same for every layout; `precision` (and `fp8_recipe`): of every layout (the
    planner asks once per precision the device runs, `planner_precisions`); `meshes`: which meshes to keep (a
    mixed stack's: those its per-kind tables price), None all."""
    pairs = mesh_micro_batches(spec, devices, global_batch=global_batch, seq_len=seq_len,
                               micro_batches=micro_batches)
    if meshes is not None:
        pairs = [(mesh, mb) for mesh, mb in pairs if meshes(mesh)]
    options: dict = {}  # tp -> the sharding table's choices; (tp, sequence parallel) -> their valid combinations
    intra = {}  # mesh -> its (sequence_parallel, strategies, stage choices) options
    for mesh in {mesh for mesh, _ in pairs}:
        sps = [sp for sp in sequence_parallel
               if not sp or sequence_parallel_violation(spec, mesh, seq_len) is None]
        for sp in sps:
            if (mesh.tp, sp) not in options:
                options[mesh.tp, sp] = strategy_options(spec, mesh.tp, sequence_parallel=sp)
        if mesh.tp not in options:
            options[mesh.tp] = choices(spec, mesh.tp)
        intra[mesh] = tuple((sp, st, per) for sp in sps for st in options[mesh.tp, sp]
                            for per in [_stage_choices(mesh, sp, sps, options[mesh.tp])] if "groups" not in per or
                            "groups" not in dict(st))
    schedules_of = {}  # (pp, micro-batches) -> the schedules that go with them
    parts = []
    for mesh, mb in pairs:
        key = (mesh.pp, microbatches_per_step(global_batch, mesh, mb))
        if key not in schedules_of:
            schedules_of[key] = tuple(pipeline_schedules(spec, *key, schedules))
        parts.append(_pair_layouts(mesh, mb, intra[mesh], zeros, offload, schedules_of[key], moe_imbalance, precision,
                                   fp8_recipe))
    return CandidateLayouts(parts, precision=precision)


def planner_precisions(hw) -> tuple[tuple[Precision, Fp8Recipe | None], ...]:
    """The (precision, fp8 recipe) pairs the planner searches on `hw`, jointly with the rest of the layout: the
    device's default (bf16-mixed on an accelerator, fp32 on the cpu profile) and, where the profile has FP8
    tensor cores (`fp8_peak_flops`), fp8 with each of torchao's recipes."""
    default = ((resolve_precision(Precision.AUTO, hw), None),)
    if hw.fp8_peak_flops is None:
        return default
    return default + tuple((Precision.FP8, recipe) for recipe in Fp8Recipe)


class CandidateLayouts(tuple):
    """`candidate_layouts`' answer: the layouts, a tuple that is the concatenation of `parts` (the
    `_pair_layouts` tuples, the same objects in every plan of the process: `bounds.layout_codes` reads the
    layouts' keys a part at a time), all of precision `precision`."""

    def __new__(cls, parts: list[tuple[Layout, ...]], *, precision: Precision) -> CandidateLayouts:
        self = super().__new__(cls, itertools.chain.from_iterable(parts))
        self.parts, self.precision = tuple(parts), precision
        return self


def _stage_choices(mesh, sp: bool, sps, have: dict) -> tuple[str, ...]:
    """The layer choices the stages of a pipeline (pp > 1) make each on its own (`Layout.stage_choices`):
    sequence parallelism, in the layout that is otherwise off, where both values are searched (the one
    that is on everywhere stays its own layout: its boundaries carry the shard); Mamba-2 groups where
    tp divides them (`have`: `sharding.choices` at the mesh's tp)."""
    if mesh.pp == 1:
        return ()
    out = ("sequence_parallel",) if not sp and True in sps else ()
    return out + (("groups",) if "groups" in have else ())


@functools.lru_cache(maxsize=1 << 16)
def _pair_layouts(mesh, micro_batch: int, intra: tuple, zeros: tuple, offload: bool, schedules: tuple,
                  moe_imbalance: float, precision: Precision, fp8_recipe: Fp8Recipe | None = None) -> tuple[Layout, ...]:
    """`candidate_layouts`' layouts of one (mesh, micro-batch): its intra-op options x the ZeRO levels that go
    with the mesh (and offload) x the schedules. The same objects for the same arguments, so a re-plan in
    process builds only the pairs whose options changed (building one Layout validates it, ~8 us; a plan
    has ~30k), and `bounds.bound_columns` reads each layout's keys once."""
    return tuple(_layout(mesh, micro_batch, z, o, sched, v, sp, st, per, moe_imbalance, precision, fp8_recipe)
                 for sp, st, per in intra for z in zeros if zero_violation(mesh, z) is None
                 for o in ((False, True) if offload and z == 3 else (False,)) for sched, v in schedules)


@functools.lru_cache(maxsize=1 << 17)
def _layout(mesh, micro_batch: int, zero: int, offload: bool, schedule, virtual_stages: int, sequence_parallel: bool,
            strategies: tuple, stage_choices: tuple, moe_imbalance: float, precision: Precision,
            fp8_recipe: Fp8Recipe | None) -> Layout:
    """One candidate Layout, built (and validated) once per process: a re-plan at another global batch, whose
    pairs take other schedules (`_pair_layouts`' arguments change), builds only the layouts it had not."""
    return Layout(mesh=mesh, micro_batch=micro_batch, zero=zero, offload_optimizer=offload, schedule=schedule,
                  virtual_stages=virtual_stages, sequence_parallel=sequence_parallel, strategies=strategies,
                  stage_choices=stage_choices, moe_imbalance=moe_imbalance, precision=precision, fp8_recipe=fp8_recipe)


def pipeline_schedules(spec, pp: int, microbatches: int, options=RUNTIME_SCHEDULES) -> list:
    """The (schedule, virtual_stages) pairs of `options` that a pipeline of `pp` stages with this
    many micro-batches can run (ir.check_schedule, schedules.check_chunks); pp = 1: 1F1B only
    (nothing to schedule); with fewer micro-batches than stages 1F1B becomes GPipe, as the runtime
    asks."""
    if pp == 1:
        return [(Schedule.ONE_F_ONE_B, 1)]
    out = []
    for sched, v in options:
        if Schedule(sched) is Schedule.ONE_F_ONE_B and microbatches < pp:
            sched = Schedule.GPIPE  # what runs with fewer micro-batches than stages (1F1B's bubble)
        try:
            check_schedule(Schedule(sched), v, pp=pp)
            check_chunks(sched, v, pp=pp, microbatches=microbatches, layers=spec.layers)
        except AutoshardError:
            continue
        out.append((Schedule(sched), v))
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    layout: Layout
    result: MeshResult


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchResult:
    found: tuple[Candidate, ...]  # best first; the best of every mesh that could be runner-up
    visited: int  # layouts whose tables were built and solved
    pruned_memory: int  # layouts ruled out by the memory bound before any table
    layouts: int
    # per expert-parallel size searched: (ep, least step-time bound of its layouts that pass the
    # memory bound (inf: none does), least peak-memory bound in bytes); `show` explains the ep with it
    ep_bounds: tuple[tuple[int, float, float], ...] = ()


def search(ct: CompiledTable, hw, *, global_batch: int, seq_len: int, layouts: list[Layout],
           time_limit_s: float = 10.0, progress: Progress | None = None) -> SearchResult:
    """Solve layouts in order of their step-time bound until the bound reaches the runner-up
    (the best plan on a mesh other than the best one), each with the best value it must beat
    as a cutoff. Deterministic: no wall clock decides anything."""
    if ct.kinds:
        return ranges_search(ct, hw, global_batch=global_batch, seq_len=seq_len, layouts=layouts, progress=progress)
    if not isinstance(layouts, CandidateLayouts) or layouts.precision is Precision.AUTO:
        layouts = [cost.resolved(lay, hw) for lay in layouts]  # precision AUTO: the device's default
    memo: dict = {}  # lower_bounds' parameters and p2p times
    cols = LazyBounds(ct, hw, layouts, global_batch=global_batch, seq_len=seq_len, memo=memo)
    fits = cols.peak_bytes <= hw.memory_bytes
    pruned = len(layouts) - int(fits.sum())
    ep = cols.ep
    ep_bounds: dict = {}  # ep -> [least step bound of the layouts that fit, least peak bound]
    for e in np.unique(ep).tolist():
        mine = ep == e
        ep_bounds[e] = [cols.least(np.flatnonzero(mine & fits)), float(cols.peak_bytes[mine].min())]
    kept = np.flatnonzero(fits)
    numbers: dict = {}
    best: dict = {}  # mesh -> best Candidate on it
    visited = 0

    for done, k in enumerate(cols.ordered(kept)):  # by (bound, index)
        layout, bound = layouts[k], float(cols.step_s[k])
        first, second = _top2(best)
        if bound >= second * (1 - 1e-9):
            break
        cutoff = first.result.step_s if first is not None and first.layout.mesh == layout.mesh else second
        if bound >= cutoff * (1 - 1e-9) or refined_step_bound(
                ct, hw, layout, Bounds(step_s=bound, peak_bytes=float(cols.peak_bytes[k])), global_batch=global_batch,
                seq_len=seq_len, block_s=cols.block_s[int(cols.block_code[k])], memo=memo,
                cutoff_s=cutoff) >= cutoff * (1 - 1e-9):  # nothing on it beats the cutoff: skip its tables
            continue
        key = (layout.mesh, layout.micro_batch, layout.sequence_parallel, layout.strategies, layout.stage_choices,
               layout.schedule, layout.virtual_stages)  # p2p depends on v
        if key not in numbers:
            numbers[key] = stage_numbers(ct, hw, layout, seq_len=seq_len, memo=numbers)
        problem = mesh_problem(ct, hw, layout, global_batch=global_batch, seq_len=seq_len, blocks=numbers[key])
        result = solve_mesh(problem, time_limit_s=time_limit_s, hint=_even(problem), cutoff_s=cutoff)
        visited += 1
        _keep(best, layout, result, progress, done, len(kept),
              keep=result.assignment is not None and not _all_sequence_parallel(problem, result.assignment))
    return _searched(best, visited=visited, pruned=pruned, layouts=len(layouts), ep_bounds=ep_bounds)


def _keep(best: dict, layout: Layout, result: MeshResult, progress: Progress | None, done: int, total: int, *,
          keep: bool = True) -> None:
    """Keep `result` (`keep`: a plan to keep) as its mesh's best (`best`: mesh -> Candidate) when it is, and
    report the progress."""
    if keep and result.assignment is not None:
        mine = best.get(layout.mesh)
        if mine is None or result.step_s < mine.result.step_s:
            best[layout.mesh] = Candidate(layout=layout, result=result)
    if progress is not None:
        progress(done + 1, total, _top2(best)[0].result.step_s if best else math.inf)


def _top2(best: dict) -> tuple[Candidate | None, float]:
    """The best candidate of `best` (mesh -> Candidate) and the step of the runner-up (inf: none)."""
    ranked = sorted(best.values(), key=lambda c: c.result.step_s)
    return (ranked[0] if ranked else None), (ranked[1].result.step_s if len(ranked) > 1 else math.inf)


def _searched(best: dict, *, visited: int, pruned: int, layouts: int, ep_bounds: dict) -> SearchResult:
    found = tuple(sorted(best.values(), key=lambda c: (c.result.step_s, str(c.layout))))
    return SearchResult(found=found, visited=visited, pruned_memory=pruned, layouts=layouts,
                        ep_bounds=tuple((ep, s, p) for ep, (s, p) in sorted(ep_bounds.items())))


def ranges_search(ct: CompiledTable, hw, *, global_batch: int, seq_len: int, layouts: list[Layout],
                  progress: Progress | None = None) -> SearchResult:
    """`search` of a mixed stack (`ct.kinds`): the layouts its per-kind tables price (`cost.mixed_violation`;
    one model chunk per rank, since a rank of an interleaved pipeline holds no one layer range) in order of a
    lower bound on their step, each solved exactly over its stages' layer ranges (`_solve_ranges`) with the
    value it must beat as a cutoff, until the bound reaches the runner-up; a layout whose table bound
    (`ranges.table_bound`) lies above the next one's bound goes back in line at it. The bounds of a layout: passes/solve/
    mixed_bounds.py (the mean layer of the stack's sequence, the recompute memory forces, the peak of its mix)."""
    layouts = _priced_layouts(ct, hw, layouts)
    step_b, peak_b = mixed_bounds(ct, hw, layouts, global_batch=global_batch, seq_len=seq_len)
    fits = peak_b <= hw.memory_bytes
    ep_bounds, eps = {}, np.array([lay.mesh.ep for lay in layouts])
    for e in np.unique(eps).tolist():
        mine = eps == e
        ep_bounds[e] = (float(step_b[mine & fits].min(initial=math.inf)), float(peak_b[mine].min()))
    kept = np.flatnonzero(fits)
    queue = [(float(step_b[k]), k, False) for k in kept[np.argsort(step_b[kept], kind="stable")].tolist()]
    best: dict = {}  # mesh -> best Candidate on it
    numbers = _kept_numbers(ct, hw, seq_len)
    visited = done = 0

    while queue:  # by (bound, index): a heap already
        bound, k, tabled = heapq.heappop(queue)
        layout = layouts[k]
        first, second = _top2(best)
        if bound >= second * (1 - 1e-9):
            break
        cutoff = first.result.step_s if first is not None and first.layout.mesh == layout.mesh else second
        if bound >= cutoff * (1 - 1e-9):
            continue
        key = ("stage numbers", layout.mesh, layout.micro_batch, layout.strategies, layout.sequence_parallel,
               layout.schedule, layout.virtual_stages, layout.precision, layout.fp8_recipe, layout.moe_imbalance)
        if key not in numbers:
            numbers[key] = stage_numbers(ct, hw, layout, seq_len=seq_len, memo=numbers,
                                         recomputes=(Recompute.NONE, Recompute.FULL))
        if not tabled:
            table_b = ranges.table_bound(ct, hw, layout, numbers[key], global_batch=global_batch, seq_len=seq_len,
                                         memo=numbers)
            if table_b >= cutoff:
                continue  # its search would stop at once, nothing found: skip its tables
            if queue and (table_b, k) > queue[0][:2]:  # a layout bounded lower first: back in line at this bound
                heapq.heappush(queue, (table_b, k, True))
                continue
        result = ranges.known_result(numbers.get(("range result", layout, global_batch)), cutoff)
        if result is None:
            problem = mesh_problem(ct, hw, layout, global_batch=global_batch, seq_len=seq_len, blocks=numbers[key],
                                   recomputes=(Recompute.NONE, Recompute.FULL))
            result = _solve_ranges(problem, cutoff_s=cutoff)
            numbers[("range result", layout, global_batch)] = (cutoff, result)
            visited += 1
        _keep(best, layout, result, progress, done, len(kept))
        done += 1
    return _searched(best, visited=visited, pruned=len(layouts) - len(kept), layouts=len(layouts), ep_bounds=ep_bounds)


def _kept_numbers(ct: CompiledTable, hw, seq_len: int) -> dict:
    """The block numbers and table bounds (`ranges.table_bound`) a mixed stack's search reuses over plans (a
    re-plan at another global batch needs the same ones), kept in `ct.memo` for the last two (device, sequence
    length) pairs."""
    kept = ct.memo.setdefault("range numbers", {})
    key = (hw, seq_len)
    if key not in kept:
        while len(kept) >= 2:
            kept.pop(next(iter(kept)))
        kept[key] = {}
    return kept[key]


def _priced_layouts(ct: CompiledTable, hw, layouts) -> list[Layout]:
    """The resolved `layouts` a mixed stack's search prices (`_priced_layout`); of the planner's candidates a part at
    a time, kept in `ct.memo` per part object (the same in every plan of the process: `bounds.layout_codes` then
    reads each part's codes once), less the layouts priced exactly as a twin the candidates hold too
    (`Layout.priced_twin`: below ZeRO-3 an fp8 recipe's prices as tensorwise, and never beats it). A part's twins
    are those of another part here: `candidate_layouts` makes each recipe's part of a (mesh, micro-batch) from the
    same options, in the same order, so the first layouts stand for the parts."""
    parts = getattr(layouts, "parts", None)
    if parts is None:
        return [cost.resolved(lay, hw) for lay in layouts if _priced_layout(ct, lay)]
    kept, entries = ct.memo.setdefault(("priced parts", hw), {}), []
    for part in parts:
        entry = kept.get(id(part))
        if entry is None or entry[0] is not part:  # (held here, so its id is not reused)
            priced = tuple(cost.resolved(lay, hw) for lay in part if _priced_layout(ct, lay))
            twin = priced[0].priced_twin() if priced else None
            entry = kept[id(part)] = (part, priced, twin if priced and twin is not priced[0] else None,
                                      tuple(lay for lay in priced if lay.priced_twin() is lay))
        entries.append(entry)
    firsts = {priced[0] for _, priced, _, _ in entries if priced}
    return CandidateLayouts([alone if twin in firsts else priced for _, priced, twin, alone in entries],
                            precision=layouts.precision)


def _priced_layout(ct: CompiledTable, layout: Layout) -> bool:
    """Whether the planner searches `layout` for `ct`: every layout of a one-kind model; of a mixed stack those
    its per-kind tables price (`cost.mixed_violation`) with one model chunk per rank (a rank of an interleaved
    pipeline holds no one layer range)."""
    return not ct.kinds or (layout.virtual_stages == 1 and mixed_violation(ct, layout) is None)


def _priced_mesh(ct: CompiledTable, mesh, *, cp: bool = True) -> bool:
    """Whether a mixed stack's per-kind tables price `mesh` (`cost.mixed_violation`), kept in `ct.memo`; `cp` False:
    and it has no cp."""
    key = ("priced mesh", mesh)
    if key not in ct.memo:
        ct.memo[key] = mixed_violation(ct, Layout(mesh=mesh)) is None
    return ct.memo[key] and (cp or mesh.cp == 1)


def _all_sequence_parallel(problem: MeshProblem, a: Assignment) -> bool:
    """Whether every stage of a layout whose stages choose their sequence parallelism took it: the layout
    with sequence parallelism everywhere runs (and prices lower) that plan, its boundaries carrying the shard."""
    return "sequence_parallel" in problem.layout.stage_choices and all(
        problem.variants[a.variant_of(i)].sequence_parallel for i in range(problem.pp))


def _even(problem: MeshProblem) -> Assignment:
    stages = even_stages(problem.layers, problem.pp) if problem.pp <= problem.layers else ()
    layers = tuple(st.layers for st in stages) or (problem.layers,) + (0,) * (problem.pp - 1)
    return problem.assignment(layers, [0] * problem.pp)


def solve(spec, hw, *, devices: int, global_batch: int, seq_len: int, time_limit_s: float = 10.0,
          progress: Progress | None = None, table=None, fingerprint: str | None = None,
          moe_imbalance: float = 1.0) -> Plan:
    """The fastest plan that fits (docs/modules/solve.md). `hw`: a profile or its name;
    `table`: a CostTable / CompiledTable already built for `spec` (built here when None);
    `time_limit_s`: CP-SAT's deterministic-time budget per layout (`solve_mesh`);
    `fingerprint`: the model's, when the caller has it (else built from `spec` on meta);
    `moe_imbalance`: the busiest expert's load over the mean, for a mixture of experts (passes/cost/moe_cost.py)."""
    from autoshard.hardware import load_hardware
    from autoshard.passes.capture.shapes import build_cost_table

    for name, value in (("devices", devices), ("global_batch", global_batch), ("seq_len", seq_len)):
        if not is_positive_int(value):
            raise InvalidConfigError(f"{name} must be a positive integer, got {value!r}")
    hw = load_hardware(hw)
    t0 = time.perf_counter()
    offload = hw.host_link_bandwidth is not None and hw.host_memory_bandwidth is not None
    mixed = compile_table(table, spec) if table is not None else None
    mixed = mixed if mixed is not None and mixed.kinds else None

    def candidates(cp: bool) -> CandidateLayouts:  # every layout concrete; `cp` False: a mixed stack's without cp
        meshes = functools.partial(_priced_mesh, mixed, cp=cp) if mixed is not None else None
        parts = [part for precision, recipe in planner_precisions(hw)
                 for part in candidate_layouts(spec, devices=devices, global_batch=global_batch, seq_len=seq_len,
                                               precision=precision, fp8_recipe=recipe, offload=offload,
                                               moe_imbalance=moe_imbalance, meshes=meshes).parts]
        return CandidateLayouts(parts, precision=resolve_precision(Precision.AUTO, hw))

    # a mixed stack's cp layouts (four in five of its layouts) only where none without cp fits: their bounds
    # alone took seconds (bench/bench_mixed_plan.py: DeepSeek-V3 on 1024 H100, 2.8 s a plan with them 11 s)
    layouts = candidates(cp=mixed is None)
    if not layouts:
        raise InvalidConfigError(
            f"no valid layout of {devices} devices for {spec.name}: tp must divide the heads ({spec.heads}), "
            f"pp <= layers ({spec.layers}), dp x micro-batch must divide the global batch ({global_batch}); "
            "change the device count or the global batch")
    ct = compile_table(table if table is not None else build_cost_table(spec, kernels=hw.kernels), spec)
    result = search(ct, hw, global_batch=global_batch, seq_len=seq_len, layouts=layouts,
                    time_limit_s=time_limit_s, progress=progress)
    if not result.found and mixed is not None:
        layouts = candidates(cp=True)
        result = search(ct, hw, global_batch=global_batch, seq_len=seq_len, layouts=layouts,
                        time_limit_s=time_limit_s, progress=progress)
    if not result.found:
        raise _infeasible(ct, hw, spec, layouts, devices=devices, global_batch=global_batch, seq_len=seq_len)
    return _plan(ct, hw, spec, result, devices=devices, global_batch=global_batch, seq_len=seq_len,
                 solve_s=time.perf_counter() - t0, fingerprint=fingerprint)


def _infeasible(ct, hw, spec, layouts, *, devices, global_batch, seq_len) -> InfeasiblePlanError:
    top = {}  # mesh -> the highest ZeRO level searched with it (ZeRO-2 only where pp = 1): its least memory
    for lay in layouts:
        top[lay.mesh] = max(top.get(lay.mesh, 0), lay.zero)
    # without data parallelism ZeRO shards nothing (ZeRO-3 only adds its gather buffer): every level there
    small = [lay for lay in layouts if lay.micro_batch == 1 and _priced_layout(ct, lay)
             and (lay.zero == top[lay.mesh] or lay.mesh.dp * lay.mesh.cp * lay.mesh.ep == 1)]
    best, where = math.inf, None
    for lay in small:
        need = min_peak_bytes(mesh_problem(ct, hw, lay, global_batch=global_batch, seq_len=seq_len))
        if need < best:
            best, where = need, lay
    cap = hw.memory_bytes
    return InfeasiblePlanError(
        f"{spec.name} fits no layout on {devices} x {hw.name}: binding constraint is memory per device; "
        f"the smallest plan ({where.mesh}, ZeRO-{where.zero}, micro-batch 1, recompute per stage) needs "
        f"{best / 1e9:.3g} GB but the device has {cap / 1e9:.3g} GB, {(best - cap) / 1e9:.3g} GB "
        f"({100 * (best / cap - 1):.0f}%) too much; use more devices or a device with more memory")


def _predict(ct, hw, spec, cand: Candidate, *, global_batch: int, seq_len: int) -> dict:
    """Predicted figures of a solved layout (`predict`)."""
    return predict(ct, hw, spec, cand.layout, cand.result.assignment, global_batch=global_batch, seq_len=seq_len)


def predict(ct, hw, spec, layout: Layout, a: Assignment, *, global_batch: int, seq_len: int) -> dict:
    """Predicted figures of `layout` with stage assignment `a` (layers, recompute level and variant per
    pipeline rank) from `cost.estimate(stages=)`: what a plan reports, and what `autoshard price` reports
    of a layout given by hand (engines/training_run.py), so both agree. With one recompute
    level on every stage they are estimate's own; with mixed levels (which estimate prices with
    one level) step time and memory come from the per-stage tables, the breakdown from estimate
    run at the bottleneck stage's level."""
    problem = mesh_problem(ct, hw, layout, global_batch=global_batch, seq_len=seq_len)
    ev = evaluate(problem, a)
    slow = max(range(len(ev.stage_s)), key=lambda i: ev.stage_s[i])
    variants = stage_variants(layout)
    slow_layout = replace(variants[a.variant_of(slow)], recompute=a.recompute[slow])
    est = cost.estimate(ct, spec, hw, slow_layout, global_batch=global_batch, seq_len=seq_len, stages=a.stages())
    uniform = len(set(a.recompute)) == 1 and len({a.variant_of(i) for i in range(len(a.layers))}) == 1 and not (
        "sequence_parallel" in layout.stage_choices and slow_layout.sequence_parallel)
    step = est.step_time_s if uniform else ev.step_s
    tokens = global_batch * seq_len
    # block recompute (an engine's command line, never a plan) is priced by estimate alone: the planner's
    # per-stage tables hold one recompute level per stage
    block = bool(layout.recompute_layers)
    if block and not uniform:
        raise InvalidConfigError("block recompute with per-stage recompute levels or layer choices: give one level "
                                 "and one choice for every stage")
    stage_bytes = [g * 1e9 for g in est.stage_memory_gb] if block else ev.stage_bytes
    return {
        "step_time_s": step, "tokens_per_s": tokens / step, "mfu": est.mfu * est.step_time_s / step,
        "memory_gb": (est.memory_gb if uniform else ev.peak_bytes / 1e9),
        "stage_memory_gb": [b / 1e9 for b in stage_bytes], "stage_time_s": list(est.stage_times_s if block else ev.stage_s),
        "microbatches": problem.microbatches, "time_breakdown_s": est.time.as_dict(),
        "memory_breakdown_gb": est.memory.as_gb(), "fits": est.fits if block else ev.peak_bytes <= hw.memory_bytes,
        "source": "cost.estimate(stages=)" if uniform else "cost component tables (per-stage recompute / strategy)",
        **({"layer_kinds": ranges.kind_breakdown(ct, hw, layout, a, global_batch=global_batch, seq_len=seq_len)}
           if ct.kinds else {}),
    }


def _why(win: dict, other: dict) -> str:
    diffs = {k: other["time_breakdown_s"].get(k, 0.0) - v for k, v in win["time_breakdown_s"].items()}
    k = max(diffs, key=lambda x: diffs[x])
    return f"{k.replace('_', ' ')} costs {diffs[k]:.3g} s more per step on the runner-up"


def _other_eps(ct, hw, spec, result: SearchResult, ep: int, pred: dict, *, global_batch: int,
               seq_len: int) -> list[dict]:
    """Per expert-parallel size the planner searched besides `ep`: the best plan it solved with it
    (mesh, step time and the time term that costs it most against the winner), or why it solved
    none (its layouts' step-time lower bound was no better than the plans found, or none fit)."""
    out = []
    for other, bound_s, peak in result.ep_bounds:
        if other == ep:
            continue
        solved = [c for c in result.found if c.layout.mesh.ep == other]
        if solved:
            ru = _predict(ct, hw, spec, solved[0], global_batch=global_batch, seq_len=seq_len)
            out.append({"ep": other, "mesh": solved[0].layout.mesh.as_dict(), "step_time_s": ru["step_time_s"],
                        "why": _why(pred, ru)})
        elif math.isinf(bound_s):
            out.append({"ep": other, "why": f"no layout fits: each needs at least {peak / 1e9:.3g} GB per device "
                                            f"({hw.memory_bytes / 1e9:.3g} GB there)"})
        else:
            out.append({"ep": other, "why": f"not solved: its layouts' step-time lower bound, {bound_s:.4g} s, is "
                                            f"no better than this plan's {pred['step_time_s']:.4g} s"})
    return out


def _plan(ct, hw, spec, result: SearchResult, *, devices, global_batch, seq_len, solve_s, fingerprint) -> Plan:
    from autoshard.passes.capture.shipped import fingerprint_spec
    from autoshard.rules.sharding import block_placements

    found = result.found
    best = found[0]
    pred = _predict(ct, hw, spec, best, global_batch=global_batch, seq_len=seq_len)
    a, layout = best.result.assignment, best.layout
    others = [c for c in found[1:] if c.layout.mesh != layout.mesh]
    solver = {"status": best.result.status, "gap": best.result.gap, "solve_time_s": solve_s,
              "layouts": result.layouts, "layouts_solved": result.visited,
              "layouts_pruned_by_memory": result.pruned_memory, "objective_s": best.result.step_s}
    if others:
        ru = _predict(ct, hw, spec, others[0], global_batch=global_batch, seq_len=seq_len)
        solver["runner_up"] = {"mesh": others[0].layout.mesh.as_dict(), "zero": others[0].layout.zero,
                               "micro_batch": others[0].layout.micro_batch, "step_time_s": ru["step_time_s"],
                               "why": _why(pred, ru)}
    if spec.is_moe:  # why this ep (show)
        solver["other_eps"] = _other_eps(ct, hw, spec, result, layout.mesh.ep, pred,
                                         global_batch=global_batch, seq_len=seq_len)
    rec = a.recompute[0] if len(set(a.recompute)) == 1 else max(a.recompute, key=list(Recompute).index)
    stages = chunk_stages(a, layout)
    sp, strategies = chunk_strategies(a, layout)
    plan = Plan(model=spec.name, fingerprint=fingerprint or fingerprint_spec(spec), hardware=hw.name, devices=devices,
                global_batch=global_batch, seq_len=seq_len, mesh=layout.mesh, micro_batch=layout.micro_batch,
                zero=layout.zero, offload_optimizer=layout.offload_optimizer, recompute=rec, schedule=layout.schedule,
                # fp8 where the planner chose it; else the device's default (AUTO, as it was searched)
                **({"precision": layout.precision, "fp8_recipe": layout.fp8_recipe}
                   if layout.precision is Precision.FP8 else {}),
                virtual_stages=layout.virtual_stages, sequence_parallel=sp, strategies=strategies, stages=stages,
                predicted=pred, solver=solver)
    return replace(plan, placements=block_placements(spec, tp=layout.mesh.tp, sequence_parallel=plan.sequence_parallel,
                                                     strategies=plan.strategies, stages=stages))


def chunk_strategies(a: Assignment, layout: Layout) -> tuple[bool | tuple[bool, ...], tuple]:
    """The plan's `sequence_parallel` and `strategies` for assignment `a`: with per-stage choices
    (`layout.stage_choices`) one value per model chunk, each chunk its rank's variant (a list whose
    entries agree collapses to one value, `ir.Plan`)."""
    if not layout.stage_choices:
        return layout.sequence_parallel, layout.strategies
    variants = stage_variants(layout)
    ranks = [stage_rank(i, pp=layout.mesh.pp, virtual_stages=layout.virtual_stages, schedule=layout.schedule)
             for i in range(layout.mesh.pp * layout.virtual_stages)]
    mine = [variants[a.variant_of(r)] for r in ranks]
    strategies = dict(layout.strategies)
    groups = [dict(v.strategies).get("groups", "split") for v in mine]
    if "groups" in layout.stage_choices and set(groups) != {"split"}:  # all split: the default, unnamed
        strategies["groups"] = groups
    return [v.sequence_parallel for v in mine], strategies


def chunk_stages(a: Assignment, layout: Layout) -> tuple[Stage, ...]:
    """The plan's stages: one per pipeline rank, or with v virtual stages the pp * v model chunks in
    model order, rank r's layers split as evenly as they go over its v chunks (ir.stage_rank
    places chunk i on its rank), each chunk at its rank's recompute level."""
    pp, v = layout.mesh.pp, layout.virtual_stages
    if v == 1:
        return a.stages()
    ranks = [stage_rank(i, pp=pp, virtual_stages=v, schedule=layout.schedule) for i in range(pp * v)]
    parts = {r: list(chunk_layers(n, rank=r, pp=pp, virtual_stages=v, schedule=layout.schedule))
             for r, n in enumerate(a.layers)}
    out, start = [], 0
    for i, r in enumerate(ranks):
        n = parts[r].pop(0)
        out.append(Stage(first_layer=start, end_layer=start + n, embed=i == 0, head=i == pp * v - 1,
                         recompute=a.recompute[r]))
        start += n
    return tuple(out)
