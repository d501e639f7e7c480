"""The planner's vectorised bounds (passes/solve/bounds.py `bound_columns`) are `lower_bounds` of each layout,
to the bit, at two (batch, seq) shapes in one process (the layouts' keys are kept over plans), and leave
the memo `refined_step_bound` reads as `lower_bounds` leaves it; the lazy bounds the search reads
(`LazyBounds`) give the same bounds in the same order: the search visits the same layouts in the same
order, so it finds the same plan."""

import numpy as np
import pytest

from autoshard.hardware import load_hardware
from autoshard.ir import BlockKind, Precision
from autoshard.models.presets import get_spec
from autoshard.passes.cost.compiled import compile_table
from autoshard.passes.solve.bounds import LazyBounds, bound_columns, least_block_s, lower_bounds, refined_step_bound
from autoshard.passes.cost.precision import resolve_precision
from autoshard.passes.cost.shape_memo import KEEP
from autoshard.passes.capture.shapes import build_cost_table
from autoshard.passes.solve.planner import candidate_layouts, solve

CASES = [("llama-tiny", "h100", 16), ("mamba2-tiny", "cpu", 8), ("mixtral-tiny", "h100", 8)]
SHAPES = [(32, 256), (64, 128), (32, 256)]  # the last: a re-plan at the first shape


@pytest.mark.parametrize("name, hardware, devices", CASES)
def test_bound_columns_equal_lower_bounds_of_each_layout(name, hardware, devices):
    spec, hw = get_spec(name), load_hardware(hardware)
    ct = compile_table(build_cost_table(spec, kernels=hw.kernels), spec)
    for batch, seq in SHAPES:
        kw = dict(global_batch=batch, seq_len=seq)
        layouts = candidate_layouts(spec, devices=devices, offload=True, moe_imbalance=1.25,
                                    precision=resolve_precision(Precision.AUTO, hw), **kw)
        assert len({lay.mesh.pp for lay in layouts}) > 1 and len({lay.mesh.ep for lay in layouts}) > (name == "mixtral-tiny")
        memo, alone = {}, {}
        cols = bound_columns(ct, hw, layouts, memo=memo, **kw)
        for k, lay in enumerate(layouts):
            b = lower_bounds(ct, hw, lay, memo=alone, **kw)
            assert (cols.step_s[k], cols.peak_bytes[k]) == (b.step_s, b.peak_bytes), lay
            block_s = cols.block_s[int(cols.block_code[k])]
            assert block_s == least_block_s(ct, hw, lay, seq_len=seq), lay
            if k % 7 == 0:  # the memo the search hands refined_step_bound
                assert refined_step_bound(ct, hw, lay, b, block_s=block_s, memo=memo, **kw) == \
                    refined_step_bound(ct, hw, lay, b, block_s=block_s, memo=alone, **kw), lay
        order = np.argsort(cols.step_s, kind="stable").tolist()
        assert order == sorted(range(len(layouts)), key=lambda k: (lower_bounds(ct, hw, layouts[k], **kw).step_s, k))
        # the search's lazy bounds: a floor under every bound, the same bounds in the same order, priced as asked
        lazy = LazyBounds(ct, hw, layouts, memo={}, **kw)
        assert (lazy.floor_s <= cols.step_s).all() and (lazy.peak_bytes == cols.peak_bytes).all()
        odd = np.arange(1, len(layouts), 2)
        assert lazy.least(odd) == cols.step_s[odd].min()  # a subset first: some codes priced, others not
        assert np.isnan(lazy.step_s).any()
        assert list(lazy.ordered(np.arange(len(layouts)))) == order
        assert (lazy.step_s == cols.step_s).all()


@pytest.mark.parametrize("name, hardware, devices", CASES)
def test_a_re_plan_in_process_gives_the_fresh_plan(name, hardware, devices):
    """Planning shape after shape with one table (the planner's memos, its Layouts and their keys kept over
    plans) gives at each shape the plan a table of its own gives."""
    spec, hw = get_spec(name), load_hardware(hardware)
    ct = compile_table(build_cost_table(spec, kernels=hw.kernels), spec)
    def plan(b, s, table):
        p = solve(spec, hw, devices=devices, global_batch=b, seq_len=s, table=table, fingerprint="t").to_json()
        p["solver"].pop("solve_time_s")
        return p

    plans = [plan(b, s, ct) for b, s in SHAPES]
    fresh = {(b, s): plan(b, s, compile_table(build_cost_table(spec, kernels=hw.kernels), spec))
             for b, s in SHAPES[:2]}  # each shape planned in a table of its own: no memo of another shape
    assert plans[0] == plans[2] == fresh[SHAPES[0]]
    assert plans[1] == fresh[SHAPES[1]]  # a re-plan at a new shape in the same process: the fresh plan


@pytest.mark.parametrize("name, hardware, devices", CASES[:2])
def test_memos_stay_bounded_over_many_shapes(name, hardware, devices):
    """Planning more sequence lengths than `shape_memo.KEEP` with one table, twice over: each block holds the
    shape-dependent entries of the last KEEP sequence lengths planned only, those of each exactly what a table of
    its own holds after planning that shape; the shape-independent memos (a block's `memo`, the table's) do not
    grow on the second pass; and every plan is the one a table of its own gives."""
    spec, hw = get_spec(name), load_hardware(hardware)
    new_table = lambda: compile_table(build_cost_table(spec, kernels=hw.kernels), spec)
    ct = new_table()
    shapes = [(32 if i % 2 else 64, 64 * (i + 1)) for i in range(KEEP + 3)]

    def plan(b, s, table):
        p = solve(spec, hw, devices=devices, global_batch=b, seq_len=s, table=table, fingerprint="t").to_json()
        p["solver"].pop("solve_time_s")
        return p

    def held(table):
        return {kind: {s: set(d) for s, d in blk.shaped.held().items()} for kind, blk in table.blocks.items()}

    planned, fresh, sizes = [], {}, []
    for _ in range(2):
        for b, s in shapes:
            if (b, s) not in fresh:
                table = new_table()
                fresh[b, s] = (plan(b, s, table), held(table))
            assert plan(b, s, ct) == fresh[b, s][0], (b, s)
            planned = [x for x in planned if x != s] + [s]
            for kind, by_seq in held(ct).items():
                assert list(by_seq) == planned[-KEEP:]  # least recent first
                assert by_seq[s] == fresh[b, s][1][kind][s]
            assert len(ct.block(BlockKind.LAYER).shaped) == sum(map(len, held(ct)[BlockKind.LAYER].values()))
        sizes.append(({kind: len(blk.memo) for kind, blk in ct.blocks.items()}, len(ct.memo)))
    assert sizes[1] == sizes[0]
