"""The planner's lower bounds (passes/solve/bounds.py) never exceed what a layout can reach, so skipping a
layout on them never changes the plan; the slowest-stage floor is the brute-force least slowest stage."""

import itertools
import random

import pytest

from autoshard.hardware import load_hardware
from autoshard.models.presets import get_spec
from autoshard.passes.cost.compiled import compile_table
from autoshard.passes.solve.bounds import least_block_s, lower_bounds, refined_step_bound, slowest_stage_floor
from autoshard.passes.cost.precision import resolve_precision
from autoshard.passes.capture.shapes import build_cost_table
from autoshard.passes.solve.planner import candidate_layouts, solve_mesh
from autoshard.passes.solve.solve_model import mesh_problem
from autoshard.ir import Precision


def test_slowest_stage_floor_is_the_least_slowest_stage_of_any_split():
    rng = random.Random(0)
    for _ in range(300):
        pp, layers = rng.randint(2, 4), rng.randint(2, 9)
        first, middle, last, layer = (rng.choice([0.0, rng.uniform(0, 3)]) for _ in range(4))
        v = rng.choice([1, 1, 2])
        lows = (v - 1, v)
        fixed = [first] + [middle] * (pp - 2) + [last]
        least = [lows[0]] + [lows[1]] * (pp - 2) + [lows[0]]
        best = min((max(f + n * layer for f, n in zip(fixed, split))
                    for split in itertools.product(range(layers + 1), repeat=pp)
                    if sum(split) == layers and all(n >= lo for n, lo in zip(split, least))), default=None)
        if best is None:
            continue
        floor = slowest_stage_floor(pp, layers, first_s=first, middle_s=middle, last_s=last, layer_s=layer,
                                    min_layers=lows)
        assert best - 1e-5 * max(layer, 1e-9) <= floor <= best, (pp, layers, fixed, layer, v)


@pytest.mark.parametrize("name, hardware", [("llama-tiny", "h100"), ("mamba2-tiny", "cpu"), ("mixtral-tiny", "h100")])
def test_bounds_never_exceed_a_layouts_optimum(name, hardware):
    spec, hw = get_spec(name), load_hardware(hardware)
    ct = compile_table(build_cost_table(spec, kernels=hw.kernels), spec)
    kw = dict(global_batch=32, seq_len=256)
    layouts = candidate_layouts(spec, devices=8, offload=True, precision=resolve_precision(Precision.AUTO, hw),
                                **kw)
    memo, checked, tighter = {}, 0, 0
    # every layout, dp x cp = 1 < ep included (a one-rank expert group: dp_exposed_time once failed there)
    for lay in layouts[::2]:
        b = lower_bounds(ct, hw, lay, memo=memo, **kw)
        block_s = least_block_s(ct, hw, lay, seq_len=kw["seq_len"])  # (per-stage choices: the least variant)
        refined = refined_step_bound(ct, hw, lay, b, block_s=block_s, memo=memo, **kw)
        problem = mesh_problem(ct, hw, lay, **kw)
        best = solve_mesh(problem, cutoff_s=float("inf"))
        assert b.step_s <= refined
        if best.assignment is None:
            continue
        assert refined <= best.step_s * (1 + 1e-12), lay
        checked, tighter = checked + 1, tighter + (refined > b.step_s * (1 + 1e-9))
    assert checked > 50 and tighter > checked // 4  # the refinement bites on many layouts


@pytest.mark.parametrize("name, hardware", [("llama-tiny", "h100"), ("mamba2-tiny", "cpu")])
def test_single_stage_bound_with_memory_binding_never_exceeds_the_optimum(name, hardware):
    """pp = 1 on a device whose memory binds (the median no-recompute peak of the layouts): the refined bound
    takes the fastest recompute level that can fit, so it never exceeds a layout's optimum, and it bites (above
    the bound with memory aside, or infinite where no level fits) on some layouts."""
    from dataclasses import replace

    spec, roomy = get_spec(name), load_hardware(hardware)
    ct = compile_table(build_cost_table(spec, kernels=roomy.kernels), spec)
    kw = dict(global_batch=32, seq_len=256)
    layouts = [lay for lay in candidate_layouts(spec, devices=8, precision=resolve_precision(Precision.AUTO,
                                                                                             roomy), **kw)
               if lay.mesh.pp == 1]
    peaks = sorted(float(mesh_problem(ct, roomy, lay, **kw).mem_bytes[0, 0, -1]) for lay in layouts)
    hw = replace(roomy, memory_bytes=peaks[len(peaks) // 2])
    memo, aside, bites = {}, {}, 0
    for lay in layouts:
        b = lower_bounds(ct, hw, lay, memo=memo, **kw)
        block_s = least_block_s(ct, hw, lay, seq_len=kw["seq_len"])
        refined = refined_step_bound(ct, hw, lay, b, block_s=block_s, memo=memo, **kw)
        loose = refined_step_bound(ct, roomy, lay, lower_bounds(ct, roomy, lay, memo=aside, **kw), block_s=block_s,
                                   memo=aside, **kw)
        best = solve_mesh(mesh_problem(ct, hw, lay, **kw), cutoff_s=float("inf"))
        if best.assignment is not None:
            assert refined <= best.step_s * (1 + 1e-12), lay
        bites += refined > loose * (1 + 1e-9)
    assert bites > len(layouts) // 10, (bites, len(layouts))
