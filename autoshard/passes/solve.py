"""The CP-SAT planner (the only module that imports OR-Tools): `solve` and one mesh's model.

Contract: `solve_mesh(problem, time_limit_s=...) -> MeshResult` decides together the option of
every mesh-wide `Choice` (op-group placements, ZeRO level), the number of layers of each
pipeline stage and each stage's recomputation, minimising the step time of
`solve_model.evaluate` under the per-stage memory limit. CP-SAT needs integers: seconds and
bytes are converted once here, times to `time_unit` (about 1e-5 of one layer's time),
bytes to `byte_unit` (1e-6 of the capacity, rounded up so a plan that fits in integers
fits in floats). Products of a stage's layer count with a per-layer cost that depends on
decisions are exact `AddMultiplicationEquality` constraints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ortools.sat.python import cp_model

from autoshard.passes.solve_model import Assignment, Linear, MeshProblem

_STATUS = {cp_model.OPTIMAL: "optimal", cp_model.FEASIBLE: "feasible", cp_model.INFEASIBLE: "infeasible",
           cp_model.MODEL_INVALID: "invalid", cp_model.UNKNOWN: "unknown"}


@dataclass(frozen=True, slots=True, kw_only=True)
class MeshResult:
    status: str  # optimal / feasible / infeasible / unknown
    assignment: Assignment | None
    objective_s: float  # CP-SAT's objective converted back (integer-rounded costs)
    bound_s: float
    wall_s: float

    @property
    def gap(self) -> float:
        return 0.0 if self.objective_s <= 0 else max(0.0, (self.objective_s - self.bound_s) / self.objective_s)


class _Builder:
    """Turns `Linear` forms into integer CP-SAT expressions over one-hot option booleans."""

    def __init__(self, problem: MeshProblem, *, time_unit: float, byte_unit: float) -> None:
        self.p, self.m = problem, cp_model.CpModel()
        self.time_unit, self.byte_unit = time_unit, byte_unit
        self.x = {}
        for c in problem.choices:
            lits = {o: self.m.NewBoolVar(f"{c.name}={o}") for o in c.options}
            self.m.AddExactlyOne(lits.values())
            self.x.update({(c.name, o): v for o, v in lits.items()})
        self.pairs = {}
        self.domain = {}  # var index -> (lo, hi): kept here, not read back from the proto

    def int_var(self, lo: int, hi: int, name: str):
        v = self.m.NewIntVar(lo, hi, name)
        self.domain[v.Index()] = (lo, hi)
        return v

    def _pair(self, a, b):
        key = (a, b)
        if key not in self.pairs:
            v = self.m.NewBoolVar(f"{a}&{b}")
            self.m.AddBoolAnd([self.x[a], self.x[b]]).OnlyEnforceIf(v)
            self.m.AddBoolOr([self.x[a].Not(), self.x[b].Not()]).OnlyEnforceIf(v.Not())
            self.pairs[key] = v
        return self.pairs[key]

    def ints(self, form: Linear, unit: float, up: bool) -> tuple[int, list[tuple[int, object]]]:
        r = math.ceil if up else round
        terms = [(int(r(c / unit)), self.x[o]) for o, c in form.terms]
        terms += [(int(r(c / unit)), self._pair(a, b)) for a, b, c in form.pairs]
        return int(r(form.const / unit)), [(k, v) for k, v in terms if k]

    def expr(self, form: Linear, unit: float, up: bool = False):
        const, terms = self.ints(form, unit, up)
        return const + sum(k * v for k, v in terms)

    def bounds(self, form: Linear, unit: float, up: bool = False) -> tuple[int, int]:
        const, terms = self.ints(form, unit, up)
        lo = const + sum(min(0, k) for k, _ in terms)
        hi = const + sum(max(0, k) for k, _ in terms)
        return lo, hi

    def per_stage(self, name: str, forms: dict, r_lits: dict, unit: float, up: bool):
        """Integer var equal to forms[r] for the recompute r taken by this stage."""
        bounds = [self.bounds(f, unit, up) for f in forms.values()]
        v = self.int_var(min(b[0] for b in bounds), max(b[1] for b in bounds), name)
        for r, f in forms.items():
            self.m.Add(v == self.expr(f, unit, up)).OnlyEnforceIf(r_lits[r])
        return v

    def times_n(self, name: str, n, value):
        """n * value for an integer layer count n and an integer var value (exact product)."""
        lo, hi = self.domain[value.Index()]
        nmax = self.p.layers
        prod = self.m.NewIntVar(min(0, lo * nmax), max(0, hi * nmax), name)
        self.m.AddMultiplicationEquality(prod, [n, value])
        return prod


def _units(problem: MeshProblem) -> tuple[float, float]:
    scale = max([abs(c) for f in problem.layer.time.values() for c in _coefs(f)] + [1e-12])
    return scale * 1e-5, problem.capacity_bytes * 1e-6


def _coefs(form: Linear) -> list[float]:
    return [form.const, *(c for _, c in form.terms), *(c for *_, c in form.pairs)]


def build(problem: MeshProblem, *, memory_limit: bool = True):
    """The CP-SAT model of `problem`: (builder, layer-count vars, recompute literals, objective, peak)."""
    tu, bu = _units(problem)
    b = _Builder(problem, time_unit=tu, byte_unit=bu)
    m, p, L = b.m, problem.pp, problem.layers
    lows = [L] if p == 1 else [0] + [1] * (p - 2) + [0]
    n = [m.NewIntVar(lows[i], L, f"n{i}") for i in range(p)]
    m.Add(sum(n) == L)
    rec = []
    for i in range(p):
        lits = {r: m.NewBoolVar(f"r{i}={r.value}") for r in problem.recomputes}
        m.AddExactlyOne(lits.values())
        rec.append(lits)
    layer_state = b.int_var(*b.bounds(problem.layer.state, bu, True), "layer_state")
    m.Add(layer_state == b.expr(problem.layer.state, bu, True))
    layer_sync = b.int_var(*b.bounds(problem.layer.sync, tu), "layer_sync")
    m.Add(layer_sync == b.expr(problem.layer.sync, tu))
    t_max = m.NewIntVar(0, 2**50, "t_max")
    s_max = m.NewIntVar(0, 2**50, "sync_max")
    mem_max = m.NewIntVar(0, 2**50, "mem_max")
    times = []
    for i in range(p):
        first, last, inflight = i == 0, i == p - 1, problem.inflight(i)
        t_layer = b.per_stage(f"tl{i}", dict(problem.layer.time), rec[i], tu, False)
        a_layer = b.per_stage(f"al{i}", dict(problem.layer.act), rec[i], bu, True)
        time = b.times_n(f"T{i}", n[i], t_layer) + (round(problem.p2p_s / tu) if p > 1 else 0)
        mem = b.times_n(f"S{i}", n[i], layer_state) + inflight * b.times_n(f"A{i}", n[i], a_layer)
        mem += math.ceil(problem.fixed_bytes / bu)
        sync = b.times_n(f"G{i}", n[i], layer_sync)
        for present, block, tag in ((first, problem.embed, "e"), (last, problem.head, "h")):
            if present:
                time += b.per_stage(f"bt{tag}{i}", dict(block.time), rec[i], tu, False)
                mem += b.expr(block.state, bu, True) + b.expr(block.peak, bu, True)
                mem += inflight * b.per_stage(f"ba{tag}{i}", dict(block.act), rec[i], bu, True)
                sync += b.expr(block.sync, tu)
        if memory_limit:
            m.Add(mem <= math.floor(problem.capacity_bytes / bu))
        m.Add(mem_max >= mem)
        m.Add(t_max >= time)
        m.Add(s_max >= sync)
        times.append(time)
    objective = (problem.microbatches - 1) * t_max + sum(times) + s_max
    return b, n, rec, objective, mem_max


def solve_mesh(problem: MeshProblem, *, time_limit_s: float = 10.0, workers: int = 1,
               hint: Assignment | None = None) -> MeshResult:
    """Optimal (or best within the time limit) assignment of one mesh's problem."""
    b, n, rec, objective, _ = build(problem)
    b.m.Minimize(objective)
    if hint is not None:
        _add_hint(b, n, rec, hint)
    solver = _solver(time_limit_s, workers)
    status = solver.Solve(b.m)
    name = _STATUS.get(status, "unknown")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return MeshResult(status=name, assignment=None, objective_s=math.inf, bound_s=math.inf,
                          wall_s=solver.WallTime())
    taken = {c: o for (c, o), v in b.x.items() if solver.Value(v)}
    assignment = Assignment(taken=taken, layers=tuple(solver.Value(v) for v in n),
                            recompute=tuple(next(r for r, lit in lits.items() if solver.Value(lit)) for lits in rec))
    tu = b.time_unit
    fixed = problem.fixed_s
    return MeshResult(status=name, assignment=assignment, objective_s=solver.ObjectiveValue() * tu + fixed,
                      bound_s=solver.BestObjectiveBound() * tu + fixed, wall_s=solver.WallTime())


def min_peak_bytes(problem: MeshProblem, *, time_limit_s: float = 5.0) -> float:
    """The smallest per-device peak memory any assignment reaches (ignores the capacity)."""
    b, _, _, _, mem_max = build(problem, memory_limit=False)
    b.m.Minimize(mem_max)
    solver = _solver(time_limit_s, 1)
    solver.Solve(b.m)
    return solver.BestObjectiveBound() * b.byte_unit


def _solver(time_limit_s: float, workers: int) -> cp_model.CpSolver:
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.05, float(time_limit_s))
    solver.parameters.num_search_workers = max(1, workers)
    return solver


def _add_hint(b: _Builder, n, rec, hint: Assignment) -> None:
    for (c, o), v in b.x.items():
        b.m.AddHint(v, hint.taken.get(c) == o)
    for i, k in enumerate(hint.layers):
        b.m.AddHint(n[i], k)
        for r, lit in rec[i].items():
            b.m.AddHint(lit, hint.recompute[i] == r)
