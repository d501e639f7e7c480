"""Preset models: the HF configs of the paper's LLaMA and Mamba-2 sizes, plus tiny debug sizes.

A preset is a `ModelSpec` (frozen numbers) that builds an unmodified HF `LlamaForCausalLM` or
`Mamba2ForCausalLM`. `build_model(spec, device="meta")` allocates no weights: planning a 70B
model needs none. `resolve_model` also accepts `package.module:factory`, a callable returning
an `nn.Module` (its spec is read off the HF config it carries).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, replace
from enum import Enum

import torch
from torch import nn

from autoshard.errors import InvalidConfigError, UnknownNameError


class Family(str, Enum):
    LLAMA = "llama"
    MAMBA2 = "mamba2"


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """The numbers of a model that the cost model and the runtime's divisibility rules need."""

    name: str
    family: Family
    vocab: int
    hidden: int
    layers: int
    tied: bool
    # LLaMA
    ffn: int = 0
    heads: int = 0
    kv_heads: int = 0
    # Mamba-2 (heads is the SSM head count)
    state: int = 0
    expand: int = 0
    head_dim: int = 0
    groups: int = 0
    conv: int = 0
    chunk: int = 0

    @property
    def intermediate(self) -> int:
        """Mamba-2 inner width (expand * hidden); LLaMA's ffn width."""
        return self.expand * self.hidden if self.family is Family.MAMBA2 else self.ffn

    def hf_config(self):
        """The Hugging Face config this spec describes."""
        if self.family is Family.LLAMA:
            from transformers import LlamaConfig

            return LlamaConfig(
                vocab_size=self.vocab,
                hidden_size=self.hidden,
                intermediate_size=self.ffn,
                num_hidden_layers=self.layers,
                num_attention_heads=self.heads,
                num_key_value_heads=self.kv_heads,
                tie_word_embeddings=self.tied,
                max_position_embeddings=max(4096, 2 * 65536),
                attn_implementation="sdpa",
            )
        from transformers import Mamba2Config

        return Mamba2Config(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            num_hidden_layers=self.layers,
            state_size=self.state,
            expand=self.expand,
            head_dim=self.head_dim,
            num_heads=self.heads,
            n_groups=self.groups,
            conv_kernel=self.conv,
            chunk_size=self.chunk,
            tie_word_embeddings=self.tied,
        )


def _llama(name, vocab, hidden, ffn, layers, heads, kv_heads, tied=False) -> ModelSpec:
    return ModelSpec(name=name, family=Family.LLAMA, vocab=vocab, hidden=hidden, ffn=ffn, layers=layers,
                     heads=heads, kv_heads=kv_heads, tied=tied)


def _mamba2(name, vocab, hidden, layers, heads, groups, tied, state=128, head_dim=64, chunk=256) -> ModelSpec:
    return ModelSpec(name=name, family=Family.MAMBA2, vocab=vocab, hidden=hidden, layers=layers, state=state,
                     expand=2, head_dim=head_dim, heads=heads, groups=groups, conv=4, chunk=chunk, tied=tied)


PRESETS: dict[str, ModelSpec] = {
    s.name: s
    for s in (
        _llama("llama-1b", 32000, 2048, 5632, 22, 32, 4),
        _llama("llama-7b", 32000, 4096, 11008, 32, 32, 32),
        _llama("llama-13b", 32000, 5120, 13824, 40, 40, 40),
        _llama("llama-70b", 128256, 8192, 28672, 80, 64, 8),
        _llama("llama-tiny", 256, 64, 176, 4, 4, 2),
        _mamba2("mamba2-1b", 50288, 2048, 48, 64, 1, tied=True),
        _mamba2("mamba2-7b", 32768, 4096, 64, 128, 8, tied=False),
        _mamba2("mamba2-tiny", 256, 64, 4, 8, 2, tied=False, state=16, head_dim=16, chunk=16),
    )
}


def preset_names() -> tuple[str, ...]:
    return tuple(PRESETS)


def get_spec(name: str, *, layers: int | None = None) -> ModelSpec:
    """The preset called `name`, optionally with another layer count."""
    try:
        spec = PRESETS[name]
    except KeyError:
        raise UnknownNameError(
            f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)} "
            "(or pass package.module:factory returning an nn.Module)"
        ) from None
    if layers is not None:
        if layers <= 0:
            raise InvalidConfigError(f"layers must be positive, got {layers}")
        spec = replace(spec, layers=layers)
    return spec


def build_model(spec: ModelSpec, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                seed: int | None = 0) -> nn.Module:
    """An unmodified HF model for `spec` with random weights; `device="meta"` allocates none."""
    from transformers import AutoModelForCausalLM

    if seed is not None and str(device) != "meta":
        torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(spec.hf_config(), dtype=dtype)
    return model


def spec_from_hf_config(config, *, name: str) -> ModelSpec:
    """Read a `ModelSpec` off a HF LLaMA or Mamba-2 config (for user-built models)."""
    model_type = getattr(config, "model_type", None)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if model_type == "llama":
        return ModelSpec(name=name, family=Family.LLAMA, vocab=config.vocab_size, hidden=config.hidden_size,
                         ffn=config.intermediate_size, layers=config.num_hidden_layers,
                         heads=config.num_attention_heads, kv_heads=config.num_key_value_heads, tied=tied)
    if model_type == "mamba2":
        return ModelSpec(name=name, family=Family.MAMBA2, vocab=config.vocab_size, hidden=config.hidden_size,
                         layers=config.num_hidden_layers, state=config.state_size, expand=config.expand,
                         head_dim=config.head_dim, heads=config.num_heads, groups=config.n_groups,
                         conv=config.conv_kernel, chunk=config.chunk_size, tied=tied)
    raise InvalidConfigError(
        f"model type {model_type!r} is not supported yet; autoshard knows 'llama' and 'mamba2' "
        "(LlamaForCausalLM, Mamba2ForCausalLM)"
    )


def resolve_model(name_or_factory: str, *, device: str = "meta") -> tuple[ModelSpec, nn.Module]:
    """A preset name or `package.module:factory` -> (spec, model)."""
    if ":" not in name_or_factory:
        spec = get_spec(name_or_factory)
        return spec, build_model(spec, device=device)
    module_name, _, attr = name_or_factory.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise UnknownNameError(f"cannot load model factory {name_or_factory!r}: {e}") from None
    with torch.device(device):
        model = factory()
    if not isinstance(model, nn.Module):
        raise InvalidConfigError(f"{name_or_factory} returned {type(model).__name__}, expected an nn.Module")
    config = getattr(model, "config", None)
    if config is None:
        raise InvalidConfigError(f"{name_or_factory} returned a module without a HF .config; "
                                 "autoshard needs a LlamaForCausalLM or Mamba2ForCausalLM-like model")
    return spec_from_hf_config(config, name=name_or_factory), model
