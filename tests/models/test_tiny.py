"""models/tiny.py: `tiny_config` gives a working tiny config of every class it is checked on (`CHECKED`): the
model builds, holds one layer of each of its layer types, and one forward gives a finite loss."""

import pytest
import torch

from autoshard.models.tiny import CHECKED, MLA_SIZES, build_tiny, tiny_config


@pytest.mark.parametrize("model_type", CHECKED)
def test_tiny_config_builds_and_runs_one_forward(model_type):
    config = tiny_config(model_type)
    model = build_tiny(config)
    assert type(model).__name__.endswith("ForCausalLM") and config.hidden_size == 64
    assert sum(p.numel() for p in model.parameters()) < 1_000_000, "the tiny config kept a full-size field"
    types = list(getattr(config, "layer_types", None) or [])
    assert config.num_hidden_layers == max(2, len(set(types)))
    ids = torch.randint(0, config.vocab_size, (2, 8))
    assert torch.isfinite(model(ids, labels=ids, use_cache=False).loss)  # a training step (Bamba's default config
    # has no attention layer, for which HF's hybrid cache cannot be built)


def test_jamba_holds_each_kind_of_layer():
    # Jamba's layer_types is derived from attn / expert layer periods: tiny_config sets them so that its two
    # layers are a Mamba-1 layer and an attention layer, one with experts
    model = build_tiny(tiny_config("jamba"))
    layers = model.model.layers
    assert {type(layer).__name__ for layer in layers} == {"JambaMambaDecoderLayer", "JambaAttentionDecoderLayer"}
    assert any(hasattr(layer.feed_forward, "experts") for layer in layers)


@pytest.mark.parametrize("model_type, published", [
    ("bamba", dict(num_hidden_layers=32, hidden_size=4096, attn_layer_indices=[9, 18, 27], mamba_n_heads=128,
                   mamba_d_head=64, mamba_n_groups=1)),  # Bamba-9B's Mamba-2 sizes
    ("granitemoehybrid", dict(num_hidden_layers=10, hidden_size=1536, mamba_d_head=24,
                              layer_types=["mamba"] * 5 + ["attention"] + ["mamba"] * 4)),
    ("falcon_h1", dict(hidden_size=1024, mamba_n_heads=24, mamba_d_head=64, mamba_d_ssm=1536))])
def test_tiny_config_of_a_published_mamba2_hybrid_runs(model_type, published):
    """`autoshard verify` shrinks the user's own config: a hybrid's Mamba-2 heads x head_dim made the tiny mixer's
    inner width (expand x hidden) under the family's own names (Bamba's mamba_n_heads / mamba_d_head; they kept
    the published 128 x 64 against a 128-wide mixer), its attention layers kept."""
    from transformers import AutoConfig

    config = tiny_config(AutoConfig.for_model(model_type, **published))
    model = build_tiny(config)
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    assert "full_attention" in config.layer_types or model_type == "falcon_h1"
    ids = torch.randint(0, config.vocab_size, (2, 8))
    assert torch.isfinite(model(ids, labels=ids).loss)


def _mla_types() -> list[str]:
    """The causal-LM classes of transformers whose config declares a KV latent (`kv_lora_rank`: multi-head latent
    attention), read off each default config; per-layer configs (one config per layer) are not tiny_config's yet."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = []
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        try:
            config = AutoConfig.for_model(model_type)
        except Exception:  # noqa: BLE001 - a class whose default config does not build (gemma4_assistant)
            continue
        if "kv_lora_rank" in config.to_dict() and not getattr(config, "is_heterogeneous", False):
            found.append(model_type)
    return found


MLA_TYPES = _mla_types()


def test_every_mla_class_is_found():
    assert {"deepseek_v2", "deepseek_v3", "deepseek_v32", "minicpm3", "glm4_moe_lite"} <= set(MLA_TYPES)


@pytest.mark.parametrize("model_type", MLA_TYPES)
def test_tiny_mla_config_runs_hf_forward(model_type):
    # MLA's widths shrunk together (models/tiny.py `MLA_SIZES`): the per-head rope / nope / value widths, the KV and
    # query latents, and what the config derives from them (head_dim, qk_head_dim, K/V heads), so HF's forward runs
    config = tiny_config(model_type)
    model = build_tiny(config)
    assert config.qk_head_dim == config.qk_nope_head_dim + config.qk_rope_head_dim == 16
    assert config.kv_lora_rank == MLA_SIZES["kv_lora_rank"]
    ids = torch.randint(0, config.vocab_size, (2, 16))
    assert torch.isfinite(model(ids, labels=ids).loss)


def test_per_layer_kinds_keep_each_kind():
    # a per-layer list besides layer_types (mlp_layer_types: 1 dense layer, then sparse ones) shrinks to one layer of
    # each kind, so the tiny model holds a dense MLP and routed experts
    config = tiny_config("glm4_moe_lite")
    assert config.mlp_layer_types == ["dense", "sparse"] and config.num_hidden_layers == 2
    layers = build_tiny(config).model.layers
    assert [hasattr(layer.mlp, "experts") for layer in layers] == [False, True]
