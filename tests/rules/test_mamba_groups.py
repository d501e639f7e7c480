"""Mamba-2 tensor parallelism for any group count (sharding table `whole` pieces): when tp does not
divide n_groups the heads are split and B/C kept whole, and the rewrite, the cost model and the
validator agree. The gloo equivalence runs are in tests/runtime/test_equivalence.py."""

from __future__ import annotations

import dataclasses
import math

import pytest

import torch

from autoshard.ir import BlockKind, Mesh, Plan
from autoshard.models.presets import get_spec
from autoshard.rules import sharding
from autoshard.rules.validity import valid_meshes
from autoshard.ir import Shard
from autoshard.passes.rewrite import shard_program
from autoshard.runtime.tensor_parallel import shard_tensor, unshard

ONE = dataclasses.replace(get_spec("mamba2-tiny"), name="mamba2-tiny-1group", groups=1)


def _program(spec, tp, rank):
    plan = Plan(model=spec.name, fingerprint="", hardware="cpu", devices=tp, global_batch=tp, seq_len=16,
                mesh=Mesh(tp=tp))
    from autoshard.models.presets import build_model

    shapes = {n: tuple(p.shape) for n, p in build_model(spec, device="meta").named_parameters()}
    return shard_program(plan, spec, shapes, tp_rank=rank), shapes


def test_one_group_at_tp2_splits_heads_and_keeps_b_c_whole():
    assert sharding.tp_violation(get_spec("mamba2-1b"), 2) is None  # one group, tp 2: allowed now
    program, shapes = _program(ONE, 2, 1)
    inner, gn, heads = ONE.intermediate, ONE.groups * ONE.state, ONE.heads
    in_proj = program.placement("backbone.layers.0.mixer.in_proj.weight")
    assert isinstance(in_proj, Shard) and in_proj.whole == (False, False, True, True, False)
    assert in_proj.local_sizes() == (inner // 2, inner // 2, gn, gn, heads // 2)
    assert in_proj.ranges()[2] == (2 * inner, gn)  # B: every rank the whole piece
    assert {"backbone.layers.0.mixer.in_proj.weight", "backbone.layers.0.mixer.conv1d.weight",
            "backbone.layers.0.mixer.conv1d.bias"} <= set(program.partial_grads)
    attrs = {(p, a): v for p, a, v in program.attrs if p == "backbone.layers.0.mixer"}
    assert attrs[("backbone.layers.0.mixer", "n_groups")] == 1
    assert attrs[("backbone.layers.0.mixer", "ssd_head_offset")] == heads // 2
    assert attrs[("backbone.layers.0.mixer", "ssd_norm_group_size")] == inner
    full = torch.arange(float(sum(in_proj.segments) * 3)).reshape(-1, 3)
    slices = [shard_tensor(full, _program(ONE, 2, r)[0].placement("backbone.layers.0.mixer.in_proj.weight"))
              for r in range(2)]
    torch.testing.assert_close(unshard(slices, in_proj), full)


def test_groups_tp_divides_are_split_as_before():
    program, _ = _program(get_spec("mamba2-tiny"), 2, 0)  # 2 groups, tp 2
    in_proj = program.placement("backbone.layers.0.mixer.in_proj.weight")
    assert in_proj.whole == () and "backbone.layers.0.mixer.in_proj.weight" not in program.partial_grads


def test_cost_model_holds_the_whole_b_c_on_every_rank():
    spec = get_spec("mamba2-1b")
    role = next(r for r in sharding.table(spec) if r.path == "mixer.in_proj")
    inner, gn, heads = spec.intermediate, spec.groups * spec.state, spec.heads
    held = 2 * inner / 2 + 2 * gn + heads / 2
    assert sharding.role_divisor(spec, role, 2) == (2 * inner + 2 * gn + heads) / held
    total = 10**9
    per_rank = sharding.params_per_rank(spec, BlockKind.LAYER, total, 2)
    assert total / 2 < per_rank < total / 2 + 2 * gn * (spec.hidden + spec.conv + 1)


def test_mamba2_1b_gets_tp_layouts_and_a_bad_tp_names_the_numbers():
    tps = {m.tp for m in valid_meshes(get_spec("mamba2-1b"), 8, global_batch=1024, seq_len=4096)}
    assert {2, 4, 8} <= tps
    why = sharding.tp_violation(dataclasses.replace(get_spec("mamba2-tiny"), vocab=255), 3)  # vocab splits
    assert why is not None and "tp (3)" in why and "heads" in why and "(8)" in why


@pytest.mark.parametrize("name, tp", [("llama-tiny", 4), ("mamba2-tiny-1group", 2)])
def test_the_cost_model_prices_the_partial_gradients_the_runtime_sums(name, tp):
    """The elements per layer the cost model's tp gradient sums move (`sharding.partial_grad_sizes`) are those the
    runtime all-reduces (`partial_grads`: GQA's KV heads shared by tp / kv_heads ranks, one slot per part, the whole
    weight; Mamba-2's B / C rows kept whole on every rank): the layer-0 weights of the program's partial gradients."""
    spec = ONE if name == ONE.name else get_spec(name)
    program, shapes = _program(spec, tp, 0)
    placements = dict(program.placements)
    moved = []
    for param in program.partial_grads:
        placement = placements[param]
        if ".layers.0." not in f".{param}" or not param.endswith("weight") or not isinstance(placement, Shard):
            continue
        shape = shapes[param]
        rest = math.prod(shape) // shape[placement.dim]
        rows = sum(n for i, n in enumerate(placement.segments) if placement.kept_whole(i)) if placement.whole else \
            shape[placement.dim]  # whole pieces: their rows; else a slot per part, the whole weight
        moved.append(float(rows * rest))
    priced = [n for n, on in sharding.partial_grad_sizes(spec, tp) if on == 1.0]
    assert moved and sorted(moved) == sorted(priced)
