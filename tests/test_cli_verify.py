"""`autoshard verify`: the table of axes, the stored verdict, and what plan / parallelize make of it."""

from __future__ import annotations

import json


from autoshard.cli import main


def gemma2():  # the factory `verify --model tests.test_cli_verify:gemma2` loads
    from autoshard.models.tiny import build_tiny, tiny_config

    return build_tiny(tiny_config("gemma2"))


def test_verify_proves_axes_and_stores_the_verdict(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AUTOSHARD_CACHE_DIR", str(tmp_path))
    assert main(["verify", "--model", "tests.test_cli_verify:gemma2", "--axes", "tp", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["class"] == "Gemma2ForCausalLM"
    assert {a: v["status"] for a, v in out["axes"].items()} == {"tp": "exact"}
    from transformers import Gemma2ForCausalLM

    from autoshard.models import verdicts

    assert verdicts.load(Gemma2ForCausalLM) == {"tp": ("exact", "")}


def test_a_failed_verdict_is_refused_by_plan_rules(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOSHARD_CACHE_DIR", str(tmp_path))
    from transformers import Gemma2ForCausalLM

    from autoshard.ir import Mesh
    from autoshard.models import verdicts
    from autoshard.models.presets import spec_from_hf_config
    from autoshard.rules.validity import plan_violation

    verdicts.store(Gemma2ForCausalLM, {"tp": ("failed", "gradient x differs by 12% of its norm"), "dp": ("exact", "")})
    model = gemma2()
    spec = spec_from_hf_config(model.config, name="g", model=model)
    why = plan_violation(spec, Mesh(tp=2), global_batch=2, seq_len=16)
    assert why.startswith("tp is refused for g: autoshard verify found it not exact for Gemma2ForCausalLM "
                          "(gradient x differs by 12% of its norm)")
    assert plan_violation(spec, Mesh(dp=2), global_batch=2, seq_len=16) is None  # the other axes still plan


def test_bad_axes_are_named(capsys):
    assert main(["verify", "--model", "llama-tiny", "--axes", "dp,xp"]) == 2
    assert "--axes 'dp,xp': expected a comma-separated list of dp, tp, pp, cp, ep" in capsys.readouterr().err


def qwen3():  # q/k norms summed over tp inside the attention region, the layer's norms on the sequence shard
    from autoshard.models.tiny import build_tiny, tiny_config

    return build_tiny(tiny_config("qwen3"))


def test_verify_proves_sequence_parallelism_and_a_failed_verdict_refuses_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AUTOSHARD_CACHE_DIR", str(tmp_path))
    assert main(["verify", "--model", "tests.test_cli_verify:qwen3", "--axes", "sequence_parallel"]) == 0
    assert "tp=2 sequence_parallel  exact" in capsys.readouterr().out
    from transformers import Qwen3ForCausalLM

    from autoshard.models import verdicts
    from autoshard.models.presets import spec_from_hf_config
    from autoshard.rules.validity import refusal

    assert verdicts.load(Qwen3ForCausalLM) == {"sequence_parallel": ("exact", "")}
    model = qwen3()
    assert refusal(spec_from_hf_config(model.config, name="q", model=model), "sequence_parallel") is None
    verdicts.store(Qwen3ForCausalLM, {"sequence_parallel": ("failed", "gradient x differs")})
    why = refusal(spec_from_hf_config(model.config, name="q", model=model), "sequence_parallel")
    assert why.startswith("sequence_parallel is refused for q: autoshard verify found it not exact")
