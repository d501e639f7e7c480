"""The tp strategy of a model, read from its sharding table, and its proof on the model's own traced graph.

Contract: `strategy(spec, names, tp_plan) -> Strategy` turns the sharding table (rules/sharding.py
`table(spec)`) into per-parameter placements: a colwise role's weight and bias `Shard(0)` (packed
pieces listed, Mamba-2's in_proj), a rowwise role's weight `Shard(1)` (its bias whole), a region's
own per-head parameters (Mamba-2's A_log / D / dt_bias, GPT-OSS's sinks) `Shard(0)`, everything else
`Replicate()`. A layer parameter the table gives no role of its own, inside a tp region or outside every
role, takes HF's declared style for its module (`base_model_tp_plan`: colwise* / packed_colwise -> Shard(0), rowwise* -> Shard(1)), so a
fused projection HF declares is proven or refused by what the graph does with it. A gathered linear (`Role.gathered`)
is `Replicate()`: whole in and out on every rank (its gather / slice runs inside it), the proof is of what is around it.

The whole contract: docs/modules/capture.md (passes/capture/tp_proof.py).
"""

from __future__ import annotations

import copy
import fnmatch
from dataclasses import dataclass

from autoshard.ir import BlockKind
from autoshard.passes.capture.placements import R, Shard
from autoshard.passes.capture.propagate import Proof, propagate

COLWISE_STYLES = ("colwise", "colwise_gather_output", "packed_colwise", "local_colwise")
ROWWISE_STYLES = ("rowwise", "rowwise_split_input", "local_rowwise")


@dataclass(frozen=True, slots=True, kw_only=True)
class Strategy:
    """Placements of the layer parameters (full names), the tp regions and row-parallel linears (paths
    inside a layer)."""

    params: tuple[tuple[str, object], ...]
    regions: tuple[str, ...]
    rowwise: tuple[str, ...]


def strategy(spec, names: tuple[str, ...], tp_plan: tuple[tuple[str, str], ...] = (), *, layers: str = "") -> Strategy:
    """The table's strategy for parameters `names` (docs/modules/capture.md); `layers`: the layer list's prefix
    ("model.layers")."""
    from autoshard.rules import sharding

    roles = [r for r in sharding.table(spec) if r.block is BlockKind.LAYER]
    out = {}
    for name in names:
        module, _, leaf = name.rpartition(".")
        rel = _inside(module, layers)
        if rel is None:
            continue
        role = max((r for r in roles if r.path == rel or (r.path and rel.startswith(r.path + "."))),
                   key=lambda r: len(r.path), default=None)
        own = role is not None and role.path == rel
        if own:
            out[name] = _placement(spec, role, leaf)
        elif role is not None and leaf in role.params:  # a region's own parameters (per head)
            out[name] = Shard(0)
        elif role is not None and role.strategy is not sharding.Strategy.REGION:
            out[name] = R  # inside a module the table keeps whole (a shared expert, the routed experts)
        else:
            style = next((s for pattern, s in tp_plan if fnmatch.fnmatchcase(f"layers.*.{rel}", pattern)), "")
            out[name] = Shard(0) if style in COLWISE_STYLES else Shard(1) if style in ROWWISE_STYLES and leaf != "bias" \
                else R
    regions = tuple(r.path for r in roles if r.strategy is sharding.Strategy.REGION)
    rowwise = tuple(r.path for r in roles if r.strategy is sharding.Strategy.ROWWISE and not r.gathered)
    rowwise += tuple(p.removeprefix("layers.*.") for p, s in tp_plan if s in ROWWISE_STYLES
                     and p.removeprefix("layers.*.") not in rowwise and not any(r.path == p.removeprefix("layers.*.")
                                                                              for r in roles))
    return Strategy(params=tuple(out.items()), regions=regions, rowwise=rowwise)


def _placement(spec, role, leaf: str):
    from autoshard.rules import sharding

    s = role.strategy
    if role.gathered:  # whole in, whole out (its gather / slice on the way): the graph around it sees it whole
        return R
    if s is sharding.Strategy.COLWISE and leaf in role.params:
        if sharding.one_kv_head(spec, role):
            return R  # multi-query attention's one KV head: whole on every rank
        pieces = tuple(sharding.size(spec, p.length) for p in role.pieces)
        return Shard(sharding.param_dim(role, leaf), pieces if len(pieces) > 1 else ())
    if s is sharding.Strategy.ROWWISE and leaf in role.params and leaf != "bias":
        return Shard(sharding.param_dim(role, leaf))
    if s is sharding.Strategy.REGION and leaf in role.params:
        return Shard(0)
    return R


def _inside(module: str, layers: str) -> str | None:
    if not module.startswith(layers + "."):
        return None
    head, _, rest = module[len(layers) + 1:].partition(".")
    return rest if head.isdigit() else None


def traced(model):
    """(`model`'s class with one layer of each layer type, its captured joint graph): what `prove_tp` proves on
    and `tp_proposal.propose` reads pairs off. CaptureError where the model does not trace."""
    import torch

    from autoshard.passes.capture.capture import capture_model

    small = _one_of_each(model)
    return small, capture_model(small, (torch.zeros(2, 8, dtype=torch.long),))


def prove_tp(spec, model, graph=None) -> Proof:
    """The proof of `spec`'s tp strategy on `model`'s own graph (docs/modules/capture.md); `graph`:
    `traced(model)`, when the caller has it already."""
    from autoshard.models import facts
    from autoshard.rules import sharding

    small, cap = graph or traced(model)
    layers = cap.repeated[0].prefix if cap.repeated else ""
    tp_plan = tuple((getattr(facts.text_config(model.config), "base_model_tp_plan", None) or {}).items())
    st = strategy(spec, cap.param_names, tp_plan, layers=layers)
    whole = sharding.attention_whole(spec)
    return propagate(cap, dict(st.params), regions=st.regions, rowwise=st.rowwise,
                     counts=_counts(small, facts, whole_attention=whole),
                     repeats=() if whole or not spec.kv_heads or spec.kv_heads > 1 else _repeats(small, facts))


def _one_of_each(model):
    """`model`'s class on the meta device with one layer of each layer type (the config's `layer_types`), in
    bf16 when it has routed experts (HF's grouped_mm experts trace in bf16 only; a model on HF's eager
    experts does not trace: `capture_model` says to switch)."""
    import torch

    from autoshard.models.facts import ALIASES, text_config

    whole = copy.deepcopy(model.config)
    config = text_config(whole)  # a multimodal wrapper's decoder: its text config, narrowed inside the copy
    kinds = list(dict.fromkeys(getattr(config, "layer_types", None) or ())) or [None]
    for name in ALIASES["layers"]:
        if hasattr(config, name) and getattr(config, name) is not None:
            setattr(config, name, len(kinds))
    if kinds != [None]:
        try:
            config.layer_types = kinds
        except AttributeError:  # a config that derives its layer types (Mamba-2)
            pass
    experts = any(getattr(config, n, None) for n in ALIASES["experts"])
    with torch.device("meta"):  # the config keeps the model's own experts implementation
        small = type(model)(whole)
    return small.to(torch.bfloat16) if experts else small


# the per-rank sizes the rewrite sets on a layer's attention module and Mamba-2 mixer (passes/rewrite.py)
PER_RANK_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads", "n_groups",
                  "intermediate_size", "conv_dim")


def _counts(model, facts, *, whole_attention: bool = False) -> frozenset[int]:
    """The sizes the layer's attention module or SSD mixer keeps as attributes that the rewrite sets per
    rank: a view by one of them is right on every rank. `whole_attention`: the attention runs whole on every
    rank (`sharding.attention_whole`), its counts kept."""
    mods = [m for _, m in _layer0_modules(model, facts)
            if (facts.is_attention(m) and not whole_attention) or hasattr(m, "dt_bias")]
    return frozenset(getattr(m, a) for m in mods for a in PER_RANK_ATTRS if isinstance(getattr(m, a, None), int))


def _layer0_modules(model, facts) -> list:
    """(path inside the layer, module) of the first layer's submodules, its layers found by structure
    (`facts.layer_list`: Mllama's text layers sit under model.language_model); none without a layer list."""
    found = facts.layer_list(model)
    return [(p, m) for p, m in found[1][0].named_modules() if p] if found is not None and len(found[1]) else []


def _repeats(model, facts) -> tuple[tuple[str, int], ...]:
    """(path inside a layer, `num_key_value_groups`) of the layer's attention modules: with one KV head, whole on
    every rank, the rewrite sets it to the local query heads (passes/rewrite.py `_attention_attrs`)."""
    return tuple((p, m.num_key_value_groups) for p, m in _layer0_modules(model, facts)
                 if facts.is_attention(m) and isinstance(getattr(m, "num_key_value_groups", None), int))


def table_findings(spec, proof: Proof) -> tuple[str, ...]:
    """Where the sharding table's gradient sums disagree with the proof: a replicated parameter whose gradient
    comes out partial that the table does not sum over tp (the gradient would be a rank's summand), or one the
    table sums whose gradient is whole (summing would multiply it by tp)."""
    from autoshard.rules import sharding

    summed = {r.path for r in sharding.table(spec)
              if r.block is BlockKind.LAYER and (r.grad_sum or sharding.one_kv_head(spec, r))}
    out = [f"layers.*.{m}: its gradient comes out partial on each tp rank, but the sharding table does not sum "
           "it over tp" for m in proof.grad_sums if m not in summed]
    out += [f"layers.*.{m}: the sharding table sums its gradient over tp, but it comes out whole on every rank "
            "(the sum would multiply it by tp)" for m in sorted(summed) if m not in proof.grad_sums]
    return tuple(out)
