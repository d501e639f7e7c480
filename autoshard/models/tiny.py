"""Tiny configs of any HF decoder class: what `autoshard verify` and the equivalence tests run.

Contract: `tiny_config(config, **overrides)` -> a copy of `config` (same class, same model_type, every
field the family sets kept) with its sizes shrunk through the alias table (models/facts.py `ALIASES`):
hidden 64, 4 heads of 16 (2 KV heads), MLP 96, vocabulary 256, one layer of each layer type (at
least two layers), 4 experts of width 32 (2 per token), windows of 4 tokens. `exaggerated(config)`
turns the multipliers and softcaps a family has far from 1 / small, so that a dropped op changes the
loss of a tiny random model visibly. `build_tiny(config_or_type)` builds the causal LM, float32,
seeded, eager-free (sdpa; the experts on grouped_mm, which traces on fake tensors).
"""

from __future__ import annotations

import copy
import math

from autoshard.models.facts import ALIASES

SIZES = {"hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "ffn": 96, "vocab": 256, "experts": 4,
         "top_k": 2, "expert_ffn": 32, "shared_ffn": 64, "sliding_window": 4}
# the model types tiny_config is checked on (tests/models/test_tiny.py: each builds and runs a forward); the
# classes of transformers' causal-LM mapping it does not handle yet, and why, are listed in docs/decoders.md
CHECKED = ("llama", "qwen3", "mistral", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "granite", "cohere",
           "stablelm", "glm4", "falcon", "bloom", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "granitemoe",
           "mamba", "falcon_mamba", "mamba2", "jamba", "gpt_neox", "opt", "gptj", "codegen")
# multipliers / caps that make a dropped op visible on a tiny random model (config field: value)
EXAGGERATED = {"logits_scaling": 0.25, "embedding_multiplier": 6.0, "residual_multiplier": 0.5,
               "attention_multiplier": 0.4, "logit_scale": 3.0, "final_logit_softcapping": 0.1,
               "attn_logit_softcapping": 0.05}


def tiny_config(config, **overrides):
    """A tiny config of the same class as `config` (a config or a model_type string); see the module
    docstring. `overrides`: config fields set last."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(config) if isinstance(config, str) else copy.deepcopy(config)
    for fact, value in SIZES.items():
        for name in ALIASES[fact]:
            if _settable(config, name) and (getattr(config, name) is not None or fact == "head_dim"):
                setattr(config, name, value)
    if isinstance(getattr(config, "rotary_dim", None), int) and config.rotary_dim > SIZES["head_dim"]:
        config.rotary_dim = SIZES["head_dim"]  # the rotated width of each head (GPT-J, CodeGen): at most the head's
    if all(isinstance(getattr(config, n, None), int) for n in ("expand", "num_heads", "head_dim")):
        # a Mamba-2 SSD config: its heads x head_dim is the mixer's inner width, expand x hidden
        config.num_heads = config.expand * config.hidden_size // config.head_dim
        if isinstance(getattr(config, "n_groups", None), int):
            config.n_groups = math.gcd(config.n_groups, config.num_heads)
    types = list(getattr(config, "layer_types", None) or [])
    kinds = list(dict.fromkeys(types)) or ["full_attention"]
    layers = max(2, len(kinds))
    for name in ALIASES["layers"]:
        if _settable(config, name):
            setattr(config, name, layers)
    if hasattr(config, "layer_types") and not _settable(config, "layer_types"):
        _periods_within(config, kinds, layers)  # derived from periods and offsets (Jamba) or fixed (Mamba)
    elif types:
        config.layer_types = [kinds[i % len(kinds)] for i in range(layers)]
    for name in ("max_window_layers",):
        if hasattr(config, name):
            setattr(config, name, layers)
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(getattr(config, name, None), int) and getattr(config, name) >= SIZES["vocab"]:
            setattr(config, name, {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}[name])
    for name in ("mlp_only_layers",):
        if hasattr(config, name):
            setattr(config, name, [])
    config.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def _settable(config, name: str) -> bool:
    """A field of `config` that can be set: not a property derived from others (Falcon's head_dim, Mamba's and
    Jamba's layer_types, Bamba's layers_block_type)."""
    prop = getattr(type(config), name, None)
    return hasattr(config, name) and not (isinstance(prop, property) and prop.fset is None)


def _periods_within(config, kinds, layers: int) -> None:
    """A config whose `layer_types` is derived (a property): every `*_layer_period` / `*_layer_offset` pair
    (Jamba's attention and expert layers) set to period 2, offset 1, so that `layers` layers hold each kind;
    ValueError naming the kinds when they still do not."""
    for name in [n for n in dir(config) if n.endswith("_layer_period")]:
        if isinstance(getattr(config, name, None), int):
            setattr(config, name, 2)
            offset = name.replace("_period", "_offset")
            if isinstance(getattr(config, offset, None), int):
                setattr(config, offset, 1)
    missing = [k for k in kinds if k not in list(config.layer_types)]
    if missing:
        raise ValueError(f"{type(config).__name__}: {layers} layers of the tiny config hold no {', '.join(missing)} "
                         "layer (its layer_types is derived from fields tiny_config does not know); give overrides")


def exaggerated(config):
    """`config` with the multipliers and softcaps it has (any value, even None) set to `EXAGGERATED`."""
    config = copy.deepcopy(config)
    for name, value in EXAGGERATED.items():
        if hasattr(config, name):
            setattr(config, name, value)
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
