import re
from dataclasses import replace

import pytest
import torch

from autoshard.errors import UnknownNameError
from autoshard.models import facts
from autoshard.models import PRESETS, build_model, get_spec
from autoshard.model_spec import Mixer


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
    assert (m7.mixer, m7.heads, m7.groups, m7.state, m7.tied) == (Mixer.SSD, 128, 8, 128, False)
    assert get_spec("mamba2-1b").tied


@pytest.mark.parametrize("name", [n for n in sorted(PRESETS) if PRESETS[n].is_moe])
def test_moe_preset_layout_is_what_the_module_tree_shows(name):
    """A MoE preset's layout (`moe_paths`, no family name) is the one models/facts.py reads off the HF model it
    builds: router, experts, shared expert and its linears at the modules' own paths."""
    from autoshard.models.facts import read_facts

    spec = get_spec(name)
    model = build_model(replace(spec, layers=1), device="meta")
    facts = read_facts(model.config, model)
    assert spec.moe_paths == (facts.router_path, facts.experts_path, facts.shared_path, *facts.shared_parts)
    assert bool(spec.shared_ffn) == bool(facts.shared_path)


def test_tiny_presets_run_forward():
    for name in ("llama-tiny", "mamba2-tiny"):
        model = build_model(get_spec(name))
        ids = torch.randint(0, model.config.vocab_size, (2, 32))
        loss = model(ids, labels=ids).loss
        assert torch.isfinite(loss)


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(UnknownNameError, match="llama-7b"):
        get_spec("llama-8x")


@pytest.mark.parametrize("config, needle", [
    # HF builds each of these and then fails in its forward, reported as a trace failure before
    (dict(kind="llama", num_attention_heads=4, num_key_value_heads=3),
     "num_attention_heads (4) is not a multiple of num_key_value_heads (3)"),
    (dict(kind="mamba2", num_heads=8, n_groups=3), "num_heads (8) is not a multiple of n_groups (3)"),
    (dict(kind="mixtral", num_local_experts=3, num_experts_per_tok=4),
     "num_experts_per_tok (4) must be between 1 and the number of experts (3)"),
])
def test_a_config_whose_forward_fails_is_refused_by_name(config, needle):
    from transformers import LlamaConfig, Mamba2Config, MixtralConfig

    from autoshard.errors import InvalidConfigError
    from autoshard.models.presets import spec_from_hf_config

    kind = config.pop("kind")
    small = dict(vocab_size=64, hidden_size=64, num_hidden_layers=1)
    hf = {"llama": lambda: LlamaConfig(intermediate_size=64, **small, **config),
          "mamba2": lambda: Mamba2Config(state_size=8, expand=2, head_dim=16, conv_kernel=4, chunk_size=8, **small,
                                         **config),
          "mixtral": lambda: MixtralConfig(intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, **small,
                                           **config)}[kind]()
    with pytest.raises(InvalidConfigError, match=r"^user: " + needle.replace("(", r"\(").replace(")", r"\)")):
        spec_from_hf_config(hf, name="user")


def test_rope_scaling_lifts_the_position_limit():
    from transformers import LlamaConfig

    from autoshard.models.presets import max_positions

    spec = get_spec("llama-tiny")
    rope = dict(rope_theta=1e4)
    assert max_positions(spec, LlamaConfig(max_position_embeddings=4096)) == 4096
    assert max_positions(spec, LlamaConfig(max_position_embeddings=4096,
                                           rope_parameters=dict(rope, rope_type="yarn", factor=4.0))) == 16384
    assert max_positions(spec, LlamaConfig(max_position_embeddings=4096,  # linear: positions / factor
                                           rope_parameters=dict(rope, rope_type="linear", factor=2.0))) == 8192
    llama31 = dict(rope, rope_type="llama3", factor=8.0, original_max_position_embeddings=8192, low_freq_factor=1.0,
                   high_freq_factor=4.0)  # Llama 3.1: max_position_embeddings is already the stretched length
    assert max_positions(spec, LlamaConfig(max_position_embeddings=131072, rope_parameters=llama31)) == 131072
    assert max_positions(spec, LlamaConfig(max_position_embeddings=8, rope_parameters=dict(rope, rope_type="dynamic",
                                                                                          factor=2.0))) is None


@pytest.mark.parametrize("model_type,overrides,want", [
    ("mistral", dict(sliding_window=4), (4, 2)),  # config.sliding_window, passed by every layer's attention
    ("gemma2", {}, (4, 1)),  # alternating: the attention module's own sliding_window, None on full layers
    ("qwen2", dict(sliding_window=4, use_sliding_window=False), (0, 0)),  # a window the config turns off
    ("llama", {}, (0, 0)),
])
def test_sliding_window_is_read_where_the_attention_call_gets_it(model_type, overrides, want):
    from autoshard.models.presets import spec_from_hf_config
    from autoshard.models.tiny import build_tiny, tiny_config

    config = tiny_config(model_type, **overrides)
    spec = spec_from_hf_config(config, name=model_type, model=build_tiny(config, device="meta"))
    assert (spec.sliding_window, spec.window_layers) == want


def test_constructs_without_a_rule_are_refused_by_name_and_the_other_axes_plan():
    """Zamba2's shared transformer block (one module in several layers): pp refused naming it; MiniMax's lightning
    attention (a sequence mixer with no CP algorithm): cp refused naming it; LFM2's short convolution and Qwen3-Next's
    gated DeltaNet not (runtime/cp_conv.py, cp_delta.py); a uniform stack of Mamba-1 scans runs every axis (its
    own forward; cp by state passing: runtime/cp_scan.py)."""
    from transformers import MambaConfig, MambaForCausalLM

    from autoshard.errors import InvalidConfigError
    from autoshard.models.presets import spec_from_hf_config
    from autoshard.rules.validity import refusal
    from tests.models import hybrid_models

    from autoshard.models.tiny import build_tiny, tiny_config

    for model_type, axis, want in (("zamba2", "pp", "its layers share a block"),
                                   ("minimax", "cp", "the sequence mixer layers.1.self_attn (MiniMaxLightningAttention")):
        model = hybrid_models.build(model_type) if model_type == "zamba2" else build_tiny(tiny_config(model_type))
        for spec in (spec_from_hf_config(model.config, name=model_type, model=model),  # parallelize's
                     resolve_model_spec(model, model_type)):  # plan's
            assert want in (refusal(spec, axis) or ""), (model_type, spec.refused)
            assert refusal(spec, "dp") is None
    for model_type in ("lfm2", "qwen3_next"):
        model = hybrid_models.build(model_type)
        assert refusal(spec_from_hf_config(model.config, name=model_type, model=model), "cp") is None
    mamba = MambaForCausalLM(MambaConfig(vocab_size=256, hidden_size=64, state_size=8, num_hidden_layers=2))
    spec = spec_from_hf_config(mamba.config, name="mamba", model=mamba)  # read by its parts, as Jamba's layers
    assert spec.own_forward and all(refusal(spec, a) is None for a in ("dp", "pp", "tp", "sequence_parallel", "cp"))
    # a module with no sequence mixer autoshard can name at all is still refused whole
    with pytest.raises(InvalidConfigError, match="a sequence mixer autoshard has no rule for"):
        spec_from_hf_config(mamba.config, name="bare", model=torch.nn.Sequential(torch.nn.Linear(2, 2)))


def resolve_model_spec(model, name):
    from autoshard.models.layered import layered_spec

    return layered_spec(model, name=name)


def test_classic_decoders_are_read_by_structure_and_own_attention_is_refused_by_name(monkeypatch):
    """GPT-2 / GPT-J / CodeGen keep their layers in transformer.h, OPT in model.decoder.layers, GPT-NeoX's
    attention names its head width head_size: found by structure, they plan (their stages run the model's own
    forward where the base is no plain LLaMA stack, OPT's projections and Bloom's embedding norm with the stage
    that runs them; pp refused where no stage would hold a parameter, BERT's); a config with no widths of its own (BLT) and attention that looks both
    ways (BERT without is_decoder) are refused naming the module; attention computed in a module's own forward
    (ALiBi in Bloom and MPT, Falcon's direct SDPA call, XGLM's matmuls) plans dp and pp by the model's own forward
    and tp with that attention whole on every rank (its projections gathered), sequence parallelism, cp and serving
    refused naming the module; a loss
    computed in the model's own forward (TrOCR's, labels already shifted) is refused whole."""
    from autoshard.errors import InvalidConfigError
    from autoshard.models.presets import spec_from_hf_config
    from autoshard.models.tiny import build_tiny, tiny_config
    from autoshard.rules import sharding
    from autoshard.rules.validity import refusal

    for model_type, attention, own in (("gpt_neox", "attention", False), ("opt", "self_attn", True),
                                       ("gpt2", "attn", True), ("gptj", "attn", False)):
        model = build_tiny(tiny_config(model_type), device="meta")
        spec = spec_from_hf_config(model.config, name=model_type, model=model)
        assert (spec.mixer, spec.attention_path, spec.own_forward) == (Mixer.ATTENTION, attention, own), spec
        assert refusal(spec, "dp") is None and refusal(spec, "cp") is None, spec.refused
        assert refusal(spec, "pp") is None, spec.refused  # (tiny OPT projects its 768-wide embedding and back)
    for model_type, module in (("bloom", "h.*.self_attention (BloomAttention)"), ("mpt", "blocks.*.attn (MptAttention)"),
                               ("falcon", "h.*.self_attention (FalconAttention)"),
                               ("xglm", "layers.*.self_attn (XGLMAttention)")):
        model = build_tiny(tiny_config(model_type), device="meta")
        spec = spec_from_hf_config(model.config, name=model_type, model=model)
        assert spec.own_forward and refusal(spec, "dp") is None, spec.refused
        assert refusal(spec, "pp") is None, spec.refused  # (Bloom's embedding norm: with the first stage)
        assert refusal(spec, "tp") is None and sharding.attention_whole(spec), spec.refused  # whole, gathered
        for axis in ("cp", "sequence_parallel", "inference"):
            assert f"{module} computes attention in its own forward" in (refusal(spec, axis) or ""), (axis, spec.refused)
    model = build_tiny(tiny_config("trocr"), device="meta")
    with pytest.raises(InvalidConfigError, match=r"TrOCRForCausalLM computes its loss in its own forward"):
        spec_from_hf_config(model.config, name="trocr", model=model)
    # BERT's causal-LM head over an encoder built without is_decoder attends both ways: refused, naming the fix
    # (priced as the causal kernel and split into causal chunks under cp it trained wrong); as a decoder it plans
    config = tiny_config("bert")
    with pytest.raises(InvalidConfigError, match=r"attention.self \(BertSelfAttention\) attends in both directions"
                                                 r".*set is_decoder=True"):
        spec_from_hf_config(config, name="bert", model=build_tiny(config, device="meta"))
    config.is_decoder = True
    spec = spec_from_hf_config(config, name="bert", model=build_tiny(config, device="meta"))
    assert refusal(spec, "dp") is None and refusal(spec, "cp") is None, spec.refused
    assert "BertEncoder: no final norm after its layers, and bert.embeddings.position_embeddings holds parameters " \
           "outside bert.encoder" in refusal(spec, "pp"), spec.refused  # (its head's transform: no stage holds it)
    # BLT: its cross-attention looks both ways; past that, its widths live in the sub-configs of its encoder, global
    # transformer and decoder: named too, not a TypeError
    model = build_tiny(tiny_config("blt"), device="meta")
    with pytest.raises(InvalidConfigError, match=r"cross_attn_layers.0 \(BltCrossAttention\) attends in both"):
        spec_from_hf_config(model.config, name="blt", model=model)
    monkeypatch.setattr(facts, "bidirectional_attention", lambda model: None)
    with pytest.raises(InvalidConfigError, match=r"BltForCausalLM's config has no hidden \(hidden_size"):
        spec_from_hf_config(model.config, name="blt", model=model)


def test_what_the_base_holds_beside_the_layers_goes_with_the_stage_that_runs_it():
    """Read off the traced graph, not the order HF declares modules in (OPT declares project_out first): OPT's
    learned positions and project_in run before the layers (the first stage's), project_out after them (the last
    stage's, `ModelSpec.after_layers`); BLOOM's embedding norm before; OPT-350m's post-norm decoder has no final
    norm and still places every parameter; layers reading another layer's hidden states refuse pp by name."""
    from autoshard.models.beside import beside_layers, stand_in_width
    from autoshard.models.presets import spec_from_hf_config
    from autoshard.models.tiny import build_tiny, tiny_config
    from autoshard.rules.validity import refusal

    def names(model_type, **overrides):
        model = build_tiny(tiny_config(model_type, **overrides), device="meta")
        base = model.get_submodule(facts.layer_list(model)[0].rpartition(".")[0])
        before, after, why = beside_layers(model)
        named = {id(m): n for n, m in base.named_children()}
        spec = spec_from_hf_config(model.config, name=model_type, model=model)
        return [named[id(m)] for m in before], [named[id(m)] for m in after], why, spec

    before, after, why, spec = names("opt")
    assert (before, after, why, spec.after_layers) == (["embed_positions", "project_in"], ["project_out"], "",
                                                        ("project_out",))
    before, after, why, spec = names("opt", do_layer_norm_before=False)
    assert (before, after, why) == (["embed_positions", "project_in"], ["project_out"], "") and \
        refusal(spec, "pp") is None
    before, after, why, _ = names("bloom")
    assert (before, after, why) == (["word_embeddings_layernorm"], [], "")
    model = build_tiny(tiny_config("opt"), device="meta")
    assert stand_in_width(model.model.decoder.project_in) == model.model.decoder.project_in.out_features
    assert stand_in_width(model.model.decoder.embed_positions)[0] == "lookup"
    _, _, _, spec = names("inkling2_text")
    assert "its layers read block_states beside their input" in refusal(spec, "pp"), spec.refused


def test_sequence_parallelism_around_learned_positions():
    """GPT-2's learned positions run under sequence parallelism: looked up for the whole sequence, their output cut to
    the rank's shard (a replicated EMBED role, no `sequence`); its final norm runs whole (its forward views the output
    by the input's length past it), the sequence leaving the shard there; CTRL's positions are a buffer its forward
    indexes: refused by name (the tp2 runs: tests/runtime/families.py `SEQUENCE`)."""
    from autoshard.ir import Mesh, Plan
    from autoshard.models.presets import spec_from_hf_config
    from autoshard.models.tiny import build_tiny, tiny_config
    from autoshard.passes.rewrite import shard_program
    from autoshard.rules.validity import refusal

    model = build_tiny(tiny_config("gpt2"), device="meta")
    spec = spec_from_hf_config(model.config, name="gpt2", model=model)
    assert spec.beside == (("transformer.wpe", "split"),) and refusal(spec, "sequence_parallel") is None
    plan = Plan(model="gpt2", fingerprint="", hardware="cpu", devices=2, global_batch=2, seq_len=16,
                mesh=Mesh(tp=2), sequence_parallel=True)
    program = shard_program(plan, spec, {n: tuple(p.shape) for n, p in model.named_parameters()}, tp_rank=0)
    assert program.sequence_splits == ("transformer.wpe",) and "transformer.ln_f" in program.sequence_wholes
    assert "lm_head" not in program.sequence_paths and "transformer.ln_f.weight" not in program.sequence_grads
    model = build_tiny(tiny_config("ctrl"), device="meta")
    spec = spec_from_hf_config(model.config, name="ctrl", model=model)
    assert spec.beside == () and "positions or attention masks of its own" in refusal(spec, "sequence_parallel")


def test_pp_places_a_wrappers_idle_vision_modules_and_refuses_a_module_no_stage_replaces():
    """A wrapper's vision projection (Fuyu's), which its forward on token ids never runs (read off the traced graph),
    is held by the first pipeline stage (`idle_modules`; before, Fuyu's pp2 ran with it on no stage, its checkpoint
    would have lost it, and then pp was refused for every wrapper); ModernBERT decoder's embeddings block, run before
    the layers with no stand-in for a later stage, is refused by name."""
    from autoshard.models.beside import beside_layers, idle_modules
    from autoshard.models.presets import spec_from_hf_config
    from autoshard.models.tiny import build_tiny, tiny_config
    from autoshard.rules.validity import refusal

    model = build_tiny(tiny_config("fuyu"), device="meta")
    assert idle_modules(model) == ("model.vision_embed_tokens",) and beside_layers(model)[2] == ""
    spec = spec_from_hf_config(model.config, name="fuyu", model=model)
    assert spec.idle_modules == ("model.vision_embed_tokens",) and refusal(spec, "pp") is None
    assert idle_modules(build_tiny(tiny_config("llama"), device="meta")) == ()  # nothing outside the decoder
    model = build_tiny(tiny_config("modernbert-decoder"), device="meta")  # (its embeddings block first: no stand-in)
    assert "model.embeddings (ModernBertDecoderEmbeddings) holds parameters beside" in beside_layers(model)[2]


@pytest.mark.parametrize("model_type,axis,why", [
    ("modernbert-decoder", "pp", "model.embeddings (ModernBertDecoderEmbeddings) holds parameters beside the embedding"),
    ("gemma4_text", "pp", "its layers read per-layer inputs"),
    ("gpt_neox_japanese", "inference", "computes attention in its own forward"),  # its last layer differs: mixed
])
def test_plan_and_parallelize_read_the_same_refusals(model_type, axis, why):
    """A mixed stack is read twice: by `plan` (`layered.layered_spec`, via `resolve_model`) and by `parallelize`
    (`spec_from_hf_config`). What its pipeline stages cannot place, per-layer inputs and an attention of its own
    were refused in the second only, so `plan` could pick a pp or a serving plan that `parallelize` and `generate`
    refuse (`presets.model_refusals`, read by both now)."""
    from autoshard.models.facts import text_config
    from autoshard.models.layered import layered_spec
    from autoshard.models.presets import spec_from_hf_config
    from autoshard.models.tiny import build_tiny, tiny_config

    model = build_tiny(tiny_config(model_type), device="meta")
    for spec in (layered_spec(model, name=model_type),
                 spec_from_hf_config(text_config(model.config), name=model_type, model=model)):
        assert why in dict(spec.refused)[axis], spec.refused
