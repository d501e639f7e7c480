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

from dataclasses import replace

from torch import nn

from autoshard.errors import InvalidConfigError
from autoshard.model_spec import Mixer, ModelSpec, config_violation
from autoshard.models.facts import ssd_mixers

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
        spec = ModelSpec(mixer=Mixer.SSD, **_ssd_numbers(mixers[0][1], config.hidden_size), **common)
    else:
        heads = getattr(config, "num_attention_heads", 0) or 0
        spec = ModelSpec(mixer=Mixer.ATTENTION, heads=heads,
                         kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                         ffn=getattr(config, "intermediate_size", 0) or 0, **common)
    # the axes the runtime refuses on this model are not searched either (rules/validity.axis_violation): a plan
    # of `autoshard plan` is one `parallelize` runs
    spec = replace(_with_experts(spec, model, stack, config), refused=hybrid_refusals(model) or (),
                   **beside_facts(model, config, spec.mixer))
    why = config_violation(spec) if spec.heads and (spec.kv_heads or spec.groups) else None
    if why:
        raise InvalidConfigError(f"{name}: {why}")
    return spec


def _ssd_numbers(mixer: nn.Module, hidden: int) -> dict:
    """The ModelSpec numbers of a Mamba-2 SSD mixer (its HF size attributes, `facts.ssd_mixers`)."""
    return dict(state=mixer.ssm_state_size, expand=max(1, mixer.intermediate_size // hidden), head_dim=mixer.head_dim,
                heads=mixer.num_heads, groups=mixer.n_groups, conv=mixer.conv_kernel_size, chunk=mixer.chunk_size)


def beside_facts(model: nn.Module, config, mixer: Mixer) -> dict:
    """The spec facts of a hybrid's second sequence mixer (ModelSpec `attention_beside` / `ssd_beside`): what
    serving prices the KV cache or the SSM state of those layers from. An SSD-read stack with attention layers:
    (heads, kv_heads, head_dim) of its attention modules (the config's head counts, the module's head_dim);
    an attention-read model whose layers hold a Mamba-2 mixer: that mixer's numbers. {} when there is none."""
    from autoshard.models.facts import config_value, is_attention

    if mixer is Mixer.SSD:
        attention = next((m for m in model.modules() if is_attention(m)), None)
        if attention is None:
            return {}
        heads = config_value(config, "heads")
        return {"attention_beside": (heads, config_value(config, "kv_heads", heads) or heads,
                                     getattr(attention, "head_dim", None) or config.hidden_size // heads)}
    mixers = ssd_mixers(model)
    if not mixers:
        return {}
    n = _ssd_numbers(mixers[0][1], config.hidden_size)
    return {"ssd_beside": tuple(n[k] for k in ("heads", "head_dim", "state", "groups", "conv", "expand"))}


def _with_experts(spec: ModelSpec, model: nn.Module, stack, config) -> ModelSpec:
    """`spec` with the routed experts of the stack's MoE layers (the first kind whose layer holds them, found as
    models/facts.py finds a MoE block: an experts module of 3-d weights with `experts` rows, the router beside
    it): their count, top-k, width and paths inside a layer, so that ep is searched and priced; the kinds
    without them are priced as dense layers (passes/cost/compiled.py `kind_spec`). `spec` when none holds any."""
    from autoshard.models.facts import _moe_modules, config_value

    experts = config_value(config, "experts", 0) or 0
    if not experts:
        return spec
    layers = model.get_submodule(stack.prefix)
    for kind in stack.kinds:
        path, router, shared, parts, _, _ = _moe_modules(layers[kind.layers[0]], experts)
        if path:
            return replace(spec, experts=experts, top_k=config_value(config, "top_k", 1),
                           ffn=config_value(config, "expert_ffn", None) or spec.ffn,
                           shared_ffn=config_value(config, "shared_ffn", 0) or 0,
                           moe_paths=(router, path, shared, *parts))
    return spec


def hybrid_refusals(model: nn.Module) -> tuple[tuple[str, str], ...] | None:
    """What the runtime cannot run yet on a hybrid, as (axis, why) pairs; None for a model that is no hybrid
    (one kind of layer, no SSD mixer beside attention). A hybrid is a mixed stack (layers of several kinds:
    Bamba, Nemotron-H, Jamba, DeepSeek-V3's dense and MoE layers) or one whose layers hold an SSD mixer beside
    attention (Falcon-H1). Its pipeline stages run the model's own forward (HF's hybrid cache, a mask per layer
    type); dp, pp and cp run, cp by state passing in the Mamba-2 layers (runtime/cp_mamba.py) and the
    attention algorithm in the attention layers. Refused by name: cp where a layer holds a sequence mixer no
    CP algorithm splits (Mamba-1's selective scan, gated DeltaNet, short convolutions), pp where layers share
    a block (Zamba2), tp / ep / sequence parallelism (the runtime's rules split one kind of layer)."""
    from autoshard.passes.capture.layer_kinds import find_layer_stack

    stack = find_layer_stack(model)
    if stack is None:
        return None
    ssd = ssd_mixers(model)
    if stack.uniform and not ssd:
        return None
    base = stack.prefix.rpartition(".")[0]
    what = (f"its layers are of several kinds ({', '.join(k.name for k in stack.kinds)})" if not stack.uniform
            else f"its layers hold a Mamba-2 mixer ({_relative(ssd[0][0], base)}) beside attention")
    out = [("tp", f"{what}: the runtime's tensor-parallel rules split one kind of layer; use tp=1"),
           ("sequence_parallel", f"{what}: sequence parallelism runs with tp, which this model does not run yet; "
                                 "set sequence_parallel to false")]
    experts = _experts_paths(model, stack)
    if experts:
        out.append(("ep", f"{what}: the experts of {_relative(experts[0], base)} are dispatched over ep in one "
                          "repeated layer only; use ep=1"))
    mixer = _mixer_without_cp(model, stack)
    if mixer is not None:
        out.append(("cp", f"{mixer} has no CP algorithm; use cp=1"))
    if stack.shared_params:
        out.append(("pp", f"its layers share a block ({stack.shared_params} parameters held by several layers: "
                          "Zamba2's shared transformer, which reads the embeddings' output); pipeline stages cut "
                          "layers that own their weights; use pp=1"))
    return tuple(out)


def _experts_paths(model: nn.Module, stack) -> list[str]:
    """Full paths of the routed-experts modules of the stack's MoE kinds, found by their 3-d weights with
    `experts` rows (models/facts.py `_moe_modules`), not by a module name."""
    from autoshard.models.facts import _moe_modules, config_value

    experts = config_value(getattr(model, "config", None), "experts", 0) or 0
    layers = model.get_submodule(stack.prefix)
    found = [(kind.layers[0], _moe_modules(layers[kind.layers[0]], experts)[0]) for kind in stack.kinds]
    return [f"{stack.prefix}.{i}.{path}" for i, path in sorted(found) if path]


def _mixer_without_cp(model: nn.Module, stack) -> str | None:
    """The first layer's sequence mixer that context parallelism has no algorithm for, named ("the Mamba-1
    selective scan of layers.0.mamba"), or None: a layer with neither an attention module nor an SSD mixer
    but a child holding a Conv1d or an A_log mixes its sequence some other way (Mamba-1's selective scan, Qwen3-Next's gated DeltaNet, LFM2's short
    convolutions)."""
    from autoshard.models.facts import is_attention

    base = stack.prefix.rpartition(".")[0]
    layers = model.get_submodule(stack.prefix)
    for i, layer in enumerate(layers):
        if any(is_attention(m) for m in layer.modules()) or ssd_mixers(layer):
            continue
        scan = next((p for p, m in layer.named_modules() if _selective_scan(m)), None)
        if scan is not None:
            return f"the Mamba-1 selective scan of {_relative(f'{stack.prefix}.{i}.{scan}', base)}"
        mixer = next(((p, m) for p, m in layer.named_children() if _mixes_sequence(m)), None)
        if mixer is None:  # a layer of per-token ops alone (Nemotron-H's MLP and MoE layers)
            continue
        path = _relative(f"{stack.prefix}.{i}.{mixer[0]}", base)
        return f"the sequence mixer {path} ({type(mixer[1]).__name__}, neither attention nor a Mamba-2 SSD)"
    return None


def _mixes_sequence(module: nn.Module) -> bool:
    """A layer child that mixes along the sequence: it holds a Conv1d or a recurrence's A_log."""
    return any(isinstance(m, nn.Conv1d) or "A_log" in dict(m.named_parameters(recurse=False))
               for m in module.modules())


def _selective_scan(module: nn.Module) -> bool:
    """A Mamba-1 mixer: its own A_log (heads x state) and the dt / x projections, no SSD dt_bias."""
    own = {k for k, _ in module.named_parameters(recurse=False)}
    return "A_log" in own and "dt_bias" not in own and hasattr(module, "x_proj") and hasattr(module, "dt_proj")


def _relative(path: str, base: str) -> str:
    """`path` below the base model ("model.layers.2.mamba" -> "layers.2.mamba")."""
    return path[len(base) + 1:] if base and path.startswith(base + ".") else path
