"""Decide what one rank runs: its slice of every parameter and where the collectives go.

Contract: `shard_program(plan, spec, params, tp_rank=r)` -> `ShardProgram`, a frozen table for
tensor-parallel rank `r` of the unmodified HF model whose parameters are `params`
({original name: shape}):

* `placements`: every parameter name -> `Replicate()` or `Shard(dim, index, parts, segments)`.
  A sharded tensor is the concatenation along `dim` of pieces of sizes `segments` (one piece
  for a plain linear; Mamba-2's in_proj is [z, x, B, C, dt]); each piece is cut in `parts`
  equal slices and the rank keeps slice `index` of every piece. `parts` < tp means the slice
  is held by tp / parts ranks whose gradients are partial sums (`partial_grads`).
* `regions`: module paths whose input enters a tensor-parallel region (identity forward,
  gradient all-reduce backward), `rowwise`: linears whose partial outputs are summed (all-reduce
  forward, identity backward); `vocab_embed` / `vocab_head`: the vocab-parallel embedding and LM
  head (the loss is then the vocab-parallel cross-entropy).
* `attrs`: (module path, attribute, value) for module fields that hold sizes (Mamba-2's mixer
  keeps num_heads, n_groups, intermediate_size, conv_dim; LLaMA's num_key_value_groups).

`check_plan` raises `InvalidConfigError` for a plan that cannot run on `world_size` ranks; it
does no communication, so every rank raises the same error before any collective.

This pass decides; `autoshard.runtime.tensor_parallel` carries the table out on the module.
The scheme is Megatron-LM's (Shoeybi et al. 2019, section 3): attention by heads, MLP column
then row, vocab-parallel embedding / LM head / cross-entropy; Mamba-2 as in Megatron-Core's
mamba mixer (in_proj by heads and groups, conv1d by channel, gated norm by group).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from autoshard.errors import InvalidConfigError
from autoshard.ir import Plan, Recompute, check_stages
from autoshard.models.presets import Family, ModelSpec
from autoshard.passes.layouts import zero_violation


@dataclass(frozen=True, slots=True, kw_only=True)
class Replicate:
    """The full tensor on every tp rank."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Shard:
    """Slice `index` of `parts` of every piece (sizes `segments`) along `dim`."""

    dim: int
    index: int
    parts: int
    segments: tuple[int, ...]

    def ranges(self) -> tuple[tuple[int, int], ...]:
        """(start, length) along `dim` of this rank's slice of every piece, in the full tensor."""
        out, offset = [], 0
        for size in self.segments:
            step = size // self.parts
            out.append((offset + self.index * step, step))
            offset += size
        return tuple(out)


Placement = Replicate | Shard


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardProgram:
    """What tensor-parallel rank `tp_rank` of `tp` holds and where its collectives go."""

    tp: int
    tp_rank: int
    placements: tuple[tuple[str, Placement], ...]
    partial_grads: tuple[str, ...] = ()
    regions: tuple[str, ...] = ()
    rowwise: tuple[str, ...] = ()
    vocab_embed: str | None = None
    vocab_head: str | None = None
    attrs: tuple[tuple[str, str, int], ...] = ()
    checkpoint: tuple[str, ...] = ()

    def placement(self, name: str) -> Placement:
        return dict(self.placements)[name]


def check_plan(plan: Plan, spec: ModelSpec, *, world_size: int) -> None:
    """InvalidConfigError naming the numbers if `plan` cannot run `spec` on `world_size` ranks."""
    mesh = plan.mesh
    if mesh.size != world_size:
        raise InvalidConfigError(f"the plan's mesh {mesh.as_dict()} multiplies to {mesh.size}, but the world size "
                                 f"is {world_size}; choose dp*pp*tp*cp*ep = {world_size}")
    _check_cp(spec, plan)  # context parallelism (issue 6)
    if mesh.ep != 1:
        raise InvalidConfigError(f"ep={mesh.ep}: {spec.name} has no experts; use ep=1")
    if plan.zero > 2:
        raise InvalidConfigError(f"zero={plan.zero} (parameter sharding) is not supported by the runtime yet; "
                                 "use zero=2 (gradients and optimizer state sharded over dp), 1 or 0")
    why = zero_violation(mesh, plan.zero)
    if why:
        raise InvalidConfigError(why)
    if mesh.pp > spec.layers:
        raise InvalidConfigError(f"pp ({mesh.pp}) is larger than the number of blocks of {spec.name} "
                                 f"({spec.layers}); use pp <= {spec.layers}")
    if plan.stages:
        check_stages(plan.stages, num_layers=spec.layers, pp=plan.chunks)
    per_step = mesh.dp * plan.micro_batch
    if plan.global_batch % per_step:
        raise InvalidConfigError(f"global batch {plan.global_batch} is not divisible by dp ({mesh.dp}) x "
                                 f"micro_batch ({plan.micro_batch}) = {per_step}; pick a global batch that "
                                 f"is a multiple of {per_step}")
    _check_tp(spec, mesh.tp)


def _check_cp(spec: ModelSpec, plan: Plan) -> None:
    """cp > 1 (issue 6): LLaMA splits the sequence in 2*cp chunks (balanced causal layout), Mamba-2 in
    cp contiguous slices of at least conv_kernel-1 tokens (runtime/context_parallel.py)."""
    cp, seq = plan.mesh.cp, plan.seq_len
    if cp == 1:
        return
    parts, what = (2 * cp, "2*cp") if spec.family is Family.LLAMA else (cp, "cp")
    if seq % parts:
        raise InvalidConfigError(f"sequence length {seq} is not divisible by {what} = {parts} (cp={cp}, "
                                 f"{spec.name}); pad the sequence to a multiple of {parts} or pick a smaller cp")
    if spec.family is Family.MAMBA2 and seq // cp < spec.conv - 1:
        raise InvalidConfigError(f"sequence length {seq} over cp={cp} leaves {seq // cp} tokens per rank, fewer than "
                                 f"conv_kernel-1 = {spec.conv - 1} (Mamba-2 conv halo); use a smaller cp")


def _check_tp(spec: ModelSpec, tp: int) -> None:
    def need(count: int, what: str) -> None:
        if count % tp:
            raise InvalidConfigError(f"tp ({tp}) does not divide the {what} of {spec.name} ({count}); "
                                     f"use a tp that divides {count}")

    if tp == 1:
        return
    need(spec.vocab, "vocabulary size")
    need(spec.heads, "number of heads")
    if spec.family is Family.LLAMA:
        need(spec.ffn, "MLP width")
        if spec.kv_heads % tp and tp % spec.kv_heads:
            raise InvalidConfigError(f"tp ({tp}) and the KV heads of {spec.name} ({spec.kv_heads}) must divide "
                                     "one another (KV heads split, or each rank keeps one); change tp")
    else:
        need(spec.groups, "number of groups (n_groups)")


def shard_program(plan: Plan, spec: ModelSpec, params: Mapping[str, tuple[int, ...]], *,
                  tp_rank: int) -> ShardProgram:
    """The table for tp rank `tp_rank` (see the module docstring); `params`: {name: full shape}."""
    tp = plan.mesh.tp
    _check_tp(spec, tp)
    rules = _llama_rules(spec, tp, tp_rank) if spec.family is Family.LLAMA else _mamba2_rules(spec, tp, tp_rank)
    placements, partial = [], []
    for name, shape in params.items():
        placement = Replicate()
        if tp > 1:
            for pattern, rule in rules:
                if re.search(pattern, name):
                    placement = rule(shape)
                    break
        if isinstance(placement, Shard) and placement.parts < tp:
            partial.append(name)
        placements.append((name, placement))
    layers = [f"{_base(spec)}.layers.{i}" for i in range(spec.layers)]
    return ShardProgram(
        tp=tp, tp_rank=tp_rank, placements=tuple(placements), partial_grads=tuple(partial),
        checkpoint=_checkpointed(spec, layers, layer_recompute(plan, spec)),
        **(_tp_modules(spec, layers, tp) if tp > 1 else {}),
    )


def _base(spec: ModelSpec) -> str:
    return "model" if spec.family is Family.LLAMA else "backbone"


def _llama_rules(spec: ModelSpec, tp: int, r: int):
    head_dim = spec.hidden // spec.heads
    kv_parts = min(tp, spec.kv_heads)  # KV heads split, or (kv_heads | tp) one KV head per rank
    kv_index = r * kv_parts // tp

    def col(size, parts=tp, index=r):
        return lambda shape: Shard(dim=0, index=index, parts=parts, segments=(size,))

    def row(size):
        return lambda shape: Shard(dim=1, index=r, parts=tp, segments=(size,))

    return (
        (r"self_attn\.q_proj\.(weight|bias)$", col(spec.heads * head_dim)),
        (r"self_attn\.[kv]_proj\.(weight|bias)$", col(spec.kv_heads * head_dim, kv_parts, kv_index)),
        (r"self_attn\.o_proj\.weight$", row(spec.heads * head_dim)),
        (r"mlp\.(gate|up)_proj\.(weight|bias)$", col(spec.ffn)),
        (r"mlp\.down_proj\.weight$", row(spec.ffn)),
        (r"(embed_tokens|lm_head)\.weight$", col(spec.vocab)),
    )


def _mamba2_rules(spec: ModelSpec, tp: int, r: int):
    inner, gn, heads = spec.intermediate, spec.groups * spec.state, spec.heads

    def col(*segments):
        return lambda shape: Shard(dim=0, index=r, parts=tp, segments=segments)

    return (
        (r"mixer\.in_proj\.(weight|bias)$", col(inner, inner, gn, gn, heads)),
        (r"mixer\.conv1d\.(weight|bias)$", col(inner, gn, gn)),
        (r"mixer\.(dt_bias|A_log|D)$", col(heads)),
        (r"mixer\.norm\.weight$", col(inner)),
        (r"mixer\.out_proj\.weight$", lambda shape: Shard(dim=1, index=r, parts=tp, segments=(inner,))),
        (r"(embeddings|lm_head)\.weight$", col(spec.vocab)),
    )


def _tp_modules(spec: ModelSpec, layers: list[str], tp: int) -> dict:
    if spec.family is Family.LLAMA:
        attrs = ()
        if spec.kv_heads < tp:  # one KV head per rank serves heads/tp query heads
            attrs = tuple((f"{p}.self_attn", "num_key_value_groups", spec.heads // tp) for p in layers)
        return dict(regions=tuple(f"{p}.{m}" for p in layers for m in ("self_attn", "mlp")),
                    rowwise=tuple(f"{p}.{m}" for p in layers for m in ("self_attn.o_proj", "mlp.down_proj")),
                    vocab_embed="model.embed_tokens", vocab_head="lm_head", attrs=attrs)
    heads, groups, inner = spec.heads // tp, spec.groups // tp, spec.intermediate // tp
    conv_dim = inner + 2 * groups * spec.state
    sizes = (("num_heads", heads), ("n_groups", groups), ("intermediate_size", inner), ("conv_dim", conv_dim))
    attrs = [(f"{p}.mixer", k, v) for p in layers for k, v in sizes]
    attrs += [(f"{p}.mixer.conv1d", k, conv_dim) for p in layers for k in ("in_channels", "out_channels", "groups")]
    return dict(regions=tuple(f"{p}.mixer" for p in layers), rowwise=tuple(f"{p}.mixer.out_proj" for p in layers),
                vocab_embed="backbone.embeddings", vocab_head="lm_head", attrs=tuple(attrs))


def layer_recompute(plan: Plan, spec: ModelSpec) -> tuple[Recompute, ...]:
    """The recompute level of every layer: its stage's (`plan.stages`, as the planner chose them per
    stage), or `plan.recompute` for all layers when the plan names no stages."""
    if not plan.stages:
        return (plan.recompute,) * spec.layers
    out = [plan.recompute] * spec.layers
    for stage in plan.stages:
        out[stage.first_layer:stage.end_layer] = [stage.recompute] * stage.layers
    return tuple(out)


def selective_module(spec: ModelSpec) -> str:
    """The submodule of a layer that selective recompute checkpoints: the attention module / the
    Mamba-2 mixer (the cost model prices the same module, passes/cost.py)."""
    return "self_attn" if spec.family is Family.LLAMA else "mixer"


def _checkpointed(spec: ModelSpec, layers: Sequence[str], recompute: Sequence[Recompute]) -> tuple[str, ...]:
    """Modules whose forward reruns in backward, per layer: the whole block (full) or the attention
    module / Mamba-2 mixer (selective)."""
    core = selective_module(spec)
    out = []
    for path, level in zip(layers, recompute, strict=True):
        if level is Recompute.FULL:
            out.append(path)
        elif level is Recompute.SELECTIVE:
            out.append(f"{path}.{core}")
    return tuple(out)
