"""Model facts read from the model itself: its HF config (one alias table for the fields families
name differently) and its module tree, never its `model_type` or class names.

Contract: `read_facts(config, model)` -> `ModelFacts`, a frozen record of what autoshard needs to
know about a decoder to plan and run it, and the ((axis, why), ...) `presets._refusals` reads off it: the parallel
axes this model cannot run yet, each with a one-line reason naming the module and the construct.
The planner does not search a refused axis (`rules/validity.axis_violation`) and `parallelize`
refuses a plan that uses one, with that reason; every other axis still plans.

The whole contract: docs/modules/models.md (models/facts.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from autoshard.ir import is_positive_int

ALIASES: dict[str, tuple[str, ...]] = {
    "vocab": ("vocab_size", "padded_vocab_size"),
    "hidden": ("hidden_size", "n_embd", "d_model", "model_dim"),
    "layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "heads": ("num_attention_heads", "n_head", "num_heads", "n_heads"),
    "kv_heads": ("num_key_value_heads", "num_kv_heads", "multi_query_group_num", "n_kv_heads", "kv_n_heads"),
    "head_dim": ("head_dim", "attention_head_dim", "kv_channels"),
    "ffn": ("intermediate_size", "ffn_hidden_size", "n_inner", "ffn_dim", "dff"),
    "experts": ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"),
    "top_k": ("num_experts_per_tok", "moe_top_k", "num_experts_per_token", "top_k", "top_k_experts"),
    "expert_ffn": ("moe_intermediate_size", "expert_intermediate_size", "moe_ffn_hidden_size"),
    "shared_ffn": ("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size"),
    "sliding_window": ("sliding_window", "attention_window"),
    "attention_chunk": ("attention_chunk_size",),  # Llama-4's chunked attention
    "position_floor": ("floor_scale",),  # Llama-4's attention temperature: scales change every floor_scale tokens
    "attn_softcap": ("attn_logit_softcapping", "attention_logit_softcapping"),
    "final_softcap": ("final_logit_softcapping", "logit_softcapping"),
    # SSD (Mamba-2)
    "state": ("state_size", "ssm_state_size", "d_state"),
    "groups": ("n_groups", "ngroups", "mamba_n_groups"),
    "conv": ("conv_kernel", "d_conv", "mamba_d_conv"),
    "chunk": ("chunk_size", "mamba_chunk_size"),
    "expand": ("expand", "mamba_expand"),
}

# HF tp-plan styles (transformers.integrations.tensor_parallel ALL_PARALLEL_STYLES) and what the
# sharding table does with them: "run" (a role the runtime carries out) or why not yet
# colwise_gather_output (output all-gathered whole) / rowwise_split_input (whole input sliced): `GATHERED_STYLES`, run
# as HF declares them (passes/capture/tp_proposal.py `declared`; outside a MoE block)
GATHERED_STYLES = ("colwise_gather_output", "rowwise_split_input")
# local_params: a marker on a module whose own parameters other entries split (GPT-OSS-style sinks: split with the heads)
RUN_STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce", "embedding_rowwise", "moe_tp_experts",
              "packed_colwise", "grouped_gemm", "ep_dispatch_experts", "local_params", *GATHERED_STYLES)
# styles that run where the table holds the part they name, else refused with the reason given
RUN_WITHIN = {
    # multi-head latent attention's compressed KV projection: the MLA part's rule of a layer-parts table (whole on
    # every rank, its gradient summed over tp: rules/layer_parts.py `parts_table`) is what HF's style does
    "mla_kv_a_proj": ("mla", "multi-head latent attention's compressed KV projection runs only as a layer part "
                             "(q / kv up projections by heads, o_proj row-parallel: models/layered.py `layer_parts`)"),
    # Llama-4 / Aria's fused [gate; up] experts: routed experts run whole on every tp rank (split over ep)
    "packed_rowwise": ("experts", "a strided split of a fused linear runs only on routed experts, which tp keeps whole"),
}
NOT_YET = {
    "local_colwise": "a local (non-DTensor) colwise split", "local_rowwise": "a local (non-DTensor) rowwise split",
    "gather": "its output is gathered whole over tp", "sequence_parallel": "a norm under HF's sequence parallelism",
}


# the attention mask a layer of each config layer type (`layer_types`, the keys of HF's mask mapping) takes, which a
# sequence-parallel forward builds for the whole sequence (runtime/stages.whole_sequence_mask): the causal one (a
# Falcon-H1 / Zamba2 "hybrid" layer's attention too), the sliding-window one, the padding mask of recurrent layers
# (Mamba, gated DeltaNet, short convolutions: None for unpadded tokens), none (Nemotron-H's MLP and MoE layers) or
# the causal one always materialised (DeepSeek-V3.2's indexer masks its scores with it) or the chunked one (Llama-4's
# chunked attention: causal within chunks of attention_chunk_size tokens). Other types take masks it does not build.
LAYER_MASKS = {"full_attention": "causal", "hybrid": "causal", "sliding_attention": "sliding",
               "linear_attention": "recurrent", "conv": "recurrent", "mlp": "none", "moe": "none",
               "indexed_attention": "materialised", "chunked_attention": "chunked"}


def text_config(config):
    """The config of the decoder: a multimodal wrapper's text config (Gemma-4's `text_config`, HF's
    PretrainedConfig.get_text_config(decoder=True)), else `config` itself."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


# the per-layer values (HF's per_layer_config) read per layer type: the attention's sizes, which each kind's own
# modules give (models/layered.py `layer_parts`), proven on Gemma-4's sliding and full-attention layers
PER_LAYER_READ = frozenset({"head_dim", "num_key_value_heads"})


def per_type_values(config) -> dict[str, dict] | None:
    """A heterogeneous config's per-layer values by layer type ({type: {attribute: value}}), or None where it has
    no layer types or HF finds the layers of a type differ (its per_layer_config[type] raises)."""
    types = dict.fromkeys(getattr(config, "layer_types", None) or ())
    try:
        views = {t: config.per_layer_config[t] for t in types}
    except ValueError:
        return None
    return {t: {a: getattr(v, a) for a in config.per_layer_attributes} for t, v in views.items()} or None


def per_layer_refusal(config, model) -> str | None:
    """Why a heterogeneous config (HF's `per_layer_config`: values that differ per layer) cannot be read, or None.
    One whose layers of each type share their values (Gemma-4: the full-attention layers' head_dim and K/V heads)
    is read as layers of several kinds, each kind's sizes off its own modules (passes/capture/layer_kinds.py,
    models/layered.py `layer_parts`); its global values (the first layer type's) stand for the model where one
    number is asked (the spec's heads, the tiny config), so HF's per-layer guard is lifted on it
    (`allow_global_per_layer_attribute_access`). Refused: layers of one type that differ (a per-index config), and
    layers reading keys and values of another layer (Gemma-3n's and Gemma-4's E models: a pipeline stage would need
    the other layer's keys). A per-layer input embedding is read (`per_layer_input_refusals`)."""
    config = text_config(config)
    attributes = getattr(config, "per_layer_attributes", None)
    if attributes:
        what = (f"{type(config).__name__} declares per-layer values of {', '.join(sorted(attributes))} "
                "(HF's per_layer_config)")
        if not attributes <= PER_LAYER_READ:
            return (f"{what}; autoshard reads per layer type only {', '.join(sorted(PER_LAYER_READ))} (each kind's "
                    "attention sizes off its modules) so far: give every layer the same values of the others")
        if per_type_values(config) is None:
            return (f"{what} that differ between layers of one type: autoshard reads the layers by kind (one table "
                    "per layer type); give the layers of each type the same values")
        config.allow_global_per_layer_attribute_access = True
    shared = [n for n, m in model.named_modules() if getattr(m, "is_kv_shared_layer", False)]
    if shared:
        return (f"{shared[0]} reuses the keys and values of an earlier layer (num_kv_shared_layers="
                f"{getattr(config, 'num_kv_shared_layers', '?')}): a layer reading another layer's keys is not priced "
                "or split over pipeline stages yet; set num_kv_shared_layers to 0")
    return None


def per_layer_input_refusals(config) -> tuple[tuple[str, str], ...]:
    """(axis, why) of the axes a model feeding each layer its own slice of a per-layer input embedding cannot run
    (Gemma-4's and Gemma-3n's E models: HF's hidden_size_per_layer_input; the model's forward looks the token ids up in
    a [vocab, layers x d] table and adds a projection of the input embedding to it before the layers; priced grown to
    every layer's slice: passes/capture/shapes_trace.py `_grown_outside_layers`). It trains under dp (any ZeRO) and cp
    (per token: each rank looks its own tokens up) as one process does; pp refused (a later stage holds neither the
    token ids' table nor the input embedding). tp: its layers' per-layer gate and projection have no tensor-parallel
    rule (`layered.layer_parts` names them)."""
    config = text_config(config)
    width = getattr(config, "hidden_size_per_layer_input", None)
    if not is_positive_int(width):
        return ()
    return (("pp", f"its layers read per-layer inputs (hidden_size_per_layer_input={width}), made before the layers "
                   "from the token ids and the input embedding, which a later pipeline stage holds neither of; "
                   "use pp=1"),)


# the count of dense layers a MoE stack starts with (DeepSeek's first_k_dense_replace, LFM2-MoE's num_dense_layers)
DENSE_FIRST = ("first_k_dense_replace", "num_dense_layers")


def config_value(config, fact: str, default=None):
    """The first of `ALIASES[fact]` that the decoder's config (`text_config`) sets (not None), else `default`."""
    config = text_config(config)
    for name in ALIASES[fact]:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelFacts:
    """What autoshard reads off one decoder (docs/modules/models.md)."""

    mixer: str  # "attention" | "ssd"
    base: str  # the path of the base model, the module holding the layers ("model", "transformer", "model.decoder")
    layers_path: str = ""  # the path of the decoder layers' ModuleList (`layer_list`: "model.layers", "transformer.h")
    layer_params: tuple[str, ...]  # parameter names of layer 0, relative to the layer
    embedding_plain: bool  # the input embedding: a plain nn.Embedding of the vocabulary's rows (no scale in its forward)
    tp_plan: tuple[tuple[str, str], ...] = ()  # HF's base_model_tp_plan, as (pattern, style)
    experts_path: str = ""  # the routed-experts module inside a layer ("mlp.experts"), "" for dense
    router_path: str = ""  # the router linear inside a layer ("mlp.gate")
    shared_path: str = ""  # the shared expert inside a layer ("mlp.shared_expert")
    shared_parts: tuple[str, ...] = ()  # its linears, then the block's one-output gate ("mlp.shared_expert_gate")
    experts_no_ep: str = ""  # why expert parallelism cannot run the layer's experts (`experts_ep_refusal`), "" if it can
    head_params: tuple[str, ...] = ()  # attention parameters indexed by head (GPT-OSS "sinks")
    attention_path: str = ""  # the layer's module calling HF's attention interface ("self_attn", "attn", ...)
    attention_attrs: tuple[str, ...] = ()  # head counts the attention module keeps (StableLM's num_heads)
    transposed: tuple[str, ...] = ()  # layer 0's linears storing their weight as [input, output] (GPT-2's Conv1D)
    layer_types: tuple[str, ...] = ()  # the config's layer_types (per-layer attention kinds)
    sliding_window: int = 0
    window_layers: int = 0  # layers whose attention call gets sliding_window (HF's attention interface kwarg)
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    logit_scale: float = 1.0  # what ForCausalLM multiplies the logits by (Cohere logit_scale, 1/Granite logits_scaling)
    embedding_multiplier: float = 1.0  # Granite's, applied in the base forward after the embedding
    # the layer's own norms on the residual stream (leaf children holding hidden-wide vectors, every layer alike:
    # "input_layernorm", "ln_1"), per token, so sequence parallelism runs them on a sequence shard (`residual_norms`)
    residual_norms: tuple[str, ...] = ()
    own_forward: bool = False  # the model's own forward does something around the layers the stage builder
    #                            of a plain LLaMA stack would drop: pipeline stages run the model's own forward
    plain_stack: bool = True  # its base holds only the input embedding, the layers, one final norm and rotary
    #                           embeddings (`_bare_stack`): no learned positions or projections beside the layers
    own_positions: bool = False  # its base keeps position buffers or builds a mask of its own (`positions_of_its_own`)


def read_facts(config, model) -> ModelFacts:
    """The facts of `model` (a HF causal LM) and its `config` (docs/modules/models.md)."""
    from torch import nn

    config = text_config(config)  # a multimodal wrapper's decoder (Gemma-3's): its plan, layer types and scales
    found = layer_list(model)
    layers = found[1] if found is not None else None
    base_name = found[0].rpartition(".")[0] if found is not None else getattr(model, "base_model_prefix", "") or "model"
    layer0 = layers[0] if layers is not None else None
    names = tuple(n for n, _ in layer0.named_parameters()) if layer0 is not None else ()
    heads = config_value(config, "heads", 0)
    mixer = mixer_of(model) if layer0 is not None else ""
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    # a plain lookup over the vocabulary: not Gemma's scaled one, nor one with rows beyond the vocabulary (Mllama's 8
    # image tokens), which the vocab-parallel embedding would cut at other rows than the LM head
    plain = embed is not None and type(embed).forward is nn.Embedding.forward and \
        getattr(embed, "num_embeddings", None) == config_value(config, "vocab")
    experts, router, shared, parts = _moe_modules(layer0, config_value(config, "experts", 0) or 0)
    no_ep = experts_ep_refusal(layer0.get_submodule(experts), f"layers.*.{experts}") if experts else None
    attention = _attention_path(layer0)
    sinks = tuple(n.rpartition(".")[2] for n, p in (layer0.named_parameters() if layer0 is not None else ())
                  if p.dim() == 1 and p.shape[0] == heads and ".".join(n.split(".")[:-1]) == attention
                  and n.rpartition(".")[2] not in ("weight", "bias"))
    scaling = getattr(config, "logits_scaling", None)
    logit_scale = float(getattr(config, "logit_scale", None) or 1.0) / float(scaling or 1.0)
    window, windowed = _windows(config, layers if layers is not None else ())
    types = tuple(getattr(config, "layer_types", None) or ())
    facts = dict(
        mixer=mixer, base=base_name, layers_path=found[0] if found is not None else "", layer_params=names, embedding_plain=plain,
        tp_plan=_layer_patterns(tuple((getattr(config, "base_model_tp_plan", None) or {}).items()),
                                found[0].rpartition(".")[2] if found is not None else "layers"),
        experts_path=experts, router_path=router, shared_path=shared, shared_parts=parts, experts_no_ep=no_ep or "",
        head_params=sinks, attention_path=attention, attention_attrs=_count_attrs(layer0), layer_types=types,
        sliding_window=window, window_layers=windowed,
        attn_softcap=float(config_value(config, "attn_softcap", 0.0) or 0.0),
        final_softcap=float(config_value(config, "final_softcap", 0.0) or 0.0), logit_scale=logit_scale,
        embedding_multiplier=float(getattr(config, "embedding_multiplier", None) or 1.0))
    facts["transposed"] = tuple(p for p, m in layer0.named_modules() if transposed_linear(m)) if layer0 is not None \
        else ()
    facts["residual_norms"] = residual_norms(layers, config_value(config, "hidden", 0)) if layers is not None else ()
    materialised = bool(types) and all(LAYER_MASKS.get(t) == "materialised" for t in types)
    facts["plain_stack"] = _bare_stack(model, found, materialised=materialised)
    facts["own_positions"] = found is not None and positions_of_its_own(model, found, materialised=materialised)
    facts["own_forward"] = mixer == "attention" and (_needs_own_forward(facts, config) or not _llama_stack(model, found))
    return ModelFacts(**facts)


def holds_hidden_vectors(module, hidden: int) -> bool:
    """Whether `module` holds parameters and all are vectors of the hidden width (a norm's weight and bias): a
    per-channel op, each token on its own (so it runs on a sequence shard as on the whole)."""
    params = list(module.parameters())
    return bool(params) and all(tuple(p.shape) == (hidden,) for p in params)


def residual_norms(layers, hidden: int) -> tuple[str, ...]:
    """The layer's direct children that are leaf modules holding only vectors of the hidden width (RMSNorm's
    weight, LayerNorm's weight and bias; found by structure, not by class name): per-channel ops on the residual
    stream, each token on its own. () where the layers differ in them (a hybrid's kinds)."""
    def norms(layer) -> tuple[str, ...]:
        return tuple(name for name, child in layer.named_children()
                     if next(child.children(), None) is None and holds_hidden_vectors(child, hidden))

    found = {norms(layer) for layer in layers}
    return found.pop() if len(found) == 1 else ()


def _layer_patterns(plan: tuple[tuple[str, str], ...], layers: str) -> tuple[tuple[str, str], ...]:
    """HF's declared plan with its layer patterns written as autoshard reads them, "layers.*.<path>" (GPT-J's
    "h.*.attn.q_proj" -> "layers.*.attn.q_proj"; `layers`: the name of the base model's layer list)."""
    if layers == "layers":
        return plan
    return tuple((f"layers.*.{p.removeprefix(f'{layers}.*.')}" if p.startswith(f"{layers}.*.") else p, s)
                 for p, s in plan)


def stack_paths(model) -> tuple[str, str, str, str] | None:
    """(the layer list, the input embedding, the final norm or "", the LM head): the full module paths the sharding
    table's embedding, layer and head roles sit at (LLaMA's model.layers, model.embed_tokens, model.norm, lm_head;
    GPT-NeoX's gpt_neox.layers, gpt_neox.embed_in, gpt_neox.final_layer_norm, embed_out); None where the model has
    no layer list, or its embedding or LM head is no module of it."""
    from autoshard.errors import InvalidConfigError

    found = layer_list(model)
    if found is None:
        return None
    path, layers = found
    body = model.get_submodule(path.rpartition(".")[0])
    paths = {id(m): p for p, m in model.named_modules()}
    try:
        norm = paths.get(id(final_norm(body, layers)), "")
    except InvalidConfigError:
        norm = ""
    embed = paths.get(id(model.get_input_embeddings()))
    head = paths.get(id(model.get_output_embeddings()))
    return (path, embed, norm, head) if embed and head else None


def mlp_width(model, facts: ModelFacts, declared: int = 0) -> int:
    """The MLP width: the config's (`declared`) where a linear of layer 0 has it (or a multiple of it: Phi-3's fused
    gate / up), else read off layer 0: the widest linear of the hidden states outside the attention module (GPT-J's
    and CodeGen's n_inner None: HF's 4 x hidden; LFM2's intermediate_size, which its MLP adjusts to 2/3 of it rounded
    up to a multiple); 0 for none."""
    found = layer_list(model)
    if found is None:
        return declared
    hidden = config_value(model.config, "hidden", 0)
    prefix = f"{facts.attention_path}." if facts.attention_path else None
    widths = [w[1] for p, m in found[1][0].named_modules() if (w := linear_widths(m)) is not None
              and w[0] == hidden and not (prefix and (p + ".").startswith(prefix))]
    if declared and (not widths or any(w % declared == 0 for w in widths)):  # (a fused gate / up: twice it)
        return declared
    return max(widths, default=declared)


def layer_list(model):
    """(path, ModuleList) of `model`'s decoder layers, found by structure, not by name: the outermost nn.ModuleList
    holding as many modules as the config has layers (`ALIASES["layers"]`: LLaMA's model.layers, GPT-2's
    transformer.h, MPT's transformer.blocks, OPT's model.decoder.layers), one beside the input embedding first,
    else the longest one of two or more;
    None for none. Its parent module is the base model."""
    from torch import nn

    want = config_value(getattr(model, "config", None), "layers")
    lists = [(p, m) for p, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    try:
        embed = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):  # a model that does not say which module embeds its tokens
        embed = None
    # beside the input embedding first: a multimodal wrapper's vision tower may have as many layers (Gemma-3's)
    lists.sort(key=lambda pm: not any(c is embed for c in model.get_submodule(pm[0].rpartition(".")[0]).children()))
    same = next(((p, m) for p, m in lists if is_positive_int(want) and len(m) == want), None)  # outermost first
    multi = [(p, m) for p, m in lists if len(m) > 1]
    return same or (max(multi, key=lambda pm: len(pm[1])) if multi else None)


def final_norm(body, layers):
    """The base model `body`'s final norm: its last child with parameters after the `layers`, else (OPT's decoder
    declares it before them) its last child holding only vectors, else the first child after the layers with no
    parameters and no rotary buffer (OLMo's and NanoChat's norms hold none); InvalidConfigError for none."""
    from autoshard.errors import InvalidConfigError

    children = [m for _, m in body.named_children() if any(True for _ in m.parameters())]
    at = next(i for i, m in enumerate(children) if m is layers)
    after = children[at + 1:] or [m for m in children[:at] if all(p.dim() == 1 for p in m.parameters())]
    if not after:
        named = [m for _, m in body.named_children()]
        after = [m for m in named[named.index(layers) + 1:]
                 if not any(True for _ in m.parameters()) and "inv_freq" not in dict(m.named_buffers())][:1]
    if not after:
        raise InvalidConfigError(f"{type(body).__name__}: no final norm after its layers; use pp=1")
    return after[-1]


def _llama_stack(model, found) -> bool:
    """Whether the base model is a plain LLaMA stack, what the LLaMA stage builder (runtime/stages.py) calls layer
    by layer: a bare stack (`_bare_stack`) whose rotary embedding the builder can call as the model does."""
    if found is None:
        return True  # no layers: nothing to stage
    base = model.get_submodule(found[0].rpartition(".")[0])
    return _bare_stack(model, found) and hasattr(base, "rotary_emb") and _rotary_plain(base.rotary_emb)


def _bare_stack(model, found, *, materialised: bool = False) -> bool:
    """Whether the base model holds only its `layers` list, the input embedding, rotary embeddings (or none:
    Nemotron-H's attention has no positions) and at most one more module with parameters (the final
    norm), no other buffers, and builds no mask of its own. Other stacks (GPT-2's learned positions, CTRL's and
    XGLM's sinusoidal ones, OPT's projections) keep the model's own forward (`own_forward`), and their positions or
    projections beside the layers see the whole sequence. `materialised`: the causal mask it builds unskipped
    (DeepSeek-V3.2's indexed layers, `LAYER_MASKS`) is one a sequence-parallel forward hands it whole."""
    if found is None:
        return True
    path, layers = found
    base = model.get_submodule(path.rpartition(".")[0])
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    others = [m for m in base.children() if m is not layers and m is not embed]
    held = [m for m in others if any(True for _ in m.parameters())]
    return len(held) <= 1 and not positions_of_its_own(model, found, materialised=materialised)


def positions_of_its_own(model, found, *, materialised: bool = False) -> bool:
    """Whether the base model around the `found` layers keeps buffers of anything but a rotary embedding (CTRL's and
    XGLM's sinusoidal positions, Gemma-3's rotary per layer type) or builds a mask of its own (`_own_mask`), which a
    sequence-parallel forward cannot hand it for the whole sequence."""
    path, layers = found
    base = model.get_submodule(path.rpartition(".")[0])
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    others = [m for m in base.children() if m is not layers and m is not embed]
    buffers = any(True for _ in base.buffers(recurse=False)) or any(
        "Rotary" not in type(x).__name__ for m in others for x in m.modules() if any(True for _ in x.buffers(recurse=False)))
    return buffers or _own_mask(base, built={"allow_is_causal_skip"} if materialised else ())


def _rotary_plain(rotary) -> bool:
    """Whether the stage builder's call `rotary(hidden, position_ids=...)` is the model's: its forward needs no
    other argument (Mellum's takes the layer type)."""
    import inspect

    try:
        params = list(inspect.signature(rotary.forward).parameters.values())[2:]
    except (TypeError, ValueError):
        return False
    return all(p.default is not inspect.Parameter.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)


# arguments of HF's mask functions (transformers.masking_utils) that change the mask the LLaMA stage builder makes:
# a mask materialised where it would be skipped for SDPA's is_causal (Doge adds its dynamic mask onto it), and mask
# functions or'ed / and'ed into the causal one (bidirectional image tokens)
_MASK_ARGUMENTS = frozenset({"allow_is_causal_skip", "or_mask_function", "and_mask_function"})


def _own_mask(base, built=()) -> bool:
    """Whether `base`'s forward builds its attention mask with arguments the LLaMA stage builder does not pass
    (`_MASK_ARGUMENTS` but those `built`, read off the keyword names of the calls its code makes): then its own
    forward runs."""
    import inspect

    code = getattr(inspect.unwrap(type(base).forward), "__code__", None)
    consts = code.co_consts if code is not None else ()
    own = _MASK_ARGUMENTS - set(built)
    return any(isinstance(c, tuple) and own & {x for x in c if isinstance(x, str)} for c in consts)


def _windows(config, layers) -> tuple[int, int]:
    """(sliding window, layers that use it): what each layer's attention passes HF's attention interface as
    `sliding_window`: the module's own attribute where it keeps one (Gemma-2/3, GPT-OSS, Qwen2: None on a
    full-attention layer), else the config's (Mistral, Mixtral pass config.sliding_window in every layer); a
    chunked-attention layer (Llama-4's) its chunk, which HF caches as a sliding window of attention_chunk_size."""
    config_window = config_value(config, "sliding_window", None)
    types, chunk = getattr(config, "layer_types", None) or (), getattr(config, "attention_chunk_size", None)
    windows = []
    for i, layer in enumerate(layers):
        module = next((m for m in layer.modules() if is_attention(m)), None)
        if module is None:
            continue
        window = getattr(module, "sliding_window", config_window)
        if i < len(types) and types[i] == "chunked_attention":
            window = chunk
        windows.append(window if is_positive_int(window) else 0)
    used = [w for w in windows if w]
    return (max(used), len(used)) if used else (0, 0)


def mixer_of(model) -> str:
    """The sequence mixer of `model`: "attention" (a module calling HF's attention interface), "ssd" (a
    Mamba-2 SSD mixer by its pattern, `ssd_mixers` below, and no attention module), or "" (none
    autoshard knows: Mamba-1's selective scan has a state size and a conv kernel too, but no SSD)."""

    if any(is_attention(m) for m in model.modules()):
        return "attention"
    return "ssd" if ssd_mixers(model) else ""


def own_attention(model) -> str | None:
    """Why `model`'s attention is none autoshard prices and runs, naming its module, or None: a layer module that
    keeps a layer index (layer_idx, GPT-Neo's layer_id) and a head width (head_dim / head_size) but is no
    `is_attention` module computes its attention in its own forward (Bloom's and MPT's ALiBi bias, Falcon's direct
    SDPA call, XGLM's and GPT-Neo's matmuls), not through HF's attention interface, where autoshard substitutes the
    kernel that runs, prices it, and swaps in its context-parallel attention: such a model runs dp and pp by its
    own forward, priced by the ops it traces to (models/presets.py `_own_attention_refusals`)."""
    path = own_attention_path(model)
    if path is None:
        return None
    found = layer_list(model)
    return (f"{found[0].rpartition('.')[2]}.*.{path} ({type(found[1][0].get_submodule(path)).__name__}) computes "
            "attention in its own forward, not through HF's attention interface (transformers' ALL_ATTENTION_FUNCTIONS)")


def own_attention_path(model) -> str | None:
    """The path inside a layer of the module `own_attention` names (Falcon's "self_attention"), or None."""
    found = layer_list(model)
    for path, module in found[1][0].named_modules() if found is not None else ():
        if path and (hasattr(module, "layer_idx") or hasattr(module, "layer_id")) and not is_attention(module) and (
                hasattr(module, "head_dim") or hasattr(module, "head_size")):  # GPT-Neo's keeps a layer_id
            return path
    return None


def own_loss(model) -> str | None:
    """Why `model`'s training loss is none autoshard computes, or None: a forward that takes `labels` but computes
    its loss without HF's `loss_function` (the shifted causal-LM cross-entropy, ForCausalLMLoss, which
    runtime/loss.py computes over any split of the batch: TrOCR's and MVP's own CrossEntropyLoss takes the labels
    already shifted)."""
    import inspect

    code = getattr(inspect.unwrap(type(model).forward), "__code__", None)
    if code is None or "labels" not in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount] \
            or "loss_function" in code.co_names:
        return None
    return (f"{type(model).__name__} computes its loss in its own forward, not through HF's causal-LM "
            "loss_function: autoshard trains on that shifted cross-entropy (labels shifted by one inside, as "
            "ForCausalLMLoss), which need not be this model's number, so no axis can run it")


def bidirectional_attention(model) -> str | None:
    """Why `model` is no causal decoder, naming its attention module, or None: an attention module whose
    `is_causal` is False attends to later tokens too (BERT-style ...LMHeadModel classes built without
    `is_decoder=True`), where autoshard prices the causal kernel's triangle and context parallelism splits the
    sequence into causal chunks: it would mis-price the model and train it wrong under cp."""
    for path, module in model.named_modules():
        if is_attention(module) and getattr(module, "is_causal", True) is False:
            config = getattr(model, "config", None)
            fix = ("set is_decoder=True in its config, as transformers asks of a causal LM built from an encoder"
                   if getattr(config, "is_decoder", None) is False else "build it as a causal decoder")
            return (f"{path} ({type(module).__name__}) attends in both directions (its is_causal is False); "
                    f"autoshard plans causal decoders (it prices the causal attention kernel and splits the "
                    f"sequence into causal chunks under cp): {fix}")
    return None


def mask_reader(model) -> str | None:
    """Why context parallelism cannot split `model`'s attention, naming the module, or None: a child of an attention
    module whose forward takes the attention mask itself (DeepSeek-V3.2's lightning indexer scores every key of the
    sequence; on a cp rank it would see its own chunk only, and the runtime's CP attention hands it no mask)."""
    import inspect

    found = layer_list(model)
    for layer in found[1] if found is not None else ():
        for path, module in layer.named_modules():
            if not (path and is_attention(module)):
                continue
            for name, child in module.named_children():
                takes = inspect.signature(inspect.unwrap(type(child).forward)).parameters
                if {"attention_mask", "mask"} & set(takes):
                    return (f"{found[0].rpartition('.')[2]}.*.{path}.{name} ({type(child).__name__}) reads the "
                            "attention mask of the whole sequence itself, which context-parallel attention does not "
                            "split; use cp=1")
    return None


def _needs_own_forward(facts: dict, config) -> bool:
    """Whether anything around the layers differs from a plain LLaMA stack (embedding, rotary per layer
    type, logit scaling / softcap): then pipeline stages run the model's own forward."""
    rope_kinds = len({t for t in facts["layer_types"]}) > 1
    return (not facts["embedding_plain"] or facts["embedding_multiplier"] != 1.0 or facts["logit_scale"] != 1.0
            or facts["final_softcap"] != 0.0 or rope_kinds or bool(facts["head_params"]))


COUNT_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads")
WIDTH_ATTRS = ("split_size",)  # the query width an attention module cuts its packed [q; k; v] by (GPT-2's)


def _count_attrs(layer) -> tuple[str, ...]:
    """The head-count attributes the attention module holds (its forward may view by them): the rewrite
    sets them to this rank's counts under tp."""
    path = _attention_path(layer)
    if not path:
        return ()
    module = layer.get_submodule(path)
    return tuple(a for a in (*COUNT_ATTRS, *WIDTH_ATTRS) if isinstance(getattr(module, a, None), int))


def linear_widths(module) -> tuple[int, int] | None:
    """(input, output) width of a linear map: an nn.Linear, or HF's Conv1D (GPT-2's, found by structure: a module
    holding a weight of [nx, nf] and a bias of [nf], applied as x @ weight, `transposed_linear`); None otherwise."""
    from torch import nn

    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if transposed_linear(module):
        return module.nx, module.nf
    return None


def transposed_linear(module) -> bool:
    """Whether `module` is a linear map storing its weight as [input, output] (HF's Conv1D: nf outputs of nx inputs;
    its forward views its output by `nf`), so tp splits that weight on the other dimension than nn.Linear's."""
    weight = getattr(module, "_parameters", {}).get("weight")
    nf, nx = getattr(module, "nf", None), getattr(module, "nx", None)
    return weight is not None and isinstance(nf, int) and isinstance(nx, int) and tuple(weight.shape) == (nx, nf) \
        and next(module.children(), None) is None


def _attention_path(layer) -> str:
    """The layer submodule that is its attention: the one holding query / key projections (any packing)."""
    if layer is None:
        return ""
    for path, module in layer.named_modules():
        if path and is_attention(module):
            return path
    return ""


def is_attention(module) -> bool:
    """HF's attention modules keep their config and layer index, and either their scaling and head width (what
    the attention interface call is made from, whatever they name their projections) or a forward that looks
    HF's attention interface up itself (`calls_attention_interface`: GPT-NeoX's, whose head width is head_size)."""
    if not (hasattr(module, "config") and hasattr(module, "layer_idx")):
        return False
    return (hasattr(module, "scaling") and (hasattr(module, "head_dim") or hasattr(module, "num_key_value_groups"))) \
        or calls_attention_interface(module)


def calls_attention_interface(module) -> bool:
    """Whether the forward of `module`'s class reads HF's attention registry (transformers' ALL_ATTENTION_FUNCTIONS,
    the object itself, found among the globals its code names), where `attn_implementation` picks the kernel."""
    import inspect

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    forward = inspect.unwrap(type(module).forward)
    names = getattr(getattr(forward, "__code__", None), "co_names", ())
    return any(getattr(forward, "__globals__", {}).get(n) is ALL_ATTENTION_FUNCTIONS for n in names)


def _moe_modules(layer, experts: int) -> tuple[str, str, str, tuple[str, ...]]:
    """(experts path, router path, shared-expert path, shared parts) of a MoE layer, read off
    the module tree, not its names: the experts module holds one 3-d weight per projection with `experts`
    rows; the router is the linear (or module of one (experts, hidden) weight, or of one such linear: AFMoE's
    `router.gate`, HunYuan-MoE's `gate.wg`) beside it; the shared expert the other module beside them that
    holds linears (Qwen2-MoE's `shared_expert`, DeepSeek's `shared_experts`, GraniteMoeShared's `shared_mlp`).
    The shared parts: the shared expert's linears, then the block's one-output linears (Qwen2-MoE's sigmoid
    `shared_expert_gate`), in module order; none where the experts are the layer's own child (Gemma-4: its attention
    and MLP beside them). ("", "", "", ()) for a dense layer."""
    from torch import nn

    if layer is None or not experts:
        return "", "", "", ()
    for path, module in layer.named_modules():
        own = dict(module.named_parameters(recurse=False))
        if own and all(p.dim() >= 2 and p.shape[0] == experts for n, p in own.items() if not n.endswith("bias")) \
                and any(p.dim() == 3 for p in own.values()):
            parent = path.rpartition(".")[0]
            block = layer.get_submodule(parent) if parent else layer
            at = lambda n: f"{parent}.{n}".lstrip(".")  # noqa: E731 - a path inside the layer
            router = next((at(n) for n, m in block.named_children()
                           if isinstance(m, nn.Linear) and m.out_features == experts), "")
            if not router:  # a router module holding its own (experts, hidden) weight
                router = next((at(n) for n, m in block.named_children()
                               if getattr(m, "weight", None) is not None and m.weight.dim() == 2
                               and m.weight.shape[0] == experts and at(n) != path), "")
            if not router:  # a router module around its one gating linear (AFMoE, HunYuan-MoE)
                router = next((f"{at(n)}.{k}" for n, m in block.named_children() if at(n) != path
                               for k, c in m.named_children() if isinstance(c, nn.Linear) and c.out_features == experts
                               and sum(isinstance(x, nn.Linear) for x in m.modules()) == 1), "")
            linears = lambda m: [c for c in m.modules() if isinstance(c, nn.Linear)]  # noqa: E731
            shared = next((at(n) for n, m in block.named_children() if at(n) not in (path, router)
                           and not isinstance(m, nn.Linear) and linears(m)
                           and all(c.out_features != experts for c in linears(m))),
                          "") if not any(map(is_attention, block.children())) else ""  # not a router's gating; a
            # whole layer holding its experts (Gemma-4's MLP-beside-MoE layer): beside them its attention and MLP
            parts = tuple(f"{shared}.{n}" for n, m in layer.get_submodule(shared).named_modules()
                          if isinstance(m, nn.Linear)) if shared else ()
            parts += tuple(at(n) for n, m in block.named_children()
                           if isinstance(m, nn.Linear) and m.out_features == 1 and at(n) != router)
            return path, router, shared, parts
    return "", "", "", ()


def experts_ep_refusal(experts, where: str) -> str | None:
    """Why expert parallelism cannot run the routed-experts module `experts` (at `where`, the path the user reads:
    "layers.*.mlp.experts"), one line naming the module and the axis, or None: the one rule that the spec's
    refusals (models/presets.py, models/layered.py) and the runtime's `ParallelExperts` apply. Expert parallelism
    (runtime/expert_parallel.py) keeps HF's own experts module on each ep rank, holding that rank's experts, and
    calls its forward (whatever its layout, biases and gating: GPT-OSS's transposed, interleaved, clamped experts)
    on the tokens routed to them; so the module must take the model's routing (hidden, indices, weights), keep
    `num_experts`, and index every parameter by expert on dim 0 (a norm shared by the experts is not sliced:
    HF's `has_post_expert_norm`)."""
    total = getattr(experts, "num_experts", None)
    why = next((reason for reason, broken in (
        ("its forward takes the tokens already scattered to every expert, not HF's routed experts call (hidden, "
         "top_k_index, top_k_weights), and a row of zeros (a token not routed there) does not give zeros and no "
         "gradient through it (a bias, or an activation not 0 at 0), so the unrouted rows cannot be left out",
         not _takes_routing(experts) and not experts_scattered(experts)),
        ("no num_experts attribute", not isinstance(total, int)),
        ("a norm after each expert", bool(getattr(experts, "has_post_expert_norm", False))),
        ("a parameter not indexed by expert", any(p.dim() == 0 or p.shape[0] != total
                                                  for p in experts.parameters())))
        if broken), None)
    if why is None:
        return None
    return (f"{where} ({type(experts).__name__}): {why}; expert parallelism runs HF's experts module on each rank's "
            "slice of the experts (dim 0 of every parameter), called with the routing; use ep=1")


def experts_tp_split_refusal(experts, where: str) -> str | None:
    """Why a serving replica cannot split each expert's GEMMs of `experts` over tp, one line naming the module, or
    None: the runtime's `ParallelExperts` (runtime/expert_parallel.py `expert_tp_placements`) slices HF's default
    layout only, bias-free [gate; up] x hidden and down, not transposed, act(gate) * up; the spec carries the line
    (`ModelSpec.experts_no_tp_split`) so the inference planner offers no such replica."""
    own = [n for n, _ in experts.named_parameters(recurse=False)]
    gate = getattr(getattr(type(experts), "_apply_gate", None), "__name__", "_default_apply_gate")
    if sorted(own) == ["down_proj", "gate_up_proj"] and not getattr(experts, "is_transposed", False) \
            and getattr(experts, "is_concatenated", True) and gate == "_default_apply_gate" and _takes_routing(experts):
        return None
    return (f"{where} ({type(experts).__name__}): a serving replica splits over tp only HF's default experts, "
            f"called with the routing, bias-free [gate; up] x hidden and down, act(gate) * up (these hold {', '.join(own)}); use tp=1 with ep")


def experts_scattered(experts) -> bool:
    """Whether the routed-experts module `experts` takes the tokens already scattered to every expert (Llama-4's:
    one input, the (E x T, h) rows of every token for every expert, expert-major, each scaled by the token's router
    score, 0 where it is not routed there) and a row of zeros gives zeros and no gradient to its input or weights:
    every parameter a bias-free per-expert weight (E, ., .) and its activation (`act_fn`) 0 at 0. Expert
    parallelism then sends the routed (nonzero) rows alone, exactly (runtime/expert_parallel.py)."""
    import torch

    act = getattr(experts, "act_fn", None)
    if _takes_routing(experts) or act is None or any(p.dim() != 3 for p in experts.parameters()):
        return False
    return bool(act(torch.zeros(1)).eq(0).all())


def _takes_routing(experts) -> bool:
    """Whether an experts module's forward is HF's experts interface: three inputs, the hidden states, the
    top-k expert indices and their weights (Mixtral's top_k_index / top_k_weights, GPT-OSS's router_indices /
    routing_weights), the call expert parallelism dispatches; Llama-4's takes the tokens already repeated per
    expert and scaled by the router instead."""
    import inspect

    try:
        params = list(inspect.signature(type(experts).forward).parameters.values())[1:]  # after self
    except (TypeError, ValueError):
        return False
    return len([p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]) >= 3


def tp_style_refusal(facts: ModelFacts, *, layered: bool = False, mla: bool = False,
                     experts: tuple[str, ...] = (), own: tuple[str, ...] = ()) -> str | None:
    """Why HF's declared tp plan names a style autoshard does not run, naming the module, or None; `layered`: a
    hybrid's table (built from its layers' parts, not proven on the graph), which runs no gathered style; `mla`: the
    table holds a multi-head latent attention part; `experts`: the paths of its routed experts inside a layer
    (`RUN_WITHIN`); `own`: paths inside a layer of the parts the table splits by a rule of its own whatever HF declares
    in them (a gated DeltaNet by its heads, where HF gathers its projections whole). Whether the sharding table itself
    holds is proven on the traced graph (passes/capture/tp_proof.py)."""
    for pattern, style in facts.tp_plan:
        if any(pattern.startswith(f"layers.*.{path}.") for path in own):
            continue
        if style in RUN_WITHIN:
            where, why = RUN_WITHIN[style]
            inside = mla if where == "mla" else any(pattern.startswith(f"layers.*.{e}.") for e in experts)
            if not inside:
                return f"{pattern}: HF declares it {style!r}: {why}; tp is not offered for this model"
            continue
        if layered and style in GATHERED_STYLES:
            return (f"{pattern}: HF declares it {style!r}, which a hybrid's layer-parts table does not run yet; tp is "
                    "not offered for this model (dp, pp, cp and ep still plan)")
        if style in NOT_YET:
            return (f"{pattern}: HF declares it {style!r}: {NOT_YET[style]}; tp is not offered for this model "
                    "(dp, pp, cp and ep still plan)")
        if style not in RUN_STYLES:
            return f"{pattern}: HF's tp style {style!r} has no rule in autoshard; tp is not offered for this model"
    return None


_SSD_ATTRS = ("num_heads", "head_dim", "n_groups", "ssm_state_size", "conv_kernel_size", "chunk_size")


def ssd_mixers(model) -> list:
    """(path, module) of every Mamba-2 SSD mixer of `model`, by its pattern: parameters `A_log`, `D`, `dt_bias`, a `conv1d` child and HF's mixer size attributes (`_SSD_ATTRS`), not its class name."""
    out = []
    for path, module in model.named_modules():
        params = {k for k, _ in module.named_parameters(recurse=False)}
        if {"A_log", "D", "dt_bias"} <= params and hasattr(module, "conv1d") and \
                all(isinstance(getattr(module, a, None), int) for a in _SSD_ATTRS):
            out.append((path, module))
    return out


def cache_bytes_by_layer(cache) -> list[int]:
    """Bytes a HF cache holds per layer: every tensor of its layer objects (`cache_layer_bytes`) and of the per-layer
    lists kept beside them (MiniMax's `linear_cache`: its lightning-attention layers' states)."""
    layers = list(getattr(cache, "layers", ()))
    lists = [v for k, v in vars(cache).items() if k != "layers" and isinstance(v, list)]
    return [(cache_layer_bytes(layers[i]) if i < len(layers) else 0)
            + sum(_tensor_bytes(held[i]) for held in lists if i < len(held))
            for i in range(max([len(layers), *map(len, lists)]))]


def _tensor_bytes(value) -> int:
    import torch

    tensors = value if isinstance(value, (list, tuple)) else value.values() if isinstance(value, dict) else (value,)
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def cache_layer_bytes(layer) -> int:
    """Bytes of every tensor one layer of a HF cache holds (K/V, conv and SSM states, once filled)."""
    return sum(_tensor_bytes(value) for value in vars(layer).values())
