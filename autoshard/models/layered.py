"""The spec of a model whose decoder layers are of several kinds (Bamba, Nemotron-H, Granite-4, Jamba,
Zamba2, DeepSeek-V3's dense and MoE layers; passes/capture/layer_kinds.py), read off its modules and config.

`layered_spec(model, *, name) -> ModelSpec | None`: None for a model whose layers are all of one kind (read by
`presets.spec_from_hf_config`'s facts), except Mamba-2 layers other than Mamba2ForCausalLM's (an all-Mamba Bamba:
an MLP beside the mixer) and Mamba-1's selective scans (Mamba, Falcon-Mamba: by Jamba's part rule). Otherwise a spec of the family of its sequence mixer: SSD when a layer holds a Mamba-2
mixer, found by its pattern (parameters `A_log`, `D`, `dt_bias`, a `conv1d` child and HF's mixer size attributes),
not by class name, with those numbers; else ATTENTION with the config's attention numbers; its layer parts (each
part's tensor-parallel rule), experts and what the runtime refuses on it. Contract: docs/modules/models.md.
"""

from __future__ import annotations

import math

from dataclasses import replace

from torch import nn

from autoshard.errors import InvalidConfigError
from autoshard.model_spec import Mixer, ModelSpec, config_violation
from autoshard.models.dispatch import delta_mixers, delta_split, is_selective_scan, split_points
from autoshard.models.facts import bidirectional_attention, ssd_mixers, text_config

def layered_spec(model: nn.Module, *, name: str) -> ModelSpec | None:
    """The spec of a mixed layer stack (None for one kind of layer but those read by their parts); see the module
    docstring."""
    from autoshard.passes.capture.layer_kinds import find_layer_stack

    config = text_config(getattr(model, "config", None))
    stack = find_layer_stack(model)
    mixers = ssd_mixers(model)
    # a uniform stack of Mamba-1 selective scans (Mamba, Falcon-Mamba): by its parts' rules, as Jamba's layers are
    scans = stack is not None and stack.uniform and any(is_selective_scan(m) for m in model.get_submodule(stack.prefix)[0].modules())
    if config is None or stack is None or (stack.uniform and not mixers and not scans):
        return None
    parts = layer_parts(model, stack)  # the stack found once, its parts read once: passed on
    if stack.uniform and not scans and not _ssd_layers_beyond_mamba2(stack, parts[0]):
        return None
    both_ways = bidirectional_attention(model)
    if both_ways:
        raise InvalidConfigError(f"{name}: {both_ways}")
    common = dict(name=name, vocab=config.vocab_size, hidden=config.hidden_size, layers=stack.num_layers,
                  tied=bool(getattr(config, "tie_word_embeddings", False)))
    if mixers:
        spec = ModelSpec(mixer=Mixer.SSD, **_ssd_numbers(mixers[0][1], config.hidden_size), **common)
    else:
        heads = getattr(config, "num_attention_heads", 0) or 0
        spec = ModelSpec(mixer=Mixer.ATTENTION, heads=heads,
                         kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                         ffn=getattr(config, "intermediate_size", 0) or 0, **common)
    # the axes the runtime refuses on this model are not searched either (rules/validity.axis_violation): a plan
    # of `autoshard plan` is one `parallelize` runs
    from autoshard.models.presets import model_refusals

    refused = hybrid_refusals(model, stack, parts) or ()
    refused += tuple(r for r in model_refusals(model) if r[0] not in {a for a, _ in refused})
    spec = replace(stack_experts(spec, model, stack, config), refused=refused,
                   **beside_facts(model, config, spec.mixer), **kv_latent(model, config), parts=parts[0],
                   own_forward=True)  # its stages run HF's own forward (the hybrid cache, a mask per layer type)
    why = config_violation(spec) if spec.heads and (spec.kv_heads or spec.groups) else None
    if why:
        raise InvalidConfigError(f"{name}: {why}")
    return spec


def _ssd_layers_beyond_mamba2(stack, parts: tuple) -> bool:
    """Whether a uniform stack of layers holding a Mamba-2 mixer is other than Mamba2ForCausalLM's (the one-kind SSD
    table of rules/sharding.py: `backbone.layers.*` holding a mixer and a norm): an all-Mamba Bamba, Granite-4 or
    Nemotron-H (an MLP or MoE beside the mixer, or the layers elsewhere), read by their parts as a hybrid is.
    A layer with attention beside its mixer (Falcon-H1) is read as an attention model (presets._spec_of)."""
    kinds = {p.kind for p in parts if p.kind not in ("embed", "final_norm", "lm_head")}
    return "attention" not in kinds and (kinds != {"ssd", "norm"} or stack.prefix != "backbone.layers")


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


def kv_latent(model: nn.Module, config) -> dict:
    """The spec fact of multi-head latent attention (ModelSpec `kv_latent`): an attention module with a
    compressed KV projection (`kv_a_proj_with_mqa`, DeepSeek-V2/V3) caches kv_lora_rank + qk_rope_head_dim
    elements per token (HF's cache of it: the compressed KV as its keys, the RoPE key as its values). {} for none."""
    if not any(hasattr(m, "kv_a_proj_with_mqa") for m in model.modules()):
        return {}
    return {"kv_latent": int(config.kv_lora_rank) + int(config.qk_rope_head_dim)}


def stack_experts(spec: ModelSpec, model: nn.Module, stack, config) -> ModelSpec:
    """`spec` with the routed experts of the stack's MoE layers (the first kind whose layer holds them, found as
    models/facts.py finds a MoE block: an experts module of 3-d weights with `experts` rows, the router beside
    it), so that ep is searched and priced (`with_experts`); the kinds without them are priced as dense layers
    (passes/cost/compiled.py `kind_spec`). `spec` when none holds any."""
    from autoshard.models.facts import _moe_modules, config_value

    experts = config_value(config, "experts", 0) or 0
    if not experts:
        return spec
    layers = model.get_submodule(stack.prefix)
    for kind in stack.kinds:
        paths = _moe_modules(layers[kind.layers[0]], experts)
        if paths[0]:
            return with_experts(spec, config, paths, layers[kind.layers[0]])
    return spec


def with_experts(spec: ModelSpec, config, paths: tuple, layer: nn.Module) -> ModelSpec:
    """`spec` as a MoE decoder whose `layer` holds its MoE block at `paths` ((experts, router, shared expert or "",
    its parts), models/facts.py `_moe_modules`): the config's routed experts and top-k, their width (expert_ffn,
    else intermediate_size: Mixtral's naming), the shared expert's width, the block's paths (`moe_paths`), the
    experts' elements as the module holds them (`expert_numel`: biases, an ungated up x hidden), and why a serving
    replica cannot split them over tp (`experts_no_tp_split`), and whether they take every token (`experts_scattered`)."""
    from autoshard.models.facts import config_value, experts_scattered, experts_tp_split_refusal

    experts, router, shared, parts = paths
    module = layer.get_submodule(experts)
    spec = replace(spec, experts=config_value(config, "experts"), top_k=config_value(config, "top_k", 1),
                   ffn=config_value(config, "expert_ffn", None) or spec.ffn,
                   shared_ffn=config_value(config, "shared_ffn", 0) or 0, moe_paths=(router, experts, shared, *parts),
                   experts_no_tp_split=experts_tp_split_refusal(module, f"layers.*.{experts}") or "",
                   experts_scattered=experts_scattered(module))
    numel = sum(p.numel() for p in module.parameters())
    return spec if numel == spec.expert_params else replace(spec, expert_numel=numel)


def hybrid_refusals(model: nn.Module, stack, parts: tuple | None = None) -> tuple[tuple[str, str], ...] | None:
    """What the runtime cannot run yet on a hybrid, as (axis, why) pairs; None for a model that is no hybrid
    (one kind of layer, no SSD mixer beside attention). A hybrid is a mixed stack (layers of several kinds:
    Bamba, Nemotron-H, Jamba, DeepSeek-V3's dense and MoE layers) or one whose layers hold an SSD mixer beside
    attention (Falcon-H1). Its pipeline stages run the model's own forward (HF's hybrid cache, a mask per layer
    type); dp, pp and cp run, cp by state passing in the Mamba-2 and Mamba-1 layers (runtime/cp_mamba.py,
    cp_scan.py), the previous rank's tokens in short convolutions (cp_conv.py) and the attention algorithm in the
    attention layers. Refused by name: cp where a layer holds a sequence mixer no CP algorithm splits (a gated
    DeltaNet, lightning attention), pp where layers share
    a block (Zamba2), tp where a layer holds a part no tensor-parallel rule splits (`layer_parts`: Kimi-Linear's
    delta attention, a shared block; the others run by their parts' rules),
    ep, and sequence parallelism where a part has no rule of its own (`_sequence_unsplit`). `stack`: the model's `find_layer_stack`; `parts`: its `layer_parts` where the caller
    has them (else read here)."""
    if stack is None:
        return None
    ssd = ssd_mixers(model)
    parts = parts if parts is not None else layer_parts(model, stack)
    if stack.uniform and not ssd and not any(p.kind in ("mla", "mamba1") for p in parts[0]):
        return _ruleless_refusals(model, stack)
    base = stack.prefix.rpartition(".")[0]
    what = (f"its layers are of several kinds ({', '.join(k.name for k in stack.kinds)})" if not stack.uniform
            else f"its layers hold a Mamba-2 mixer ({_relative(ssd[0][0], base)})"
                 f"{' beside attention' if any(p.kind == 'attention' for p in parts[0]) else ''}" if ssd
            else "its layers hold Mamba-1 selective scans, run by their parts" if any(p.kind == "mamba1" for p in parts[0])
            else "its layers hold multi-head latent attention, run by its parts")
    _, no_tp = parts
    out = [("tp", no_tp)] if no_tp else []
    unsplit = _sequence_unsplit(model, stack, parts[0])
    if unsplit:
        out.append(("sequence_parallel", f"{what}: sequence parallelism is not run on {unsplit} yet; set "
                                         "sequence_parallel to false"))
    no_ep = _experts_without_ep(model, stack)
    if no_ep:
        out.append(("ep", no_ep))
    mixer = _mixer_without_cp(model, stack)
    if mixer is not None:
        out.append(("cp", f"{mixer} has no CP algorithm; use cp=1"))
    else:
        from autoshard.models.facts import mask_reader

        reader = mask_reader(model)  # DeepSeek-V3.2's indexer: its own mask over the whole sequence
        if reader:
            out.append(("cp", reader))
    if stack.shared_params:
        out.append(("pp", f"its layers share a block ({stack.shared_params} parameters held by several layers: "
                          "Zamba2's shared transformer, which reads the embeddings' output); pipeline stages cut "
                          "layers that own their weights; use pp=1"))
    elif _cross_layer_input(model, stack):
        out.append(("pp", f"its layers read {_cross_layer_input(model, stack)} beside their input (hidden states of "
                          "other layers than the one before: Zamba's embeddings' output, Inkling-2's block residual "
                          "states), which no pipeline boundary carries; use pp=1"))
    if ssd and not any(p.kind in ("attention", "attention_whole", "mla") for p in parts[0]):
        out.append(("inference", "it has no attention layer, and HF's hybrid cache asks an attention layer for the "
                                 "cached length (its forward with a cache, HF's own generate too, raise "
                                 "`get_seq_length` can only be called on Attention layers); plan its training"))
    return tuple(out)


def _sequence_unsplit(model: nn.Module, stack, parts) -> str:
    """What of a hybrid's layers sequence parallelism cannot run on a tp shard of the sequence, or "": a part with
    no rule of its own ("other": whole on every rank) or a "norm" holding other than hidden-wide vectors (per-token
    ops only). Every other part runs as on a uniform model: a sequence mixer (attention, latent attention, a Mamba-1
    or Mamba-2 mixer, a gated DeltaNet, a short convolution) and an MLP gather the shard at their input, their
    state running along the whole sequence, HF's gathered attention runs whole, a MoE block routes the shard."""
    from autoshard.models.facts import config_value, holds_hidden_vectors

    other = next((p for p in parts if p.kind == "other"), None)
    if other is not None:
        return f"its {other.path} (a part no tensor-parallel rule splits)"
    hidden = config_value(model.config, "hidden", 0)
    for part in (p for p in parts if p.kind == "norm"):
        if not holds_hidden_vectors(model.get_submodule(f"{stack.prefix}.{part.layers[0]}.{part.path}"), hidden):
            return f"its layers' {part.path}, which holds other than {hidden}-wide vectors"
    return ""


# a layer's forward argument carrying hidden states of other layers than the one before it (Zamba's embeddings' output,
# Inkling-2's states at its block boundaries), which a pipeline boundary does not carry
CROSS_LAYER_INPUTS = ("original_hidden_states", "block_states")


def _cross_layer_input(model: nn.Module, stack) -> str:
    """The first of `CROSS_LAYER_INPUTS` a layer's forward takes (even a tiny stack whose one Zamba layer shares its
    block with none), else ""."""
    import inspect

    layers = model.get_submodule(stack.prefix)
    return next((name for layer in layers for name in inspect.signature(type(layer).forward).parameters
                 if name in CROSS_LAYER_INPUTS), "")


def _ruleless_refusals(model: nn.Module, stack) -> tuple[tuple[str, str], ...] | None:
    """A uniform stack whose layers mix tokens by a module with no rule (a Conv1d or a recurrence's A_log in a module
    no part rule reads; Mamba-1's scans are read by their parts, `layered_spec`): run by the model's own forward
    under dp and pp; tp, sequence parallelism and cp refused naming the module. None for a uniform stack of
    attention (or per-token) layers."""
    mixer = _mixer_without_cp(model, stack)
    if mixer is None:
        return None
    out = [("tp", f"{mixer} has no tensor-parallel rule; use tp=1"),
           ("sequence_parallel", f"{mixer} has no tensor-parallel rule, and sequence parallelism runs with tp; set "
                                 "sequence_parallel to false"),
           ("cp", f"{mixer} has no CP algorithm; use cp=1")]
    return tuple(out)


def _experts_without_ep(model: nn.Module, stack) -> str | None:
    """Why the routed experts of a hybrid's MoE layers cannot be dispatched over ep, naming the first such experts
    module (models/facts.py `experts_ep_refusal`), or None (none, or all run)."""
    from autoshard.models.facts import _moe_modules, config_value, experts_ep_refusal

    experts = config_value(model.config, "experts", 0) or 0
    base = stack.prefix.rpartition(".")[0]
    for i, layer in enumerate(model.get_submodule(stack.prefix)):
        path = _moe_modules(layer, experts)[0]
        why = experts_ep_refusal(layer.get_submodule(path), _relative(f"{stack.prefix}.{i}.{path}", base)) if path else None
        if why:
            return why
    return None


def _mixer_without_cp(model: nn.Module, stack) -> str | None:
    """The first layer's sequence mixer that context parallelism has no algorithm for, named ("the sequence mixer
    layers.0.linear_attn (Qwen3NextGatedDeltaNet, ...)"), or None: a layer with neither an attention module nor an
    SSD mixer but a child holding a Conv1d or an A_log mixes its sequence some other way (MiniMax's lightning
    attention, Kimi's delta attention; Mamba-1's selective scan, gated DeltaNets and LFM2's short convolutions have
    their CP algorithms, a mixer whose forward calls no one conv they swap by signature excepted: models/dispatch.py
    `split_points`, `delta_split`)."""
    from autoshard.models.facts import config_value, is_attention

    base = stack.prefix.rpartition(".")[0]
    layers = model.get_submodule(stack.prefix)
    experts = config_value(model.config, "experts", 0) or 0
    for i, layer in enumerate(layers):
        if any(is_attention(m) for m in layer.modules()) or ssd_mixers(layer):
            continue
        scan = next(((p, m) for p, m in layer.named_modules() if is_selective_scan(m)), None)
        if scan is not None:  # passes its state between ranks (runtime/cp_scan.py) where its dispatch points swap
            points = split_points(scan[1])
            if isinstance(points, str):
                return f"the Mamba-1 selective scan of {_relative(f'{stack.prefix}.{i}.{scan[0]}', base)} ({points})"
            continue
        delta = delta_mixers(layer)  # passes its state too (runtime/cp_delta.py) where its one causal conv swaps
        for path, mixer in delta:
            why = delta_split(mixer)
            if why:
                return f"the gated DeltaNet {_relative(f'{stack.prefix}.{i}.{path}', base)} ({why})"
        if delta:
            continue
        # a child with a Conv1d or an A_log; else, in a mixed stack, one that is no MLP, MoE block or norm (MiniMax's
        # lightning attention, whose decay is a buffer): either may mix the sequence, which a cp rank holds a chunk of
        # (a short convolution has its CP algorithm: runtime/cp_conv.py, its conv continuing the previous rank's tokens)
        children = [(p, m) for p, m in layer.named_children() if short_conv(m) is None]
        mixer = next(((p, m) for p, m in children if _mixes_sequence(m)), None) or next(
            ((p, m) for p, m in children if not stack.uniform and _unknown_part(p, m, experts)), None)
        if mixer is None:  # a layer of per-token ops alone (Nemotron-H's MLP and MoE layers)
            continue
        path = _relative(f"{stack.prefix}.{i}.{mixer[0]}", base)
        return f"the sequence mixer {path} ({type(mixer[1]).__name__}, neither attention nor a Mamba-2 SSD)"
    return None


def _unknown_part(name: str, module: nn.Module, experts: int) -> bool:
    """A layer child with matrices that is no MLP nor MoE block (`_part`): what it does along the sequence is unknown."""
    params = list(module.parameters())
    if not params or all(p.dim() <= 1 for p in params):
        return False  # a norm, or nothing
    part = _part(name, module, ssd=False, experts=experts, attention=False)
    return part is None or part[0] not in ("mlp", "moe")


def _mixes_sequence(module: nn.Module) -> bool:
    """A layer child that mixes along the sequence: it holds a Conv1d or a recurrence's A_log."""
    return any(isinstance(m, nn.Conv1d) or "A_log" in dict(m.named_parameters(recurse=False))
               for m in module.modules())


_DELTA_ATTRS = ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")  # HF's gated DeltaNet size attributes


def _delta_part(name: str, child: nn.Module, linear: dict) -> tuple | None:
    """The "delta" part of a gated DeltaNet mixer (Qwen3-Next, Qwen3.5, OLMo-hybrid), found by its pattern, not its
    class: HF's size attributes (`_DELTA_ATTRS`), a per-value-head `A_log` and `dt_bias`, a depthwise `conv1d` over
    [q; k; v], projections of the layer's input whose widths are sizes of the heads, one output projection of the
    value width, and norms of one value head's width. Split by key heads (every value head of a key head on its rank):
    each projection by its width, conv1d by [q; k; v], A_log / dt_bias by head, the output projection
    row-parallel, the norms whole (their gradient summed over tp). None where anything else is found."""
    counts = {a: getattr(child, a, None) for a in _DELTA_ATTRS}
    own = dict(child.named_parameters(recurse=False))
    conv = getattr(child, "conv1d", None)
    if not all(isinstance(v, int) and v > 0 for v in counts.values()) or set(own) != {"A_log", "dt_bias"} \
            or not isinstance(conv, nn.Conv1d):
        return None
    nk, nv, hk, hv = (counts[a] for a in _DELTA_ATTRS)
    key, value = nk * hk, nv * hv
    if nv % nk or any(p.shape != (nv,) for p in own.values()) or conv.groups != conv.in_channels \
            or conv.in_channels != 2 * key + value:
        return None
    sizes = {"k_heads": nk, "v_heads": nv, "key": key, "value": value, "conv": conv.kernel_size[0]}
    # one piece split by key heads: q or k (key), v / z / g (value), a or b (one per value head), and Qwen3-Next's
    # fused projections laid out per key head ([q, k, v, z] and [b, a] of each key head in turn); [q; k; v] three pieces
    whole = {key, value, nv, 2 * key + 2 * value, 2 * nv}
    ins = [m.in_features for m in linear.values()]
    hidden = max(set(ins), key=ins.count, default=0)  # the layer's width: what the input projections read
    rows = [n for n, m in linear.items() if (m.in_features, m.out_features) == (value, hidden)]
    if len(rows) > 1:  # hidden = value: the widths do not tell the output projection apart, HF's name does
        rows = [n for n in rows if n in ("out_proj", "o_proj")]
    if len(rows) != 1:
        return None  # no output projection, or no way to tell it
    linears, norms = [], []
    for n, m in child.named_children():
        if n == "conv1d":
            continue
        if n == rows[0]:
            linears.append((n, "rowwise"))
        elif isinstance(m, nn.Linear) and m.in_features == hidden and \
                (m.out_features in whole) != (m.out_features == 2 * key + value):
            linears.append((n, "colwise" if m.out_features in whole else "qkv"))
            sizes[n] = m.out_features
        elif [tuple(p.shape) for p in m.parameters()] == [(hv,)]:
            norms.append(n)
            sizes[n] = hv
        elif any(True for _ in m.parameters()):
            return None  # a child no rule splits
    if len(linears) < 2:
        return None
    attrs = tuple(a for a in ("num_k_heads", "num_v_heads", "key_dim", "value_dim", "conv_dim")
                  if isinstance(getattr(child, a, None), int))
    return "delta", name, tuple(sizes.items()), tuple(norms), attrs, (), (), (), tuple(linears)


_KDA_ATTRS = ("num_heads", "qkv_dim", "conv_dim")  # HF's per-channel delta attention size attributes


def _kda_part(name: str, child: nn.Module, linear: dict) -> tuple | None:
    """The "kda" part of a per-channel gated delta attention (Kimi-Linear's, Bailing-hybrid's: a gated DeltaNet whose
    decay is per channel), found by its pattern, not its class: HF's size attributes (num_heads, head_dim and qkv_dim
    their product), a depthwise conv1d over [q; k; v], and below it linears and vectors whose widths are sizes of the
    heads. Split by heads: each linear of the layer's input to qkv_dim or num_heads outputs column-parallel, and one of
    a low-rank pair (hidden -> r -> qkv_dim: its r -> qkv_dim linear column-parallel, its hidden -> r one whole, its
    gradient summed), the output projection (qkv_dim -> hidden) row-parallel, the conv by [q; k; v], a module's vectors
    of qkv_dim or num_heads elements (the forget gate's dt_bias and A_log) by heads, norms of one head's width whole
    (their gradient summed). None where anything else is found."""
    heads, hd, qkv = (getattr(child, a, None) for a in ("num_heads", "head_dim", "qkv_dim"))
    conv = getattr(child, "conv1d", None)
    if not all(isinstance(v, int) and v > 0 for v in (heads, hd, qkv)) or qkv != heads * hd \
            or not isinstance(conv, nn.Conv1d) or conv.groups != conv.in_channels or conv.in_channels != 3 * qkv \
            or any(True for _ in child.parameters(recurse=False)):
        return None
    ins = [m.in_features for m in linear.values()]
    hidden = max(set(ins), key=ins.count, default=0)
    inner = {p: m for p, m in child.named_modules() if isinstance(m, nn.Linear)}
    ranks = {m.in_features for m in inner.values() if m.out_features == qkv and m.in_features not in (hidden, qkv)}
    sizes = {"heads": heads, "qkv": qkv, "conv": conv.kernel_size[0]}
    rows = [p for p, m in inner.items() if (m.in_features, m.out_features) == (qkv, hidden)]
    if len(rows) > 1:  # qkv_dim = hidden: the widths do not tell the output projection apart, HF's name does
        rows = [p for p in rows if p in _OUTPUTS]
    if len(rows) != 1:
        return None
    linears, names, vectors = [(rows[0], "rowwise")], [], []
    for path, m in inner.items():
        if path == rows[0]:
            continue
        if m.out_features in (qkv, heads) and m.in_features in (hidden, *ranks):
            linears.append((path, "colwise"))
            sizes[path], sizes[f"{path}.in"] = m.out_features, m.in_features
        elif m.in_features == hidden and m.out_features in ranks:
            names.append(path)
            sizes[path] = m.weight.numel()
        else:
            return None  # a linear no rule splits
    for path, m in child.named_modules():
        own = dict(m.named_parameters(recurse=False))
        if not own or isinstance(m, (nn.Linear, nn.Conv1d)):
            continue
        if {k: tuple(p.shape) for k, p in own.items()} == {"weight": (hd,)}:  # a norm over one head
            names.append(path)
            sizes[path] = hd
        elif path and all(p.numel() in (qkv, heads) and max(p.shape) == p.numel() for p in own.values()):
            vectors += [f"{path}.{k}" for k in own]
        else:
            return None  # a parameter no rule splits
    holders = {v.rpartition(".")[0] for v in vectors}
    attrs = tuple(f"{h}.{a}".lstrip(".") for h in ("", *sorted(holders)) for a in _KDA_ATTRS
                  if isinstance(getattr(child.get_submodule(h), a, None), int))
    return "kda", name, tuple(sizes.items()), tuple(names), attrs, (), tuple(vectors), (), tuple(linears)


def _relative(path: str, base: str) -> str:
    """`path` below the base model ("model.layers.2.mamba" -> "layers.2.mamba")."""
    return path[len(base) + 1:] if base and path.startswith(base + ".") else path


# -- a hybrid's layers by their parts: what its sharding table is built from ---------------------------------

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_OUTPUTS = ("o_proj", "out_proj")  # an attention's output projection, by HF's names
_MLA = ("kv_a_proj_with_mqa", "kv_b_proj", "o_proj")  # DeepSeek's multi-head latent attention (q_proj or q_a / q_b)


# the parts whose mixer keeps a recurrent state per sequence that no spec number prices (a Mamba-2 mixer's is priced
# by its heads, state and conv: ModelSpec.mixer_spec; "other": a mixer no rule reads: MiniMax's lightning attention):
# its bytes measured on HF's own cache (`recurrent_state_bytes`)
STATE_PARTS = ("mamba1", "delta", "kda", "short_conv", "other")


def recurrent_state_bytes(model: nn.Module) -> dict[int, int]:
    """{layer index: bytes one sequence's cache keeps for that layer whatever its length}: a recurrent mixer's conv
    and scan state, read off HF's own cache after a bf16 forward of a copy of `model` on the meta device at 4 and 8
    tokens (what grows with the tokens, attention's K and V, cancels: 2 x bytes(4) - bytes(8)); {} where that forward
    or cache cannot be read (serving then refuses the layer by name)."""
    import copy

    import torch

    from autoshard.models.facts import cache_bytes_by_layer

    sizes = []
    try:
        with torch.device("meta"):
            twin = type(model)(copy.deepcopy(model.config)).to(torch.bfloat16)
        for tokens in (4, 8):
            out = twin(torch.zeros(1, tokens, dtype=torch.long, device="meta"), use_cache=True)
            cache = getattr(out, "past_key_values", None)
            sizes.append(cache_bytes_by_layer(cache))
    except Exception:  # a forward or cache this reading does not know: nothing measured
        return {}
    return {i: 2 * a - b for i, (a, b) in enumerate(zip(*sizes)) if 2 * a - b > 0}


def layer_parts(model: nn.Module, stack) -> tuple[tuple, str | None]:
    """(parts, why): a hybrid's layers read as their parts (`model_spec.LayerPart`: attention, DeepSeek's latent
    attention, a Mamba-2 or Mamba-1 mixer, a gated DeltaNet, a short convolution, each found by its pattern, a gated
    or plain MLP, a MoE block, a norm (a child holding only vectors), and the embedding, final norm and LM head), each
    with the layers holding it at one path and its sizes. `why` (else None) names the first layer child with
    parameters that is none of them (MiniMax's lightning attention): no tensor-parallel rule splits it, so tp is refused;
    it is an "other" part, whole on every rank (the table still names every layer's experts for ep). A block
    shared by several layers (Zamba2): ((), why). `stack`: the model's `find_layer_stack`."""
    from autoshard.models.facts import _moe_modules, config_value, is_attention
    from autoshard.model_spec import LayerPart

    base = stack.prefix.rpartition(".")[0]
    layers = model.get_submodule(stack.prefix)
    ssd = {id(m) for _, m in ssd_mixers(model)}
    experts = config_value(model.config, "experts", 0) or 0
    found: dict[tuple, list[int]] = {}
    why = None
    if stack.shared_params:
        return (), (f"its layers share a block ({stack.shared_params} parameters held by several layers): no "
                    "tensor-parallel rule splits a shared block yet; use tp=1")
    for i, layer in enumerate(layers):
        own = _moe_modules(layer, experts) if experts else ("",)
        held_by_layer = ()  # the layer holds its router and experts itself (Gemma-4-26B-A4B): one MoE part at ""
        if own[0] and "." not in own[0]:
            found.setdefault(_moe_part("", layer, experts, own), []).append(i)
            held_by_layer = (own[0], own[1].partition(".")[0])
        for name, child in layer.named_children():
            vectors = [p for p in child.parameters()]
            if not vectors or name in held_by_layer:
                continue
            if all(p.dim() == 1 for p in vectors):  # a norm: whole on every rank
                part = ("norm", name, (("numel", sum(p.numel() for p in vectors)),), (), (), ())
            else:
                part = _part(name, child, ssd=id(child) in ssd, experts=experts, attention=is_attention(child))
            if part is None:  # whole on every rank (tp is refused for the model: `why`)
                part = ("other", name, (("numel", sum(p.numel() for p in child.parameters())),), (), (), ())
                why = why or (f"{_relative(f'{stack.prefix}.{i}.{name}', base)} ({type(child).__name__}) is "
                              "neither attention, a Mamba-2 SSD mixer, an MLP nor a MoE block: no tensor-parallel "
                              "rule splits it yet; use tp=1")
            found.setdefault(part, []).append(i)
    order = ("attention", "attention_whole", "mla", "ssd", "mamba1", "delta", "kda", "short_conv", "mlp", "moe", "norm",
             "other")  # the sequence mixers first (sharding.selective_module)
    parts = [LayerPart(kind=k, path=p, layers=tuple(ix), sizes=s, names=n, attrs=a, buffers=b,
                       params=q[0] if q else (), gates=q[1] if len(q) > 1 else (), linears=q[2] if len(q) > 2 else ())
             for (k, p, s, n, a, b, *q), ix in sorted(found.items(), key=lambda item: order.index(item[0][0]))]
    held = recurrent_state_bytes(model) if any(p.kind in STATE_PARTS for p in parts) else {}
    parts = [replace(p, sizes=p.sizes + (("state_bytes", max(held[i] for i in p.layers)),))
             if p.kind in STATE_PARTS and all(i in held for i in p.layers) else p for p in parts]
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    paths = {id(m): p for p, m in model.named_modules()}
    norm = _final_norm(model.get_submodule(base) if base else model, layers)
    edges = [LayerPart(kind="embed", path=paths[id(embed)])]
    if norm:
        edges.append(LayerPart(kind="final_norm", path=f"{base}.{norm}".lstrip(".")))
    edges.append(LayerPart(kind="lm_head", path=paths[id(head)]))
    return tuple(edges + parts), why


def _part(name: str, child: nn.Module, *, ssd: bool, experts: int, attention: bool) -> tuple | None:
    """(kind, path, sizes, names, attrs, buffers) of one layer child (`layer_parts`), or None."""
    from autoshard.models.facts import COUNT_ATTRS, _moe_modules

    linear = {n: m for n, m in child.named_children() if isinstance(m, nn.Linear)}
    if ssd:
        m = child
        inner, gs = m.num_heads * m.head_dim, m.n_groups * m.ssm_state_size
        sizes = (("heads", m.num_heads), ("head_dim", m.head_dim), ("inner", inner), ("groups", m.n_groups),
                 ("group_state", gs), ("state", m.ssm_state_size), ("conv", m.conv_kernel_size))
        attrs = ("norm.n_groups",) if isinstance(getattr(m.norm, "n_groups", None), int) else ()
        buffers = tuple(b for b, _ in m.named_buffers(recurse=False) if b == "mup_vector")
        return "ssd", name, sizes, (), attrs, buffers
    counts = tuple(a for a in COUNT_ATTRS if isinstance(getattr(child, a, None), int))
    if is_selective_scan(child) and {"in_proj", "x_proj", "dt_proj", "out_proj"} <= set(linear):
        x_proj, dt_proj = linear["x_proj"], linear["dt_proj"]
        sizes = (("inner", child.D.shape[0]), ("dt_rank", dt_proj.in_features), ("conv", child.conv1d.kernel_size[0]),
                 ("x_out", x_proj.out_features))
        norms = tuple((n, sum(p.numel() for p in m.parameters())) for n, m in child.named_children()
                      if n not in linear and n != "conv1d" and any(True for _ in m.parameters()))
        return "mamba1", name, sizes + norms, tuple(n for n, _ in norms), (), ()
    output = next((o for o in _OUTPUTS if o in linear), None)  # LLaMA's o_proj, LFM2's out_proj
    keys_as_values = getattr(child, "v_proj", False) is None  # the keys are the values (Gemma-4's k_eq_v layers)
    if attention and {"q_proj", "k_proj"} <= set(linear) and ("v_proj" in linear or keys_as_values) and output:
        children = set(linear)
        if output != "o_proj":  # the table's roles read o_proj: its own name, kept as its one output linear
            linear = {("o_proj" if n == output else n): m for n, m in linear.items()}
        hd, vhd = child.head_dim, getattr(child, "v_head_dim", None)
        vhd = vhd if isinstance(vhd, int) and vhd > 0 else hd  # value heads may be wider (MiMo-V2-Flash)
        # the heads o_proj reads; q_proj may hold a gate per head beside each query (Qwen3-Next / Qwen3.5: [query;
        # gate] of each head in turn, chunked after a view by heads), split by heads all the same
        heads, kv, q = linear["o_proj"].in_features // vhd, linear["k_proj"].out_features // hd, linear["q_proj"].out_features
        if q not in (heads * hd, 2 * heads * hd) or not keys_as_values and linear["v_proj"].out_features != kv * vhd \
                or linear["o_proj"].in_features != heads * vhd:
            return None  # widths that are no multiples of the heads o_proj reads: no rule splits them
        sizes = (("heads", heads), ("kv_heads", kv), ("q", q), ("kv", kv * hd), ("v", 0 if keys_as_values else kv * vhd),
                 ("o", heads * vhd))  # v 0: no v_proj (rules/layer_parts.py gives it no role)
        window = getattr(child, "sliding_window", None)  # the keys it attends to and caches (ModelSpec.mixer_spec)
        sizes += (("window", window),) if isinstance(window, int) and window > 0 else ()
        # output gates: a linear of the layer's input with an output per head or per head element (split by heads)
        gates = tuple(n for n, m in linear.items() if n not in _ATTENTION and m.in_features ==
                      linear["q_proj"].in_features and m.out_features in (heads, heads * vhd))
        if set(linear) - set(_ATTENTION) - set(gates):
            return None  # another linear inside the attention: no tensor-parallel rule splits it yet
        sizes += tuple((n, linear[n].out_features) for n in gates)
        # per-head q/k norms (one head_dim vector each): whole on every rank, their gradient summed over tp
        held = {n: [tuple(p.shape) for p in m.parameters()] for n, m in child.named_children() if n not in children}
        norms = tuple((n, hd) for n, shapes in held.items() if shapes)
        # its own per-head parameters (GPT-OSS-style sinks: one value per head) split with the heads
        own = dict(child.named_parameters(recurse=False))
        widths = {(q,), (kv * hd,)}
        if not gates and not own and norms and all(shapes == [] or tuple(shapes[0]) in widths and len(shapes) == 1
                                                   for shapes in held.values()) and q == heads * hd \
                and any(shapes not in ([], [(hd,)]) for shapes in held.values()):  # one KV head: k_norm per head
            # full-width q / k norms (OLMo-hybrid's, as OLMo-2's): the attention runs whole on every rank, its q / k /
            # v outputs gathered and o_proj's input sliced, as HF declares it
            full = tuple((n, math.prod(shapes[0])) for n, shapes in held.items() if shapes)
            return "attention_whole", name, sizes + full, tuple(n for n, _ in full), (), ()
        if any(shapes not in ([], [(hd,)]) for shapes in held.values()) or any(p.shape != (heads,) for p in own.values()):
            return None  # a full-width norm or another parameter of its own: no tensor-parallel rule splits it yet
        renamed = ((output, "rowwise"),) if output != "o_proj" else ()
        return "attention", name, sizes + norms, tuple(n for n, _ in norms), counts, (), tuple(own), gates, renamed
    if attention and set(_MLA) <= set(linear) and ("q_proj" in linear or "q_b_proj" in linear):
        heads = child.num_heads
        q = linear.get("q_b_proj", linear.get("q_proj"))
        sizes = (("heads", heads), ("q", q.out_features), ("q_rank", q.in_features),
                 ("kv_b", linear["kv_b_proj"].out_features), ("kv_rank", linear["kv_b_proj"].in_features),
                 ("o", linear["o_proj"].in_features))
        # output gates: a linear of the layer's input with an output per head (Bailing-hybrid's g_proj), by heads
        gates = tuple(n for n, m in linear.items() if n not in (*_MLA, "q_proj", "q_a_proj", "q_b_proj")
                      and m.in_features == linear["kv_a_proj_with_mqa"].in_features and m.out_features == heads)
        latent = [(n, m) for n, m in child.named_children() if n not in ("q_b_proj", "q_proj", "kv_b_proj", "o_proj",
                                                                          *gates)
                  and any(True for _ in m.parameters())]  # the latent projections and their norms: whole
        sizes += tuple((n, sum(p.numel() for p in m.parameters())) for n, m in latent)
        sizes += tuple((n, heads) for n in gates)
        return "mla", name, sizes, tuple(n for n, _ in latent), counts, (), (), gates
    delta = _delta_part(name, child, linear) or _kda_part(name, child, linear)
    if delta is not None:
        return delta
    if experts:
        paths = _moe_modules(child, experts)
        if paths[0]:
            return _moe_part(name, child, experts, paths)
    conv = _short_conv_part(name, child, linear)
    if conv is not None:
        return conv
    mlp = _mlp_linears(child, linear) if not attention else None
    if mlp is not None:  # its projections of the hidden states column-parallel, then its output projection row-parallel
        width = linear[mlp[-1]].in_features
        packed = tuple((n, "packed") for n in mlp[:-1] if linear[n].out_features == 2 * width)
        return "mlp", name, (("ffn", width),), mlp, (), (), (), (), packed
    return None


def _moe_part(name: str, block: nn.Module, experts: int, paths: tuple) -> tuple:
    """The "moe" part (`_part`'s tuple) of `block` at `name`, whose routed experts, router, shared expert and its parts
    are `paths` (`facts._moe_modules(block, experts)`): a MoE block, or a layer holding its experts itself."""
    path, router, shared, shared_parts = paths
    held = tuple(n for n, _ in block.get_submodule(path).named_parameters(recurse=False))
    sizes = (("experts", experts),
             *((p, sum(x.numel() for x in block.get_submodule(p).parameters())) for p in shared_parts))
    return "moe", name, sizes, (router, path, shared, *shared_parts), (), (), held


def _mlp_linears(child: nn.Module, linear: dict) -> tuple[str, ...] | None:
    """An MLP's linears, its input projections (LLaMA's gate / up, LFM2's w1 / w3) then its output projection (down /
    w2), found by their widths: every linear but one reads the hidden states and writes the MLP width, the last reads
    that width and writes the hidden states; the child holds nothing else. One fused input projection may write twice
    the width (Granite-4's shared_mlp input_linear: [gate; up], halves its forward chunks). None for any other child."""
    if len(linear) < 2 or sum(1 for _ in child.parameters()) != sum(1 for m in linear.values() for _ in m.parameters()):
        return None
    ins = [m.in_features for m in linear.values()]
    hidden = max(set(ins), key=ins.count)
    downs = [n for n, m in linear.items() if m.out_features == hidden and m.in_features != hidden]
    if not downs and all((m.in_features, m.out_features) == (hidden, hidden) for m in linear.values()):
        downs = [n for n in linear if n not in _reading_input(child, linear, hidden)]  # an MLP as wide as the model
    if len(downs) != 1:
        return None
    width = linear[downs[0]].in_features
    ups = [n for n, m in linear.items() if n != downs[0]]
    fused = len(ups) == 1 and linear[ups[0]].out_features == 2 * width
    if any((linear[n].in_features, linear[n].out_features) != (hidden, 2 * width if fused else width) for n in ups):
        return None
    return (*ups, downs[0])


def _reading_input(child: nn.Module, linear: dict, hidden: int) -> set[str]:
    """The names of `child`'s linears that read its input itself, seen on a forward of one token (on the device of
    its parameters: meta while planning); empty where that forward fails. Where every linear maps the hidden width
    to itself, the one that does not read the input is the MLP's output projection."""
    import torch

    param = next(child.parameters())
    x = torch.zeros(1, 1, hidden, dtype=param.dtype, device=param.device)
    seen: set[str] = set()
    hooks = [m.register_forward_pre_hook(lambda m, args, n=n: seen.add(n) if args and args[0] is x else None)
             for n, m in linear.items()]
    try:
        with torch.no_grad():
            child(x)
    except Exception:  # noqa: BLE001 (a child whose forward takes more than the hidden states: not an MLP)
        return set()
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def short_conv(module: nn.Module) -> tuple[str, str, str] | None:
    """(in_proj, conv, out_proj) child names of a short-convolution mixer (`_short_conv_part`'s pattern), or None."""
    linear = {n: m for n, m in module.named_children() if isinstance(m, nn.Linear)}
    found = _short_conv_part("", module, linear)
    return found[3] if found is not None else None


def short_convs(model: nn.Module) -> list[tuple[nn.Module, tuple[str, str, str]]]:
    """(module, its (in_proj, conv, out_proj) names) of every short-convolution mixer of `model`: LFM2's."""
    return [(m, names) for m in model.modules() if (names := short_conv(m)) is not None]


def _short_conv_part(name: str, child: nn.Module, linear: dict) -> tuple | None:
    """A short-convolution mixer (LFM2's: in_proj to [B; C; x] of the hidden width, B * x through a depthwise conv1d,
    times C, then out_proj), found by its pattern: split by channels, in_proj as its three pieces, the conv by channel,
    out_proj row-parallel; every op between them is per channel. None for any other child."""
    convs = [(n, m) for n, m in child.named_children() if isinstance(m, nn.Conv1d)]
    if len(convs) != 1 or len(linear) != 2 or any(True for _ in child.parameters(recurse=False)):
        return None
    (conv_name, conv), width = convs[0], convs[0][1].in_channels
    if not (conv.groups == conv.out_channels == width):
        return None
    into = [n for n, m in linear.items() if m.out_features == 3 * width]
    out = [n for n, m in linear.items() if (m.in_features, m.out_features) == (width, linear[into[0]].in_features)] \
        if len(into) == 1 else []
    if len(out) != 1 or out[0] == into[0] or \
            len(list(child.named_children())) != 3:
        return None
    sizes = (("width", width), ("conv", conv.kernel_size[0]))
    return "short_conv", name, sizes, (into[0], conv_name, out[0]), (), ()


def _final_norm(base: nn.Module, layers: nn.Module) -> str:
    """The base model's child after the layers that holds one weight vector (its final norm), or ""."""
    for name, child in base.named_children():
        params = list(child.parameters())
        if child is not layers and len(params) == 1 and params[0].dim() == 1:
            return name
    return ""
