"""Continuous batching (passes/serving/continuous_batching.py) on replica times set by hand, whose steady
state, percentiles and limits are known in closed form; and on llama-tiny's table end to end."""

import math

import numpy as np
import pytest

from autoshard.errors import InvalidConfigError
from autoshard.hardware import load_hardware
from autoshard.models.presets import get_spec
from autoshard.passes.serving import continuous_batching as cb
from autoshard.passes.serving.continuous_batching import ReplicaTimes, estimate_continuous
from autoshard.passes.serving.inference_cost import ServeLayout

SPEC = get_spec("llama-tiny")
HW = load_hardware("h100")
D, F, O = 0.010, 0.020, 65  # a decode step of 10 ms whatever the batch, 20 ms per prefill, 65 output tokens


def flat(max_sequences=10_000, slope=0.0):
    return ReplicaTimes(decode=lambda n: D + slope * n, prefill_s=F, max_sequences=max_sequences)


def test_steady_state_is_littles_law_with_prefills_in_the_iterations():
    lam = 10.0  # lam F = 0.2 of every iteration's time goes to prefills
    e = estimate_continuous(None, SPEC, HW, ServeLayout(replicas=2), request_rate=2 * lam, prompt_len=8,
                            output_len=O, times=flat())
    t = D / (1 - lam * F)  # 12.5 ms
    assert e.stable and e.iteration_s == pytest.approx(t) and e.tpot_p50_s == pytest.approx(t)
    assert e.running == pytest.approx(lam * (O - 1) * t)  # 8 sequences per replica
    # a flat decode step: the TPOT spread is the chained prefills' alone, over O - 1 correlated iterations
    assert e.tpot_p99_s == pytest.approx(t + cb.Z99 * math.sqrt(lam * t) * F / ((1 - lam * F) * math.sqrt(O - 1)))
    assert e.throughput_tokens_per_s == pytest.approx(2 * lam * O)
    # TTFT: at least the decode step and its own prefill, at most a long iteration more
    assert D + F < e.ttft_p50_s < e.ttft_p99_s < 2 * (D + 8 * F)


def test_ttft_quantiles_are_those_of_the_chained_iterations():
    lam = 10.0
    window = cb._admitted(D, F, lam)
    assert (window * np.arange(len(window))).sum() == pytest.approx(lam * D / (1 - lam * F))  # mean lam t
    got = [cb._ttft_quantile(q, decode_s=D, prefill_s=F, lam=lam, window=window) for q in (0.5, 0.99)]
    rng = np.random.default_rng(0)  # the same model sampled: the chain, a length-biased window, the others in it
    k = np.zeros(200_000, dtype=int)
    for i in range(1, k.size):
        k[i] = rng.poisson(lam * (D + k[i - 1] * F))
    window_s = D + k * F
    picked = window_s[rng.random(k.size) < window_s / window_s.max()]  # length-biased by rejection
    ttft = rng.random(picked.size) * picked + D + (1 + rng.poisson(lam * picked)) * F
    assert got == pytest.approx(np.quantile(ttft, [0.5, 0.99]), rel=0.02)


def test_limits_prefill_saturation_and_memory():
    lay = ServeLayout()
    e = estimate_continuous(None, SPEC, HW, lay, request_rate=1 / F, prompt_len=8, output_len=O, times=flat())
    assert not e.stable and "prefill saturates" in e.limit and e.throughput_tokens_per_s == 0
    e = estimate_continuous(None, SPEC, HW, lay, request_rate=10, prompt_len=8, output_len=O, times=flat(10))
    assert not e.stable and "memory" in e.limit  # 8 running on average, p99 ~15 > 10 that fit
    with pytest.raises(InvalidConfigError, match="request rate"):
        estimate_continuous(None, SPEC, HW, lay, request_rate=0, prompt_len=8, output_len=O, times=flat())


def test_a_decode_step_growing_with_the_batch_settles_at_the_least_fixed_point():
    e = estimate_continuous(None, SPEC, HW, ServeLayout(), request_rate=10, prompt_len=8, output_len=O,
                            times=flat(slope=1e-4))
    t = (D + 1e-4 * e.running) / (1 - 10 * F)  # t = D(n) / (1 - lam F) at n = lam (O - 1) t
    assert e.iteration_s == pytest.approx(t, rel=1e-6) and e.running == pytest.approx(10 * (O - 1) * t, rel=1e-6)
    assert e.tpot_p99_s > e.tpot_p50_s


def test_plan_continuous_on_a_real_table_ranks_the_layouts_meeting_the_targets_first():
    from autoshard.passes.capture.shapes import build_cost_table

    table = build_cost_table(SPEC)
    choice = cb.plan_continuous(table, SPEC, HW, devices=4, request_rate=50.0, prompt_len=512, output_len=64,
                                ttft_slo_s=0.05, tpot_slo_s=0.005)
    meets = [e.meets(0.05, 0.005) for e, _ in choice.rows]
    assert meets == sorted(meets, reverse=True) and meets[0]
    best, rate = choice.rows[0]
    assert rate >= 50.0 and best.ttft_p99_s <= 0.05 and best.tpot_p99_s <= 0.005
    at_max = estimate_continuous(table, SPEC, HW, best.layout, request_rate=rate, prompt_len=512, output_len=64)
    beyond = estimate_continuous(table, SPEC, HW, best.layout, request_rate=rate * 1.05, prompt_len=512, output_len=64)
    assert at_max.meets(0.05, 0.005) and not beyond.meets(0.05, 0.005)
    assert choice.to_json(0.05, 0.005)["best"]["meets_slos"] is True
