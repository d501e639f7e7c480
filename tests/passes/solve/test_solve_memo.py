"""The planner's shared memos give exactly what pricing each layout alone gives: block times keyed
on (tp, cp, ep) rather than the mesh and priced many at once, and lower_bounds' p2p / bubble / ZeRO terms shared over layouts."""

import pytest

from autoshard.hardware import load_hardware
from autoshard.ir import BlockKind, Precision, Recompute
from autoshard.models.presets import get_spec
from autoshard.passes.cost import cost
from autoshard.passes.cost.block import _block_time, _node_times, block_time, block_times
from autoshard.passes.cost.compiled import compile_table
from autoshard.passes.cost.precision import resolve_precision
from autoshard.passes.capture.shapes import build_cost_table
from autoshard.passes.solve.bounds import lower_bounds
from autoshard.passes.solve.planner import candidate_layouts

CASES = [("llama-tiny", "h100", 16), ("mamba2-tiny", "cpu", 8), ("mixtral-tiny", "h100", 8)]


def _layouts(name, hardware, devices):
    spec, hw = get_spec(name), load_hardware(hardware)
    ct = compile_table(build_cost_table(spec, kernels=hw.kernels), spec)
    layouts = candidate_layouts(spec, devices=devices, global_batch=32, seq_len=256, offload=True,
                                precision=resolve_precision(Precision.AUTO, hw), moe_imbalance=1.25)
    assert len({lay.mesh.pp for lay in layouts}) > 1 and len({lay.zero for lay in layouts}) > 2
    return ct, hw, layouts


@pytest.mark.parametrize("name, hardware, devices", CASES)
def test_memoised_block_times_equal_each_priced_alone(name, hardware, devices):
    """Block times priced together (`block_times`: the node times of many layouts in one numpy pass, then
    memoised) are each layout's priced alone, to the bit."""
    ct, hw, layouts = _layouts(name, hardware, devices)
    for r in Recompute:
        lays = [cost.replace(lay, recompute=r) for lay in layouts[::3]]
        for kind in BlockKind:
            together = block_times(ct, hw, lays, kind, seq_len=256)
            for lay, bt in zip(lays, together):
                alone = _block_time(ct, hw, lay, kind, 256, _node_times(ct, hw, lay, kind, 256))
                assert bt == alone == block_time(ct, hw, lay, kind, seq_len=256)


@pytest.mark.parametrize("name, hardware, devices", CASES)
def test_bounds_with_a_shared_memo_equal_each_layout_alone(name, hardware, devices):
    ct, hw, layouts = _layouts(name, hardware, devices)
    memo = {}
    for lay in layouts:
        shared = lower_bounds(ct, hw, lay, global_batch=32, seq_len=256, memo=memo)
        assert shared == lower_bounds(ct, hw, lay, global_batch=32, seq_len=256, memo={}), lay
