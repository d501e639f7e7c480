"""Pipeline stage modules cut from an unmodified HF causal LM.

Contract: `build_stage_module(model, spec, stage)` returns the `nn.Module` that computes one
pipeline stage of a HF `LlamaForCausalLM` or `Mamba2ForCausalLM`:

    first stage   input_ids (b, s) int64  -> embedding -> layers [first_layer, end_layer)
    middle stage  hidden (b, s, h)        -> layers [first_layer, end_layer)          -> hidden
    last stage    hidden (b, s, h)        -> layers -> final norm -> LM head           -> logits

The whole contract: docs/modules/runtime.md (runtime/stages.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from autoshard.errors import InvalidConfigError
from autoshard.ir import Recompute, Stage
from autoshard.model_spec import Mixer, ModelSpec
from autoshard.models.beside import beside_layers, stand_in_width
from autoshard.models.facts import LAYER_MASKS, final_norm, text_config
from autoshard.runtime.comm import gather_sequence, split_sequence


class StageModule(nn.Module):
    """One pipeline stage; the family subclasses say how layers are called (docs/modules/runtime.md)."""

    def __init__(self, stage: Stage, *, config, embed: nn.Module | None, layers: Sequence[nn.Module],
                 norm: nn.Module | None, lm_head: nn.Module | None) -> None:
        super().__init__()
        self.stage = stage
        self.config = config
        self.embed = embed
        # keyed by the layer's index in the full model, so names read "layers.5.mlp..."
        self.layers = nn.ModuleDict({str(stage.first_layer + i): layer for i, layer in enumerate(layers)})
        self.norm = norm
        self.lm_head = lm_head
        self.sequence_shards = 1  # sequence parallelism: hidden states hold 1/tp of the sequence (set by the builder)
        self.boundary_group = None  # a sequence-parallel stage of a mixed pipeline: its tp group (see the builder)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            hidden = self.embed(x)  # (b, s, h)
        else:  # a mixed pipeline hands a sequence-parallel stage the whole sequence: keep this rank's shard
            hidden = split_sequence(x, self.boundary_group)
        shared = self.layer_kwargs(hidden)
        for index, layer in self.layers.items():
            kwargs = self.kwargs_of(int(index), shared)
            # a layer whose forward the rewrite already wrapped in a checkpoint (plan.recompute) is not wrapped twice
            if self.stage.recompute is Recompute.FULL and torch.is_grad_enabled() and "forward" not in vars(layer):
                hidden = checkpoint(layer, hidden, use_reentrant=False, **kwargs)
            else:
                hidden = layer(hidden, **kwargs)
        if self.lm_head is not None:
            return self.head(hidden)
        return gather_sequence(hidden, self.boundary_group)  # mixed pipeline: the whole sequence crosses

    def layer_kwargs(self, hidden: torch.Tensor) -> dict:
        return {}

    def kwargs_of(self, index: int, kwargs: dict) -> dict:
        """Layer `index`'s forward kwargs out of `layer_kwargs`' (an attention mask per layer type)."""
        masks = kwargs.get("attention_mask")
        if isinstance(masks, dict):
            return {**kwargs, "attention_mask": masks[layer_type(self.config, index)]}
        return kwargs

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))  # (b, s, V or V / tp)


def attention_masks(config, layers, **mask_kwargs) -> dict[str, torch.Tensor | None]:
    """HF's attention masks for the layer types among `layers` (indices in the full model), built as the
    HF model builds them (`mask_kwargs`: those of transformers.masking_utils.create_causal_mask):
    "full_attention" causal, "sliding_attention" causal within `config.sliding_window` tokens (Mixtral's
    sliding_window, Qwen2-MoE's sliding layers). With a cache each mask is sized by the first of these
    layers of its type (a pipeline rank fills only its own layers' cache). `layer_type` says which mask
    a layer takes."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    first: dict[str, int] = {}
    for index in layers:
        first.setdefault(layer_type(config, index), index)
    return {kind: (create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask)(
        config=config, layer_idx=index, **mask_kwargs) for kind, index in first.items()}


def whole_sequence_mask(model: nn.Module, layers: int, batch: int, seq: int, device):
    """The `attention_mask` a sequence-parallel forward hands HF's `model` for `batch` x `seq` tokens: HF would size
    its masks by the embedding's output, 1/tp of the sequence, while each attention runs on the gathered whole. The masks of
    the whole sequence as HF builds them (`attention_masks`; None where HF leaves it to the kernel: sdpa's causal
    mask, flash, the CP attention): one per layer type as a dict (the forwards of a config with alternating
    layer_types take one), or the one mask of layers that share a type (Mistral's window). A hybrid's forward takes
    a mapping too: its attention layers' mask under "full_attention", its recurrent layers' padding mask (None: no
    padding) under "linear_attention" and their type; a chunked or indexed layer its own (`facts.LAYER_MASKS`).
    Other layer types are refused sequence parallelism (`presets._sequence_refusal`)."""
    from transformers.masking_utils import (create_causal_mask, create_chunked_causal_mask,
                                            create_recurrent_attention_mask)

    config = text_config(model.config)
    embeds = torch.empty(batch, seq, 1, dtype=model.get_input_embeddings().weight.dtype, device=device)
    kwargs = dict(inputs_embeds=embeds, attention_mask=None, cache=None, position_ids=torch.arange(seq, device=device)[None])
    types = [layer_type(config, i) for i in range(layers)]
    kinds = {kind: LAYER_MASKS.get(kind) for kind in types}
    masks = attention_masks(config, [i for i, kind in enumerate(types) if kinds[kind] in ("causal", "sliding")],
                            **kwargs)
    if set(masks) == set(kinds):  # an attention model: one mask per layer type, or the one of them all
        return masks if len(masks) > 1 else next(iter(masks.values()))
    if not {"causal", "sliding", "materialised", "chunked"} & set(kinds.values()):  # no layer attends (Mamba's): the
        return None  # forward's own recurrent mask, None unpadded
    build = {"causal": lambda: masks["full_attention"] if "full_attention" in masks else create_causal_mask(
                 config=config, **kwargs),
             "recurrent": lambda: create_recurrent_attention_mask(config, embeds, None), "none": lambda: None,
             "materialised": lambda: create_causal_mask(config=config, allow_is_causal_skip=False, **kwargs),
             "chunked": lambda: create_chunked_causal_mask(config=config, **kwargs)}
    out = {kind: masks[kind] if kind in masks else build[how]() for kind, how in kinds.items()}
    out.setdefault("full_attention", build["causal"]())  # the keys a hybrid's forward reads whatever its types
    out.setdefault("linear_attention", build["recurrent"]())
    return out


def layer_type(config, index: int) -> str:
    """The attention type of layer `index` (a key of `attention_masks`): the config's layer_types
    (Qwen2-MoE), else sliding for every layer when the config has a window (Mixtral), else full."""
    types = getattr(config, "layer_types", None)
    if types:
        return types[index]
    return "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"


class LlamaStage(StageModule):
    """LLaMA decoder layers need rotary embeddings and the causal mask, computed here per stage."""

    def __init__(self, stage: Stage, *, rotary_emb: nn.Module,
                 positions: Callable[[int], torch.Tensor] | None = None, **parts) -> None:
        super().__init__(stage, **parts)
        self.rotary_emb = rotary_emb
        self.positions = positions

    def layer_kwargs(self, hidden: torch.Tensor) -> dict:
        s = hidden.shape[1] * self.sequence_shards  # the whole (cp-local) sequence the attention sees
        position_ids = (self.positions(s) if self.positions is not None else torch.arange(s)[None])  # (1, s)
        position_ids = position_ids.to(hidden.device)
        whole = hidden[:, :1].expand(-1, s, -1)  # its shape, for the mask (no copy)
        masks = attention_masks(self.config, map(int, self.layers), inputs_embeds=whole, attention_mask=None,
                                cache=None, position_ids=position_ids)
        return {"attention_mask": masks, "position_ids": position_ids,
                "position_embeddings": self.rotary_emb(hidden, position_ids=position_ids)}


class OwnForwardStage(StageModule):
    """A stage that runs the HF model's own forward, limited to its layers (a model whose forward does
    more around its layers than a plain LLaMA stack: Gemma's embedding scale, Granite's multipliers,
    per-layer-type rotary, logit scaling and softcaps: `ModelSpec.own_forward`, models/facts.py).

    The root forward runs with the layers outside [first_layer, end_layer) stood in for by identities
    (`_Skip`, keeping the attributes the base forward reads, e.g. attention_type); a later stage's input
    enters at its first layer (a forward pre-hook swaps the hidden states the base forward built from
    placeholder embeddings for the received ones), and an earlier stage's output leaves at the next
    stage's first layer (a pre-hook raises it out of the forward, so the norm and head do not run). So
    the rotary embeddings, masks, multipliers, the final norm, the head and the logit transforms are
    HF's own code, on every stage."""

    def __init__(self, stage: Stage, *, model: nn.Module, base: nn.Module, positions=None,
                 extras: Sequence[nn.Module] = (), finals: Sequence[nn.Module] = (), **parts) -> None:
        super().__init__(stage, **parts)
        self.__dict__["_model"] = model  # not a submodule: the stage holds only its own parameters
        self.__dict__["_base"] = base
        self.__dict__["_attr"] = _layers_attr(model)
        self.positions = positions
        # the base's modules beside the layers (models/beside.py `beside_layers`): those run before the layers (GPT-2's
        # learned positions, BLOOM's embedding norm, OPT's project_in) the first stage holds (they train there); a
        # later stage's forward runs stand-ins giving zeros of their output's shape (`_Zeros`: their output is
        # replaced by the received hidden states, and their weights are not on this rank); those run after the
        # layers (OPT's project_out) the last stage holds, and no earlier stage reaches them
        self.extras = nn.ModuleList(extras if stage.embed else ())
        self.finals = nn.ModuleList(finals if stage.head else ())
        self.__dict__["_beside"] = [n for n, m in base.named_children() if any(m is e for e in extras)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Under sequence parallelism the hidden states between layers (and stages) hold 1/tp of the sequence: the
        positions, masks and placeholder are the whole (cp-local) sequence's, as `DistributedModel` hands them."""
        if not self.stage.embed:  # a mixed pipeline hands a sequence-parallel stage the whole sequence
            x = split_sequence(x, self.boundary_group)
        s = x.shape[1] if self.stage.embed else x.shape[1] * self.sequence_shards
        position_ids = (self.positions(s) if self.positions is not None else torch.arange(s)[None]).to(x.device)
        kwargs = {}
        if self.sequence_shards > 1:
            layers = len(self._base._modules[self.__dict__["_attr"]])
            kwargs["attention_mask"] = whole_sequence_mask(self._model, layers, x.shape[0], s, x.device)
        out = self.run(x, position_ids=position_ids, length=s, **kwargs)
        return out if self.stage.head else gather_sequence(out, self.boundary_group)

    def run(self, x: torch.Tensor, *, cache=None, logits_to_keep: int = 0, length: int | None = None,
            **kwargs) -> torch.Tensor:
        """This stage's output for `x` (input_ids on the first stage, else hidden states (b, s, h)):
        hidden states, or on the last stage the logits (b, s, V or V / tp). `length`: the sequence the base forward
        builds its positions and masks for (default x's; the whole one when `x` is a sequence-parallel shard)."""
        model, base, stage = self._model, self._base, self.stage
        attr = self.__dict__["_attr"]
        layers = base._modules[attr]
        first = stage.first_layer
        inputs = {"input_ids": x} if stage.embed else {"inputs_embeds": _placeholder(model, x, length)}
        hooks = []
        if not stage.embed:  # the received hidden states enter at this stage's first layer (or the last's norm)
            entry = layers[first] if first < stage.end_layer else self.norm
            hooks.append(entry.register_forward_pre_hook(_swap_input(x), with_kwargs=True))
        stand_ins = nn.ModuleList([layer if first <= i < stage.end_layer else _Skip(layer)
                                   for i, layer in enumerate(layers)])
        if not stage.head:  # (on the stand-in of the next stage's first layer)
            hooks.append(stand_ins[stage.end_layer].register_forward_pre_hook(_leave, with_kwargs=True))
        base._modules[attr] = stand_ins
        beside = {} if stage.embed else {n: base._modules[n] for n in self.__dict__["_beside"]}
        for name, module in beside.items():
            base._modules[name] = _Zeros(stand_in_width(module))
        embed = () if stage.embed else _embedding_site(model)  # (read each call: tp may swap the module)
        if embed:  # not held here: a lookup (Gemma-4-unified's of its image token, to find it in inputs_embeds)
            embed[0]._modules[embed[1]] = _Unmatched(embed[2].weight.shape[-1])  # matches no placeholder
        wrapped = self._checkpointed(stand_ins)
        try:
            out = model(**inputs, use_cache=cache is not None, cache=cache, logits_to_keep=logits_to_keep, **kwargs)
        except _StageOutput as leaving:
            return leaving.hidden.contiguous()  # (a view, Inkling-2's: p2p sends contiguous tensors)
        finally:
            base._modules[attr] = layers
            base._modules.update(beside)
            if embed:
                embed[0]._modules[embed[1]] = embed[2]
            for layer in wrapped:
                del layer.forward
            for hook in hooks:
                hook.remove()
        return out.logits

    def _checkpointed(self, layers: nn.ModuleList) -> list[nn.Module]:
        """Full recompute of the stage: each of its layers' forward in a checkpoint, for this call only (a
        layer the rewrite already wrapped, plan.recompute, is not wrapped twice)."""
        if self.stage.recompute is not Recompute.FULL or not torch.is_grad_enabled():
            return []
        out = []
        for layer in layers[self.stage.first_layer:self.stage.end_layer]:
            if "forward" not in vars(layer):
                forward = layer.forward
                layer.forward = lambda *a, _f=forward, **k: checkpoint(_f, *a, use_reentrant=False, **k)
                out.append(layer)
        return out


def _placeholder(model: nn.Module, x: torch.Tensor, length: int | None = None) -> torch.Tensor:
    """What a later stage feeds the own forward as its input embeddings (the received hidden states `x` replace
    them at the stage's first layer): zeros of the embedding's width (OPT projects the embeddings to the hidden
    width before the layers, project_in), never `x` itself (CTRL scales its embeddings in place); `length`
    positions long (x's by default)."""
    width = model.get_input_embeddings().weight.shape[-1]
    return x.new_zeros(x.shape[0], length or x.shape[1], width)


class _Zeros(nn.Module):
    """Stands in for a module of the first stage run before the layers on a later one (models/beside.py
    `stand_in_width`): zeros of an embedding's width for any indices, of a linear's output for its input, of a
    norm's input (and whatever else its forward takes: BioGPT's positions embedding is called with the mask, the
    cache length and position_ids)."""

    def __init__(self, width):
        super().__init__()
        self.lookup, self.width = width if isinstance(width, tuple) else (None, width)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        shape = x.shape if self.lookup else x.shape[:-1]
        return torch.zeros(*shape, self.width or x.shape[-1], device=x.device,
                           dtype=None if self.lookup else x.dtype)


def _embedding_site(model: nn.Module) -> tuple:
    """(parent module, attribute, module) of the model's input embedding."""
    embed = model.get_input_embeddings()
    path = next(p for p, m in model.named_modules() if m is embed)
    parent, _, attr = path.rpartition(".")
    return model.get_submodule(parent), attr, embed


class _Unmatched(nn.Module):
    """Stands in for the input embedding on a later stage, which does not hold it: rows of NaN for any indices, which
    equal no input embedding (a wrapper given inputs_embeds looks its image / audio tokens up in its embedding to find
    them among its inputs: Gemma-4-unified's `get_placeholder_mask`; a later stage's inputs are a placeholder that
    the received hidden states replace at its first layer)."""

    def __init__(self, width: int):
        super().__init__()
        self.width = width

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.full((*ids.shape, self.width), float("nan"), device=ids.device)


class _StageOutput(Exception):
    """Carries a stage's output hidden states out of the model's forward (OwnForwardStage)."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__("stage output")
        self.hidden = hidden


def _leave(module, args, kwargs):
    raise _StageOutput(args[0] if args else kwargs["hidden_states"])


def _swap_input(x: torch.Tensor):
    def hook(module, args, kwargs):
        if args:
            return (x, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": x}
    return hook


class _Skip(nn.Module):
    """Stands in for a layer of another stage: passes the hidden states through, in the structure the real
    layer returns them (a tuple where its forward is annotated to return one: Bamba's (hidden, attention
    weights)); other attributes (the layer's attention_type, which the base forward may read) are the real
    layer's."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.__dict__["_real"] = layer
        self.__dict__["_outputs"] = _tuple_length(type(layer).forward)

    def forward(self, hidden_states, *args, **kwargs):
        outputs = self.__dict__["_outputs"]
        return hidden_states if outputs is None else (hidden_states, *([None] * (outputs - 1)))

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_real"], name)


def _tuple_length(forward) -> int | None:
    """How many values `forward` is annotated to return as a tuple (hidden states first), else None."""
    import inspect
    import typing

    try:
        returned = inspect.signature(forward).return_annotation
    except (TypeError, ValueError):
        return None
    if isinstance(returned, str):  # a postponed annotation: "tuple[torch.Tensor, torch.Tensor | None]"
        if not returned.startswith("tuple[") or returned.endswith(", ...]"):
            return 1 if returned.startswith("tuple[") else None
        depth, count = 0, 1
        for c in returned[6:-1]:
            depth += (c == "[") - (c == "]")
            count += c == "," and depth == 0
        return count
    if typing.get_origin(returned) is tuple:
        parts = typing.get_args(returned)
        return 1 if len(parts) == 2 and parts[1] is Ellipsis else len(parts)
    return None


class Mamba2Stage(StageModule):
    """Mamba-2 blocks take the hidden state alone; the head casts as Mamba2ForCausalLM does."""

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        dtype = next(self.lm_head.parameters()).dtype
        return self.lm_head(self.norm(hidden).to(dtype)).float()  # (b, s, V or V / tp)


def build_stage_module(model: nn.Module, spec: ModelSpec, stage: Stage, *,
                       positions: Callable[[int], torch.Tensor] | None = None,
                       sequence_shards: int = 1, boundary_group=None) -> StageModule:
    """The module of `stage`, sharing `model`'s submodules (docs/modules/runtime.md).

    positions: local sequence length -> (1, s) position ids of this rank's tokens (context
    parallelism); default 0..s-1. Only LLaMA uses positions (rotary embeddings, causal mask).
    sequence_shards: tp under sequence parallelism (the hidden states between layers, and so
    between stages, hold 1/tp of the sequence: runtime/tensor_parallel.py), else 1.
    boundary_group: a sequence-parallel stage in a pipeline whose stages differ in sequence
    parallelism (the plan lists it per stage): every boundary then carries the whole sequence, so
    this stage keeps its shard of what it receives (`split_sequence`) and all-gathers what it sends
    (`gather_sequence`) over this tp group; None: the boundary carries the stage's own layout.
    """
    module = _build_stage_module(model, spec, stage, positions=positions)
    if stage.embed and spec.idle_modules:  # a wrapper's vision tower: never run on token ids, held here
        module.idle = nn.ModuleList(model.get_submodule(p) for p in spec.idle_modules)
    module.sequence_shards = sequence_shards
    module.boundary_group = boundary_group
    return module


def _build_stage_module(model: nn.Module, spec: ModelSpec, stage: Stage, *,
                        positions: Callable[[int], torch.Tensor] | None) -> StageModule:
    config = getattr(model, "config", None)
    layers_total = spec.layers  # the decoder's (a multimodal wrapper's config has none of its own)
    if not 0 <= stage.first_layer <= stage.end_layer <= layers_total:
        raise InvalidConfigError(f"stage layers [{stage.first_layer}, {stage.end_layer}) are outside the "
                                 f"model's {layers_total} layers; stages must lie within 0..{layers_total}")
    body, parts = _parts(model, stage, own_forward=spec.own_forward)
    if spec.own_forward:
        extras, finals, unplaced = beside_layers(model, after=spec.after_layers, idle=spec.idle_modules)
        if unplaced and not (stage.embed and stage.head):  # (one stage of the whole model: nothing to place)
            raise InvalidConfigError(f"{type(model).__name__}: {unplaced}; use pp=1")
        return OwnForwardStage(stage, config=config, model=model, base=body, positions=positions, extras=extras,
                               finals=finals, **parts)
    if spec.mixer is Mixer.ATTENTION:  # rotary embeddings and the causal mask, made per stage
        return LlamaStage(stage, config=config, rotary_emb=body.rotary_emb, positions=positions, **parts)
    return Mamba2Stage(stage, config=config, **parts)  # SSD blocks: the hidden state alone


def _parts(model: nn.Module, stage: Stage, *, own_forward: bool = False) -> tuple[nn.Module, dict]:
    """(the base model holding the layers, this stage's embed / layers / norm / lm_head), found by the
    model's structure (models/facts.py `layer_list`: the ModuleList of the config's layers, whatever its name:
    model.layers, transformer.h, model.decoder.layers), the final norm its last child with parameters after
    the layers, the embedding and head HF's input / output embeddings. `own_forward`: a base with no final norm
    (OPT-350m's decoder) runs its own forward without one, each stage entered at a layer of its own."""
    body = model.get_submodule(_layers_path(model).rpartition(".")[0])
    layers = model.get_submodule(_layers_path(model))
    try:
        norm = final_norm(body, layers)
    except InvalidConfigError:
        if not own_forward or (stage.first_layer == stage.end_layer and not stage.embed):
            raise
        norm = None
    parts = dict(embed=model.get_input_embeddings(), layers=list(layers)[stage.first_layer:stage.end_layer],
                 norm=norm, lm_head=model.get_output_embeddings())
    return body, _keep(parts, stage)


def _layers_path(model: nn.Module) -> str:
    from autoshard.models.facts import layer_list

    found = layer_list(model)
    if found is None:
        raise InvalidConfigError(f"{type(model).__name__}: no ModuleList holds the decoder layers; pipeline stages "
                                 "cut that list; use pp=1")
    return found[0]


def _layers_attr(model: nn.Module) -> str:
    return _layers_path(model).rpartition(".")[2]


def _keep(parts: dict, stage: Stage) -> dict:
    """Drop the embedding unless the stage is first, and the norm and head unless it is last."""
    return {**parts, "embed": parts["embed"] if stage.embed else None,
            "norm": parts["norm"] if stage.head else None, "lm_head": parts["lm_head"] if stage.head else None}


def original_names(model: nn.Module, stage_module: nn.Module) -> dict[str, str]:
    """{stage parameter name: name of the same parameter in `model.named_parameters()`}."""
    by_id = {id(p): name for name, p in model.named_parameters()}
    names = {}
    for name, param in stage_module.named_parameters():
        if id(param) not in by_id:
            raise InvalidConfigError(f"stage parameter {name} is not a parameter of the model; stage modules "
                                     "must be built from the model they are mapped back to")
        names[name] = by_id[id(param)]
    return names
