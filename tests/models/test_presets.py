import pytest
import torch

from autoshard.errors import UnknownNameError
from autoshard.models import PRESETS, build_model, get_spec
from autoshard.models.presets import Family


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_builds_on_meta_with_no_weights(name):
    spec = get_spec(name)
    model = build_model(spec, device="meta")
    assert all(p.device.type == "meta" for p in model.parameters())
    assert model.config.num_hidden_layers == spec.layers
    assert model.config.tie_word_embeddings == spec.tied


def test_preset_numbers_match_the_table():
    assert build_model(get_spec("llama-7b"), device="meta").num_parameters() == 6_738_415_616
    spec = get_spec("llama-70b")
    assert (spec.vocab, spec.hidden, spec.ffn, spec.layers, spec.heads, spec.kv_heads) == (128256, 8192, 28672, 80, 64, 8)
    m7 = get_spec("mamba2-7b")
    assert (m7.family, m7.heads, m7.groups, m7.state, m7.tied) == (Family.MAMBA2, 128, 8, 128, False)
    assert get_spec("mamba2-1b").tied


def test_tiny_presets_run_forward():
    for name in ("llama-tiny", "mamba2-tiny"):
        model = build_model(get_spec(name))
        ids = torch.randint(0, model.config.vocab_size, (2, 32))
        loss = model(ids, labels=ids).loss
        assert torch.isfinite(loss)


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(UnknownNameError, match="llama-7b"):
        get_spec("llama-8x")
