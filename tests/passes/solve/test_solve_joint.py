"""The intra-op choices are decided jointly with everything else, and optimally: a brute force over the
whole joint space (mesh x micro-batch x ZeRO x intra-op strategies x stage splits x per-stage recompute)
on the tiny presets, each point priced by the cost model, has the planner's step time as its minimum."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from autoshard.errors import InvalidConfigError
from autoshard.hardware import load_hardware
from autoshard.ir import BlockKind, Mesh, Plan, Recompute
from autoshard.model_spec import Mixer
from autoshard.models.presets import get_spec
from autoshard.passes.cost import cost
from autoshard.passes.cost.block import block_params, block_time
from autoshard.passes.cost.compiled import compile_table
from autoshard.passes.cost.pipeline import logits_bytes, p2p_time, sequence_boundary_time
from autoshard.rules import sharding
from autoshard.passes.cost.layout import Layout
from autoshard.rules.validity import check_plan
from autoshard.passes.capture.shapes import build_cost_table
from autoshard.passes.solve.planner import candidate_layouts, search, solve, solve_mesh
from autoshard.passes.solve.solve_model import Assignment, brute_force, evaluate, mesh_problem, stage_variants


@pytest.fixture(scope="module", params=["llama-tiny", "mamba2-tiny"])
def tiny(request):
    spec = get_spec(request.param)
    return spec, compile_table(build_cost_table(spec), spec)


def _brute(ct, hw, layouts, *, global_batch, seq_len):
    """(step, layout, assignment) of the fastest fitting point of the joint space, by enumeration."""
    best = (math.inf, None, None)
    for lay in layouts:
        found = brute_force(mesh_problem(ct, hw, lay, global_batch=global_batch, seq_len=seq_len))
        if found is not None and found[1].step_s < best[0]:
            best = (found[1].step_s, lay, found[0])
    return best


def test_strategy_options_cover_the_table(tiny):
    spec, _ = tiny
    assert sharding.strategy_options(spec, 1) == ((),)
    options = set(sharding.strategy_options(spec, 2))
    expected = {"embedding", "head"} | ({"groups"} if spec.mixer is Mixer.SSD else set())
    assert {name for combo in options for name, _ in combo} == expected
    assert len(options) == 2 ** len(expected)  # untied presets: every combination
    layouts = candidate_layouts(spec, devices=4, global_batch=1, seq_len=64)
    assert {lay.strategies for lay in layouts if lay.mesh.tp == 2} == options


@pytest.mark.parametrize("hw_name, global_batch, seq_len, memory", [
    ("h100", 1, 64, None), ("cpu", 2, 128, 0.5)])
def test_planner_reaches_the_joint_brute_force_optimum(tiny, hw_name, global_batch, seq_len, memory):
    """Every candidate layout of 4 devices, with every intra-op strategy combination, every split and
    per-stage recompute; `memory`: the device memory set halfway between the smallest and the largest
    peak of the layouts' best points, so that memory binds."""
    spec, ct = tiny
    hw = load_hardware(hw_name)
    kw = dict(global_batch=global_batch, seq_len=seq_len)
    layouts = candidate_layouts(spec, devices=4, **kw)
    assert any(lay.strategies for lay in layouts)
    assert any(len(stage_variants(lay)) > 1 for lay in layouts)  # per-stage SP (and groups) mixes are in it
    if memory is not None:
        peaks = sorted(evaluate(p, brute_force(p)[0]).peak_bytes
                       for p in (mesh_problem(ct, hw, lay, **kw) for lay in layouts[::7]))
        hw = replace(hw, memory_bytes=peaks[0] + memory * (peaks[-1] - peaks[0]))
    step, _, _ = _brute(ct, hw, layouts, **kw)
    plan = solve(spec, hw, devices=4, table=ct, fingerprint="0" * 16, **kw)
    assert plan.solver["status"] == "optimal"
    assert plan.solver["objective_s"] == pytest.approx(step, rel=1e-9)
    assert plan.predicted["step_time_s"] == pytest.approx(step, rel=1e-9)
    check_plan(plan, spec, world_size=4)  # the one validator accepts what the planner emits


@pytest.mark.parametrize("hw_name", ["h100", "cpu"])
def test_strategies_decide_the_optimum_under_tp(tiny, hw_name):
    """Over the tp = 2 layouts (where the choices exist), sequence parallelism on and off included (priced
    by passes/cost/sequence_cost.py), the search reaches the brute force. On h100 at these tiny sizes the all-reduces of the vocab-parallel
    embedding / head cost more than the work they split: the optimum replicates the head (the choice is
    live, not decoration)."""
    spec, ct = tiny
    hw = load_hardware(hw_name)
    kw = dict(global_batch=1, seq_len=64)
    layouts = [lay for lay in candidate_layouts(spec, devices=4, sequence_parallel=(False, True), **kw)
               if lay.mesh.tp == 2]
    assert {lay.sequence_parallel for lay in layouts} == {False, True}
    assert not any(lay.sequence_parallel and ("head", "replicate") in lay.strategies for lay in layouts)
    step, layout, _ = _brute(ct, hw, layouts, **kw)
    found = search(ct, hw, layouts=layouts, **kw).found[0]
    assert found.result.step_s == pytest.approx(step, rel=1e-9)
    if hw_name == "h100":
        assert dict(found.layout.strategies).get("head") == "replicate"
        default = _brute(ct, hw, [lay for lay in layouts if not lay.strategies and not lay.sequence_parallel
                                  and not lay.stage_choices], **kw)[0]
        assert step < default


def test_stages_choose_their_strategy(tiny):
    """pp x tp layouts let each stage choose sequence parallelism (and Mamba-2 its groups) on its own:
    the tables hold one option per (recompute level, variant), the tail depends on the variant, and the
    exact split search and CP-SAT alone both reach the brute force over every per-stage mix."""
    spec, ct = tiny
    kw = dict(global_batch=2, seq_len=128)
    mamba = spec.mixer is Mixer.SSD
    expect = {"sequence_parallel"} | ({"groups"} if mamba else set())
    layouts = candidate_layouts(spec, devices=4, **kw)
    per = [lay for lay in layouts if lay.stage_choices]
    assert per and all(lay.mesh.pp > 1 for lay in per)
    assert {c for lay in per for c in lay.stage_choices} == expect
    assert not any(lay.mesh.pp > 1 and ("groups", "whole") in lay.strategies for lay in layouts)  # per stage there
    for hw_name, memory in (("h100", None), ("cpu", 0.3)):
        hw = load_hardware(hw_name)
        problems = [mesh_problem(ct, hw, lay, **kw) for lay in per if lay.mesh.tp == 2][::3]
        if memory is not None:  # a cap between the smallest and largest stage memory: it binds
            finite = [float(x) for p in problems for x in p.mem_bytes.reshape(-1) if math.isfinite(x)]
            problems = [replace(p, capacity_bytes=min(finite) + memory * (max(finite) - min(finite))) for p in problems]
        for problem in problems:
            assert len(problem.variants) == 2 ** len(set(problem.layout.stage_choices))
            assert problem.tail_s.shape == problem.time_s.shape
            best = brute_force(problem)
            for steps in (1000, 0):
                got = solve_mesh(problem, max_steps=steps)
                if best is None:
                    assert got.assignment is None
                    continue
                assert got.step_s == pytest.approx(best[1].step_s, rel=1e-9), (problem.layout, steps)
        if mamba:  # groups whole hold more parameters: a larger DP sync / optimizer tail
            p = problems[0]
            whole = next(v for v, lay in enumerate(p.variants) if ("groups", "whole") in lay.strategies)
            assert p.tail_s[0, p.option(Recompute.NONE, whole), 2] > p.tail_s[0, p.option(Recompute.NONE, 0), 2]


def test_a_per_stage_mix_beats_every_uniform_choice():
    """Among the pp2 x tp2 layouts of llama-tiny on 4 h100s (global batch 4, seq 1024) with 9.9 MB per device,
    sequence parallelism on stage 0 only is strictly faster than any uniform choice: stage 0 holds the most
    micro-batches in flight and needs SP's smaller activations to fit, stage 1 fits without and runs faster
    so (SP costs more than it saves at this size on h100). The search finds that mix, as the brute force
    over every per-stage mix does. (Over all 4-device layouts dp4 wins by far on these tiny presets: no
    per-stage mix is globally best there, see docs/solver.md.)"""
    spec = get_spec("llama-tiny")
    ct = compile_table(build_cost_table(spec), spec)
    hw = replace(load_hardware("h100"), memory_bytes=9.9e6)
    kw = dict(global_batch=4, seq_len=1024)
    layouts = [lay for lay in candidate_layouts(spec, devices=4, **kw) if lay.mesh == Mesh(pp=2, tp=2)]
    uniform = [replace(lay, stage_choices=()) if lay.stage_choices else lay for lay in layouts]
    step, layout, a = _brute(ct, hw, layouts, **kw)
    found = search(ct, hw, layouts=layouts, **kw).found[0]
    assert found.result.step_s == pytest.approx(step, rel=1e-9)
    chosen = [found.layout.sequence_parallel or stage_variants(found.layout)[found.result.assignment.variant_of(i)]
              .sequence_parallel for i in range(2)]
    assert chosen == [True, False]
    best_uniform = search(ct, hw, layouts=uniform, **kw).found[0].result.step_s
    assert step < best_uniform * (1 - 1e-3)


def test_mixed_sequence_parallel_is_priced_as_it_runs():
    """A stage of a pipeline whose stages differ in sequence parallelism: off, exactly the SP-off layout's
    stage; on, the SP layout's stage with the whole sequence's p2p in place of the shard's and one all-gather
    per boundary (runtime/stages.py: the boundaries carry the whole sequence)."""
    spec = get_spec("llama-tiny")
    ct = compile_table(build_cost_table(spec), spec)
    hw = load_hardware("h100")
    kw = dict(global_batch=4, seq_len=64)
    base = Layout(mesh=Mesh(pp=2, tp=2), micro_batch=1, zero=1)
    off, on = (mesh_problem(ct, hw, replace(base, sequence_parallel=sp), **kw) for sp in (False, True))
    mixed = mesh_problem(ct, hw, replace(base, stage_choices=("sequence_parallel",)), **kw)
    assert [lay.sequence_parallel for lay in mixed.variants] == [False, True]
    r = len(mixed.recomputes)
    for table in ("time_s", "mem_bytes", "tail_s"):
        assert (getattr(mixed, table)[:, :r] == getattr(off, table)).all()
    assert (mixed.mem_bytes[:, r:] == on.mem_bytes).all() and (mixed.tail_s[:, r:] == on.tail_s).all()
    lay = cost.resolved(replace(base, sequence_parallel=True), hw)
    shard, whole = (p2p_time(ct, hw, cost.resolved(replace(base, sequence_parallel=sp), hw), seq_len=64)
                    for sp in (True, False))
    gather = sequence_boundary_time(ct, hw, lay, seq_len=64, boundaries=1)  # first and last: one boundary
    assert gather > 0 and whole > shard
    assert mixed.time_s[:, r:] == pytest.approx(on.time_s - shard + whole + gather, rel=1e-12)
    a = Assignment(layers=(2, 2), recompute=(Recompute.NONE,) * 2, variant=(1, 0))
    assert evaluate(mixed, a).stage_s[0] == pytest.approx(on.time_s[0, 0, 2] - shard + whole + gather)


def test_planner_writes_a_per_stage_plan_as_priced():
    """A per-stage assignment becomes a plan that lists each stage's choice, passes the one validator, names
    each stage's placements, and predicts the step the tables price (estimate takes one strategy)."""
    from autoshard.passes.solve.planner import Candidate, MeshResult, SearchResult, _plan

    spec = get_spec("mamba2-tiny")
    ct = compile_table(build_cost_table(spec), spec)
    hw = load_hardware("h100")
    kw = dict(global_batch=4, seq_len=64)
    layout = cost.resolved(Layout(mesh=Mesh(pp=2, tp=2), micro_batch=1, zero=1,
                                  stage_choices=("sequence_parallel", "groups")), hw)
    problem = mesh_problem(ct, hw, layout, **kw)
    whole_on = next(v for v, lay in enumerate(problem.variants)
                    if lay.sequence_parallel and ("groups", "whole") in lay.strategies)
    a = Assignment(layers=(1, 3), recompute=(Recompute.SELECTIVE, Recompute.NONE), variant=(whole_on, 0))
    step = evaluate(problem, a).step_s
    result = MeshResult(status="optimal", assignment=a, step_s=step, bound_s=step, wall_s=0.0)
    found = SearchResult(found=(Candidate(layout=layout, result=result),), visited=1, pruned_memory=0, layouts=1)
    plan = _plan(ct, hw, spec, found, devices=4, solve_s=0.0, fingerprint="0" * 16, **kw)
    check_plan(plan, spec, world_size=4)
    assert plan.sequence_parallel == (True, False) and dict(plan.strategies)["groups"] == ("whole", "split")
    assert plan.predicted["step_time_s"] == pytest.approx(step, rel=1e-12)
    assert plan.predicted["source"] == "cost component tables (per-stage recompute / strategy)"
    placements = dict(plan.placements)
    assert placements["layers.0-0.norm"] == "sequence" and placements["layers.1-3.norm"] == "replicate"
    assert placements["layers.0-0.mixer.in_proj"] == "colwise (groups whole)"
    assert placements["layers.1-3.mixer.in_proj"] == "colwise"


def test_tables_agree_with_estimate_for_every_strategy(tiny):
    """The per-stage tables the search reads price each strategy as `cost.estimate` does."""
    spec, ct = tiny
    hw = load_hardware("h100")
    for strategies in sharding.strategy_options(spec, 2):
        for rec in (Recompute.NONE, Recompute.SELECTIVE):
            layout = Layout(mesh=Mesh(pp=2, tp=2), micro_batch=1, zero=1, recompute=rec, strategies=strategies)
            problem = mesh_problem(ct, hw, layout, global_batch=4, seq_len=64)
            a = Assignment(layers=(1, 3), recompute=(rec, rec))
            est = cost.estimate(ct, spec, hw, layout, global_batch=4, seq_len=64, stages=a.stages())
            ev = evaluate(problem, a)
            assert ev.step_s == pytest.approx(est.step_time_s, rel=1e-9)
            assert ev.peak_bytes == pytest.approx(est.memory.total, rel=1e-9)


def test_replicated_head_is_priced_as_it_runs():
    """A replicated LM head and loss: no TP collective, the logits and their FLOPs whole on every rank,
    the LM head's weights whole; a vocab-parallel one divides them by tp."""
    spec = get_spec("llama-tiny")
    ct = compile_table(build_cost_table(spec), spec)
    hw = load_hardware("h100")
    vocab = Layout(mesh=Mesh(tp=2))
    whole = replace(vocab, strategies=(("head", "replicate"),))
    head = BlockKind.HEAD
    assert block_time(ct, hw, whole, head, seq_len=64).tp_comm_s == 0.0
    assert block_time(ct, hw, vocab, head, seq_len=64).tp_comm_s > 0.0
    assert logits_bytes(ct, whole, seq_len=64) == 2 * logits_bytes(ct, vocab, seq_len=64)
    assert block_params(ct, whole, head) > block_params(ct, vocab, head)
    assert block_params(ct, whole, BlockKind.EMBED) == block_params(ct, vocab, BlockKind.EMBED)


def _plan(spec, mesh, strategies) -> Plan:
    return Plan(model=spec.name, fingerprint="0" * 16, hardware="cpu", devices=mesh.size, global_batch=4,
                seq_len=64, mesh=mesh, strategies=strategies)


@pytest.mark.parametrize("preset, mesh, strategies, match", [
    ("llama-tiny", Mesh(tp=2), {"groups": "whole"}, r"'groups' is not an intra-op choice of llama-tiny at tp=2"),
    ("llama-tiny", Mesh(dp=2), {"head": "replicate"}, r"'head' is not an intra-op choice .* none \(tp = 1\)"),
    ("llama-tiny", Mesh(tp=2), {"head": "whole"}, r"head='whole' is not an option; use one of 'vocab', 'replicate'"),
    ("mamba2-1b", Mesh(tp=2), {"groups": "split"}, r"'groups' is not an intra-op choice of mamba2-1b"),
    ("mamba2-1b", Mesh(tp=2), {"head": "replicate"}, r"ties its embedding and LM head"),
])
def test_validator_names_a_bad_choice(preset, mesh, strategies, match):
    spec = get_spec(preset)
    with pytest.raises(InvalidConfigError, match=match):
        check_plan(_plan(spec, mesh, strategies), spec)


@pytest.mark.parametrize("preset, mesh, extra, match", [
    ("llama-tiny", Mesh(pp=2, tp=2), dict(sequence_parallel=[True, False, True]),
     r"sequence_parallel lists 3 values, but the plan has 2 pipeline stages"),
    ("mamba2-tiny", Mesh(pp=2, tp=2), dict(strategies={"groups": ["whole"]}),
     r"groups lists 1 options, but the plan has 2 pipeline stages"),
    ("mamba2-tiny", Mesh(pp=2, tp=2), dict(strategies={"groups": ["split", "halves"]}),
     r"groups='halves' is not an option"),
    ("llama-tiny", Mesh(pp=2, tp=2), dict(strategies={"head": ["vocab", "replicate"]}),
     r"head is decided once per plan"),
    ("llama-tiny", Mesh(pp=2, tp=2), dict(strategies={"head": "replicate"}, sequence_parallel=[False, True]),
     r"head='replicate' with sequence_parallel on the last stage"),
    ("llama-tiny", Mesh(pp=2), dict(sequence_parallel=[True, False]), r"sequence_parallel needs tp > 1"),
    ("llama-tiny", Mesh(pp=2, tp=2), dict(sequence_parallel=[1, 0]), r"sequence_parallel must be"),
])
def test_validator_checks_every_stage(preset, mesh, extra, match):
    """Per-stage values: one per model chunk, each valid for its stage (the embedding's and head's
    with the first / last stage's sequence parallelism)."""
    spec = get_spec(preset)
    with pytest.raises(InvalidConfigError, match=match):
        check_plan(Plan(model=spec.name, fingerprint="0" * 16, hardware="cpu", devices=mesh.size, global_batch=4,
                        seq_len=64, mesh=mesh, **extra), spec)


def test_per_stage_plan_round_trips_and_names_each_stage(tmp_path, capsys):
    """A plan listing sequence parallelism and groups per stage: valid, saved and loaded as lists, its
    placements name each stage's strategy; lists that agree are the single value; old files still load."""
    from autoshard.ir import even_stages

    spec = get_spec("mamba2-tiny")
    mesh = Mesh(pp=2, tp=2)
    stages = even_stages(spec.layers, 2)
    plan = Plan(model=spec.name, fingerprint="0" * 16, hardware="cpu", devices=4, global_batch=4, seq_len=64,
                mesh=mesh, sequence_parallel=[True, False], strategies={"groups": ["split", "whole"]}, stages=stages)
    check_plan(plan, spec, world_size=4)
    assert plan.per_stage and plan.stage_sequence_parallel == (True, False)
    assert plan.stage_strategies(1) == (("groups", "whole"),)
    data = plan.to_json()
    assert data["sequence_parallel"] == [True, False] and data["strategies"] == {"groups": ["split", "whole"]}
    assert Plan.from_json(data) == plan
    placements = dict(sharding.block_placements(spec, tp=2, sequence_parallel=plan.sequence_parallel,
                                                strategies=plan.strategies, stages=stages))
    first, last = f"layers.0-{stages[0].end_layer - 1}", f"layers.{stages[1].first_layer}-{spec.layers - 1}"
    assert placements[f"{first}.norm"] == "sequence" and placements[f"{last}.norm"] == "replicate"
    assert placements[f"{first}.mixer.in_proj"] == "colwise"
    assert placements[f"{last}.mixer.in_proj"] == "colwise (groups whole)"
    assert placements["backbone.norm_f"] == "replicate" and placements["backbone.embeddings"] == "vocab"
    same = Plan.from_json({**data, "sequence_parallel": [True, True], "strategies": {"groups": ["whole", "whole"]}})
    assert same.sequence_parallel is True and same.strategies == (("groups", "whole"),) and not same.per_stage
    old = Plan.from_json({**data, "sequence_parallel": True, "strategies": {"groups": "whole"}})
    assert old.stage_sequence_parallel == (True, True) and old.stage_strategies(0) == (("groups", "whole"),)
    from autoshard.cli import main

    path = tmp_path / "plan.json"
    replace(plan, placements=tuple(placements.items())).save(path)
    assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "sequence parallel: on in stages 0" in out and "groups per stage split / whole" in out
    assert "strategy" in out and "groups whole" in out and f"{last}.mixer.in_proj" in out  # (rich wraps cells)


def test_plan_names_the_chosen_strategy_of_every_role():
    spec = get_spec("mamba2-tiny")
    chosen = (("embedding", "replicate"), ("groups", "whole"))
    placements = dict(sharding.block_placements(spec, tp=2, strategies=chosen))
    assert placements["backbone.embeddings"] == "replicate" and placements["lm_head"] == "vocab"
    assert placements["layers.*.mixer.in_proj"] == "colwise (groups whole)"
    plan = _plan(spec, Mesh(tp=2), dict(chosen))
    check_plan(plan, spec)
    assert Plan.from_json(plan.to_json()).strategies == chosen
    assert plan.to_json()["strategies"] == {"embedding": "replicate", "groups": "whole"}
    old = {k: v for k, v in plan.to_json().items() if k != "strategies"}
    assert Plan.from_json(old).strategies == ()  # older files: the table's default layout
    with pytest.raises(InvalidConfigError, match="strategies must be a mapping"):
        _plan(spec, Mesh(tp=2), "replicate")
