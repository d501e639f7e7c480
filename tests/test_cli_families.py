"""Classes of bench/families_sweep.json once counted wrong or crashing: through `inspect --json` on their
`tiny_config` (autoshard/models/tiny.py), HF's parameter count or one clean line naming why not."""

import functools
import json

import pytest
from torch import nn

from autoshard.cli import main
from autoshard.errors import InvalidConfigError
from autoshard.models.tiny import build_tiny, tiny_config


def tiny(model_type: str):
    return build_tiny(tiny_config(model_type), device="meta")


# the factories: `--model tests.test_cli_families:<model type>`
hunyuan_v1_moe, longcat_flash, gemma4, dots3_note, rwkv, zaya, gemma3 = (
    functools.partial(tiny, t) for t in ("hunyuan_v1_moe", "longcat_flash", "gemma4", "dots3_note", "rwkv", "zaya",
                                         "gemma3"))


def _inspect(capsys, factory: str):
    code = main(["inspect", "--model", f"tests.test_cli_families:{factory}", "--seq-len", "64", "--json"])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("factory", ["hunyuan_v1_moe", "gemma4"])
def test_parameters_outside_the_layers_are_counted_as_hf_does(capsys, factory):
    """HunYuan-MoE's router is the linear `mlp.gate.wg` inside its gate module: read as the router, the model
    inspects with HF's count (its dp2 / ep2 runs match one process). Gemma-4's ConditionalGeneration wrapper with the
    default per-layer input embedding (its E models; refused before, the table counting one layer's slice of it)."""
    code, out, err = _inspect(capsys, factory)
    assert code == 0, err
    assert json.loads(out)["params"] == globals()[factory]().num_parameters()


@pytest.mark.parametrize("factory,needle", [
    ("longcat_flash", "the traced blocks hold 32,832 parameters"),  # its layers of two sublayers each: not read
    ("dots3_note", "declares per-layer values of kv_lora_rank, num_attention_heads"),
    ("rwkv", "changes with the input shape (b, s) = (2, 64) vs (2, 128)"),  # a Python loop over tokens
    ("zaya", "chooses among 5 experts, but the routed experts at 'mlp.experts' hold 4"),  # a null expert
])
def test_what_cannot_be_counted_right_is_one_line(capsys, factory, needle):
    code, _, err = _inspect(capsys, factory)
    assert code == 2 and err.count("\n") == 1 and err.startswith("autoshard inspect: error:"), err
    assert needle in err and "Traceback" not in err


def test_parameters_outside_the_traced_blocks_are_refused():
    """The cost table's parameters are checked against the model's own (`shapes.check_params`): one the
    blocks do not hold (here on the top-level module) is refused, naming both counts."""
    from autoshard.models import build_model, get_spec
    from autoshard.passes.capture.shapes import build_cost_table

    spec = get_spec("llama-tiny")
    model = build_model(spec, device="meta")
    own = model.num_parameters()
    build_cost_table(spec, model=model)  # every parameter in a block (the tied-free head counted once)
    model.extra = nn.Parameter(model.lm_head.weight.new_empty(7))
    with pytest.raises(InvalidConfigError, match=f"hold {own:,} parameters .*, the model {own + 7:,}"):
        build_cost_table(spec, model=model)


def gemma4_31b_shaped():
    """Gemma-4-31B's shape of a heterogeneous config (HF's per_layer_config), tiny: the full-attention layers' head_dim
    twice the sliding ones', a quarter of their K/V heads and the keys as values (k_eq_v), no per-layer input."""
    from transformers import Gemma4TextConfig

    config = Gemma4TextConfig(hidden_size_per_layer_input=0, attention_k_eq_v=True, num_attention_heads=32,
                              num_key_value_heads=16, num_global_key_value_heads=4)
    return build_tiny(tiny_config(config), device="meta")


def test_a_per_layer_config_is_read_as_layers_of_several_kinds(capsys):
    """Gemma-4's head_dim and K/V heads per layer type (HF's per_layer_config) were refused; each layer type is a
    kind whose table is traced off its own layer: inspect counts HF's parameters, one row per kind, and plan emits a
    plan with tp (the attention split by each kind's own heads)."""
    model = gemma4_31b_shaped()
    attention = [layer.self_attn for layer in model.model.layers]
    assert [a.head_dim for a in attention] == [16, 32] and attention[1].v_proj is None
    code, out, err = _inspect(capsys, "gemma4_31b_shaped")
    assert code == 0, err
    got = json.loads(out)
    assert got["params"] == model.num_parameters()
    assert got["layer_kinds"] == ["sliding_attention", "full_attention"]
    assert [b["name"] for b in got["blocks"]] == ["embed", "sliding_attention", "full_attention", "head"]
    code = main(["plan", "--model", "tests.test_cli_families:gemma4_31b_shaped", "--hardware", "h100", "--devices",
                 "8", "--global-batch", "8", "--seq-len", "64", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out)["mesh"]["tp"] >= 1


def test_experts_held_by_the_layer_itself_are_its_moe_block_beside_its_mlp():
    """Gemma-4-26B-A4B's layer holds its router and experts as its own children beside its attention and MLP: the
    experts' module beside the attention was read as a shared expert (`moe_paths` named self_attn); now none, top-k
    read from `top_k_experts` (it was 1); the layer's router and experts are one MoE part at the layer's own path,
    so tp is no longer refused for them ("layers.0.router is neither attention, ..."): its experts whole per rank."""
    from transformers import Gemma4TextConfig

    from autoshard.models.presets import spec_from_hf_config
    from autoshard.rules.validity import refusal

    config = tiny_config(Gemma4TextConfig(hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=128,
                                          top_k_experts=8, moe_intermediate_size=704))
    model = build_tiny(config, device="meta")
    spec = spec_from_hf_config(model.config, name="gemma4-moe", model=model)
    assert (spec.experts, spec.top_k, spec.moe_paths[:3]) == (4, 2, ("router.proj", "experts", ""))
    moe = [p for p in spec.parts if p.kind == "moe"]
    assert [(p.path, p.names) for p in moe] == [("", ("router.proj", "experts", ""))] and refusal(spec, "tp") is None


def test_a_multimodal_wrapper_plans_its_decoder_and_every_axis():
    """Gemma-4-unified's causal LM is a ConditionalGeneration wrapper (its decoder's sizes in a text config): its
    layers were not read ("narrowing the config built 2 layers"); now the wrapper's text config is narrowed and its
    layer types read, so it inspects with HF's count, and pp plans too (its pp2 once hung: a later stage looked its
    image token up in an input embedding it does not hold; runtime/stages.py `_Unmatched`)."""
    from autoshard.models.presets import spec_from_hf_config
    from autoshard.rules.validity import refusal

    model = build_tiny(tiny_config("gemma4_unified"), device="meta")
    spec = spec_from_hf_config(model.config, name="gemma4-unified", model=model)
    assert refusal(spec, "pp") is None and refusal(spec, "dp") is None and refusal(spec, "tp") is None


def test_a_vision_tower_as_deep_as_the_decoder_is_not_read_as_its_layers(capsys):
    """Gemma-3's causal LM is Gemma3ForConditionalGeneration; with its vision tower shrunk, the tower holds as many
    layers as the decoder. Its layers were read as the decoder's (the tiny one refused: "the traced blocks hold
    178,129,088 parameters"; the tp rewrite looked for o_proj in SiglipAttention): now the decoder's layers are the
    list beside the input embedding, the tower (no layer the text forward runs) counts with the embedding, and the
    tp plan HF declares in the text config is the one proven."""
    from autoshard.models.presets import spec_from_hf_config
    from autoshard.rules import sharding
    from autoshard.rules.validity import refusal

    model = tiny("gemma3")
    tower = model.model.vision_tower.encoder.layers
    assert len(tower) == len(model.model.language_model.layers) == 2
    code, out, _ = _inspect(capsys, "gemma3")
    assert code == 0
    table = json.loads(out)
    layer = sum(p.numel() for p in model.model.language_model.layers[0].parameters())
    assert table["params"] == sum(p.numel() for p in model.parameters())
    assert [(b["name"], b["count"], b["params"]) for b in table["blocks"] if b["name"] == "layer"] == [("layer", 2, layer)]
    spec = spec_from_hf_config(model.config, name="gemma3", model=model)
    assert sharding.layers_path(spec) == "model.language_model.layers"
    assert refusal(spec, "tp") is None and refusal(spec, "pp") is None  # the first stage holds the tower
    assert spec.idle_modules == ("model.vision_tower", "model.multi_modal_projector")
