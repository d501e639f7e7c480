"""Decide what one rank runs: its slice of every parameter and where the collectives go.

Contract: `shard_program(plan, spec, params, tp_rank=r)` -> `ShardProgram`, a frozen table for
tensor-parallel rank `r` of the unmodified HF model whose parameters are `params`
({original name: shape}).

The whole contract: docs/modules/package.md (passes/rewrite.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from autoshard.errors import InvalidConfigError
from autoshard.ir import BlockKind, Placement, Plan, Recompute, Replicate, Shard, ShardProgram, even_stages
from autoshard.model_spec import Mixer, ModelSpec
from autoshard.rules import sharding
from autoshard.rules.sharding import Strategy


def shard_program(plan: Plan, spec: ModelSpec, params: Mapping[str, tuple[int, ...]], *,
                  tp_rank: int) -> ShardProgram:
    """The table for tp rank `tp_rank` (docs/modules/package.md); `params`: {name: full shape}.
    Every placement, region, row-parallel linear and vocab-parallel module comes from the family's
    sharding table (`rules/sharding.py`)."""
    tp = plan.mesh.tp
    why = sharding.tp_violation(spec, tp, plan.strategies)
    if why:
        raise InvalidConfigError(why)
    chunk_of = layer_chunks(plan, spec)  # each layer's model chunk: its stage's choices (checked by check_plan)
    chosen = [sharding.canonical(spec, tp, plan.stage_strategies(c)) for c in range(plan.chunks)]
    placements, partial = [], []
    for name in params:
        layer = _layer_index(spec, name)
        placement = (_fitted(_placement(spec, name, tp, tp_rank, chosen[chunk_of[layer] if layer is not None else 0]),
                             params[name]) if tp > 1 else Replicate())
        if isinstance(placement, Shard) and (placement.parts < tp or any(placement.whole)):
            partial.append(name)
        elif tp > 1 and _grad_summed(spec, name):  # replicated, its gradient partial on each rank (q/k norms)
            partial.append(name)
        placements.append((name, placement))
    layers = [sharding.layer_prefix(spec, i) for i in range(spec.layers)]
    sp = plan.stage_sequence_parallel if tp > 1 else (False,) * plan.chunks
    on = _sequence_paths(spec, layers, [sp[c] for c in chunk_of], first=sp[0], last=sp[-1])
    return ShardProgram(
        tp=tp, tp_rank=tp_rank, placements=tuple(placements), partial_grads=tuple(partial),
        checkpoint=_checkpointed(spec, layers, layer_recompute(plan, spec)),
        sequence_parallel=any(sp), sequence_paths=on, sequence_grads=_sequence_grads(spec, params, on),
        **_sequence_edges(spec, on), sequence_wholes=_sequence_wholes(spec, layers, [sp[c] for c in chunk_of]),
        buffers=_buffer_placements(spec, layers, tp, tp_rank, [chosen[c] for c in chunk_of]) if tp > 1 else (),
        **(_tp_modules(spec, layers, tp, tp_rank, [chosen[c] for c in chunk_of]) if tp > 1 else {}),
    )


def _buffer_placements(spec: ModelSpec, layers: list[str], tp: int, tp_rank: int, strategies: list) -> tuple:
    """Buffers indexed like a Mamba-2 mixer's in_proj output channels (Falcon-H1's mup_vector, (1, 1, channels)):
    sliced along their last dim as in_proj's rows are (`ModelSpec.parts`' buffers)."""
    out = []
    for part in spec.parts:
        for i in part.layers if part.buffers else ():
            mixer = f"{layers[i]}.{part.path}"
            rows = _placement(spec, f"{mixer}.in_proj.weight", tp, tp_rank, strategies[i])
            for name in part.buffers:
                out.append((f"{mixer}.{name}", replace(rows, dim=2) if isinstance(rows, Shard) else rows))
    return tuple(out)


def layer_chunks(plan: Plan, spec: ModelSpec) -> tuple[int, ...]:
    """The model chunk (pipeline stage, model order) that holds each layer: the plan's stages, or an
    even split of the layers over pp x virtual_stages chunks."""
    if plan.chunks == 1:
        return (0,) * spec.layers
    stages = plan.stages or even_stages(spec.layers, plan.chunks)
    return tuple(c for c, st in enumerate(stages) for _ in range(st.layers))


def _layer_index(spec: ModelSpec, name: str) -> int | None:
    """The layer index of parameter `name` ("model.layers.3.mlp..." -> 3), None outside the layers."""
    base = sharding.layers_path(spec) + "."
    if not name.startswith(base):
        return None
    return int(name[len(base):].split(".", 1)[0])


def _sequence_paths(spec: ModelSpec, layers: Sequence[str], on: Sequence[bool], *, first: bool,
                    last: bool) -> tuple[str, ...]:
    """The modules on the sequence shard under sequence parallelism: the `sequence` roles (norms), the
    regions (which gather their input) and row-parallel linears (which reduce-scatter their output) of
    every layer of a sequence-parallel stage; the embedding / final norm and LM head with the first /
    last stage's."""
    out = []
    for kind, keep in ((BlockKind.EMBED, first), (BlockKind.HEAD, last and not spec.beside)):  # (`_sequence_wholes`)
        if keep:
            out += [r.path for r in sharding.table(spec) if r.block is kind and r.path]
    inner = [r for r in sharding.table(spec) if r.block is BlockKind.LAYER and r.path
             and (r.sequence or r.strategy in (Strategy.REGION, Strategy.ROWWISE))]
    out += [f"{p}.{r.path}" for i, (p, keep) in enumerate(zip(layers, on)) if keep for r in inner
            if not r.layers or i in r.layers]  # a hybrid's part: on the layers holding it
    return tuple(out)


def _sequence_wholes(spec: ModelSpec, layers: Sequence[str], on: Sequence[bool]) -> tuple[str, ...]:
    """The modules of a sequence-parallel stage's layers that run whole on every tp rank (`sharding.whole_modules`:
    HF's gathered attention), which leave the shard at their input; and the final norm of a model whose forward
    reshapes by the input's length past it (`ModelSpec.beside`: GPT-2's), where the sequence leaves the shard."""
    wholes = sharding.whole_modules(spec)
    final = spec.stack[2] if spec.stack else "model.norm"  # the model's own final norm, else LLaMA's ("": none)
    norm = (final,) if spec.beside and on and on[-1] and final else ()
    return tuple(f"{p}.{w}" for i, (p, keep) in enumerate(zip(layers, on)) if keep for w, held in wholes
                 if not held or i in held) + norm


def _sequence_edges(spec: ModelSpec, on: Sequence[str]) -> dict:
    """Where a replicated embedding or LM head (an embedding that is no plain lookup of the vocabulary's rows:
    Gemma's scaled one, Mllama's with image rows; a head tied to it) meets the sequence shard: the embedding's
    output is cut to this rank's slice (its gradient gathered whole), the head's input gathered (its gradient cut
    back). The vocab-parallel ones do it themselves (reduce-scatter, all-gather)."""
    def replicated(kind: BlockKind) -> tuple[str, ...]:
        return tuple(r.path for r in sharding.table(spec) if r.block is kind and r.path in on
                     and r.strategy is Strategy.REPLICATE and not r.sequence)
    return dict(sequence_splits=replicated(BlockKind.EMBED), sequence_gathers=replicated(BlockKind.HEAD))


def _sequence_grads(spec: ModelSpec, params: Mapping[str, tuple[int, ...]], on: Sequence[str]) -> tuple[str, ...]:
    """Parameters used on the sequence shard under sequence parallelism (modules `on` it): the
    `sequence` roles' (norm weights, and everything in a MoE block, which routes the shard's tokens) and the
    row-parallel biases (added after the reduce-scatter)."""
    held = tuple(f"{m}." for m in set(sharding.sequence_modules(spec)) & set(on))
    rows = set(sharding.modules(spec, Strategy.ROWWISE)) & set(on)
    split = [name.rpartition(".") for name in params]
    return tuple(f"{m}.{a}" for m, _, a in split if f"{m}.".startswith(held) or (m in rows and a == "bias"))


def _grad_summed(spec: ModelSpec, name: str) -> bool:
    """Whether parameter `name` belongs to a replicated role whose gradient is summed over tp."""
    role = sharding.role_at(spec, name.rpartition(".")[0])
    return role is not None and role.grad_sum


def _placement(spec: ModelSpec, name: str, tp: int, tp_rank: int, strategies=()) -> Placement:
    """Parameter `name`'s placement: its module's role splits it (row-parallel: dim 1, else dim 0)
    into the role's parts, this rank keeping part tp_rank * parts // tp of every piece."""
    module, _, attr = name.rpartition(".")
    role = sharding.role_at(spec, module, strategies)
    if role is None or attr not in role.params or role.strategy in (Strategy.REPLICATE, Strategy.EXPERT):
        return Replicate()  # (experts: whole on every tp rank, split over ep by runtime/expert_parallel.py)
    parts = sharding.role_parts(spec, role, tp)
    whole = sharding.whole_pieces(spec, role, tp)
    return Shard(dim=sharding.param_dim(role, attr), index=tp_rank * parts // tp, parts=parts,
                 segments=tuple(sharding.size(spec, p.length) for p in role.pieces), whole=whole if any(whole) else ())


def _fitted(placement: Placement, shape: tuple[int, ...]) -> Placement:
    """A one-piece split of a vector held with singleton dims or of another length than the piece (a per-head A_log,
    (1, 1, heads, 1), split by heads beside a dt_bias of heads x head_dim: Kimi-Linear's forget gate) along its one
    dimension longer than 1, whole; any other placement as it is."""
    if not isinstance(placement, Shard) or len(placement.segments) != 1 or \
            shape[placement.dim:placement.dim + 1] == placement.segments:
        return placement
    long = [d for d, size in enumerate(shape) if size > 1]
    if len(long) != 1:
        return placement
    return replace(placement, dim=long[0], segments=(shape[long[0]],))


def _tp_modules(spec: ModelSpec, layers: list[str], tp: int, tp_rank: int, strategies: list) -> dict:
    # a replicated embedding / LM head (the plan's "embedding" / "head" choice) is no VOCAB module: it stays
    # the plain HF module, and the loss runs on full logits (ShardProgram.vocab_head is None)
    # `strategies`: each layer's (its stage's); the embedding / head choices are the same on every stage
    embed = sharding.modules(spec, Strategy.VOCAB, BlockKind.EMBED, strategies[0])
    head = sharding.modules(spec, Strategy.VOCAB, BlockKind.HEAD, strategies[0])
    common = dict(regions=sharding.modules(spec, Strategy.REGION), rowwise=sharding.modules(spec, Strategy.ROWWISE),
                  vocab_embed=embed[0] if embed else None, vocab_head=head[0] if head else None,
                  output_regions=sharding.output_region_modules(spec),
                  gather_outputs=sharding.gathered_modules(spec, Strategy.COLWISE),
                  split_inputs=sharding.gathered_modules(spec, Strategy.ROWWISE))
    if spec.parts:
        return dict(common, attrs=_part_attrs(spec, layers, tp, tp_rank, strategies))
    if spec.mixer is Mixer.ATTENTION:
        attention = sharding.selective_module(spec)  # the attention module (the layer's first tp region)
        if sharding.attention_whole(spec):  # it runs whole on every rank (gathered q/k/v): its head counts kept
            return dict(common, attrs=tuple(_transposed_attrs(spec, layers, tp, tp_rank)))
        attrs = [a for p in layers
                 for a in _attention_attrs(f"{p}.{attention}", spec.heads, spec.kv_heads, spec.attention_attrs, tp=tp,
                                           head_dim=spec.attention_head_dim)]
        return dict(common, attrs=(*attrs, *_transposed_attrs(spec, layers, tp, tp_rank)))
    attrs = []
    for p, chosen in zip(layers, strategies):
        split_groups = not sharding.groups_whole(spec, tp, chosen)  # else every rank keeps all groups (B, C
        # whole) and its heads' own: where tp does not divide n_groups, or the stage chose "groups": "whole"
        attrs += _ssd_attrs(f"{p}.mixer", spec.heads, spec.groups, spec.intermediate, spec.state, tp=tp,
                            tp_rank=tp_rank, split_groups=split_groups)
    return dict(common, attrs=tuple(attrs))


def _attention_attrs(attention: str, heads: int, kv_heads: int, names, *, tp: int, head_dim: int = 0) -> list:
    """The head counts of the attention module at `attention` on this rank, for those of its attributes
    `names` its forward views by (and the query width it cuts a fused q/k/v by, GPT-2's split_size); where
    tp > KV heads one KV head per rank serves heads / tp query heads."""
    local = {"num_heads": heads // tp, "num_attention_heads": heads // tp,
             "num_key_value_heads": max(1, kv_heads // tp), "num_kv_heads": max(1, kv_heads // tp),
             "split_size": heads // tp * head_dim}
    out = [(attention, a, local[a]) for a in names]
    if kv_heads < tp:
        out.append((attention, "num_key_value_groups", heads // tp))
    return out


def _transposed_attrs(spec: ModelSpec, layers: list[str], tp: int, tp_rank: int) -> list:
    """The output width each column-parallel transposed linear (HF's Conv1D, whose forward views its output by
    `nf`) holds on this rank."""
    out = []
    for role in sharding.table(spec):
        if role.transposed and role.strategy is Strategy.COLWISE and role.block is BlockKind.LAYER:
            shards = [(p, _placement(spec, f"{p}.{role.path}.weight", tp, tp_rank)) for p in layers]
            out += [(f"{p}.{role.path}", "nf", sum(s.local_sizes())) for p, s in shards if isinstance(s, Shard)]
    return out


def _ssd_attrs(mixer: str, heads: int, groups: int, inner: int, state: int, *, tp: int, tp_rank: int,
               split_groups: bool, norm_groups: bool = False) -> list:
    """The size attributes of the Mamba-2 mixer at `mixer` on this rank (its heads, groups, inner width, conv
    channels; with the groups whole, which group each local head reads and the norm's group width);
    `norm_groups`: its gated norm keeps its own group count (Falcon-H1's n_groups)."""
    local_heads, local_groups, local_inner = heads // tp, groups // tp if split_groups else groups, inner // tp
    conv_dim = local_inner + 2 * local_groups * state
    sizes = [("num_heads", local_heads), ("n_groups", local_groups), ("intermediate_size", local_inner),
             ("conv_dim", conv_dim)]
    if not split_groups:  # runtime/ssd.py: which group each local head reads, and the norm's group sync
        sizes += [("ssd_heads_per_group", heads // groups), ("ssd_norm_group_size", inner // groups),
                  ("ssd_head_offset", local_heads * tp_rank)]
    out = [(mixer, k, v) for k, v in sizes] + [(f"{mixer}.conv1d", k, conv_dim) for k in ("in_channels", "out_channels", "groups")]
    if norm_groups and split_groups:
        out.append((f"{mixer}.norm", "n_groups", local_groups))
    return out


def _part_attrs(spec: ModelSpec, layers: list[str], tp: int, tp_rank: int, strategies: list) -> tuple:
    """A hybrid's size attributes on this rank, per layer part (`ModelSpec.parts`): its attention's head counts
    (and one KV head serving heads / tp query heads where tp > KV heads), its Mamba-2 mixers' and gated DeltaNets'
    sizes."""
    out = []
    for part in spec.parts:
        for i in part.layers:
            path = f"{layers[i]}.{part.path}"
            if part.kind in ("attention", "mla"):
                heads = part.size("heads")
                kv = part.size("kv_heads") if part.kind == "attention" else heads
                out += _attention_attrs(path, heads, kv, part.attrs, tp=tp)
            elif part.kind == "mamba1":  # its forward reads its channels off the weights; its sizes kept in step
                local = part.size("inner") // tp
                out += [(path, "intermediate_size", local)]
                out += [(f"{path}.conv1d", k, local) for k in ("in_channels", "out_channels", "groups")]
            elif part.kind == "delta":  # its forward views by its head counts and widths: this rank's
                key, value = part.size("key") // tp, part.size("value") // tp
                local = {"num_k_heads": part.size("k_heads") // tp, "num_v_heads": part.size("v_heads") // tp,
                         "key_dim": key, "value_dim": value, "conv_dim": 2 * key + value}
                out += [(path, a, local[a]) for a in part.attrs]
                out += [(f"{path}.conv1d", k, 2 * key + value) for k in ("in_channels", "out_channels", "groups")]
            elif part.kind == "kda":  # its forward splits [q; k; v] by qkv_dim, its forget gate views by num_heads
                local = {"num_heads": part.size("heads") // tp, "qkv_dim": part.size("qkv") // tp,
                         "conv_dim": 3 * part.size("qkv") // tp}
                for attr in part.attrs:  # its own ("qkv_dim") and its forget gate's ("forget_gate.num_heads")
                    module, _, leaf = f"{path}.{attr}".rpartition(".")
                    out.append((module, leaf, local[leaf]))
                out += [(f"{path}.conv1d", k, local["conv_dim"]) for k in ("in_channels", "out_channels", "groups")]
            elif part.kind == "ssd":
                split = not sharding.groups_whole(spec, tp, strategies[i])
                out += _ssd_attrs(path, part.size("heads"), part.size("groups"), part.size("inner"), part.size("state"),
                                  tp=tp, tp_rank=tp_rank, split_groups=split, norm_groups="norm.n_groups" in part.attrs)
    return tuple(out)


def layer_recompute(plan: Plan, spec: ModelSpec) -> tuple[Recompute, ...]:
    """The recompute level of every layer: its stage's (`plan.stages`, as the planner chose them per
    stage), or `plan.recompute` for all layers when the plan names no stages."""
    if not plan.stages:
        return (plan.recompute,) * spec.layers
    out = [plan.recompute] * spec.layers
    for stage in plan.stages:
        out[stage.first_layer:stage.end_layer] = [stage.recompute] * stage.layers
    return tuple(out)


def _checkpointed(spec: ModelSpec, layers: Sequence[str], recompute: Sequence[Recompute]) -> tuple[str, ...]:
    """Modules whose forward reruns in backward, per layer: the whole block (full) or the attention
    module / Mamba-2 mixer (selective)."""
    out = []
    for i, (path, level) in enumerate(zip(layers, recompute, strict=True)):
        core = sharding.selective_module(spec, i)
        if level is Recompute.FULL:
            out.append(path)
        elif level is Recompute.SELECTIVE and core:
            out.append(f"{path}.{core}")
    return tuple(out)
