"""The CP-SAT planner: `solve(spec, hw, *, devices, global_batch, seq_len) -> Plan`.

This is the only module that imports OR-Tools.

Contract
  For every candidate layout (mesh DP x PP x TP x CP x EP = devices, micro-batch size, ZeRO
  level; `candidate_layouts`) one CP-SAT model decides together the contiguous assignment of
  the layers to the pipeline stages (the first stage also holds the embedding, the last the
  LM head and loss; uneven splits allowed, a first / last stage may hold no layer) and the
  recomputation level of every stage, minimising the step time of `passes/cost.py` (read off
  its component functions through `solve_model.mesh_problem`) subject to peak memory per
  device <= capacity on every stage. Layouts are visited by a lower bound on their step time
  (perfect pipeline balance, no recomputation, no exposed sync) and skipped once the bound
  reaches the best plan found. The op placements are the Megatron-LM ones the cost model
  prices (`strategies.block_placements`).
  Integers: seconds are converted once here to units of 1e-6 of the largest stage time.
  No layout fits -> `InfeasiblePlanError` naming the binding constraint (memory per device)
  and by how much the smallest plan misses.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Callable

from ortools.sat.python import cp_model

from autoshard.errors import InfeasiblePlanError, InvalidConfigError
from autoshard.ir import Mesh, Plan, Recompute
from autoshard.passes import cost
from autoshard.passes.cost import CompiledTable, Layout
from autoshard.passes.solve_model import Assignment, MeshProblem, evaluate, mesh_problem

_STATUS = {cp_model.OPTIMAL: "optimal", cp_model.FEASIBLE: "feasible", cp_model.INFEASIBLE: "infeasible",
           cp_model.MODEL_INVALID: "invalid", cp_model.UNKNOWN: "unknown"}
Progress = Callable[[int, int, float], None]  # (layouts visited, layouts in total, best step so far)


@dataclass(frozen=True, slots=True, kw_only=True)
class MeshResult:
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


def solve_mesh(problem: MeshProblem, *, time_limit_s: float = 10.0, hint: Assignment | None = None,
               workers: int = 1) -> MeshResult:
    """The fastest assignment of `problem` that fits (CP-SAT, optimal within the time limit)."""
    p, L, R = problem.pp, problem.layers, len(problem.recomputes)
    unit = max(max(max(row) for row in rows) for rows in problem.time_s) * 1e-6 or 1.0
    m = cp_model.CpModel()
    n = [m.NewIntVar(problem.min_layers(i), L, f"n{i}") for i in range(p)]
    m.Add(sum(n) == L)
    times, tails = [], []
    for i in range(p):
        allowed = [r * (L + 1) + k for r in range(R) for k in range(problem.min_layers(i), L + 1)
                   if problem.mem_bytes[i][r][k] <= problem.capacity_bytes]
        if not allowed:
            return MeshResult(status="infeasible", assignment=None, step_s=math.inf, bound_s=math.inf, wall_s=0.0)
        idx = m.NewIntVarFromDomain(cp_model.Domain.FromValues(allowed), f"idx{i}")
        r = m.NewIntVar(0, R - 1, f"r{i}")
        m.Add(idx == r * (L + 1) + n[i])
        table = [round(t / unit) for row in problem.time_s[i] for t in row]
        t = m.NewIntVar(0, max(table), f"t{i}")
        m.AddElement(idx, table, t)
        tail_table = [round(x / unit) for x in problem.tail_s[i]]
        tail = m.NewIntVar(0, max(tail_table), f"tail{i}")
        m.AddElement(n[i], tail_table, tail)
        times.append((t, r))
        tails.append(tail)
    t_max = m.NewIntVar(0, max(round(max(max(row) for row in rows) / unit) for rows in problem.time_s), "t_max")
    m.AddMaxEquality(t_max, [t for t, _ in times])
    tail_max = m.NewIntVar(0, max(max(round(x / unit) for x in row) for row in problem.tail_s), "tail_max")
    m.AddMaxEquality(tail_max, tails)
    m.Minimize((problem.microbatches - 1) * t_max + sum(t for t, _ in times) + tail_max)
    if hint is not None:
        for i in range(p):
            m.AddHint(n[i], hint.layers[i])
            m.AddHint(times[i][1], problem.recomputes.index(hint.recompute[i]))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.05, float(time_limit_s))
    solver.parameters.num_workers = max(1, workers)
    status = solver.Solve(m)
    name = _STATUS.get(status, "unknown")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return MeshResult(status=name, assignment=None, step_s=math.inf, bound_s=math.inf, wall_s=solver.WallTime())
    a = Assignment(layers=tuple(solver.Value(v) for v in n),
                   recompute=tuple(problem.recomputes[solver.Value(r)] for _, r in times))
    step = evaluate(problem, a).step_s
    bound = min(step, solver.BestObjectiveBound() * unit)
    return MeshResult(status=name, assignment=a, step_s=step, bound_s=bound, wall_s=solver.WallTime())


def min_peak_bytes(problem: MeshProblem) -> float:
    """The smallest peak memory per device over every assignment (binary search on the cap)."""
    p, L = problem.pp, problem.layers

    def fits(cap: float) -> bool:
        # stages are independent given their layer counts: can the layers be spread so each fits?
        lo = [min((k for k in range(problem.min_layers(i), L + 1)
                   if any(row[k] <= cap for row in problem.mem_bytes[i])), default=None) for i in range(p)]
        hi = [max((k for k in range(problem.min_layers(i), L + 1)
                   if any(row[k] <= cap for row in problem.mem_bytes[i])), default=None) for i in range(p)]
        return None not in lo and sum(lo) <= L <= sum(hi)

    values = sorted({v for rows in problem.mem_bytes for row in rows for v in row})
    left, right = 0, len(values) - 1
    while left < right:
        mid = (left + right) // 2
        left, right = (left, mid) if fits(values[mid]) else (mid + 1, right)
    return values[left]


# -- the search over layouts -------------------------------------------------------------------
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(spec, *, devices: int, global_batch: int, seq_len: int,
                      zeros: tuple[int, ...] = (0, 1, 2, 3), micro_batches: tuple[int, ...] = (1, 2, 4, 8)):
    """Every (mesh, micro-batch, ZeRO) the runtime can run: tp divides the heads (and Mamba-2's
    groups), cp gives each rank two equal causal chunks, pp <= layers, dp x micro-batch divides
    the global batch. EP stays 1 (dense models)."""
    out = []
    for tp in _divisors(devices):
        if spec.heads % tp or (spec.groups and spec.groups % tp):
            continue
        for cp in _divisors(devices // tp):
            if seq_len % (2 * cp) and cp > 1:
                continue
            for pp in _divisors(devices // (tp * cp)):
                dp = devices // (tp * cp * pp)
                if pp > spec.layers or global_batch % dp:
                    continue
                for mb in micro_batches:
                    if global_batch % (dp * mb):
                        continue
                    for z in zeros:
                        out.append(Layout(mesh=Mesh(dp=dp, pp=pp, tp=tp, cp=cp), micro_batch=mb, zero=z))
    return out


def lower_bound(ct: CompiledTable, hw, layout: Layout, *, global_batch: int, seq_len: int) -> float:
    """A step time no plan of `layout` beats: all work W (no recompute) perfectly balanced,
    W + (m - 1) * max(W / pp, heaviest single block)."""
    kinds = (cost.BlockKind.EMBED, cost.BlockKind.LAYER, cost.BlockKind.HEAD)
    bt = {k: cost.block_time(ct, hw, replace(layout, recompute=Recompute.NONE), k, seq_len=seq_len) for k in kinds}
    mesh = layout.mesh
    p2p = cost.p2p_time(ct, hw, layout, seq_len=seq_len)
    work = sum(bt[k].total_s for k in kinds) + (ct.spec.layers - 1) * bt[cost.BlockKind.LAYER].total_s
    work += mesh.pp * p2p
    m = global_batch // (mesh.dp * layout.micro_batch)
    heaviest = max(bt[k].total_s for k in kinds) + p2p
    return work + (m - 1) * max(work / mesh.pp, heaviest)


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    layout: Layout
    result: MeshResult


def search(ct: CompiledTable, hw, *, devices: int, global_batch: int, seq_len: int, time_limit_s: float = 30.0,
           progress: Progress | None = None, layouts: list[Layout] | None = None) -> list[Candidate]:
    """Solve layouts in order of their lower bound until the bound passes the best plan;
    returns every solved layout's result, best first."""
    spec = ct.spec
    layouts = layouts if layouts is not None else candidate_layouts(
        spec, devices=devices, global_batch=global_batch, seq_len=seq_len)
    memo: dict = {}  # the bound ignores ZeRO: one per (mesh, micro-batch)
    for lay in layouts:
        key = (lay.mesh, lay.micro_batch)
        if key not in memo:
            memo[key] = lower_bound(ct, hw, lay, global_batch=global_batch, seq_len=seq_len)
    bounds = sorted(((memo[(lay.mesh, lay.micro_batch)], k, lay) for k, lay in enumerate(layouts)),
                    key=lambda x: (x[0], x[1]))
    start, best, found = time.perf_counter(), math.inf, []
    for visited, (bound, _, layout) in enumerate(bounds):
        if bound >= best * (1 - 1e-9):
            break
        left = time_limit_s - (time.perf_counter() - start)
        if left <= 0 and found:
            break
        problem = mesh_problem(ct, hw, layout, global_batch=global_batch, seq_len=seq_len)
        result = solve_mesh(problem, time_limit_s=max(0.2, min(left, time_limit_s / 4)), hint=_even(problem))
        if result.assignment is not None:
            found.append(Candidate(layout=layout, result=result))
            best = min(best, result.step_s)
        if progress is not None:
            progress(visited + 1, len(bounds), best)
    return sorted(found, key=lambda c: c.result.step_s)


def _even(problem: MeshProblem) -> Assignment:
    stages = cost.default_stages(problem.layers, problem.pp) if problem.pp <= problem.layers else ()
    layers = tuple(st.layers for st in stages) or (problem.layers,) + (0,) * (problem.pp - 1)
    return Assignment(layers=layers, recompute=(problem.recomputes[0],) * problem.pp)


def solve(spec, hw, *, devices: int, global_batch: int, seq_len: int, time_limit_s: float = 30.0,
          progress: Progress | None = None, table=None) -> Plan:
    """The fastest plan that fits (see the module docstring). `hw`: a profile or its name;
    `table`: a CostTable / CompiledTable already built for `spec` (built here when None)."""
    from autoshard.hardware import load_hardware
    from autoshard.passes.shapes import build_cost_table

    for name, value in (("devices", devices), ("global_batch", global_batch), ("seq_len", seq_len)):
        if not isinstance(value, int) or value <= 0:
            raise InvalidConfigError(f"{name} must be a positive integer, got {value!r}")
    hw = load_hardware(hw)
    t0 = time.perf_counter()
    ct = cost.compile_table(table if table is not None else build_cost_table(spec), spec)
    layouts = candidate_layouts(spec, devices=devices, global_batch=global_batch, seq_len=seq_len)
    if not layouts:
        raise InvalidConfigError(
            f"no valid layout of {devices} devices for {spec.name}: tp must divide the heads ({spec.heads}), "
            f"pp <= layers ({spec.layers}), dp x micro-batch must divide the global batch ({global_batch}); "
            "change the device count or the global batch")
    found = search(ct, hw, devices=devices, global_batch=global_batch, seq_len=seq_len,
                   time_limit_s=time_limit_s, progress=progress, layouts=layouts)
    if found and not any(c.layout.mesh != found[0].layout.mesh for c in found):
        found += _runner_up(ct, hw, found[0].layout.mesh, layouts, global_batch=global_batch, seq_len=seq_len)
    if not found:
        raise _infeasible(ct, hw, spec, layouts, devices=devices, global_batch=global_batch, seq_len=seq_len)
    return _plan(ct, hw, spec, found, devices=devices, global_batch=global_batch, seq_len=seq_len,
                 solve_s=time.perf_counter() - t0, layouts=len(layouts))


def _runner_up(ct, hw, mesh: Mesh, layouts, *, global_batch: int, seq_len: int) -> list[Candidate]:
    """The best plan on another mesh (for `show`'s "why this mesh"): next layouts by bound."""
    rest = [lay for lay in layouts if lay.mesh != mesh]
    rest.sort(key=lambda lay: lower_bound(ct, hw, lay, global_batch=global_batch, seq_len=seq_len))
    for lay in rest[:8]:
        found = search(ct, hw, devices=mesh.size, global_batch=global_batch, seq_len=seq_len, time_limit_s=2.0,
                       layouts=[x for x in rest if x.mesh == lay.mesh])
        if found:
            return found[:1]
    return []


def _infeasible(ct, hw, spec, layouts, *, devices, global_batch, seq_len) -> InfeasiblePlanError:
    small = [lay for lay in layouts if lay.zero == max(x.zero for x in layouts) and lay.micro_batch == 1]
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
    """Predicted figures of a solved layout from `cost.estimate(stages=)`. With one recompute
    level on every stage they are estimate's own; with mixed levels (which estimate prices with
    one level) step time and memory come from the per-stage tables, the breakdown from estimate
    run at the bottleneck stage's level."""
    a = cand.result.assignment
    problem = mesh_problem(ct, hw, cand.layout, global_batch=global_batch, seq_len=seq_len)
    ev = evaluate(problem, a)
    slow = max(range(len(ev.stage_s)), key=lambda i: ev.stage_s[i])
    layout = replace(cand.layout, recompute=a.recompute[slow])
    est = cost.estimate(ct, spec, hw, layout, global_batch=global_batch, seq_len=seq_len, stages=a.stages())
    uniform = len(set(a.recompute)) == 1
    step = est.step_time_s if uniform else ev.step_s
    tokens = global_batch * seq_len
    return {
        "step_time_s": step, "tokens_per_s": tokens / step, "mfu": est.mfu * est.step_time_s / step,
        "memory_gb": (est.memory_gb if uniform else ev.peak_bytes / 1e9),
        "stage_memory_gb": [b / 1e9 for b in ev.stage_bytes], "stage_time_s": list(ev.stage_s),
        "microbatches": problem.microbatches, "time_breakdown_s": est.time.as_dict(),
        "memory_breakdown_gb": est.memory.as_gb(), "fits": ev.peak_bytes <= hw.memory_bytes,
        "source": "cost.estimate(stages=)" if uniform else "cost component tables (mixed recompute)",
    }


def _why(win: dict, other: dict) -> str:
    diffs = {k: other["time_breakdown_s"].get(k, 0.0) - v for k, v in win["time_breakdown_s"].items()}
    k = max(diffs, key=lambda x: diffs[x])
    return f"{k.replace('_', ' ')} costs {diffs[k]:.3g} s more per step on the runner-up"


def _plan(ct, hw, spec, found: list[Candidate], *, devices, global_batch, seq_len, solve_s, layouts) -> Plan:
    from autoshard.fingerprint import fingerprint_spec
    from autoshard.passes.strategies import block_placements

    best = found[0]
    pred = _predict(ct, hw, spec, best, global_batch=global_batch, seq_len=seq_len)
    a, layout = best.result.assignment, best.layout
    others = [c for c in found[1:] if c.layout.mesh != layout.mesh]
    solver = {"status": best.result.status, "gap": best.result.gap, "solve_time_s": solve_s,
              "layouts": layouts, "layouts_solved": len(found), "objective_s": best.result.step_s}
    if others:
        ru = _predict(ct, hw, spec, others[0], global_batch=global_batch, seq_len=seq_len)
        solver["runner_up"] = {"mesh": others[0].layout.mesh.as_dict(), "zero": others[0].layout.zero,
                               "micro_batch": others[0].layout.micro_batch, "step_time_s": ru["step_time_s"],
                               "why": _why(pred, ru)}
    rec = a.recompute[0] if len(set(a.recompute)) == 1 else max(a.recompute, key=list(Recompute).index)
    return Plan(model=spec.name, fingerprint=fingerprint_spec(spec), hardware=hw.name, devices=devices,
                global_batch=global_batch, seq_len=seq_len, mesh=layout.mesh, micro_batch=layout.micro_batch,
                zero=layout.zero, recompute=rec, stages=a.stages(),
                placements=block_placements(spec, tp=layout.mesh.tp), predicted=pred, solver=solver)
