"""The planner on a mixed layer stack: its exact split search over layer ranges finds the optimum of every
contiguous split enumerated, its tables agree with estimate, and `solve` plans it."""

import itertools
from dataclasses import replace

import numpy as np
import pytest

from autoshard.hardware import load_hardware
from autoshard.ir import BlockKind, Mesh, Recompute
from autoshard.models.presets import get_spec
from autoshard.passes.capture.shapes import build_cost_table
from autoshard.passes.cost import cost
from autoshard.passes.cost.cost import Layout
from autoshard.passes.solve.planner import solve, solve_mesh
from autoshard.passes.solve.ranges import table_bound
from autoshard.passes.solve.solve_model import (Assignment, brute_force, evaluate, mesh_problem, stage_numbers,
                                                stage_splits)
from autoshard.passes.cost.compiled import compile_table
from autoshard.passes.cost.block import block_time


@pytest.fixture(scope="module")
def mixed():
    """llama-tiny's table as a stack of two kinds: "b" is its layer with three times the FLOPs and twice the
    saved bytes (a heavier kind), laid out a a b a b b a (7 layers)."""
    spec = replace(get_spec("llama-tiny"), layers=7)
    table = build_cost_table(get_spec("llama-tiny"))
    embed, layer, head = (table.block(k) for k in (BlockKind.EMBED, BlockKind.LAYER, BlockKind.HEAD))
    heavy = replace(layer, name="b", params=layer.params * 2, nodes=tuple(
        replace(n, flops=n.flops * 3, saved_bytes=n.saved_bytes * 2) for n in layer.nodes))
    sequence = ("a", "a", "b", "a", "b", "b", "a")
    mixed = replace(table, blocks=(embed, replace(layer, name="a", count=4), replace(heavy, count=3), head),
                    layer_kinds=sequence)
    return spec, compile_table(mixed, spec)


def _tight(hw, problem, fraction):
    """A device whose memory sits `fraction` of the way between the smallest and largest finite stage."""
    finite = problem.mem_bytes[problem.mem_bytes < float("inf")]
    return replace(hw, memory_bytes=float(finite.min() + fraction * (finite.max() - finite.min())))


@pytest.mark.parametrize("pp, dp, zero, schedule, fraction", [
    (2, 4, 1, "1f1b", 1.0), (3, 1, 0, "1f1b", 0.4), (4, 2, 2, "1f1b", 0.3), (4, 1, 1, "gpipe", 0.6),
    (3, 2, 1, "zero-bubble", 0.5), (5, 1, 0, "1f1b", 0.2), (1, 8, 1, "1f1b", 1.0)])
def test_range_search_finds_the_brute_force_optimum(mixed, pp, dp, zero, schedule, fraction):
    """Every contiguous split of the 7 layers over the stages at every recompute level per stage, enumerated,
    against the planner's exact search, under memory that rules some of them out."""
    spec, ct = mixed
    layout = Layout(mesh=Mesh(dp=dp, pp=pp), micro_batch=1, zero=zero, schedule=schedule)
    kw = dict(global_batch=16, seq_len=64)
    roomy = mesh_problem(ct, load_hardware("cpu"), layout, **kw)
    hw = _tight(load_hardware("cpu"), roomy, fraction)
    problem = mesh_problem(ct, hw, layout, **kw)
    assert problem.sequence == (0, 0, 1, 0, 1, 1, 0) and problem.recomputes == (Recompute.NONE, Recompute.FULL)
    best = brute_force(problem)
    got = solve_mesh(problem)
    if best is None:
        assert got.assignment is None and got.status == "infeasible"
        return
    assert got.status == "optimal"
    assert evaluate(problem, got.assignment).peak_bytes <= hw.memory_bytes
    assert got.step_s == pytest.approx(best[1].step_s, rel=1e-9)


@pytest.mark.parametrize("pp, dp, zero, schedule, fraction", [
    (2, 4, 1, "1f1b", 1.0), (3, 1, 0, "1f1b", 0.4), (4, 2, 2, "1f1b", 0.3), (4, 1, 1, "gpipe", 0.6),
    (3, 2, 1, "zero-bubble", 0.5), (5, 1, 0, "1f1b", 0.2), (1, 8, 1, "1f1b", 1.0)])
def test_table_bound_is_below_every_split(mixed, pp, dp, zero, schedule, fraction):
    """The bound read before a layout's tables are built is at most the step of every split that fits (the
    brute-force optimum), and where it reaches a cutoff the search over the tables finds nothing below it."""
    spec, ct = mixed
    layout = cost.resolved(Layout(mesh=Mesh(dp=dp, pp=pp), micro_batch=1, zero=zero, schedule=schedule),
                           load_hardware("cpu"))
    kw = dict(global_batch=16, seq_len=64)
    hw = _tight(load_hardware("cpu"), mesh_problem(ct, load_hardware("cpu"), layout, **kw), fraction)
    recomputes = (Recompute.NONE, Recompute.FULL)
    blocks = stage_numbers(ct, hw, layout, seq_len=64, recomputes=recomputes)
    bound = table_bound(ct, hw, layout, blocks, **kw)
    problem = mesh_problem(ct, hw, layout, blocks=blocks, recomputes=recomputes, **kw)
    best = brute_force(problem)
    if best is None:
        assert bound == float("inf")
        return
    assert bound <= best[1].step_s
    assert solve_mesh(problem, cutoff_s=bound).assignment is None


@pytest.mark.parametrize("pp, dp, tp, zero, sp", [
    (1, 8, 1, 0, False), (1, 4, 2, 2, True), (2, 4, 1, 1, False), (3, 1, 2, 0, True), (4, 2, 1, 2, False),
    (7, 1, 1, 1, False)])
def test_mixed_peak_floor_is_below_every_split(mixed, pp, dp, tp, zero, sp):
    """The peak floor a mixed stack's layout is pruned by before its tables are built is at most the peak of every
    split and recompute choice (brute force over a device large enough for all)."""
    from autoshard.passes.solve.mixed_bounds import mixed_peak_floor

    spec, ct = mixed
    hw = replace(load_hardware("cpu"), memory_bytes=1e18)
    layout = cost.resolved(Layout(mesh=Mesh(dp=dp, pp=pp, tp=tp), micro_batch=2, zero=zero,
                                  sequence_parallel=sp), hw)
    kw = dict(global_batch=16, seq_len=64)
    problem = mesh_problem(ct, hw, layout, recomputes=(Recompute.NONE, Recompute.FULL), **kw)
    floor = float(mixed_peak_floor(ct, [layout], seq_len=64)[0])
    peaks = [evaluate(problem, problem.assignment(split, opts)).peak_bytes
             for split in stage_splits(7, pp) for opts in itertools.product(range(len(problem.options)), repeat=pp)]
    assert 0 < floor <= min(peaks)


def _tight_problem(ct, *, pp, dp, zero, schedule, fraction):
    """(layout, device, its tables at both recompute levels) of the mixed stack on a device `_tight` makes tight."""
    cpu = load_hardware("cpu")
    layout = cost.resolved(Layout(mesh=Mesh(dp=dp, pp=pp), micro_batch=1, zero=zero, schedule=schedule), cpu)
    kw = dict(global_batch=16, seq_len=64, recomputes=(Recompute.NONE, Recompute.FULL))
    hw = _tight(cpu, mesh_problem(ct, cpu, layout, **kw), fraction)
    return layout, hw, mesh_problem(ct, hw, layout, **kw)


@pytest.mark.parametrize("pp, dp, zero, schedule, fraction", [
    (1, 8, 0, "1f1b", 0.7), (2, 4, 1, "1f1b", 0.3), (3, 1, 0, "1f1b", 0.2), (4, 2, 2, "gpipe", 0.1),
    (4, 1, 1, "zero-bubble", 0.2), (7, 1, 0, "1f1b", 0.05)])
def test_mixed_bounds_are_below_every_split(mixed, pp, dp, zero, schedule, fraction):
    """The step and peak bounds a mixed stack's layouts are ordered and pruned by (the forced recompute included)
    are at most the brute-force optimum's on devices tight enough to force recompute on some stages (the floor
    counts 1 to 5 layers forced on four of these)."""
    from autoshard.passes.solve.mixed_bounds import mixed_bounds

    spec, ct = mixed
    layout, hw, problem = _tight_problem(ct, pp=pp, dp=dp, zero=zero, schedule=schedule, fraction=fraction)
    step, peak = (float(x[0]) for x in mixed_bounds(replace(ct, memo={}), hw, [layout], global_batch=16, seq_len=64))
    best = brute_force(problem)
    assert best is not None and step <= best[1].step_s and peak <= best[1].peak_bytes


@pytest.mark.parametrize("pp, dp, zero, schedule, fraction", [
    (1, 8, 0, "1f1b", 0.7), (1, 8, 1, "1f1b", 0.9), (2, 4, 1, "1f1b", 0.3), (3, 1, 0, "1f1b", 0.2),
    (4, 1, 1, "zero-bubble", 0.2), (4, 2, 2, "gpipe", 0.1), (7, 1, 0, "1f1b", 0.05)])
def test_forced_recompute_is_below_every_split(mixed, pp, dp, zero, schedule, fraction):
    """The layers the mixed bound counts as rerun, at least, are at most those of every split and recompute choice
    that fits a tight device; with one stage, that stage reruns all its layers wherever it cannot keep them all."""
    from autoshard.passes.solve import mixed_bounds
    from autoshard.passes.solve.bounds import layout_codes

    spec, ct = mixed
    layout, hw, problem = _tight_problem(ct, pp=pp, dp=dp, zero=zero, schedule=schedule, fraction=fraction)
    codes = layout_codes([layout])
    _, per_layer, buffers, _ = mixed_bounds._memory_columns(ct, [layout], codes, seq_len=64)
    act = np.array([[each[0][2] for each in (mixed_bounds._least_layer_many(v, hw, [layout], seq_len=64)
                                              for v in ct.kinds)]])
    forced = float(mixed_bounds.forced_recompute(ct, hw, [layout], codes, per_layer, act, buffers,
                                                 global_batch=16)[0])
    rerun = [sum(n for n, r in zip(split, opts) if problem.recomputes[r] is Recompute.FULL)
             for split in stage_splits(7, pp) for opts in itertools.product(range(2), repeat=pp)
             if evaluate(problem, problem.assignment(split, opts)).peak_bytes <= hw.memory_bytes]
    assert rerun and forced <= min(rerun)
    if pp == 1:
        assert forced == min(rerun)  # 0 where the stage keeps all, else all 7


def test_an_fp8_recipe_prices_as_its_tensorwise_twin(mixed):
    """Below ZeRO-3 the cost model prices an fp8 layout exactly as its tensorwise twin (the recipes differ in the
    bytes ZeRO-3 gathers only): the same tables, so the mixed search keeps the twin alone; under ZeRO-3 they differ."""
    from autoshard.ir import Fp8Recipe, Precision

    spec, ct = mixed
    hw = load_hardware("h100")
    kw = dict(global_batch=16, seq_len=64, recomputes=(Recompute.NONE, Recompute.FULL))
    row, tensor = (cost.resolved(Layout(mesh=Mesh(dp=2, pp=2), micro_batch=1, zero=1, precision=Precision.FP8,
                                        fp8_recipe=r), hw) for r in (Fp8Recipe.ROWWISE, Fp8Recipe.TENSORWISE))
    assert row.priced_twin() == tensor and tensor.priced_twin() is tensor
    a, b = mesh_problem(ct, hw, row, **kw), mesh_problem(ct, hw, tensor, **kw)
    assert all(np.array_equal(getattr(a, t), getattr(b, t)) for t in ("time_s", "mem_bytes", "tail_s"))
    z3 = replace(row, mesh=Mesh(dp=4), zero=3)
    assert z3.priced_twin() is z3
    est = [cost.estimate(ct.kinds[0], spec, hw, lay, global_batch=16, seq_len=64).memory_gb
           for lay in (z3, replace(tensor, mesh=Mesh(dp=4), zero=3))]
    assert est[0] > est[1]  # rowwise gathers bf16 weights, tensorwise float8
    # the search leaves a twin out only where its tensorwise twin is searched too
    from autoshard.passes.solve.planner import CandidateLayouts, candidate_layouts, search

    parts = {r: candidate_layouts(spec, devices=4, global_batch=16, seq_len=64, precision=Precision.FP8,
                                  fp8_recipe=r).parts for r in (Fp8Recipe.ROWWISE, Fp8Recipe.TENSORWISE)}
    alone = search(replace(ct, memo={}), hw, global_batch=16, seq_len=64,
                   layouts=CandidateLayouts(list(parts[Fp8Recipe.ROWWISE]), precision=Precision.FP8))
    both = search(replace(ct, memo={}), hw, global_batch=16, seq_len=64, layouts=CandidateLayouts(
        list(parts[Fp8Recipe.TENSORWISE] + parts[Fp8Recipe.ROWWISE]), precision=Precision.FP8))
    assert alone.found[0].layout.fp8_recipe is Fp8Recipe.ROWWISE and both.layouts < 2 * alone.layouts
    assert both.found[0].layout == alone.found[0].layout.priced_twin()
    assert both.found[0].result.step_s == alone.found[0].result.step_s


def test_stage_time_follows_its_own_layers(mixed):
    """A stage's time is the sum of its layers' kinds: the heavy layers make uneven splits the better ones, and
    the tables agree with estimate at every split."""
    spec, ct = mixed
    hw = load_hardware("h100")
    layout = Layout(mesh=Mesh(dp=4, pp=2), micro_batch=1, zero=1, recompute=Recompute.NONE)
    problem = mesh_problem(ct, hw, layout, global_batch=16, seq_len=64)
    for n in range(8):
        a = Assignment(layers=(n, 7 - n), recompute=(Recompute.NONE,) * 2)
        est = cost.estimate(ct, spec, hw, layout, stages=a.stages(), global_batch=16, seq_len=64)
        ev = evaluate(problem, a)
        assert ev.step_s == pytest.approx(est.step_time_s, rel=1e-9)
        assert max(ev.stage_bytes) == pytest.approx(est.memory_gb * 1e9, rel=1e-9)
    # layers a a b a | b b a: 3 a + 1 b vs 2 a + 2 b, not 4 vs 3 of one time
    t = problem.time_s[0, 0]
    one = [block_time(v, hw, layout, BlockKind.LAYER, seq_len=64).total_s for v in ct.kinds]
    assert t[4] - t[3] == pytest.approx(one[0], rel=1e-9) and t[3] - t[2] == pytest.approx(one[1], rel=1e-9)


def test_solve_plans_a_mixed_stack(mixed):
    """`solve` on the mixed table: a plan whose stages cover the sequence, its prediction estimate's own, and
    no split of its layout beats it."""
    spec, ct = mixed
    plan = solve(spec, "h100", devices=8, global_batch=16, seq_len=64, table=ct)
    stages = plan.stages
    assert stages[0].first_layer == 0 and stages[-1].end_layer == 7 and plan.mesh.tp == plan.mesh.cp == 1
    layout = Layout(mesh=plan.mesh, micro_batch=plan.micro_batch, zero=plan.zero, schedule=plan.schedule)
    problem = mesh_problem(ct, load_hardware("h100"), cost.resolved(layout, load_hardware("h100")),
                           global_batch=16, seq_len=64)
    best = brute_force(problem)
    assert plan.predicted["step_time_s"] == pytest.approx(best[1].step_s, rel=1e-9)


def test_show_has_a_column_per_layer_kind(mixed, capsys):
    """The plan's per-kind breakdown counts every layer of each stage once, and `show` prints a column per
    kind (a row per stage, then each kind's layers and share of the layers' time)."""
    from autoshard.commands.show import render

    spec, ct = mixed
    plan = solve(spec, "h100", devices=4, global_batch=16, seq_len=64, table=ct)
    rows = plan.predicted["layer_kinds"]
    assert [r["kind"] for r in rows] == ["a", "b"] and [sum(r["layers"]) for r in rows] == [4, 3]
    assert [sum(r["layers"][i] for r in rows) for i in range(len(plan.stages))] == [st.layers for st in plan.stages]
    heavy, light = (sum(r["time_s"]) / sum(r["layers"]) for r in rows[::-1])
    assert heavy > 2 * light  # "b" has three times the FLOPs
    render(plan)
    out = capsys.readouterr().out
    assert "layer kinds" in out
    last = next(line for line in out.splitlines() if "all" in line and "layers" in line)
    assert "4 layers" in last and "3 layers" in last  # each kind's layer count on the totals row


def test_a_re_plan_reuses_the_bounds_block_times(mixed):
    """The mixed bounds' block times are kept in the table's memo per device and sequence length: a re-plan at
    another global batch reads those the first priced and plans as a fresh table does."""
    spec, ct = mixed
    kw = dict(devices=8, seq_len=64)
    solve(spec, "h100", global_batch=16, table=ct, **kw)
    kept = [k for k in ct.memo if isinstance(k, tuple) and k[0] == "range bound blocks"]
    assert len(kept) == 1 and 64 in ct.memo[kept[0]]
    held = dict(ct.memo[kept[0]][64])
    again = solve(spec, "h100", global_batch=32, table=ct, **kw)
    assert all(ct.memo[kept[0]][64][code] is each for code, each in held.items())  # read, not priced again
    fresh = solve(spec, "h100", global_batch=32, table=replace(ct, memo={}), **kw)
    assert (again.mesh, again.micro_batch, again.stages) == (fresh.mesh, fresh.micro_batch, fresh.stages)
    assert again.predicted["step_time_s"] == fresh.predicted["step_time_s"]
