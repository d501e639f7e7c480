"""The planner: CP-SAT finds the brute-force optimum of the same cost model; plans beat sweep."""

from dataclasses import replace

import pytest

from autoshard.errors import InfeasiblePlanError
from autoshard.hardware import load_hardware
from autoshard.ir import Mesh, Recompute
from autoshard.models.presets import get_spec
from autoshard.passes.cost import cost
from autoshard.passes.cost.compiled import compile_table
from autoshard.passes.cost.layout import Layout
from autoshard.passes.capture.shapes import build_cost_table
from autoshard.passes.solve.planner import candidate_layouts, min_peak_bytes, solve, solve_mesh
from autoshard.passes.solve.solve_model import Assignment, brute_force, evaluate, mesh_problem, min_stage_sums


@pytest.fixture(scope="module", params=["llama-tiny", "mamba2-tiny"])
def tiny(request):
    spec = get_spec(request.param)
    return spec, compile_table(build_cost_table(spec), spec)


def _tight(hw, ct, layout, fraction):
    """A device whose memory sits `fraction` of the way between the smallest and largest stage."""
    problem = mesh_problem(ct, hw, layout, global_batch=16, seq_len=64)
    lo = min(min(r[problem.min_layers(i)] for r in rows) for i, rows in enumerate(problem.mem_bytes))
    hi = max(max(max(r) for r in rows) for rows in problem.mem_bytes)
    return replace(hw, memory_bytes=lo + fraction * (hi - lo))


@pytest.mark.parametrize("max_steps", [0, 2, 64], ids=["cpsat-only", "exact-cut-short", "exact"])
@pytest.mark.parametrize("pp, dp, tp, zero, fraction", [(2, 4, 1, 1, 0.3), (4, 2, 1, 0, 0.5), (3, 1, 2, 2, 0.2),
                                                         (4, 1, 2, 3, 0.05), (1, 8, 1, 1, 1.0)])
def test_cpsat_finds_the_brute_force_optimum(tiny, pp, dp, tp, zero, fraction, max_steps):
    """CP-SAT alone (max_steps=0), the exact split search alone, and the search cut short then
    finished by CP-SAT all reach the brute-force optimum."""
    spec, ct = tiny
    layout = Layout(mesh=Mesh(dp=dp, pp=pp, tp=tp), micro_batch=1, zero=zero)
    hw = _tight(load_hardware("cpu"), ct, layout, fraction)
    problem = mesh_problem(ct, hw, layout, global_batch=16, seq_len=64)
    best = brute_force(problem)
    got = solve_mesh(problem, time_limit_s=20, max_steps=max_steps)
    if best is None:
        assert got.assignment is None
        return
    assert got.status == "optimal"
    assert evaluate(problem, got.assignment).peak_bytes <= hw.memory_bytes
    assert got.step_s == pytest.approx(best[1].step_s, rel=1e-5)


@pytest.mark.parametrize("schedule, v", [("interleaved-1f1b", 2), ("zero-bubble", 1), ("gpipe", 1)])
def test_schedules_search_finds_the_brute_force_optimum(tiny, schedule, v):
    """With a bubble fraction f < 1 (interleaved, zero-bubble) or all micro-batches in flight
    (GPipe) the exact search and CP-SAT still reach the brute-force optimum, and the tables agree
    with estimate at the optimum."""
    spec, ct = tiny
    layout = Layout(mesh=Mesh(dp=2, pp=2, tp=2), micro_batch=1, zero=1, schedule=schedule, virtual_stages=v)
    hw = _tight(load_hardware("cpu"), ct, layout, 0.4)
    problem = mesh_problem(ct, hw, layout, global_batch=16, seq_len=64)
    best = brute_force(problem)
    for max_steps in (0, 64):
        got = solve_mesh(problem, time_limit_s=20, max_steps=max_steps)
        assert got.step_s == pytest.approx(best[1].step_s, rel=1e-5)
    est = cost.estimate(ct, spec, hw, replace(layout, recompute=best[0].recompute[0]), global_batch=16, seq_len=64,
                        stages=best[0].stages())
    if len(set(best[0].recompute)) == 1:
        assert best[1].step_s == pytest.approx(est.step_time_s, rel=1e-9)


def test_min_stage_sums_equal_every_split_enumerated():
    """The split search's min-plus DP (several tables side by side, each stage's pass over its finite
    counts and the running totals that can still complete) gives, per table, the least sum over every
    split and, on ties, the split whose last stage holds the fewest layers, then the one before...
    (small integers: sums are exact, so ties are ties)."""
    from itertools import product

    import numpy as np

    rng = np.random.default_rng(0)
    for _ in range(400):
        stages, layers, count = int(rng.integers(1, 5)), int(rng.integers(0, 7)), int(rng.integers(1, 4))
        tables = rng.integers(0, 4, size=(count, stages, layers + 1)).astype(float)
        tables[rng.random(tables.shape) < rng.random()] = np.inf
        for table, got in zip(tables, min_stage_sums(tables, layers)):
            splits = [s for s in product(range(layers + 1), repeat=stages) if sum(s) == layers]
            sums = {s: sum(table[i, n] for i, n in enumerate(s)) for s in splits}
            least = min(sums.values())
            if least == np.inf:
                assert got == (np.inf, None)
            else:
                assert got == (least, min((s for s in splits if sums[s] == least), key=lambda s: s[::-1]))


def test_planner_chooses_the_schedule_and_emits_its_chunks(tiny):
    """Offered 1F1B and interleaving, the planner keeps the faster (smaller bubble against more in
    flight and v x the p2p sends), and an interleaved plan's pp x v model chunks come in model order."""
    from autoshard.passes.solve.planner import chunk_stages, search

    spec, ct = tiny
    hw = load_hardware("h100")
    kw = dict(devices=4, global_batch=16, seq_len=64)
    both, one, inter = ((("1f1b", 1), ("interleaved-1f1b", 2)), (("1f1b", 1),), (("interleaved-1f1b", 2),))
    runs = {}
    for name, options in (("both", both), ("1f1b", one), ("interleaved", inter)):
        layouts = [lay for lay in candidate_layouts(spec, schedules=options, **kw) if lay.mesh == Mesh(dp=2, pp=2)]
        full = [lay for lay in layouts if 16 // (2 * lay.micro_batch) >= 2]  # at least pp micro-batches
        assert {(lay.schedule.value, lay.virtual_stages) for lay in full} == set(options)
        # fewer micro-batches than stages: 1F1B runs as GPipe (the runtime's rule), interleaving at 1F1B's bubble
        assert {(lay.schedule.value, lay.virtual_stages) for lay in layouts if lay not in full} <= {
            ("gpipe", 1), ("interleaved-1f1b", 2)}
        runs[name] = search(ct, hw, global_batch=16, seq_len=64, layouts=layouts).found[0]
    assert runs["both"].result.step_s == pytest.approx(min(runs["1f1b"].result.step_s,
                                                           runs["interleaved"].result.step_s))
    best = runs["interleaved"]
    chunks = chunk_stages(best.result.assignment, best.layout)
    assert len(chunks) == 4 and chunks[0].embed and chunks[-1].head and chunks[0].first_layer == 0
    assert [c.first_layer for c in chunks[1:]] == [c.end_layer for c in chunks[:-1]]
    assert chunks[-1].end_layer == spec.layers and all(c.layers >= 1 for c in chunks[1:-1])


def test_tables_agree_with_estimate(tiny):
    spec, ct = tiny
    hw = load_hardware("cpu")
    for rec in Recompute:
        layout = Layout(mesh=Mesh(dp=2, pp=3), micro_batch=1, zero=1, recompute=rec)
        problem = mesh_problem(ct, hw, layout, global_batch=16, seq_len=64)
        a = Assignment(layers=(0, 3, 1), recompute=(rec,) * 3)
        est = cost.estimate(ct, spec, hw, layout, global_batch=16, seq_len=64, stages=a.stages())
        ev = evaluate(problem, a)
        assert ev.step_s == pytest.approx(est.step_time_s, rel=1e-9)
        assert ev.peak_bytes == pytest.approx(est.memory.total, rel=1e-9)


def test_tables_agree_with_estimate_under_zero3(tiny):
    """ZeRO-3 pays one collective per FSDP block (embedding, layers, head) in both."""
    spec, ct = tiny
    hw = load_hardware("h100")
    layout = Layout(mesh=Mesh(dp=4), micro_batch=1, zero=3)
    problem = mesh_problem(ct, hw, layout, global_batch=16, seq_len=64)
    a = Assignment(layers=(spec.layers,), recompute=(Recompute.NONE,))
    est = cost.estimate(ct, spec, hw, layout, global_batch=16, seq_len=64, stages=a.stages())
    assert evaluate(problem, a).step_s == pytest.approx(est.step_time_s, rel=1e-9)


def test_plan_is_never_worse_than_sweep(tiny):
    spec, ct = tiny
    hw = load_hardware("cpu")
    plan = solve(spec, hw, devices=8, global_batch=16, seq_len=64, time_limit_s=20, table=ct)
    rows = [cost.estimate(ct, spec, hw, replace(lay, recompute=r), global_batch=16, seq_len=64)
            for lay in candidate_layouts(spec, devices=8, global_batch=16, seq_len=64) for r in Recompute]
    best = min(e.step_time_s for e in rows if e.fits)
    assert plan.predicted["step_time_s"] <= best * (1 + 1e-6)
    assert plan.solver["status"] in ("optimal", "feasible")
    assert sum(st.layers for st in plan.stages) == spec.layers


def test_infeasible_says_by_how_much(tiny):
    spec, ct = tiny
    hw = replace(load_hardware("cpu"), memory_bytes=1e5)
    with pytest.raises(InfeasiblePlanError, match=r"memory per device.*needs .* GB.*%\) too much"):
        solve(spec, hw, devices=2, global_batch=4, seq_len=64, time_limit_s=5, table=ct)


def test_infeasible_names_the_smallest_plan_over_every_mesh():
    """The smallest plan is looked for on every mesh at its own highest ZeRO level (every level
    where nothing is data-parallel, where ZeRO shards nothing): on 4 devices llama-tiny's is model
    parallel (tp4 with sequence parallelism since the planner searches it; before, pp2 tp2 ZeRO-1). (No host link in the
    profile: with one, offload would move the state off the device and fit.)"""
    spec = get_spec("llama-tiny")
    ct = compile_table(build_cost_table(spec), spec)
    hw = replace(load_hardware("cpu"), memory_bytes=1e6, host_link_bandwidth=None, host_memory_bandwidth=None)
    from autoshard.passes.cost.precision import resolve_precision

    precision = resolve_precision("auto", hw)  # the planner builds its layouts at the device's precision
    layouts = [lay for lay in candidate_layouts(spec, devices=4, global_batch=8, seq_len=64, precision=precision)
               if lay.micro_batch == 1]
    need = {lay: min_peak_bytes(mesh_problem(ct, hw, lay, global_batch=8, seq_len=64)) for lay in layouts}
    smallest = min(need, key=need.get)
    assert need[smallest] > 1e6 and smallest.mesh.pp * smallest.mesh.tp > 1
    with pytest.raises(InfeasiblePlanError, match=rf"smallest plan \({smallest.mesh}, ZeRO-\d, .*needs "
                                                  rf"{need[smallest] / 1e9:.3g} GB"):
        solve(spec, hw, devices=4, global_batch=8, seq_len=64, time_limit_s=5, table=ct)


@pytest.mark.parametrize("name", ["llama-7b", "mamba2-7b"])
def test_reference_setup_beats_the_best_sweep_row(name):
    """8 x ascend-910b, global batch 1024, seq 4096: the plan is never worse than the best row of
    `autoshard sweep` over every micro-batch, recompute level and ZeRO level the runtime runs."""
    from autoshard.commands.sweep import sweep
    from autoshard.rules.validity import RUNTIME_ZERO

    spec = get_spec(name)
    ct = compile_table(build_cost_table(spec), spec)
    hw = load_hardware("ascend-910b")
    plan = solve(spec, hw, devices=8, global_batch=1024, seq_len=4096, table=ct, fingerprint="0" * 16)
    rows = [e for mb in (1, 2, 4, 8) for e in sweep(spec, ct, hw, devices=8, global_batch=1024, seq_len=4096,
                                                    micro_batch=mb, zeros=RUNTIME_ZERO, recomputes=tuple(Recompute))]
    best = min(e.step_time_s for e in rows if e.fits)
    assert plan.predicted["fits"]
    assert plan.predicted["step_time_s"] <= best * (1 + 1e-6)

def test_check_plan_matches_names_the_mismatch(tiny):
    from autoshard.errors import PlanFileError
    from autoshard.fingerprint import check_plan_matches

    spec, ct = tiny
    plan = solve(spec, load_hardware("cpu"), devices=2, global_batch=4, seq_len=64, table=ct, fingerprint="f" * 16)
    check_plan_matches(plan, fingerprint="f" * 16, devices=2)
    with pytest.raises(PlanFileError, match=rf"another model \({spec.name}, fingerprint f+; this model's is 0+\)"):
        check_plan_matches(plan, fingerprint="0" * 16, devices=2)
    with pytest.raises(PlanFileError, match="made for 2 devices, this run has 4"):
        check_plan_matches(plan, fingerprint="f" * 16, devices=4)


def test_no_virtual_stage_is_left_empty():
    """Regression: a rank holding the embedding or head may hold v - 1 layers (the search allows it),
    and its empty chunk must be the embedding / head one, never a middle chunk ("stage 8 (layers
    [15, 15)) holds nothing" on qwen2-moe, 8 x ascend-910b); under the zero-bubble V, rank pp - 1
    holds two middle chunks, so it needs v layers (min_layers counts its chunks with ir.end_chunks)."""
    from autoshard.ir import Schedule, check_stages, end_chunks
    from autoshard.passes.solve.planner import chunk_stages

    assert [end_chunks(r, pp=4, virtual_stages=2, schedule=Schedule.ZERO_BUBBLE) for r in range(4)] == [2, 0, 0, 0]
    assert [end_chunks(r, pp=4, virtual_stages=2, schedule=Schedule.INTERLEAVED_1F1B) for r in range(4)] == [1, 0, 0, 1]
    for schedule, layers in ((Schedule.INTERLEAVED_1F1B, (1, 2, 2, 1)), (Schedule.ZERO_BUBBLE, (1, 2, 2, 2))):
        layout = Layout(mesh=Mesh(dp=1, pp=4), micro_batch=1, zero=1, schedule=schedule, virtual_stages=2)
        a = Assignment(layers=layers, recompute=(Recompute.NONE,) * 4)
        check_stages(chunk_stages(a, layout), num_layers=sum(layers), pp=8)  # raises on an empty middle chunk
    for name, devices, gb in (("qwen2-moe", 8, 32), ("llama-70b", 64, 256)):  # the shapes that raised
        plan = solve(get_spec(name), load_hardware("ascend-910b"), devices=devices, global_batch=gb, seq_len=2048)
        assert plan.virtual_stages == 1 or all(st.layers >= 1 for st in plan.stages[1:-1]), (name, plan.stages)


def test_a_plan_after_another_models_plan(monkeypatch):
    """Regression: the bound's node-time stems are kept over plans and models (bounds._CODES), so a block is
    priced from any layout with its stem, perhaps another model's; its tp divisors must read only the block's own
    choices. mamba2-1b (vocab 50288) at tp 32 after llama-1b had registered tp 32 with a vocab-parallel head
    raised "lm_head: tp=32 splits its pieces into ['None'] parts"; now it plans as it does alone."""
    from autoshard.passes.solve import bounds

    hw = load_hardware("h100")
    kw = dict(devices=32, global_batch=32, seq_len=4096)
    monkeypatch.setattr(bounds, "_CODES", bounds._Codes())  # as in a fresh process
    solve(get_spec("llama-1b"), hw, **kw)
    after = solve(get_spec("mamba2-1b"), hw, **kw)
    monkeypatch.setattr(bounds, "_CODES", bounds._Codes())
    alone = solve(get_spec("mamba2-1b"), hw, **kw)
    assert after.mesh == alone.mesh and after.predicted == alone.predicted
