"""The spec of a model whose decoder layers are of several kinds (Bamba, Nemotron-H, Granite-4, Jamba,
Zamba2, DeepSeek-V3's dense and MoE layers; passes/capture/layer_kinds.py), read off its modules and config.

`layered_spec(model, *, name) -> ModelSpec | None`: None for a model whose layers are all of one kind
(the type gate of `presets.spec_from_hf_config` reads those, as it always did). Otherwise a spec of
the family of its sequence mixer: MAMBA2 when a layer holds a Mamba-2 SSD mixer, found by its pattern
(parameters `A_log`, `D`, `dt_bias`, a `conv1d` child and HF's mixer attributes `num_heads`,
`head_dim`, `n_groups`, `ssm_state_size`, `conv_kernel_size`, `chunk_size`), not by class name, with
those numbers; else LLAMA with the config's attention numbers. What the spec holds is what capture and
`inspect` need (the family's sampled lengths and fused kernels); planning a mixed stack is refused by
name in `passes/cost/compiled.compile_table` until the cost model prices a stage as the sum of its kinds.
"""

from __future__ import annotations

from torch import nn

from autoshard.errors import InvalidConfigError
from autoshard.model_spec import Mixer, ModelSpec, config_violation

_SSD_ATTRS = ("num_heads", "head_dim", "n_groups", "ssm_state_size", "conv_kernel_size", "chunk_size")


def ssd_mixers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) of every Mamba-2 SSD mixer of `model`, by the pattern of the module docstring."""
    out = []
    for path, module in model.named_modules():
        params = {k for k, _ in module.named_parameters(recurse=False)}
        if {"A_log", "D", "dt_bias"} <= params and hasattr(module, "conv1d") and \
                all(isinstance(getattr(module, a, None), int) for a in _SSD_ATTRS):
            out.append((path, module))
    return out


def layered_spec(model: nn.Module, *, name: str) -> ModelSpec | None:
    """The spec of a mixed layer stack (None for one kind of layer); see the module docstring."""
    from autoshard.passes.capture.layer_kinds import find_layer_stack

    config = getattr(model, "config", None)
    stack = find_layer_stack(model)
    if config is None or stack is None or stack.uniform:
        return None
    common = dict(name=name, vocab=config.vocab_size, hidden=config.hidden_size, layers=stack.num_layers,
                  tied=bool(getattr(config, "tie_word_embeddings", False)))
    mixers = ssd_mixers(model)
    if mixers:
        m = mixers[0][1]
        spec = ModelSpec(mixer=Mixer.SSD, state=m.ssm_state_size, expand=max(1, m.intermediate_size // config.hidden_size),
                         head_dim=m.head_dim, heads=m.num_heads, groups=m.n_groups, conv=m.conv_kernel_size,
                         chunk=m.chunk_size, **common)
    else:
        heads = getattr(config, "num_attention_heads", 0) or 0
        spec = ModelSpec(mixer=Mixer.ATTENTION, heads=heads,
                         kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                         ffn=getattr(config, "intermediate_size", 0) or 0, **common)
    why = config_violation(spec) if spec.heads and (spec.kv_heads or spec.groups) else None
    if why:
        raise InvalidConfigError(f"{name}: {why}")
    return spec
