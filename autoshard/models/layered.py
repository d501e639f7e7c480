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
    spec = replace(_with_experts(spec, model, stack, config), refused=construct_refusals(model, stack))
    why = config_violation(spec) if spec.heads and (spec.kv_heads or spec.groups) else None
    if why:
        raise InvalidConfigError(f"{name}: {why}")
    return spec


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
        path, router, shared, _, _ = _moe_modules(layers[kind.layers[0]], experts)
        if path:
            return replace(spec, experts=experts, top_k=config_value(config, "top_k", 1),
                           ffn=config_value(config, "expert_ffn", None) or spec.ffn,
                           shared_ffn=config_value(config, "shared_ffn", 0) or 0, moe="layout",
                           moe_paths=(router, path, shared))
    return spec


def hybrid_refusals(model: nn.Module) -> tuple[tuple[str, str], ...] | None:
    """What the runtime cannot run yet on a hybrid, as (axis, why) pairs; None for a model that is no hybrid
    (one kind of layer, no SSD mixer beside attention). A hybrid is a mixed stack (layers of several kinds:
    Bamba, Nemotron-H, Jamba, DeepSeek-V3's dense and MoE layers) or one whose layers hold an SSD mixer beside
    attention (Falcon-H1). Its pipeline stages run the model's own forward (HF's hybrid cache, a mask per layer
    type); dp, pp and cp run, cp by state passing in the Mamba-2 layers (runtime/cp_mamba.py) and the
    attention algorithm in the attention layers. Refused by name: cp where a layer holds a sequence mixer no
    CP algorithm splits (Mamba-1's selective scan), tp / ep / sequence parallelism (the runtime's rules
    split one kind of layer)."""
    from autoshard.passes.capture.layer_kinds import find_layer_stack

    stack = find_layer_stack(model)
    if stack is None:
        return None
    ssd = ssd_mixers(model)
    base = stack.prefix.rpartition(".")[0]
    if stack.uniform and not ssd:
        return construct_refusals(model, stack) or None
    what = (f"its layers are of several kinds ({', '.join(k.name for k in stack.kinds)})" if not stack.uniform
            else f"its layers hold a Mamba-2 mixer ({_relative(ssd[0][0], base)}) beside attention")
    out = [("tp", f"{what}: the runtime's tensor-parallel rules split one kind of layer; use tp=1 "
                  "(dp, pp and cp run)"),
           ("sequence_parallel", f"{what}: sequence parallelism runs with tp, which this model does not run yet; "
                                 "set sequence_parallel to false")]
    experts = [p for p, m in model.named_modules() if p.endswith(".experts")]
    if experts:
        out.append(("ep", f"{what}: the experts of {_relative(experts[0], base)} are dispatched over ep in one "
                          "repeated layer only; use ep=1"))
    return construct_refusals(model, stack) + tuple(out)


def construct_refusals(model: nn.Module, stack) -> tuple[tuple[str, str], ...]:
    """(axis, why) of the constructs no axis rule covers, each naming its module: a block shared by several
    layers (pp: `_shared_block`) and a sequence mixer without a CP algorithm (cp: Mamba-1's selective scan, or
    any other `unknown_mixer`); the planner does not search those axes (the layered spec carries them) and
    `parallelize` refuses them, while every other axis still plans."""
    layers = model.get_submodule(stack.prefix)
    out = list(_shared_block(layers, stack.prefix))
    base = stack.prefix.rpartition(".")[0]
    scan = next((p for p, m in model.named_modules() if _selective_scan(m)), None)
    if scan is not None:
        out.append(("cp", f"the Mamba-1 selective scan of {_relative(scan, base)} has no CP algorithm; use cp=1"))
        return tuple(out)
    other = next(((k.layers[0], p) for k in stack.kinds if (p := unknown_mixer(layers[k.layers[0]]))), None)
    if other:
        out.append(("cp", f"layers.{other[0]}.{other[1]}: a sequence mixer with no CP algorithm (neither a module "
                          "calling HF's attention interface nor the Mamba-2 SSD scan); use cp=1"))
    return tuple(out)


def _shared_block(layers: nn.ModuleList, prefix: str) -> tuple[tuple[str, str], ...]:
    """(("pp", why),) where one module object serves several layers (Zamba2's shared transformer block), else
    (): pipeline stages on different ranks would each hold a copy whose gradients no rule sums."""
    seen: dict[int, list[tuple[int, str]]] = {}
    for index, layer in enumerate(layers):
        for path, param in layer.named_parameters(remove_duplicate=False):
            seen.setdefault(id(param), []).append((index, path))
    for uses in seen.values():
        indices = sorted({i for i, _ in uses})
        if len(indices) > 1:
            i, path = uses[0]
            top = path.split(".")[0]
            return (("pp", f"layers.{i}.{top}: one module shared by layers {', '.join(map(str, indices))}: pipeline "
                           "stages would each hold a copy whose gradients no rule sums over stages; use pp=1 "
                           "(dp and the other axes still plan)"),)
    return ()


def unknown_mixer(layer: nn.Module) -> str:
    """The path in `layer` of a sequence mixer autoshard has no rule for, or "": in a layer without a module
    calling HF's attention interface and without the SSD scan, the first child that is no norm, no MLP (all
    its parameters in linears) and no MoE block (routed experts: 3-d weights, one row per expert): Mamba-1's
    selective scan, RWKV's time mixing, a short convolution, a gated DeltaNet."""
    from autoshard.models.facts import is_attention

    if any(is_attention(m) for m in layer.modules()) or ssd_mixers(layer):
        return ""
    for name, child in layer.named_children():
        params = list(child.parameters())
        if not params or _is_norm(child):
            continue
        if all(isinstance(m, nn.Linear) or not any(True for _ in m.parameters(recurse=False)) for m in child.modules()):
            continue  # an MLP
        if any(p.dim() == 3 and p.shape[0] > 1 for m in child.modules() if not isinstance(m, nn.Conv1d)
               for p in m.parameters(recurse=False)):
            continue  # a MoE block
        return name
    return ""


def _is_norm(module: nn.Module) -> bool:
    """A norm: only vector parameters of its own and no children holding any (RMSNorm, LayerNorm)."""
    own = list(module.parameters(recurse=False))
    return bool(own) and all(p.dim() == 1 for p in own) and not any(
        True for m in module.children() for _ in m.parameters())


def _selective_scan(module: nn.Module) -> bool:
    """A Mamba-1 mixer: its own A_log (heads x state) and the dt / x projections, no SSD dt_bias."""
    own = {k for k, _ in module.named_parameters(recurse=False)}
    return "A_log" in own and "dt_bias" not in own and hasattr(module, "x_proj") and hasattr(module, "dt_proj")


def _relative(path: str, base: str) -> str:
    """`path` below the base model ("model.layers.2.mamba" -> "layers.2.mamba")."""
    return path[len(base) + 1:] if base and path.startswith(base + ".") else path
