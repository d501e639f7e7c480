"""Pipeline stage modules cut from an unmodified HF causal LM.

Contract: `build_stage_module(model, spec, stage)` returns the `nn.Module` that computes one
pipeline stage of a HF `LlamaForCausalLM` or `Mamba2ForCausalLM`:

    first stage   input_ids (b, s) int64  -> embedding -> layers [first_layer, end_layer)
    middle stage  hidden (b, s, h)        -> layers [first_layer, end_layer)          -> hidden
    last stage    hidden (b, s, h)        -> layers -> final norm -> LM head           -> logits

(a stage that is both first and last maps input_ids to logits). Logits are (b, s, V), or this
rank's vocab slice (b, s, V / tp) when the model's LM head has been split for TP in place.

Invariants:
* The stage *shares* the model's modules: no copy, parameters keep their identity, so whatever
  was done to the model in place (TP slicing, loaded weights) is what the stage runs, and
  `original_names(model, stage_module)` maps every stage parameter name back to the name the
  parameter has in `model.named_parameters()` (for tied embeddings the LM head weight maps to
  the embedding's name, the one HF reports).
* Chaining the stages of `even_stages(...)` (or any valid split) in one process reproduces
  `model(input_ids).logits` exactly: LLaMA layers get the rotary position embeddings computed
  locally from position ids 0..s-1 (or this rank's positions under context parallelism, see
  `build_stage_module`) and the causal mask from HF's own `create_causal_mask`
  (None under sdpa, which then runs causal); Mamba-2 blocks do their residual themselves.
* `stage.recompute == Recompute.FULL` checkpoints every layer of the stage (only each layer's
  input is kept; its forward reruns in backward).

Terms: a *split* is the tuple of `Stage`s of a pipeline, stage i on pp rank i.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from autoshard.errors import InvalidConfigError
from autoshard.ir import Recompute, Stage, check_stages, even_stages  # noqa: F401  (re-exported)
from autoshard.models.presets import Family, ModelSpec
from autoshard.runtime.comm import gather_sequence, split_sequence


class StageModule(nn.Module):
    """One pipeline stage; the family subclasses say how layers are called (see module docstring)."""

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


class Mamba2Stage(StageModule):
    """Mamba-2 blocks take the hidden state alone; the head casts as Mamba2ForCausalLM does."""

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        dtype = next(self.lm_head.parameters()).dtype
        return self.lm_head(self.norm(hidden).to(dtype)).float()  # (b, s, V or V / tp)


def build_stage_module(model: nn.Module, spec: ModelSpec, stage: Stage, *,
                       positions: Callable[[int], torch.Tensor] | None = None,
                       sequence_shards: int = 1, boundary_group=None) -> StageModule:
    """The module of `stage`, sharing `model`'s submodules (see the module docstring).

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
    module.sequence_shards = sequence_shards
    module.boundary_group = boundary_group
    return module


def _build_stage_module(model: nn.Module, spec: ModelSpec, stage: Stage, *,
                        positions: Callable[[int], torch.Tensor] | None) -> StageModule:
    config = getattr(model, "config", None)
    layers_total = getattr(config, "num_hidden_layers", None)
    if not 0 <= stage.first_layer <= stage.end_layer <= (layers_total or 0):
        raise InvalidConfigError(f"stage layers [{stage.first_layer}, {stage.end_layer}) are outside the "
                                 f"model's {layers_total} layers; stages must lie within 0..{layers_total}")
    if spec.family is Family.LLAMA:
        body = model.model
        parts = dict(embed=body.embed_tokens, layers=list(body.layers)[stage.first_layer:stage.end_layer],
                     norm=body.norm, lm_head=model.lm_head)
        return LlamaStage(stage, config=config, rotary_emb=body.rotary_emb, positions=positions,
                          **_keep(parts, stage))
    if spec.family is Family.MAMBA2:
        body = model.backbone
        parts = dict(embed=body.embeddings, layers=list(body.layers)[stage.first_layer:stage.end_layer],
                     norm=body.norm_f, lm_head=model.lm_head)
        return Mamba2Stage(stage, config=config, **_keep(parts, stage))
    raise InvalidConfigError(f"pipeline stages are built for LLaMA and Mamba-2 models, got family "
                             f"{spec.family!r}; use pp=1 for other models")


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
