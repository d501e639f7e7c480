"""FP8 pricing (issue 28): the float8 GEMMs at the FP8 rate plus torchao's casts, checked by hand on the toy
table of test_cost.py; profiles without FP8 tensor cores refused by name; the planner's precision choice."""

import dataclasses

import numpy as np
import pytest

from autoshard.errors import InvalidConfigError
from autoshard.hardware import load_hardware
from autoshard.ir import BlockKind, Mesh, Precision
from autoshard.models.presets import get_spec
from autoshard.passes.cost import cost
from autoshard.passes.cost.block import _node_times
from autoshard.passes.cost.state import zero3_time
from autoshard.passes.cost.cost import estimate
from autoshard.passes.cost.layout import Layout
from autoshard.passes.solve.planner import planner_precisions, solve

from tests.passes.cost.test_cost import CT, GB, HW, SEQ, SPEC, H

# the toy device with FP8 twice its bf16 peak, no shape penalty
FP8_HW = dataclasses.replace(HW, fp8_peak_flops=2e12, fp8_gemm_efficiency=1.0, fp8_gemm_half_dim=1e-9)


def _layer_times(hw, **kw):
    return _node_times(CT, hw, cost.resolved(Layout(mesh=Mesh(), **kw), hw), BlockKind.LAYER, SEQ)


def test_float8_gemms_by_hand():
    """up_proj (a float8 role) runs at the FP8 rate and pays 5 B per element of both its operands (amax read,
    read + write of the cast) at the vector rate; norms unchanged; the LM head (not float8) stays bf16."""
    t = SEQ
    bf16 = _layer_times(FP8_HW, precision="bf16-mixed")
    fp8 = _layer_times(FP8_HW, precision="fp8")
    assert fp8[0] == bf16[0] and fp8[3] == bf16[3]  # the norms
    fwd_flops, bwd_flops = 2 * t * H * 256, 4 * t * H * 256
    assert bf16[1] == pytest.approx(fwd_flops / 1e12)
    assert fp8[1] == pytest.approx(fwd_flops / 2e12 + 5 * (t * H + H * 256) / 1e11)  # (t x H) . (H x 256)
    assert fp8[2] == pytest.approx(bwd_flops / 2e12 + 5 * (t * 256 + 256 * H) / 1e11)  # gemm (1, t, H, 256)
    head = lambda p: _node_times(CT, FP8_HW, Layout(mesh=Mesh(), precision=p), BlockKind.HEAD, SEQ)  # noqa: E731
    assert np.array_equal(head("fp8"), head("bf16-mixed"))


def test_fp8_state_is_bf16_mixed_and_tensorwise_gathers_float8():
    """Memory per parameter as bf16-mixed (torchao saves the bf16 input and weight, no float8 copy kept); under
    ZeRO-3 tensorwise all-gathers 1 B per parameter (FSDP2 float8 all-gather), rowwise bf16's 2."""
    kw = dict(global_batch=GB, seq_len=SEQ)
    mesh = Mesh(dp=2)
    bf16, tensorwise, rowwise = (estimate(CT, SPEC, FP8_HW, Layout(mesh=mesh, zero=3, **p), **kw)
                                 for p in ({"precision": "bf16-mixed"}, {"precision": "fp8", "fp8_recipe": "tensorwise"},
                                           {"precision": "fp8", "fp8_recipe": "rowwise"}))
    assert tensorwise.memory.weights == bf16.memory.weights == rowwise.memory.weights
    assert tensorwise.memory.optimizer == bf16.memory.optimizer
    assert tensorwise.memory.activations == bf16.memory.activations
    assert tensorwise.memory.buffers < rowwise.memory.buffers == bf16.memory.buffers  # the gathered layer
    z3 = {name: zero3_time(FP8_HW, 1e6, Layout(mesh=mesh, zero=3, precision="fp8", fp8_recipe=name))
          for name in ("tensorwise", "rowwise")}
    assert z3["tensorwise"] < z3["rowwise"] == zero3_time(FP8_HW, 1e6, Layout(mesh=mesh, zero=3,
                                                                                      precision="bf16-mixed"))


@pytest.mark.parametrize("name", ["ascend-910b", "a100-80g", "cpu"])
def test_fp8_refused_without_fp8_tensor_cores(name):
    hw = load_hardware(name)
    with pytest.raises(InvalidConfigError, match=rf"precision 'fp8' on {name}: the profile has no FP8 tensor cores"):
        estimate(CT, SPEC, hw, Layout(mesh=Mesh(), precision="fp8"), global_batch=GB, seq_len=SEQ)
    assert planner_precisions(hw) == ((Precision.BF16_MIXED if name != "cpu" else Precision.FP32, None),)


def test_a_profile_gives_all_fp8_fields_or_none():
    with pytest.raises(InvalidConfigError, match="give all of fp8_peak_flops, fp8_gemm_efficiency"):
        dataclasses.replace(HW, fp8_peak_flops=2e12, fp8_gemm_efficiency=None, fp8_gemm_half_dim=None)


def test_the_planner_chooses_the_precision():
    """On an H100 the planner searches bf16-mixed and fp8 with both recipes with the rest of the layout: llama-7b's
    4096-wide GEMMs gain more from FP8 than its casts cost, llama-1b's 2048-wide ones at batch 1 x 2048 do not."""
    plans = {name: solve(get_spec(name), "h100", devices=8, global_batch=16, seq_len=2048, time_limit_s=2.0)
             for name in ("llama-7b", "llama-1b")}
    assert (plans["llama-7b"].precision, plans["llama-7b"].fp8_recipe.value) == (Precision.FP8, "tensorwise")
    assert plans["llama-1b"].precision is Precision.AUTO  # bf16-mixed, the device's default
    assert plans["llama-7b"].to_json()["fp8_recipe"] == "tensorwise"
