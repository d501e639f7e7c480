"""Tiny configs of any HF decoder class: what `autoshard verify` and the equivalence tests run.

Contract: `tiny_config(config, **overrides)` -> a copy of `config` (same class, same model_type, every
field the family sets kept; a multimodal wrapper's text config too) with its sizes shrunk through the alias
table (models/facts.py `ALIASES`):
hidden 64, 4 heads of 16 (2 KV heads), MLP 96, vocabulary 256, one layer of each layer type (at
least two layers), 4 experts of width 32 (2 per token), windows of 4 tokens, a gated DeltaNet's 2 key heads and
4 value heads of 16. `exaggerated(config)`
turns the multipliers and softcaps a family has far from 1 / small, so that a dropped op changes the
loss of a tiny random model visibly. `build_tiny(config_or_type)` builds the causal LM, float32,
seeded, eager-free (sdpa; the experts on grouped_mm, which traces on fake tensors).
"""

from __future__ import annotations

import copy
import math

from autoshard.models.facts import ALIASES, DENSE_FIRST, config_value

SIZES = {"hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "ffn": 96, "vocab": 256, "experts": 4,
         "top_k": 2, "expert_ffn": 32, "shared_ffn": 64, "sliding_window": 4, "attention_chunk": 4, "chunk": 4,
         "position_floor": 4}
# the model types tiny_config is checked on (tests/models/test_tiny.py: each builds and runs a forward); the
# classes of transformers' causal-LM mapping it does not handle yet, and why, are listed in docs/decoders.md
CHECKED = ("llama", "qwen3", "mistral", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "granite", "cohere",
           "stablelm", "glm4", "falcon", "bloom", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "granitemoe",
           "mamba", "falcon_mamba", "mamba2", "jamba", "gpt_neox", "opt", "gptj", "codegen", "bamba",
           "granitemoehybrid", "zamba2", "nemotron", "dots1", "lfm2_moe", "cohere_compass_text")
# multipliers / caps that make a dropped op visible on a tiny random model (config field: value)
EXAGGERATED = {"logits_scaling": 0.25, "embedding_multiplier": 6.0, "residual_multiplier": 0.5,
               "attention_multiplier": 0.4, "logit_scale": 3.0, "final_logit_softcapping": 0.1,
               "attn_logit_softcapping": 0.05}
# multi-head latent attention (DeepSeek-V2's MLA, a config that sets kv_lora_rank): its per-head and latent widths,
# and its sparse indexer's (DeepSeek-V3.2's DSA)
MLA_SIZES = {"qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 16, "kv_lora_rank": 16, "q_lora_rank": 24,
             "index_head_dim": 16, "index_n_heads": 4, "index_topk": 4}  # 4 keys of the 16: sparse (HF's 2048: all)
# a gated DeltaNet's heads (Qwen3-Next, Qwen3.5, OLMo-hybrid, LaraMini: the config's linear_* fields, where it
# sets them): 2 key heads of 16, each with 2 value heads of 16; a per-channel one's (Kimi-Linear, Bailing-hybrid:
# HF's 32 heads of 128 made each tiny layer 4096 wide): 4 heads of 16
DELTA_SIZES = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
               "linear_value_head_dim": 16, "linear_num_heads": 4, "linear_head_dim": 16}
# a per-layer input embedding (Gemma-3n's, Gemma-4's: each layer reads its own slice of a second embedding)
PER_LAYER_INPUT_SIZES = {"hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": 256}
# fields HF's default config of a family leaves unset although every published checkpoint of it sets them (the model
# does not build without them): what a tiny config of that family takes (model_type: {field: value})
UNSET_BY_DEFAULT = {"nemotron": {"num_key_value_heads": SIZES["kv_heads"]},
                    "dots1": {"n_routed_experts": SIZES["experts"], "num_experts_per_tok": SIZES["top_k"],
                              "n_shared_experts": 1},
                    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
                    "dbrx": {"attn_config.rope_theta": 10000.0, "attn_config.clip_qkv": 8.0},  # a sub-config's
                    "cohere_compass_text": {"rope_parameters": {
                        kind: {"rope_type": "default", "rope_theta": 10000.0}
                        for kind in ("full_attention", "sliding_attention")}}}
# group-limited routing (DeepSeek-V3's: the top groups of experts, then the top experts in them), where a config
# groups its experts (n_group > 1): 2 groups of 2
ROUTING_GROUPS = {"n_group": 2, "topk_group": 1}


def tiny_config(config, **overrides):
    """A tiny config of the same class as `config` (a config or a model_type string); see the module
    docstring. `overrides`: config fields set last."""
    from transformers import AutoConfig, PretrainedConfig

    config = AutoConfig.for_model(config) if isinstance(config, str) else copy.deepcopy(config)
    text = config.get_text_config(decoder=True)
    for name, value in UNSET_BY_DEFAULT.get(getattr(text, "model_type", None), {}).items():
        holder, _, field = name.rpartition(".")
        held = getattr(text, holder) if holder else text
        if not getattr(held, field, None):
            setattr(held, field, copy.deepcopy(value))
    # a multimodal wrapper's decoder sizes are in its text config (Gemma-3, Gemma-4), its towers' in theirs (a
    # heterogeneous tower kept as it is); DBRX's attention and MLP sizes in its attn_config and ffn_config
    for sub in [v for v in vars(config).values() if isinstance(v, PretrainedConfig) and v is not text]:
        if not getattr(sub, "is_heterogeneous", False):
            _shrink(sub)
    if text is not config:
        _shrink(text)
    _shrink(config)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def _shrink(config) -> None:
    """`config`'s sizes set in place to `SIZES` (see the module docstring); a heterogeneous config's per-layer
    values (HF's per_layer_config: Gemma-4's head_dim and K/V heads of its full-attention layers) shrunk with them,
    per layer type (`_per_layer_within`)."""
    per_type = _per_type_values(config)
    if per_type is not None:
        config.per_layer_config = None  # homogeneous while the sizes shrink; per layer again at the end
    kept = set(getattr(config, "per_layer_attributes", None) or ())
    latent = {name: None if name in kept else getattr(config, name, None)
              for name in ("head_dim", "qk_head_dim", *MLA_SIZES)}
    same_heads = latent["kv_lora_rank"] is not None and len({config_value(config, f) for f in ("heads", "kv_heads")}) == 1
    per_layer = _per_layer_kinds(config)
    # multi-query attention (StarCoder's one KV head) kept so (a per-layer value, `kept`, is not read globally)
    one_kv = any(getattr(config, n, None) == 1 for n in ALIASES["kv_heads"] if n not in kept)
    for fact, value in SIZES.items():
        for name in ALIASES[fact]:
            if name not in kept and _settable(config, name) and (getattr(config, name) is not None or fact == "head_dim"):
                setattr(config, name, 1 if one_kv and fact == "kv_heads" else value)
    if isinstance(getattr(config, "rotary_dim", None), int) and config.rotary_dim > SIZES["head_dim"]:
        config.rotary_dim = SIZES["head_dim"]  # the rotated width of each head (GPT-J, CodeGen): at most the head's
    _ssd_within(config)
    for name, value in {**DELTA_SIZES, **PER_LAYER_INPUT_SIZES}.items():
        if name not in kept and _settable(config, name) and getattr(config, name):
            setattr(config, name, value)
    if config_value(config, "experts") is not None:
        _route_tiny(config)
    if latent["kv_lora_rank"] is not None:
        _shrink_latent(config, latent, same_heads=same_heads)
    types = list(getattr(config, "layer_types", None) or [])
    kinds = list(dict.fromkeys(types)) or ["full_attention"]
    layers = max(2, len(kinds), *map(len, per_layer.values()))
    for name in ALIASES["layers"]:
        if _settable(config, name):
            setattr(config, name, layers)
    if hasattr(config, "layer_types") and not _settable(config, "layer_types"):
        _derived_within(config, kinds, layers)  # derived: periods (Jamba), attention indices (Bamba), a pattern
    elif types:
        config.layer_types = [kinds[i % len(kinds)] for i in range(layers)]
        _flags_by_type(config, types, config.layer_types)
    _shared_block_within(config)
    if per_type is not None:
        _per_layer_within(config, *per_type)
    for name, each in per_layer.items():  # one layer of each kind (DeepSeek-style mlp_layer_types: dense, sparse)
        setattr(config, name, [each[i % len(each)] for i in range(layers)])
    for name in ("max_window_layers",):
        if hasattr(config, name):
            setattr(config, name, layers)
    for name in DENSE_FIRST:
        if isinstance(getattr(config, name, None), int) and getattr(config, name) >= layers:
            setattr(config, name, 1)  # the dense layers first, then at least one MoE layer
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(getattr(config, name, None), int) and getattr(config, name) >= SIZES["vocab"]:
            setattr(config, name, {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}[name])
    for name in ("mlp_only_layers",):
        if hasattr(config, name):
            setattr(config, name, [])
    config.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))


# a Mamba-2 SSD mixer's (expand, heads, head_dim, groups) as each family names them: Mamba-2's; Bamba's, Granite-4's
# and Falcon-H1's; Zamba2's
SSD_NAMES = (("expand", "num_heads", "head_dim", "n_groups"),
             ("mamba_expand", "mamba_n_heads", "mamba_d_head", "mamba_n_groups"),
             ("mamba_expand", "n_mamba_heads", "mamba_headdim", "mamba_ngroups"))


def _ssd_within(config) -> None:
    """A Mamba-2 SSD config's heads set so that heads x head_dim is the mixer's inner width, expand x hidden (its
    head_dim the tiny one where the config's does not divide that width: Zamba2 derives it from the full hidden size;
    a Falcon-H1 that sets its inner width, `mamba_d_ssm`, to that too), its groups to a divisor of the heads."""
    for expand, heads, head_dim, groups in SSD_NAMES:
        if all(isinstance(getattr(config, n, None), int) for n in (expand, heads, head_dim)) and _settable(config, heads):
            inner = getattr(config, expand) * config.hidden_size
            if inner % getattr(config, head_dim) and _settable(config, head_dim):
                setattr(config, head_dim, math.gcd(SIZES["head_dim"], inner))
            setattr(config, heads, max(1, inner // getattr(config, head_dim)))
            if isinstance(getattr(config, groups, None), int):
                setattr(config, groups, math.gcd(getattr(config, groups), getattr(config, heads)))
            if isinstance(getattr(config, "mamba_d_ssm", None), int):
                config.mamba_d_ssm = getattr(config, heads) * getattr(config, head_dim)
            return


def _shared_block_within(config) -> None:
    """Zamba's and Zamba2's shared transformer block reads the layer input beside the embeddings' output,
    concatenated: its width (`attention_hidden_size`) twice the hidden size and its heads' that over the heads,
    its adapters' rank at most a head, the layers calling it (Zamba2's `hybrid_layer_ids`) those of the tiny
    stack, as HF's config derives them only when it is built (they stay the full model's after the sizes shrink)."""
    if isinstance(getattr(config, "attention_hidden_size", None), int) and _settable(config, "attention_hidden_size"):
        config.attention_hidden_size = 2 * config.hidden_size
        if isinstance(getattr(config, "attention_head_dim", None), int):
            config.attention_head_dim = config.attention_hidden_size // config.num_attention_heads
    if isinstance(getattr(config, "adapter_rank", None), int):
        config.adapter_rank = min(config.adapter_rank, SIZES["head_dim"])
    if isinstance(getattr(config, "hybrid_layer_ids", None), list):  # Zamba2's layers that call the shared block
        config.hybrid_layer_ids = [i for i, kind in enumerate(config.layers_block_type) if kind == "hybrid"]


def _per_type_values(config) -> tuple[dict, dict] | None:
    """A heterogeneous config's per-layer values by layer type ({type: {attribute: value}}) and the global values
    of those attributes; None for a homogeneous config, or one whose layers of a type differ (HF raises)."""
    from autoshard.models.facts import PER_LAYER_READ, per_type_values

    attributes = getattr(config, "per_layer_attributes", None)
    if not attributes or not attributes <= PER_LAYER_READ:  # others kept (refused by name)
        return None
    per_type = per_type_values(config)  # None: the layers of one type differ, kept (refused by name)
    return None if per_type is None else (
        per_type, {a: config._getattr_without_heterogeneous_validation(a) for a in attributes})


def _per_layer_within(config, per_type: dict, full: dict) -> None:
    """`config` heterogeneous again: each layer of the tiny stack given its type's per-layer values, each scaled
    as it relates to the full config's global value (Gemma-4's full-attention head_dim 512 of 256: 32 of 16), at
    least 1, K/V heads a divisor of the query heads."""
    def scaled(name: str, value):
        tiny = getattr(config, name)
        if not isinstance(value, int) or not isinstance(full[name], int) or not full[name]:
            return value
        out = max(1, round(tiny * value / full[name]))
        return math.gcd(out, config_value(config, "heads")) if name in ALIASES["kv_heads"] else out

    overrides = {i: {a: scaled(a, v) for a, v in per_type[t].items()} for i, t in enumerate(config.layer_types)}
    differ = {i: o for i, o in overrides.items() if any(getattr(config, a) != v for a, v in o.items())}
    config.per_layer_config = differ or None


def _settable(config, name: str) -> bool:
    """A field of `config` that can be set: not a property derived from others (Falcon's head_dim, Mamba's and
    Jamba's layer_types, Bamba's layers_block_type)."""
    if not hasattr(config, name):
        return False
    name = (getattr(config, "attribute_map", None) or {}).get(name, name)  # an alias (Bamba: layers_block_type)
    prop = getattr(type(config), name, None)
    return not (isinstance(prop, property) and prop.fset is None)


def _flags_by_type(config, full: list[str], tiny: list[str]) -> None:
    """Per-layer flags of the full config (0 / 1 lists as long as its `layer_types`: Llama-4's no_rope_layers) re-picked
    for the tiny layers: each takes the flag of the full config's first layer of its type (a Llama-4 full-attention
    layer keeps its lack of rope, as in every checkpoint, not the first layers' flags)."""
    source = [full.index(kind) for kind in tiny]
    for name, value in list(vars(config).items()):
        if name != "layer_types" and isinstance(value, list) and len(value) == len(full) and \
                all(v in (0, 1) and not isinstance(v, float) for v in value) and _settable(config, name):
            setattr(config, name, [value[i] for i in source])


def _per_layer_kinds(config) -> dict[str, list[str]]:
    """The per-layer lists of kinds `config` sets besides `layer_types` (a list of strings, one per layer of the full
    config: `mlp_layer_types`, `indexer_types`), each as its kinds in order of appearance."""
    full = config_value(config, "layers")
    return {name: list(dict.fromkeys(value)) for name, value in vars(config).items()
            if name != "layer_types" and isinstance(value, (list, tuple)) and value and len(value) == full
            and all(isinstance(v, str) for v in value) and _settable(config, name)}


def _route_tiny(config) -> None:
    """A config with routed experts: its top-k set where the class declares it unset (DeepSeek-V2's defaults), its
    expert groups (`ROUTING_GROUPS`) where it groups them."""
    if config_value(config, "top_k") is None:
        for name in ALIASES["top_k"]:
            if _settable(config, name):
                setattr(config, name, SIZES["top_k"])
    if isinstance(getattr(config, "n_group", None), int) and config.n_group > 1:  # grouped: 2 groups of 2 experts
        for name, value in ROUTING_GROUPS.items():
            if _settable(config, name):
                setattr(config, name, value)


def _shrink_latent(config, full: dict, *, same_heads: bool) -> None:
    """An MLA config with `MLA_SIZES` (those of its fields it sets), and the widths derived from them kept as the
    `full` config's values relate: head_dim the rope width, qk_head_dim nope + rope, K/V heads as many as the
    query heads (MLA expands its latent to every query head)."""
    for name, value in MLA_SIZES.items():
        if full[name] is not None and _settable(config, name):
            setattr(config, name, value)
    rope, nope = config.qk_rope_head_dim, getattr(config, "qk_nope_head_dim", 0)
    if full["head_dim"] is not None and full["head_dim"] == full["qk_rope_head_dim"] and _settable(config, "head_dim"):
        config.head_dim = rope
    if full["qk_head_dim"] is not None and full["qk_head_dim"] == full["qk_nope_head_dim"] + full["qk_rope_head_dim"]:
        config.qk_head_dim = nope + rope
    if same_heads:
        for name in ALIASES["kv_heads"]:
            if _settable(config, name) and getattr(config, name) is not None:
                setattr(config, name, config_value(config, "heads"))


def _derived_within(config, kinds, layers: int) -> None:
    """A config whose `layer_types` is derived (a property): every `*_layer_period` / `*_layer_offset` pair
    (Jamba's attention and expert layers) set to period 2, offset 1, and every list of layer indices
    (`*_layer_indices`: Bamba's attention layers) to the odd layers, so that `layers` layers hold each kind; a
    fixed pattern (RecurrentGemma's block_types) by up to 8 layers; ValueError naming the kinds when they still do not."""
    for name in [n for n in dir(config) if n.endswith("_layer_period")]:
        if isinstance(getattr(config, name, None), int):
            setattr(config, name, 2)
            offset = name.replace("_period", "_offset")
            if isinstance(getattr(config, offset, None), int):
                setattr(config, offset, 1)
    for name in [n for n in vars(config) if n.endswith("_layer_indices")]:
        value = getattr(config, name)
        if isinstance(value, (list, tuple)) and value and all(isinstance(i, int) for i in value) and _settable(config, name):
            setattr(config, name, list(range(1, layers, 2)))
    for more in range(layers + 1, 9):
        if not _missing_kinds(config, kinds):
            break
        for name in ALIASES["layers"]:
            if _settable(config, name):
                setattr(config, name, more)
    missing = _missing_kinds(config, kinds)
    if missing:
        raise ValueError(f"{type(config).__name__}: {layers} layers of the tiny config hold no {', '.join(missing)} "
                         "layer (its layer_types is derived from fields tiny_config does not know); give overrides")


def _missing_kinds(config, kinds) -> list[str]:
    """The layer kinds of `kinds` that `config`'s (derived) layer_types holds no layer of."""
    return [k for k in kinds if k not in list(config.layer_types)]


def exaggerated(config):
    """`config` with the multipliers and softcaps it has (any value, even None) set to `EXAGGERATED`."""
    config = copy.deepcopy(config)
    for name, value in EXAGGERATED.items():
        if _settable(config, name):  # (MiniCPM3's logits_scaling is derived: a property)
            setattr(config, name, value)
    return config


def without_dropout(config):
    """`config` with every dropout probability it has (a number field named *dropout*, *pdrop*, *dropout_prob*,
    *layerdrop*: GPT-2's resid_pdrop, Seed-OSS's residual_dropout, XGLM's layerdrop) set to 0, its text config's too:
    a run split over ranks draws other random masks than one process, so only a model without dropout can be
    compared with one."""
    config = copy.deepcopy(config)
    text = config.get_text_config(decoder=True)
    for part in (config,) if text is config else (config, text):
        for name, value in list(vars(part).items()):
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 and \
                    any(k in name for k in ("dropout", "pdrop", "layerdrop")) and _settable(part, name):
                setattr(part, name, 0.0)
    return config


def build_tiny(config, *, seed: int = 0, device: str = "cpu"):
    """The HF causal LM of `config` (see `tiny_config`), float32, weights drawn from `seed`."""
    config = copy.deepcopy(config)
    config._attn_implementation = "sdpa" if _sdpa_ok(config) else "eager"
    try:
        return _build(config, seed=seed, device=device)
    except ValueError as e:  # a class with no sdpa path (Mamba, Bloom): its eager attention
        if "does not support an attention implementation" not in str(e):
            raise
        config._attn_implementation = "eager"
        return _build(config, seed=seed, device=device)


def _build(config, *, seed: int, device: str):
    import torch
    from transformers import AutoModelForCausalLM

    grouped = bool(getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None))
    for experts in (("grouped_mm",) if grouped else ()) + (None,):
        if experts is not None:
            config._experts_implementation = experts
        if str(device) != "meta":
            torch.manual_seed(seed)
        try:
            with torch.device(device):
                return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        except ValueError as e:  # a class with its own experts (Llama-4): HF refuses the setting
            if experts is None or "experts implementation" not in str(e):
                raise
            config = copy.deepcopy(config)
            config._experts_implementation_internal = None


def _sdpa_ok(config) -> bool:
    """HF's sdpa attention takes no softcap or sinks; those families run their eager attention."""
    return not getattr(config, "attn_logit_softcapping", None) and getattr(config, "model_type", "") != "gpt_oss"
