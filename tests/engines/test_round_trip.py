"""`plan --emit ENGINE` then `price --from-ENGINE` reproduces the predicted step time: every preset on h100
and ascend-910b at 8 and 16 devices (in process, the shipped cost tables). Where the engine expresses the
whole plan the figure is the plan's own prediction; else the projected run's (named by the notes).
torchtitan's command lines are read back by torchtitan's own ConfigManager.parse_args."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from autoshard.engines import megatron, torchtitan
from autoshard.engines.training_run import default_strategies, price, run_of_plan
from autoshard.errors import InfeasiblePlanError
from autoshard.hardware import load_hardware
from autoshard.model_spec import Mixer
from autoshard.models.presets import get_spec, preset_names
from autoshard.passes.cost.compiled import compile_table
from autoshard.passes.capture.shapes import build_cost_table
from autoshard.passes.solve.planner import solve

CASES = [(name, hw, n) for name in preset_names() for hw in ("h100", "ascend-910b") for n in (8, 16)]


@functools.lru_cache(maxsize=None)
def _solved(name: str, hw_name: str, devices: int):
    spec, hw = get_spec(name), load_hardware(hw_name)
    gb, sl = 4 * devices, 2048
    try:
        plan = solve(spec, hw, devices=devices, global_batch=gb, seq_len=sl)
    except InfeasiblePlanError:
        return None  # nothing fits (llama-70b / mixtral-8x7b on 8 x ascend-910b): nothing to emit
    return spec, hw, compile_table(build_cost_table(spec, kernels=hw.kernels), spec), plan


def _round_trip(engine, parse, name, hw_name, devices):
    solved = _solved(name, hw_name, devices)
    if solved is None:
        return None
    spec, hw, ct, plan = solved
    gb, sl = plan.global_batch, plan.seq_len
    run, notes = engine.project(ct, hw, spec, run_of_plan(plan), global_batch=gb, seq_len=sl)
    projected = price(ct, hw, spec, run, global_batch=gb, seq_len=sl)["step_time_s"]
    if not notes:
        assert projected == pytest.approx(plan.predicted["step_time_s"], rel=1e-9)
    back, gb2, sl2 = parse(engine.arguments(spec, run, global_batch=gb, seq_len=sl), spec, devices)
    assert (gb2, sl2) == (gb, sl)
    assert back.mesh == plan.mesh or notes
    again = price(ct, hw, spec, default_strategies(spec, back), global_batch=gb, seq_len=sl)["step_time_s"]
    assert again == pytest.approx(projected, rel=1e-9), (name, hw_name, devices, notes)
    return not notes


def _megatron(words, spec, devices):
    parsed = megatron.parse(" ".join(words), spec=spec, devices=devices)
    megatron.check_model(spec, parsed.model, source="test")
    return parsed.run, parsed.global_batch, parsed.seq_len


def test_megatron_round_trip_every_preset():
    exact = [c for c in CASES if _round_trip(megatron, _megatron, *c)]
    assert len(exact) >= len(CASES) // 2  # most plans are Megatron's own words, figure for figure


def test_torchtitan_round_trip_through_its_own_parser():
    pytest.importorskip("torchtitan")

    def parse(words, spec, devices):
        return torchtitan.parse(words, spec=spec, devices=devices)

    cases = [c for c in CASES if get_spec(c[0]).mixer is not Mixer.SSD and c[2] == 8]
    exact = [c for c in cases if _round_trip(torchtitan, parse, *c)]
    assert len(exact) >= len(cases) // 2


def test_a_hybrid_is_emitted_as_megatrons_hybrid_pattern_or_refused():
    # a model read by its layer parts: one Mamba-2 mixer, MoE, attention or MLP per layer is Megatron's hybrid
    # pattern (Nemotron-H); a layer holding two (Bamba's mixer and MLP, Falcon-H1's two mixers) or DeepSeek's latent
    # attention is refused by name (before, Bamba was written as four Mamba layers and DeepSeek-V3 as a GPT)
    from autoshard.errors import InvalidConfigError
    from autoshard.ir import Mesh
    from autoshard.engines.training_run import TrainingRun
    from autoshard.models.presets import resolve_model

    spec = resolve_model("tests.models.hybrid_models:nemotron_h_tiny", device="meta")[0]
    words = megatron.model_arguments(spec)
    assert "--hybrid-override-pattern ME*-M-" in words and "--ffn-hidden-size 96" in words
    assert "--num-query-groups 2" in words and "--moe-ffn-hidden-size 32" in words
    parsed = megatron.parse(" ".join(["--tensor-model-parallel-size 1", *words]), spec=spec, devices=1)
    megatron.check_model(spec, parsed.model, source="--from-megatron")  # its own pattern reads back
    with pytest.raises(InvalidConfigError, match="--hybrid-override-pattern MMMMMM but .* has ME\\*-M-"):
        megatron.check_model(spec, {**parsed.model, "--hybrid-override-pattern": "MMMMMM"}, source="--from-megatron")
    # MLP layers of two widths (as Gemma-4's attention layers of two head widths): one --ffn-hidden-size would
    # describe another model
    mlp = next(p for p in spec.parts if p.kind == "mlp")
    two = tuple(q for p in spec.parts for q in ((dataclasses.replace(p, layers=p.layers[:1]),
                                                dataclasses.replace(p, layers=p.layers[1:], sizes=(("ffn", 128),)))
                                               if p is mlp else (p,)))
    with pytest.raises(InvalidConfigError, match="its mlp layers differ in sizes .*emit torchtitan"):
        megatron.model_arguments(dataclasses.replace(spec, parts=two))
    for name, held in (("bamba_tiny", "ssd \\(mamba\\) \\+ mlp"), ("falcon_h1_tiny", "attention \\(self_attn\\) \\+ ssd"),
                       ("deepseek_v3_tiny", "mla \\(self_attn\\)")):
        other = resolve_model(f"tests.models.hybrid_models:{name}", device="meta")[0]
        with pytest.raises(InvalidConfigError, match=f"layer 0 holds {held}.*emit torchtitan"):
            megatron.arguments(other, TrainingRun(mesh=Mesh(dp=1)), global_batch=1, seq_len=16)
