"""models/tiny.py: `tiny_config` gives a working tiny config of every class it is checked on (`CHECKED`): the
model builds, holds one layer of each of its layer types, and one forward gives a finite loss."""

import pytest
import torch

from autoshard.models.tiny import CHECKED, build_tiny, tiny_config


@pytest.mark.parametrize("model_type", CHECKED)
def test_tiny_config_builds_and_runs_one_forward(model_type):
    config = tiny_config(model_type)
    model = build_tiny(config)
    assert type(model).__name__.endswith("ForCausalLM") and config.hidden_size == 64
    assert sum(p.numel() for p in model.parameters()) < 1_000_000, "the tiny config kept a full-size field"
    types = list(getattr(config, "layer_types", None) or [])
    assert config.num_hidden_layers == max(2, len(set(types)))
    ids = torch.randint(0, config.vocab_size, (2, 8))
    assert torch.isfinite(model(ids, labels=ids).loss)


def test_jamba_holds_each_kind_of_layer():
    # Jamba's layer_types is derived from attn / expert layer periods: tiny_config sets them so that its two
    # layers are a Mamba-1 layer and an attention layer, one with experts
    model = build_tiny(tiny_config("jamba"))
    layers = model.model.layers
    assert {type(layer).__name__ for layer in layers} == {"JambaMambaDecoderLayer", "JambaAttentionDecoderLayer"}
    assert any(hasattr(layer.feed_forward, "experts") for layer in layers)
