"""Serving planner on hand-built tables: the best batch and layout by brute force, disaggregation,
and the one-line error for targets nothing meets."""

import dataclasses
import itertools
import random

import pytest

from autoshard.api import _resolve_plan
from autoshard.errors import InfeasiblePlanError, InvalidConfigError
from autoshard.passes.serving import serving
from autoshard.passes.serving.inference_cost import ServeLayout, compile_inference_table, estimate_serving
from autoshard.passes.serving.serving import layouts, plan_serving
from autoshard.ir import Mesh
from autoshard.model_spec import Mixer
from autoshard.models.presets import get_spec, spec_from_hf_config
from autoshard.rules.sharding import runnable_strategies
from autoshard.rules.validity import check_plan, generate_violation
from tests.passes.serving.test_inference_cost import HW, LLAMA, LLAMA_TABLE, MAMBA, MAMBA_TABLE
from tests.rules.test_plan_validity import random_spec

P, O = 256, 32


def _brute_force(table, spec, devices, ttft, tpot, cap):
    best = None
    for tp, pp, ep in layouts(spec, devices):
        for b in range(1, cap + 1):
            e = estimate_serving(table, spec, HW, ServeLayout(tp=tp, pp=pp, ep=ep, replicas=devices // (tp * pp * ep),
                                                              batch=b), prompt_len=P, output_len=O)
            if e.fits and e.ttft_s <= ttft and e.tpot_s <= tpot and (
                    best is None or e.throughput_tokens_per_s > best.throughput_tokens_per_s):
                best = e
    return best


@pytest.mark.parametrize("table, spec", [(LLAMA_TABLE, LLAMA), (MAMBA_TABLE, MAMBA)], ids=["llama", "mamba2"])
def test_colocated_choice_is_the_brute_force_optimum(monkeypatch, table, spec):
    monkeypatch.setattr(serving, "MAX_BATCH", 48)
    ref = estimate_serving(table, spec, HW, ServeLayout(batch=8), prompt_len=P, output_len=O)
    ttft, tpot = 3 * ref.ttft_s, ref.tpot_s + 2e-4  # TTFT binds inside 1..48; room for tp / pp latencies
    choice = plan_serving(table, spec, HW, devices=4, prompt_len=P, output_len=O, ttft_slo_s=ttft,
                          tpot_slo_s=tpot, disaggregation=False)
    expected = _brute_force(table, spec, 4, ttft, tpot, 48)
    (role, got), = choice.best.pools
    assert role == "both" and got.layout == expected.layout
    assert choice.best.ttft_s <= ttft and choice.best.tpot_s <= tpot
    assert choice.runner_up is not None and choice.runner_up.shape != choice.best.shape
    assert "tokens/s" in choice.why_runner_up_lost and "capped by" in choice.why_runner_up_lost


def test_layouts_are_the_ones_the_runtime_accepts():
    # llama-tiny: 4 heads, 2 KV heads, 4 layers: tp 8 divides no head count; pp <= 4
    assert set(layouts(LLAMA, 8)) == {(tp, pp, 1) for tp, pp in ((1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 4),
                                                                  (4, 1), (4, 2))}
    # mixtral-tiny, 4 experts: ep divides them (generate slices the experts over ep), 1 for a dense model
    moe = layouts(get_spec("mixtral-tiny"), 8)
    assert {ep for _, _, ep in moe} == {1, 2, 4} and (1, 1, 4) in moe and (2, 1, 2) in moe


def test_disaggregated_pools_split_the_devices_and_price_the_transfer():
    ref = estimate_serving(LLAMA_TABLE, LLAMA, HW, ServeLayout(batch=1), prompt_len=P, output_len=O)
    choice = plan_serving(LLAMA_TABLE, LLAMA, HW, devices=4, prompt_len=P, output_len=O,
                          ttft_slo_s=1.2 * ref.ttft_s, tpot_slo_s=100 * ref.tpot_s)
    best = choice.best
    if best.mode == "disaggregated":  # a tight TTFT and a loose TPOT: splitting the pools pays
        (_, pre), (_, dec) = best.pools
        assert pre.layout.devices + dec.layout.devices == 4
        assert best.transfer_s == pytest.approx(serving.transfer_seconds(
            compile_inference_table(LLAMA_TABLE, LLAMA), HW, batch=pre.layout.batch, prompt_len=P, devices=4))
        assert best.ttft_s == pytest.approx(pre.ttft_s + best.transfer_s) and best.ttft_s <= 1.2 * ref.ttft_s
        prefill_rate = pre.layout.replicas * pre.layout.batch / pre.ttft_s
        decode_rate = dec.layout.replicas * dec.layout.batch / ((O - 1) * dec.tpot_s)
        assert best.throughput_tokens_per_s == pytest.approx(O * min(prefill_rate, decode_rate))
    colocated = plan_serving(LLAMA_TABLE, LLAMA, HW, devices=4, prompt_len=P, output_len=O,
                             ttft_slo_s=1.2 * ref.ttft_s, tpot_slo_s=100 * ref.tpot_s, disaggregation=False)
    assert best.throughput_tokens_per_s >= colocated.best.throughput_tokens_per_s


def test_transfer_of_mamba2_state_does_not_grow_with_the_prompt():
    mamba, llama = compile_inference_table(MAMBA_TABLE, MAMBA), compile_inference_table(LLAMA_TABLE, LLAMA)
    short, long = (serving.transfer_seconds(mamba, HW, batch=4, prompt_len=p, devices=4) for p in (128, 8192))
    assert short == long
    short, long = (serving.transfer_seconds(llama, HW, batch=4, prompt_len=p, devices=4) for p in (128, 8192))
    assert long > short


def test_unmeetable_targets_name_the_best_reachable_and_the_binding_constraint():
    with pytest.raises(InfeasiblePlanError) as e:
        plan_serving(LLAMA_TABLE, LLAMA, HW, devices=4, prompt_len=P, output_len=O, ttft_slo_s=1e-9,
                     tpot_slo_s=1.0)
    msg = str(e.value)
    assert "\n" not in msg and "best reachable TTFT" in msg and "TTFT target" in msg and "binds" in msg
    with pytest.raises(InfeasiblePlanError, match="TPOT target"):
        plan_serving(LLAMA_TABLE, LLAMA, HW, devices=4, prompt_len=P, output_len=O, ttft_slo_s=1.0,
                     tpot_slo_s=1e-9)
    with pytest.raises(InvalidConfigError, match="positive"):
        plan_serving(LLAMA_TABLE, LLAMA, HW, devices=4, prompt_len=P, output_len=O, ttft_slo_s=0, tpot_slo_s=1)


def test_largest_batch_bisects_a_monotone_predicate():
    assert serving.largest_batch(lambda b: b <= 37) == 37
    assert serving.largest_batch(lambda b: False) == 0
    assert serving.largest_batch(lambda b: True, cap=100) == 100


def _random_spec(rng: random.Random):
    """A small user-built LLaMA, Mamba-2 (any n_groups: tp may keep them whole) or Mixtral."""
    if rng.random() < 0.75:
        return random_spec(rng)
    from transformers import MixtralConfig

    heads = rng.choice((2, 4, 8))
    config = MixtralConfig(vocab_size=rng.choice((64, 96, 100)), hidden_size=heads * 4, intermediate_size=24,
                           num_hidden_layers=rng.randint(1, 6), num_attention_heads=heads,
                           num_key_value_heads=rng.choice([d for d in (1, 2, 4, 8) if heads % d == 0]),
                           num_local_experts=rng.choice((2, 4, 8)), num_experts_per_tok=2)
    return spec_from_hf_config(config, name="user-mixtral")


def test_every_emitted_inference_plan_passes_generates_own_check():
    """Property: random user-built models and device counts; the planner searches exactly the
    layouts generate accepts, and every pool of the best and runner-up plans, made into the replica
    plan parallelize takes, passes check_plan and generate's check (validity.generate_violation)."""
    rng = random.Random(15)
    roomy = dataclasses.replace(HW, memory_bytes=1e15)
    for _ in range(20):
        spec, devices = _random_spec(rng), rng.randint(1, 12)
        table = MAMBA_TABLE if spec.mixer is Mixer.SSD else LLAMA_TABLE  # the rules read the spec only
        grid = set(layouts(spec, devices))
        for tp, pp, ep in itertools.product(range(1, devices + 1), repeat=3):
            if devices % (tp * pp * ep) == 0:  # a vocabulary tp does not divide: embedding and head replicated
                st = runnable_strategies(spec, tp)
                assert ((tp, pp, ep) in grid) == (generate_violation(spec, Mesh(tp=tp, pp=pp, ep=ep), strategies=st)
                                                  is None), (spec, tp, pp, ep)
        choice = plan_serving(table, spec, roomy, devices=devices, prompt_len=P, output_len=O, ttft_slo_s=1e3,
                              tpot_slo_s=1e3)
        # every pool of the best and runner-up plans, and every ep > 1 layout the planner may emit
        # (the toy tables price no experts, so their winners seldom take ep > 1)
        emitted = [e.layout for c in filter(None, (choice.best, choice.runner_up)) for _, e in c.pools]
        for lay in emitted + [ServeLayout(tp=tp, pp=pp, ep=ep, batch=2) for tp, pp, ep in grid if ep > 1]:
            world = lay.tp * lay.pp * lay.ep
            # parallelize's global batch is the training one, split over ep; generate takes any batch
            strategies = dict(runnable_strategies(spec, lay.tp))  # what parallelize gives the replica
            plan = _resolve_plan({"tp": lay.tp, "pp": lay.pp, "ep": lay.ep, "strategies": strategies}, spec=spec,
                                 seq_len=P, global_batch=lay.batch * lay.ep, hardware="cpu")
            check_plan(plan, spec, world_size=world)
            assert generate_violation(spec, plan.mesh, strategies=plan.strategies) is None, (spec, lay)
    # what generate refuses: more than one replica, context parallelism, ep without experts
    assert "dp=2" in generate_violation(LLAMA, Mesh(dp=2))
    assert generate_violation(get_spec("mixtral-tiny"), Mesh(ep=2)) is None  # experts sliced over ep
    assert "ep=2" in generate_violation(LLAMA, Mesh(ep=2))  # no experts to split
    # (sequence parallelism is not refused: generate runs those layers on the whole sequence, test_generate.py)


def _scan(devices, p_size, p_rate, decode):
    """What _disaggregated once priced: every n_p = 1, 2, ..., then every decode layout (O(devices))."""
    out = []
    for n_p in range(1, devices // p_size + 1):
        rest = devices - n_p * p_size
        out += [(n_p, key, min(n_p * p_rate, rest // (key[0] * key[1] * key[2]) * d_rate))
                for key, (d_rate, _, _) in decode.items() if rest > 0 and rest % (key[0] * key[1] * key[2]) == 0]
    return out


def test_disaggregated_splits_keep_the_scan_s_best():
    """_splits prices O(layouts) splits of the devices instead of every n_p: the first best (the scan's
    tie-break) is among them, for random pool sizes and rates."""
    rng = random.Random(0)
    for _ in range(400):
        devices = rng.choice([2, 6, 8, 12, 16, 24, 30, 36, 64, 96, 360])
        sizes = [d for d in range(1, devices + 1) if devices % d == 0]
        p_size = rng.choice(sizes)
        decode = {(d, 1, 1): (rng.choice([0.5, 1.0, 3.0, rng.uniform(0.01, 50)]), None, "")
                  for d in rng.sample(sizes, rng.randint(1, min(4, len(sizes))))}
        p_rate = rng.choice([1.0, 2.0, rng.uniform(0.01, 50)])
        scan = _scan(devices, p_size, p_rate, decode)
        kept = [(n, key, min(n * p_rate, (devices - n * p_size) // key[0] * decode[key][0]))
                for n, key in serving._splits(devices, p_size, p_rate, decode)]
        assert set(kept) <= set(scan)
        if scan:
            best = max(r for *_, r in scan)
            assert next(x for x in scan if x[2] == best) == next(x for x in kept if x[2] == best)
        else:
            assert not kept


def test_serving_a_billion_devices_answers_at_once():
    # the layouts come from the prime factors and the disaggregated splits from the balance point:
    # before, `plan --inference --devices 1000000000` looped over every tp, pp and prefill replica count
    assert set(layouts(LLAMA, 8)) == {(tp, pp, ep) for tp in (1, 2, 4, 8) for pp in (1, 2, 4, 8) for ep in (1,)
                                      if 8 % (tp * pp) == 0 and generate_violation(LLAMA, Mesh(tp=tp, pp=pp)) is None}
    choice = plan_serving(LLAMA_TABLE, LLAMA, HW, devices=10**9, prompt_len=P, output_len=O, ttft_slo_s=1.0,
                          tpot_slo_s=0.05)
    assert choice.best.throughput_tokens_per_s > 0
