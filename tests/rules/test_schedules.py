"""Pipeline schedules as priced (rules/schedules.py): bubble, activations in flight, p2p, rules."""

from fractions import Fraction

import pytest

from autoshard.errors import InvalidConfigError
from autoshard.rules import schedules
from autoshard.passes.cost.pipeline import pipeline_time


@pytest.mark.parametrize("schedule, v, f", [("1f1b", 1, 1), ("gpipe", 1, 1), ("interleaved-1f1b", 2, Fraction(1, 2)),
                                            ("interleaved-1f1b", 4, Fraction(1, 4)), ("zero-bubble", 1, Fraction(1, 3))])
def test_equal_stages_give_the_textbook_bubble(schedule, v, f):
    p, m, t = 4, 8, 1.0
    step = pipeline_time([t] * p, m, schedule=schedule, virtual_stages=v)
    assert schedules.bubble_fraction(schedule, v) == f
    assert step == pytest.approx((m + float(f) * (p - 1)) * t)  # bubble f(p-1)/(m + f(p-1))
    if schedule == "interleaved-1f1b":
        assert (step - m * t) / step == pytest.approx((p - 1) / (v * m + p - 1))


def test_uneven_stages_pay_the_slowest():
    assert pipeline_time([1.0, 3.0], 4) == pytest.approx(4 * 3.0 + 1.0)  # 1F1B: sum + (m - 1) max


def test_micro_batches_in_flight():
    p, m = 4, 16
    assert [schedules.in_flight("1f1b", i, p, m) for i in range(p)] == [4, 3, 2, 1]
    assert [schedules.in_flight("zero-bubble", i, p, m) for i in range(p)] == [4, 3, 2, 1]
    assert [schedules.in_flight("gpipe", i, p, m) for i in range(p)] == [16] * 4
    assert schedules.in_flight("interleaved-1f1b", 0, p, m, 2) == pytest.approx(4 * (1 + 3 / 8))
    assert schedules.p2p_factor("interleaved-1f1b", 3) == 3 and schedules.p2p_factor("1f1b") == 1
    assert schedules.bubble_fraction("zero-bubble", 2) == Fraction(1, 6)  # V placement: two half chunks


@pytest.mark.parametrize("kw, needle", [
    (dict(schedule="interleaved-1f1b", virtual_stages=8, pp=2, microbatches=4, layers=8), "exceeds"),
    (dict(schedule="zero-bubble", virtual_stages=1, pp=4, microbatches=2, layers=8), "at least"),
    (dict(schedule="1f1b", virtual_stages=1, pp=4, microbatches=3, layers=8), "gpipe"),  # the runtime's rule
    # torch runs the micro-batches in rounds of max(1, m // pp): 9 // 4 = 2 does not divide 9
    (dict(schedule="interleaved-1f1b", virtual_stages=2, pp=4, microbatches=9, layers=8), "rounds of 2"),
    (dict(schedule="zero-bubble", virtual_stages=1, pp=2, microbatches=5, layers=8), "rounds of 2"),
])
def test_chunk_rules_are_clear_errors(kw, needle):
    schedule = kw.pop("schedule")
    v = kw.pop("virtual_stages")
    with pytest.raises(InvalidConfigError, match=needle):
        schedules.check_chunks(schedule, v, **kw)


def test_estimate_prices_what_each_schedule_keeps_alive():
    """GPipe (what parallelize(schedule='gpipe') runs) keeps every micro-batch's activations; 1F1B
    and zero-bubble p - i on stage i; interleaving (1 + (p-1)/(pv)) times 1F1B's; zero-bubble's
    fill and drain cost a third of 1F1B's."""
    from dataclasses import replace

    from autoshard.ir import Mesh
    from autoshard.passes.cost.cost import estimate
    from autoshard.passes.cost.layout import Layout
    from tests.passes.cost.test_cost import CT, GB, HW, SEQ, SPEC

    base = Layout(mesh=Mesh(pp=2), micro_batch=1)
    kw = dict(global_batch=GB, seq_len=SEQ)
    one = estimate(CT, SPEC, HW, base, **kw)
    gpipe = estimate(CT, SPEC, HW, replace(base, schedule="gpipe"), **kw)
    inter = estimate(CT, SPEC, HW, replace(base, schedule="interleaved-1f1b", virtual_stages=2), **kw)
    zb = estimate(CT, SPEC, HW, replace(base, schedule="zero-bubble"), **kw)
    from autoshard.ir import BlockKind
    from autoshard.passes.cost.block import block_activation_bytes

    # stage 0 holds the embedding and 2 of the 4 layers: its activations per micro-batch
    per_mb = sum(block_activation_bytes(CT, base, k, seq_len=SEQ, hw=HW) * c
                 for k, c in ((BlockKind.EMBED, 1), (BlockKind.LAYER, 2)))
    first = [e.stage_memory_gb[0] * 1e9 for e in (one, gpipe, inter, zb)]
    assert first[1] - first[0] == pytest.approx(per_mb * (GB - 2))  # all m = GB in flight against p = 2
    assert first[2] - first[0] == pytest.approx(per_mb * 2 * (1 / 4))  # x (1 + (p-1)/(p v)) = 1.25
    assert first[3] == pytest.approx(first[0])
    assert gpipe.step_time_s == pytest.approx(one.step_time_s)
    assert zb.time.pp_bubble == pytest.approx(one.time.pp_bubble / 3)


def test_the_runtime_accepts_what_check_chunks_accepts():
    """ZB-V has no rounds rule; GPipe runs any count; m < pp prices the full path (f = 1)."""
    schedules.check_chunks("zero-bubble", 2, pp=4, microbatches=9, layers=8)
    schedules.check_chunks("gpipe", 1, pp=4, microbatches=1, layers=8)
    schedules.check_chunks("interleaved-1f1b", 2, pp=4, microbatches=3, layers=8)  # one round
    assert schedules.bubble_fraction("interleaved-1f1b", 2, microbatches=3, pp=4) == 1
    assert pipeline_time([1.0] * 4, 1, schedule="interleaved-1f1b", virtual_stages=4) == pytest.approx(4.0)


def test_the_validator_refuses_what_torch_would_refuse():
    from autoshard.ir import Mesh, Plan
    from autoshard.models.presets import get_spec
    from autoshard.rules.validity import check_plan

    spec = get_spec("llama-tiny")
    plan = Plan(model=spec.name, fingerprint="", hardware="cpu", devices=2, global_batch=1, seq_len=16,
                mesh=Mesh(pp=2))
    with pytest.raises(InvalidConfigError, match="gpipe"):
        check_plan(plan, spec)
    from dataclasses import replace

    check_plan(replace(plan, schedule="gpipe"), spec)
