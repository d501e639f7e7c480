"""Serving prices a hybrid's cache as HF holds it: the KV cache of its attention layers and the conv + SSM
state of its Mamba-2 layers, per layer kind, per pipeline stage (issue 25 item 5).

The tiny hybrids of tests/models/hybrid_models.py run in bf16 (KV and conv state bf16, the SSM state fp32, as
HF keeps it); after a prefill of the prompts the bytes of every tensor of HF's cache, layer by layer, equal the
priced bytes of the whole model and of every stage of pp 2 and pp 3, and half of them each rank's at tp 2
(DeepSeek-V3's multi-head latent attention: its compressed KV, whole on every rank)."""

from __future__ import annotations

import pytest
import torch

from autoshard.commands.common import cost_table_for, model_for
from autoshard.errors import InvalidConfigError
from autoshard.model_spec import Mixer
from autoshard.passes.serving import inference_cost as ic
from autoshard.models.facts import cache_bytes_by_layer, cache_layer_bytes
from tests.models.hybrid_models import build

BATCH, PROMPT = 2, 20  # 20 tokens: more than the tiny chunk (16), the prefill scan spans two chunks


def _inference_table(model_type: str):
    name = f"tests.models.hybrid_models:{model_type}_tiny"
    spec, module = model_for(name)
    spec, table = cost_table_for(name, spinner=False, spec=spec, module=module)
    return spec, ic.compile_inference_table(table, spec)


def _hf_cache_per_layer(model_type: str) -> list[int]:
    torch.manual_seed(0)
    model = build(model_type).to(torch.bfloat16)
    ids = torch.randint(3, 200, (BATCH, PROMPT), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    return [cache_layer_bytes(layer) for layer in cache.layers]


@pytest.mark.parametrize("model_type, mixers, tp_parts", [
    ("bamba", {"linear_attention": (Mixer.SSD,), "full_attention": (Mixer.ATTENTION,)}, 2),
    ("nemotron_h", {"linear_attention": (Mixer.SSD,), "moe": (), "full_attention": (Mixer.ATTENTION,), "mlp": ()}, 2),
    ("falcon_h1", {"layer": (Mixer.ATTENTION, Mixer.SSD)}, 2),  # attention and Mamba-2 side by side in every layer
    # multi-head latent attention: HF caches the compressed KV and the RoPE key, whole on every tp rank
    ("deepseek_v3", {"attention+dense": (Mixer.ATTENTION,), "attention+moe": (Mixer.ATTENTION,)}, 1),
])
def test_priced_cache_bytes_equal_the_hf_cache_after_a_prefill(model_type, mixers, tp_parts):
    spec, it = _inference_table(model_type)
    kinds = it.kinds or (it,)
    names = it.ct.kind_names or ("layer",)
    assert {n: tuple(m.mixer for m in k.mixers) for n, k in zip(names, kinds)} == mixers
    held = _hf_cache_per_layer(model_type)
    per_layer = [kinds[k] for k in it.ct.layer_kinds] if it.kinds else [it] * spec.layers
    assert [bool(h) for h in held] == [bool(k.mixers) for k in per_layer]  # MLP / MoE layers cache nothing
    for pp in (1, 2, 3):
        for stage in ic.stages_of(spec, pp):
            priced = ic.stage_cache_bytes(it, stage, batch=BATCH, tokens=PROMPT, tp=1, dtype_bytes=ic.KV_BYTES)
            assert priced == sum(held[stage.first_layer:stage.end_layer]), f"{model_type} pp{pp} {stage}"
    # tp 2 splits the 2 KV heads of the attention layers and the 2 Mamba-2 groups (their heads, x / B / C conv
    # channels) of these configs: each rank holds half of every layer's cache (MLA's latent: all of it)
    whole = ic.stages_of(spec, 1)[0]
    assert tp_parts * ic.stage_cache_bytes(it, whole, batch=BATCH, tokens=PROMPT, tp=2) == sum(held)
    # the busiest device of a serving layout holds its stage's cache at prompt + output tokens
    mem = ic.memory(it, ic.ServeLayout(pp=2, batch=BATCH), prompt_len=PROMPT - 4, output_len=4)
    assert mem.cache in {ic.stage_cache_bytes(it, st, batch=BATCH, tokens=PROMPT, tp=1) for st in ic.stages_of(spec, 2)}


def test_decode_reads_the_kv_cache_of_attention_layers_and_a_constant_state_of_mamba_layers():
    from autoshard.hardware import load_hardware

    hw = load_hardware("h100")
    _, it = _inference_table("nemotron_h")
    step = {name: [ic.decode_core_seconds(kind, hw, 1, batch=64, context=c) for c in (1024, 65536)]
            for name, kind in zip(it.ct.kind_names, it.kinds)}
    assert step["full_attention"][1] > 10 * step["full_attention"][0]  # the KV cache read grows with the context
    assert step["linear_attention"][0] == step["linear_attention"][1] > 0  # the recurrent step: constant
    assert step["mlp"] == step["moe"] == [0.0, 0.0]  # per-token layers: no cache
    est = ic.estimate_serving(it, it.spec, hw, ic.ServeLayout(batch=64), prompt_len=1024, output_len=64)
    layers = dict(zip(it.ct.kind_names, (it.ct.layer_kinds.count(k) for k in range(len(it.kinds)))))
    mean = 1024 + 64 / 2
    want = sum(layers[name] * ic.decode_core_seconds(kind, hw, 1, batch=64, context=mean)
               for name, kind in zip(it.ct.kind_names, it.kinds))
    assert est.decode.core == pytest.approx(want)


@pytest.mark.parametrize("model_type", ["qwen3_next", "lfm2", "jamba"])
def test_a_recurrent_state_beside_attention_is_priced_as_hf_caches_it(model_type):
    """A gated DeltaNet's (Qwen3-Next), a short convolution's (LFM2) and Mamba-1's (Jamba) state per sequence, read
    off HF's own cache when the spec is made (models/layered.py `recurrent_state_bytes`), priced beside the attention
    layers' KV: every stage's bytes equal HF's after a prefill, half on each rank at tp 2 (the DeltaNet's key heads,
    the convolutions' channels split as the sharding table splits them); the recurrent step reads and writes it,
    whatever the context (serving refused these models before)."""
    from autoshard.hardware import load_hardware

    spec, it = _inference_table(model_type)
    held = _hf_cache_per_layer(model_type)
    kinds = [it.kinds[k] for k in it.ct.layer_kinds] if it.kinds else [it] * spec.layers
    assert any(kind.state_bytes(1) > 0 for kind in kinds) and all(h > 0 for h in held)
    for pp in (1, 2):
        for stage in ic.stages_of(spec, pp):
            priced = ic.stage_cache_bytes(it, stage, batch=BATCH, tokens=PROMPT, tp=1)
            assert priced == sum(held[stage.first_layer:stage.end_layer]), f"{model_type} pp{pp} {stage}"
    assert 2 * ic.stage_cache_bytes(it, ic.stages_of(spec, 1)[0], batch=BATCH, tokens=PROMPT, tp=2) == sum(held)
    hw = load_hardware("h100")
    recurrent = next(kind for kind in kinds if kind.state_bytes(1) and not kind.mixers)
    steps = [ic.decode_core_seconds(recurrent, hw, 1, batch=64, context=c) for c in (1024, 65536)]
    assert steps[0] == steps[1] > 0


@pytest.mark.parametrize("factory", ["mamba_tiny", "falcon_mamba_tiny"])
def test_a_stack_of_mamba1_scans_holds_the_state_hf_caches(factory):
    """An all-Mamba-1 model (Mamba, Falcon-Mamba), read by its parts as Jamba's Mamba-1 layers are: its conv and scan
    state per sequence priced equal to HF's cache after a prefill, whole and per stage, half on each rank at tp 2 (the
    scan's inner channels split), a decode step's reading of it the same at any context (refused before)."""
    import importlib

    from autoshard.hardware import load_hardware

    name = f"tests.models.mamba1_models:{factory}"
    spec, module = model_for(name)
    spec, table = cost_table_for(name, spinner=False, spec=spec, module=module)
    it = ic.compile_inference_table(table, spec)
    model = getattr(importlib.import_module("tests.models.mamba1_models"), factory)().to(torch.bfloat16)
    ids = torch.randint(3, 200, (BATCH, PROMPT), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        held = [cache_layer_bytes(layer) for layer in model(ids, use_cache=True).past_key_values.layers]
    assert all(h > 0 for h in held)
    for pp in (1, 2):
        for stage in ic.stages_of(spec, pp):
            priced = ic.stage_cache_bytes(it, stage, batch=BATCH, tokens=PROMPT, tp=1)
            assert priced == sum(held[stage.first_layer:stage.end_layer]), f"{factory} pp{pp} {stage}"
    assert 2 * ic.stage_cache_bytes(it, ic.stages_of(spec, 1)[0], batch=BATCH, tokens=PROMPT, tp=2) == sum(held)
    steps = [ic.decode_core_seconds(it, load_hardware("h100"), 1, batch=64, context=c) for c in (1024, 65536)]
    assert steps[0] == steps[1] > 0


def kimi_linear_tiny():
    from autoshard.models.tiny import build_tiny, tiny_config

    return build_tiny(tiny_config("kimi_linear"))


def minimax_tiny():
    from autoshard.models.tiny import build_tiny, tiny_config

    return build_tiny(tiny_config("minimax"))


@pytest.mark.parametrize("factory", ["kimi_linear_tiny", "minimax_tiny"])
def test_a_recurrent_mixer_keeps_its_measured_state(factory):
    """Kimi-Linear's per-channel delta attention (a "kda" part, split by heads under tp) and MiniMax's lightning
    attention (a part no tensor-parallel rule reads: "other", whole on every rank) keep a state per sequence that no
    spec number gives: HF's cache's (MiniMax keeps it beside its layers' cache, in `linear_cache`), measured when the
    spec is made, priced equal to it. MiniMax's lightning layers were priced as attention, a KV cache growing with
    the tokens (its s x s blocks read as attention's), and their state not at all."""
    name = f"tests.passes.serving.test_hybrid_cache:{factory}"
    spec, module = model_for(name)
    assert {"kimi_linear_tiny": "kda", "minimax_tiny": "other"}[factory] in {p.kind for p in spec.parts}
    spec, table = cost_table_for(name, spinner=False, spec=spec, module=module)
    it = ic.compile_inference_table(table, spec)
    model = globals()[factory]().to(torch.bfloat16)
    ids = torch.randint(3, 200, (BATCH, PROMPT), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        held = sum(cache_bytes_by_layer(model(ids, use_cache=True).past_key_values))
    assert ic.stage_cache_bytes(it, ic.stages_of(spec, 1)[0], batch=BATCH, tokens=PROMPT, tp=1) == held


def test_a_layer_state_serving_does_not_price_is_refused_by_name():
    """A convolution over the sequence that is no Mamba-2 SSD (Mamba-1's selective scan, LFM2's short
    convolutions) whose state could not be read off HF's cache (here: a table of no model) is refused, naming the
    module."""
    import dataclasses

    from tests.passes.serving.test_inference_cost import LLAMA, toy_table

    table = toy_table("self_attn", 0, 0)
    layer = table.blocks[1]
    conv = dataclasses.replace(layer.nodes[0], name="conv", target="aten.convolution.default",
                               module_path="layers.0.mamba")
    table = dataclasses.replace(table, blocks=(table.blocks[0], dataclasses.replace(layer, nodes=layer.nodes + (conv,)),
                                               table.blocks[2]))
    with pytest.raises(InvalidConfigError, match=r"layers.0.mamba mixes its sequence by a convolution that is no Mamba-2"):
        ic.compile_inference_table(table, LLAMA)


def _llama(attn_implementation: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        attn_implementation=attn_implementation))


def llama_sdpa():
    return _llama("sdpa")


def llama_eager():  # HF's eager_attention_forward: q k^T, softmax and the product with v as separate ops
    return _llama("eager")


def bamba_sdpa():
    return build("bamba")


def bamba_eager():
    return build("bamba", attn_implementation="eager")


@pytest.mark.parametrize("family", ["llama", "bamba"])
def test_eager_attention_caches_and_decodes_as_sdpa(family):
    """A model run with eager attention (no sdpa / flash node in its graph) holds the same KV cache as with sdpa:
    priced the same bytes (HF's cache after a prefill, per layer), and its decode step reads them."""
    from autoshard.hardware import load_hardware

    hw = load_hardware("h100")
    priced = {}
    for impl in ("sdpa", "eager"):
        name = f"tests.passes.serving.test_hybrid_cache:{family}_{impl}"
        spec, module = model_for(name)
        spec, table = cost_table_for(name, spinner=False, spec=spec, module=module)
        it = ic.compile_inference_table(table, spec)
        kinds = [it.kinds[k] for k in it.ct.layer_kinds] if it.kinds else [it] * spec.layers  # layer order
        assert any(Mixer.ATTENTION in (m.mixer for m in k.mixers) for k in kinds), f"{impl}: no attention layer found"
        priced[impl] = ([ic.layer_cache_bytes(k, batch=BATCH, tokens=PROMPT, tp=1) for k in kinds],
                        sum(n * ic.decode_core_seconds(k, hw, 1, batch=BATCH, context=4096.0)
                            for k, n in ic.layer_tables(it)))
    assert priced["eager"][0] == priced["sdpa"][0]
    torch.manual_seed(0)
    model = globals()[f"{family}_eager"]().to(torch.bfloat16)
    ids = torch.randint(3, 200, (BATCH, PROMPT), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    assert [cache_layer_bytes(layer) for layer in cache.layers] == priced["eager"][0]
    # the step's attention: the same KV read (its FLOPs count eager's softmax and mask ops besides the two matmuls)
    assert priced["eager"][1] == pytest.approx(priced["sdpa"][1], rel=0.05)


def test_each_layer_kind_caches_its_own_heads_and_window():
    """Gemma-4's sliding layers (2 KV heads of 16, an 8-token window) and full-attention layer (1 K/V head of 32,
    every token) are priced each by its own part (ModelSpec.mixer_spec of the kind's layers): before, every layer
    was priced with the model's one head count and width and no window (5,120 bytes each at 20 tokens). HF keeps a
    sliding layer's last window - 1 keys between steps (and an 8-byte length); the priced window is the step's."""
    spec, it = _inference_table("gemma4")
    held = _hf_cache_per_layer("gemma4_text")
    per_layer = [ic.layer_cache_bytes(it.kinds[k], batch=BATCH, tokens=PROMPT, tp=1) for k in it.ct.layer_kinds]
    token = 2 * BATCH * 2 * 16 * ic.KV_BYTES  # K and V of one token in a sliding layer
    assert per_layer[3] == held[3] == 2 * BATCH * 1 * 32 * PROMPT * ic.KV_BYTES
    assert all(priced == 8 * token and held_ == 7 * token + 8 for priced, held_ in zip(per_layer[:3], held[:3]))
    # tp 2 splits the sliding layers' 2 KV heads; the full layer's one K/V head stays whole on each rank
    assert [ic.layer_cache_bytes(it.kinds[k], batch=BATCH, tokens=PROMPT, tp=2) for k in it.ct.layer_kinds] == \
        [4 * token] * 3 + [held[3]]


def llama4_chunk4_tiny():
    from autoshard.models.tiny import build_tiny, tiny_config

    config = tiny_config("llama4_text")
    config.attention_chunk_size = 4
    return build_tiny(config)


def test_a_chunked_attention_layer_caches_its_chunk():
    """Llama-4's chunked-attention layer (a 4-token chunk) is cached by HF as a sliding window of its chunk, so it is
    priced as one (facts `_windows`): before, as a full-attention layer (every one of the 20 tokens). As for a
    sliding layer, HF keeps the window's last chunk - 1 keys between steps (and an 8-byte length); the full layer
    keeps every token."""
    name = "tests.passes.serving.test_hybrid_cache:llama4_chunk4_tiny"
    spec, module = model_for(name)
    spec, table = cost_table_for(name, spinner=False, spec=spec, module=module)
    assert (spec.sliding_window, spec.window_layers) == (4, 1)
    it = ic.compile_inference_table(table, spec)
    model = llama4_chunk4_tiny().to(torch.bfloat16)
    ids = torch.randint(3, 200, (BATCH, PROMPT), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        chunked, full = (cache_layer_bytes(layer) for layer in model(ids, use_cache=True).past_key_values.layers)
    token = full // PROMPT  # K and V of one token in one layer
    assert chunked == 3 * token + 8
    assert ic.stage_cache_bytes(it, ic.stages_of(spec, 1)[0], batch=BATCH, tokens=PROMPT, tp=1) == full + 4 * token
