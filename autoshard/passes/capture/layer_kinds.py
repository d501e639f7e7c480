"""Layer kinds: a model is a sequence of decoder layers of one or more kinds, each kind traced once.

Contract
--------
`find_layer_stack(model) -> LayerStack | None`

The whole contract: docs/modules/capture.md (passes/capture/layer_kinds.py).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoshard.errors import CaptureError
from autoshard.ir import is_int, is_positive_int
from autoshard.models.facts import DENSE_FIRST, layer_list, text_config

UNIFORM = "layer"  # the name of the one kind of a model whose layers are all alike
_LABEL_FIELDS = ("layers_block_type", "layer_types")  # HF's per-layer labels, the first one present wins


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerKind:
    name: str
    layers: tuple[int, ...]  # indices of this kind's layers, ascending
    cls: str  # the layer's class name
    params: int  # parameters of ONE layer of this kind that no other layer shares

    @property
    def count(self) -> int:
        return len(self.layers)


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerStack:
    prefix: str  # module path of the layer list, e.g. "model.layers"
    kinds: tuple[LayerKind, ...]  # in the order of their first layer
    source: str  # where the kind names come from: "config.<field>" or "parameters"
    shared_params: int = 0  # parameters held by several layers (counted once)

    @property
    def num_layers(self) -> int:
        return sum(k.count for k in self.kinds)

    @property
    def sequence(self) -> tuple[str, ...]:
        """The kind name of every layer, in order."""
        out = [""] * self.num_layers
        for k in self.kinds:
            for i in k.layers:
                out[i] = k.name
        return tuple(out)

    @property
    def uniform(self) -> bool:
        return len(self.kinds) == 1

    def kind(self, name: str) -> LayerKind:
        for k in self.kinds:
            if k.name == name:
                return k
        raise KeyError(f"no layer kind {name!r}; the kinds are {', '.join(k.name for k in self.kinds)}")


def find_layer_stack(model: nn.Module) -> LayerStack | None:
    """The decoder layers of `model` and their kinds; see docs/modules/capture.md."""
    found = layer_list(model)
    if found is None:
        return None
    prefix, layers = found
    field, labels = _labels(text_config(getattr(model, "config", None)), len(layers))
    groups: dict[tuple, list[int]] = {}
    for i, layer in enumerate(layers):
        groups.setdefault(_signature(layer), []).append(i)
    owned, shared = _owned_params(layers)
    keys = list(groups)
    common = [{labels[i] for i in groups[key]} for key in keys]
    names = _names([next(iter(c)) if len(c) == 1 and field else "" for c in common], [layers[groups[k][0]] for k in keys])
    kinds = tuple(LayerKind(name=name, layers=tuple(groups[key]), cls=type(layers[groups[key][0]]).__name__,
                            params=owned[groups[key][0]])
                  for key, name in zip(keys, names))
    for k in kinds:
        if any(owned[i] != k.params for i in k.layers):
            raise CaptureError(f"the {k.name!r} layers of {type(model).__name__} own different parameter counts "
                               f"({sorted({owned[i] for i in k.layers})}); report this with the model config")
    return LayerStack(prefix=prefix, kinds=kinds, source=f"config.{field}" if field else "parameters",
                      shared_params=shared)


def one_layer_copy(model: nn.Module, stack: LayerStack, kind: str, dtype: torch.dtype) -> nn.Module:
    """A one-layer copy of `model` whose layer is of `kind`, on the meta device; see docs/modules/capture.md."""
    config = getattr(model, "config", None)
    if config is None:
        raise CaptureError(f"{type(model).__name__} has no HF config: autoshard copies a model with one layer "
                           "by its config; give a model with a .config (a Hugging Face PreTrainedModel)")
    k = stack.kind(kind)
    i = k.layers[0]
    narrowed = narrow_config(config, i, stack.num_layers)
    with torch.device("meta"):
        one = type(model)(narrowed).to(dtype)
    got = layer_list(one)
    layers = model.get_submodule(stack.prefix)
    shared = _shared_children(layers, i)
    if got is None or len(got[1]) != 1:
        what = "no layer list" if got is None else f"{len(got[1])} layers"
        raise CaptureError(
            f"cannot copy {type(model).__name__} with one {kind!r} layer (layer {i}, a {k.cls}): narrowing the "
            f"config ({', '.join(_changed(config, narrowed)) or 'nothing'}) built {what}; the config says how many "
            "layers there are in a way autoshard does not read: report this with the model config")
    if _signature(got[1][0], skip=shared) != _signature(layers[i], skip=shared):
        got[1][0] = _own_layer(layers[i], i, config, narrowed).to(dtype)  # the config builds layer i otherwise
    return one


def _own_layer(layer: nn.Module, index: int, config: Any, narrowed: Any) -> nn.Module:
    """A copy of the model's own layer `index` on the meta device, made the first layer of the one-layer
    copy: it reads the `narrowed` config where it read `config`, and its layer index attributes
    (`layer_idx`, `layer_number`, ...: ints named "layer...") are 0 (the narrowed per-layer lists' index)."""
    memo: dict[int, Any] = {id(config): narrowed}
    for t in (*layer.parameters(), *layer.buffers()):
        meta = t.detach().to("meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    out = copy.deepcopy(layer, memo)
    for module in out.modules():
        for name, value in vars(module).items():
            if name.startswith("layer") and is_int(value) and value == index:
                setattr(module, name, 0)
    return out


def narrow_config(config: Any, index: int, num_layers: int) -> Any:
    """A copy of `config` describing one layer: layer `index` of a `num_layers`-layer model (no cache). A
    heterogeneous config (HF's `per_layer_config`: Gemma-4's head_dim per layer type) is read as that layer's own."""
    text = text_config(config)
    if text is not config:  # a multimodal wrapper (Gemma-4's): its decoder's config narrowed in a copy
        out = copy.deepcopy(config)
        for name, value in vars(config).items():
            if value is text:
                setattr(out, name, narrow_config(text, index, num_layers))
        return out
    if getattr(config, "is_heterogeneous", False):
        config = config.per_layer_config[index]  # a copy with the layer's values, not heterogeneous
    out = copy.deepcopy(config)
    for name, value in list(vars(config).items()):
        narrowed = _narrow_value(name, value, index, num_layers)
        if narrowed is not _SAME:
            setattr(out, name, narrowed)
    for name in [n for n in vars(config) if n.endswith("_layer_period")]:
        offset = name.removesuffix("period") + "offset"
        period, at = getattr(config, name), getattr(config, offset, None)
        if is_positive_int(period) and is_int(at):
            special = index % period == at
            setattr(out, name, 1 if special else 2)
            setattr(out, offset, 0 if special else 1)
    for name in DENSE_FIRST:  # the dense layers a MoE stack starts with: this layer's kind
        if is_int(getattr(config, name, None)):
            setattr(out, name, int(index < getattr(config, name)))
    step = getattr(config, "decoder_sparse_step", None)
    if is_positive_int(step):
        out.decoder_sparse_step = 1 if (index + 1) % step == 0 else 2
    if getattr(out, "num_hidden_layers", 1) != 1:
        out.num_hidden_layers = 1
    out.use_cache = False
    return out


_SAME = object()


def _narrow_value(name: str, value: Any, index: int, num_layers: int) -> Any:
    if not isinstance(value, (list, tuple)) or not value or name.endswith(("_multipliers", "_limit")):
        return _SAME
    per_layer = len(value) == num_layers and (all(isinstance(v, str) for v in value) or "layer" in name)
    if per_layer:
        return type(value)([value[index]])
    if "layer" in name and all(is_int(v) and 0 <= v < num_layers for v in value):
        return type(value)([0] if index in value else [])  # indices of the layers of some kind
    return _SAME


def _changed(before: Any, after: Any) -> list[str]:
    return [f"{k}={getattr(after, k)!r}" for k in vars(before) if getattr(after, k, None) != getattr(before, k)]


def _labels(config: Any, n: int) -> tuple[str | None, list[str]]:
    for field in _LABEL_FIELDS:
        try:
            value = getattr(config, field, None)
        except Exception:  # a property that cannot be computed for this config
            value = None
        if isinstance(value, (list, tuple)) and len(value) == n and all(isinstance(v, str) for v in value):
            return field, list(value)
    return None, [""] * n


def _signature(layer: nn.Module, skip: frozenset[str] = frozenset()) -> tuple:
    """The layer's class and parameter names and shapes (those under the children `skip` left out)."""
    return (type(layer).__name__,
            tuple((k, tuple(v.shape)) for k, v in layer.named_parameters(remove_duplicate=False)
                  if k.split(".", 1)[0] not in skip))


def _shared_children(layers: nn.ModuleList, index: int) -> frozenset[str]:
    """The children of layer `index` whose parameters other layers hold too (Zamba2's shared transformer
    block: its size follows the number of layers that share it, one adapter each, not the layer's kind)."""
    others = {id(p) for j, layer in enumerate(layers) if j != index for p in layer.parameters()}
    return frozenset(name for name, child in layers[index].named_children()
                     if any(True for _ in child.parameters()) and all(id(p) in others for p in child.parameters()))


def _owned_params(layers: nn.ModuleList) -> tuple[list[int], int]:
    """Per layer, its parameters that no other layer holds; and the total of those held by several."""
    holders: dict[int, set[int]] = {}
    sizes: dict[int, int] = {}
    for i, layer in enumerate(layers):
        for p in layer.parameters():
            holders.setdefault(id(p), set()).add(i)
            sizes[id(p)] = p.numel()
    owned = [0] * len(layers)
    shared = 0
    for pid, who in holders.items():
        if len(who) == 1:
            owned[next(iter(who))] += sizes[pid]
        else:
            shared += sizes[pid]
    return owned, shared


def _names(labels: list[str], firsts: list[nn.Module]) -> list[str]:
    """The kind names of the groups whose config labels are `labels` ("" for none or several) and whose
    first layers are `firsts`."""
    if len(labels) == 1:
        return [UNIFORM]
    base = [label or _mixer(layer) for label, layer in zip(labels, firsts)]
    names = [f"{b}+{_feed_forward(layer)}" if base.count(b) > 1 else b for b, layer in zip(base, firsts)]
    seen: dict[str, int] = {}
    out = []
    for n in names:  # still alike (same label, same feed-forward): number them
        seen[n] = seen.get(n, 0) + 1
        out.append(n if names.count(n) == 1 else f"{n}#{seen[n]}")
    return out


def _mixer(layer: nn.Module) -> str:
    names = [k for k, _ in layer.named_parameters()]
    return "mamba" if any(k.endswith("A_log") for k in names) else "attention"


def _feed_forward(layer: nn.Module) -> str:
    return "moe" if any("expert" in k for k, _ in layer.named_parameters()) else "dense"
