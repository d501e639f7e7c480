"""The MoE cost model, the planner's ep search and bad ep input (no GPU, no processes)."""

from __future__ import annotations

import json

import pytest

from autoshard.cli import main
from autoshard.commands.sweep import sweep
from autoshard.errors import InvalidConfigError
from autoshard.hardware import load_hardware
from autoshard.ir import Mesh, Plan
from autoshard.models import get_spec
from autoshard.passes.cost import moe_cost
from autoshard.passes.cost.compiled import compile_table
from autoshard.passes.cost.cost import estimate
from autoshard.passes.cost.layout import Layout
from autoshard.passes.cost.state import state_bytes
from autoshard.rules.validity import excluded_eps
from autoshard.rules.validity import check_plan
from autoshard.passes.capture.shapes import build_cost_table

H100 = load_hardware("h100")


@pytest.fixture(scope="module")
def mixtral():
    spec = get_spec("mixtral-tiny")
    return spec, compile_table(build_cost_table(spec), spec)


def _est(mixtral, mesh, **kw):
    spec, ct = mixtral
    return estimate(ct, spec, H100, Layout(mesh=mesh, **kw), global_batch=8, seq_len=256)


def test_ep_prices_all_to_alls_and_holds_experts_over_ep(mixtral):
    spec, _ = mixtral
    dp, ep = _est(mixtral, Mesh(dp=4)), _est(mixtral, Mesh(dp=2, ep=2))
    assert dp.time.ep_comm == 0 and ep.time.ep_comm > 0
    saved = spec.layers * spec.expert_params / 2  # half the experts per device
    assert dp.memory.weights - ep.memory.weights == pytest.approx(saved * 2.0)  # bf16 weights
    assert ep.microbatches == dp.microbatches == 2  # the ep peers take their own rows (EP folds into DP)


def test_imbalance_slows_the_ep_step_but_not_memory_and_not_ep1(mixtral):
    even, skew = _est(mixtral, Mesh(ep=4)), _est(mixtral, Mesh(ep=4), moe_imbalance=2.0)
    assert skew.step_time_s > even.step_time_s and skew.time.ep_comm > even.time.ep_comm
    assert skew.memory_gb == even.memory_gb  # memory is taken at the dropless worst case either way
    assert _est(mixtral, Mesh(dp=4), moe_imbalance=2.0).step_time_s == _est(mixtral, Mesh(dp=4)).step_time_s
    with pytest.raises(InvalidConfigError, match="at least 1.0"):
        Layout(mesh=Mesh(ep=2), moe_imbalance=0.5)


def test_worst_case_memory_factor_and_expert_state_sharding():
    mix, qwen = get_spec("mixtral-8x7b"), get_spec("qwen2-moe")
    assert moe_cost.expert_memory_factor(mix, Mesh(ep=8)) == 4.0  # 8 ranks x min(2, 1) / 2
    assert moe_cost.expert_memory_factor(qwen, Mesh(ep=4)) == 4.0  # 4 x min(4, 15) / 4
    assert moe_cost.expert_memory_factor(mix, Mesh(dp=8)) == 1.0
    # ZeRO-1: dense optimizer state over dp x ep x cp = 8, expert state over dp x cp = 2
    mem = state_bytes(100.0, Layout(mesh=Mesh(dp=2, ep=4), zero=1), expert=60.0)
    assert mem.optimizer == pytest.approx(40 * 12 / 8 + 60 * 12 / 2)
    assert mem.weights == pytest.approx(100 * 2.0)


def test_mfu_counts_active_parameters(mixtral):
    spec, ct = mixtral
    from autoshard.passes.cost.cost import model_flops_per_token

    total = sum(b.params * b.count for b in ct.blocks.values())
    active = total - spec.layers * spec.expert_params // 2  # top-2 of 4 experts
    assert model_flops_per_token(ct, 256) == pytest.approx(6 * active + 12 * spec.layers * spec.hidden * 256)


def test_sweep_lists_ep_layouts_and_says_why_an_ep_is_excluded(mixtral, capsys):
    spec, ct = mixtral
    rows = sweep(spec, ct, H100, devices=8, global_batch=16, seq_len=256)
    assert {e.layout.mesh.ep for e in rows} == {1, 2, 4}
    assert excluded_eps(spec, 8, [e.layout.mesh for e in rows]) == \
        ((8, "ep (8) does not divide the 4 experts of mixtral-tiny; use an ep that divides 4"),)
    llama = get_spec("llama-tiny")
    assert all("has no experts" in why for _, why in excluded_eps(llama, 4, [Mesh(dp=4)]))
    assert main(["sweep", "--model", "mixtral-tiny", "--hardware", "h100", "--devices", "8", "--global-batch", "16",
                 "--seq-len", "256", "--moe-imbalance", "1.5", "--limit", "3"]) == 0
    assert "ep=8 excluded: ep (8) does not divide the 4 experts" in capsys.readouterr().out


def _plan(model, mesh):
    return Plan(model=model, fingerprint="", hardware="h100", devices=mesh.size, global_batch=8, seq_len=16, mesh=mesh)


def test_bad_ep_is_one_clear_error():
    with pytest.raises(InvalidConfigError, match=r"ep \(3\) does not divide the 4 experts"):
        check_plan(_plan("mixtral-tiny", Mesh(ep=3)), get_spec("mixtral-tiny"), world_size=3)
    with pytest.raises(InvalidConfigError, match="llama-tiny has no experts"):
        check_plan(_plan("llama-tiny", Mesh(ep=2)), get_spec("llama-tiny"), world_size=2)
    with pytest.raises(InvalidConfigError, match=r"dp \(1\) x ep \(2\) x micro_batch \(1\) = 2"):
        check_plan(_plan("mixtral-tiny", Mesh(ep=2)).__class__(**{**_fields(_plan("mixtral-tiny", Mesh(ep=2))),
                                                                 "global_batch": 3}),
                   get_spec("mixtral-tiny"), world_size=2)


def _fields(plan):
    return {f: getattr(plan, f) for f in plan.__dataclass_fields__}


@pytest.mark.parametrize("argv, needle", [
    (["--moe-imbalance", "0.5"], "--moe-imbalance"),
    (["--moe-imbalance", "x"], "--moe-imbalance"),
])
def test_cli_bad_imbalance_exits_2(capsys, argv, needle):
    with pytest.raises(SystemExit) as e:
        main(["sweep", "--model", "mixtral-tiny", "--hardware", "h100", "--devices", "2", "--global-batch", "2",
              "--seq-len", "64", *argv])
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_show_refuses_a_plan_with_ep_for_a_dense_model(tmp_path, capsys):
    path = tmp_path / "plan.json"
    _plan("llama-tiny", Mesh(ep=2)).save(path)
    assert main(["show", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "llama-tiny has no experts" in err
    json.loads(path.read_text())


def test_planner_searches_ep_and_its_plan_passes_the_runtime_check(mixtral, capsys):
    from autoshard.commands.show import render
    from autoshard.passes.solve.planner import candidate_layouts, solve

    spec, ct = mixtral
    layouts = candidate_layouts(spec, devices=4, global_batch=8, seq_len=256, moe_imbalance=1.5)
    assert {lay.mesh.ep for lay in layouts} == {1, 2, 4} and all(lay.moe_imbalance == 1.5 for lay in layouts)
    plan = solve(spec, "h100", devices=2, global_batch=4, seq_len=256, table=ct, time_limit_s=1.0)
    check_plan(plan, spec, world_size=2)
    assert plan.mesh.size == 2 and plan.predicted["step_time_s"] > 0
    (other,) = plan.solver["other_eps"]  # show says why this ep: what the other ep would cost
    assert {other["ep"], plan.mesh.ep} == {1, 2} and other["why"]
    render(plan)
    out = " ".join(capsys.readouterr().out.split())
    assert f"expert parallelism: ep={plan.mesh.ep}" in out and f"ep={other['ep']}: " in out


def _layout_plan(spec, lay, *, devices, global_batch, seq_len):
    return Plan(model=spec.name, fingerprint="", hardware="h100", devices=devices, global_batch=global_batch,
                seq_len=seq_len, mesh=lay.mesh, micro_batch=lay.micro_batch, zero=lay.zero,
                offload_optimizer=lay.offload_optimizer, schedule=lay.schedule, virtual_stages=lay.virtual_stages,
                sequence_parallel=lay.sequence_parallel, strategies=lay.strategies)


@pytest.mark.parametrize("name", ["mixtral-tiny", "qwen2-moe-tiny"])
def test_every_layout_the_planner_searches_passes_the_runtime_check(name):
    """ep > 1 with every other option the planner searches (ZeRO 0-3, offload, micro-batches, pp): each
    layout is a plan `parallelize` accepts (validity.check_plan, the one validator), ZeRO-3 under ep among
    them (FSDP2: dense over dp x ep, experts over dp, runtime/zero3.py)."""
    from autoshard.passes.solve.planner import candidate_layouts

    spec = get_spec(name)
    for devices, global_batch, seq_len in ((8, 16, 256), (4, 4, 64), (16, 32, 128), (6, 12, 64), (2, 1, 64)):
        layouts = candidate_layouts(spec, devices=devices, global_batch=global_batch, seq_len=seq_len, offload=True)
        assert layouts and any(lay.mesh.ep > 1 for lay in layouts) == (global_batch > 1)
        assert any(lay.mesh.ep > 1 and lay.zero == 3 for lay in layouts) == (global_batch > 1)
        for lay in layouts:
            check_plan(_layout_plan(spec, lay, devices=devices, global_batch=global_batch, seq_len=seq_len), spec,
                       world_size=devices)


def test_sweep_rows_pass_the_runtime_check(mixtral):
    spec, ct = mixtral
    rows = sweep(spec, ct, H100, devices=8, global_batch=8, seq_len=256, zeros=(0, 1, 2, 3))
    assert any(e.layout.mesh.ep == 4 for e in rows)  # dp x ep divides the batch: dp 2 x ep 4, not dp 1 x ep 8
    for e in rows:
        check_plan(_layout_plan(spec, e.layout, devices=8, global_batch=8, seq_len=256), spec, world_size=8)


def test_expert_gradients_sync_over_dp_on_their_own_link():
    """dp 2 x ep 8 on 8-GPU nodes: dense gradients over all 16 ranks, the experts' over the 2 dp peers,
    8 ranks apart (another node): priced on the inter-node link, one group after the other."""
    from autoshard.passes.cost.collectives import Collective, best_time
    from autoshard.passes.cost.state import dp_exposed_time

    lay = Layout(mesh=Mesh(dp=2, ep=8), zero=0, precision="bf16-mixed")
    got = dp_exposed_time(H100, 100e6, lay, backward_s=0.0, forward_s=0.0, expert=60e6)
    want = (best_time(H100, Collective.ALL_REDUCE, 40e6 * 4, size=16, stride=1)  # Megatron's 40M buckets:
            + 2 * best_time(H100, Collective.ALL_REDUCE, 30e6 * 4, size=2, stride=8))  # 60M = two of 30M
    assert got == pytest.approx(want)
    assert best_time(H100, Collective.ALL_REDUCE, 1e9, size=2, stride=8) > \
        best_time(H100, Collective.ALL_REDUCE, 1e9, size=2, stride=1)  # stride 8 leaves the node


def test_expert_sync_over_one_rank_prices_stage_arrays():
    """dp x cp = 1 < ep: the routed experts' sync group is one rank (free) beside the dense group's
    ring; the planner passes one entry per stage split as arrays (it once raised numpy's ValueError)."""
    import numpy as np

    from autoshard.hardware import load_hardware
    from autoshard.ir import Mesh
    from autoshard.passes.cost.layout import Layout
    from autoshard.passes.cost.state import dp_exposed_time

    hw, lay = load_hardware("h100"), Layout(mesh=Mesh(tp=2, ep=4), zero=1)
    params, experts = np.array([1e9, 2e9]), np.array([5e8, 1e9])
    arrays = dp_exposed_time(hw, params, lay, backward_s=np.zeros(2), forward_s=np.zeros(2), expert=experts)
    singles = [dp_exposed_time(hw, p, lay, backward_s=0.0, forward_s=0.0, expert=e) for p, e in zip(params, experts)]
    np.testing.assert_allclose(arrays, singles)
    assert singles[1] > singles[0] > 0  # the dense group's ring, over ep = 4 ranks, is paid
