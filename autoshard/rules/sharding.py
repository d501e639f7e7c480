"""The sharding table: what tensor parallelism does to every module role, one table per model family.

This is the one place that says what TP shards (DESIGN.md, "One source of truth"). Everything else
derives from it.

The whole contract: docs/modules/rules.md (rules/sharding.py).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import Enum

from autoshard.ir import BlockKind
from autoshard.model_spec import Mixer, ModelSpec


class Strategy(str, Enum):
    """What TP does to a module (torchtitan's ParallelStyle names where one exists)."""

    COLWISE = "colwise"  # weight split along its output features (dim 0); its input is replicated
    ROWWISE = "rowwise"  # weight split along its input features (dim 1); partial outputs summed
    VOCAB = "vocab"  # embedding / LM head / loss split over the vocabulary (vocab-parallel)
    REGION = "region"  # a module whose input enters a TP region (identity fwd, all-reduce bwd) and
    #                     whose own ops run on this rank's heads / channels (attention, MLP, mixer)
    REPLICATE = "replicate"  # whole on every TP rank (RMSNorms, residual adds)
    EXPERT = "expert"  # routed experts: split over ep by expert, tokens dispatched by all-to-all
    #                    (runtime/expert_parallel.py); whole on every TP rank
    SEQUENCE = "sequence"  # under sequence parallelism (plan key sequence_parallel): a `sequence` role
    #                        runs on this rank's tp shard of the sequence, weights whole, gradients
    #                        summed over tp (Megatron-LM SP, Korthikanti et al. 2022 sec. 4.2.2)


@dataclass(frozen=True, slots=True)
class Piece:
    """One piece of a tensor along its split dimension: its length and the count TP splits.

    `length`, `count`: names of sizes of the model (see `SIZES`). `share`: tp may also be a
    multiple of the count (each rank keeps one of `count` parts)."""

    length: str
    count: str
    share: bool = False
    whole: bool = False
    kept: bool = False  # a `whole` piece kept whole at every tp (the plan chose "groups": "whole")


@dataclass(frozen=True, slots=True)
class Role:
    """A module role of one block: `path` inside the block (a LAYER role sits under every
    `<base>.layers.<i>`; EMBED / HEAD roles are full paths; "" is the model root, where the loss
    runs), its strategy, the pieces of its split tensors and the parameters they apply to,
    `fan`: the size of the parameters' other dimension (1 for a vector). `sequence`: a replicated
    role that sequence parallelism runs on a shard of the sequence (`Strategy.SEQUENCE`)."""

    path: str
    block: BlockKind
    strategy: Strategy
    pieces: tuple[Piece, ...] = ()
    params: tuple[str, ...] = ("weight",)
    fan: str = "one"
    sequence: bool = False
    grad_sum: bool = False  # replicated over tp, its gradient partial on each rank: summed over tp
    layers: tuple[int, ...] = ()  # a LAYER role of a hybrid's part: the layers holding it (empty: every layer)
    output_region: bool = False  # a row-parallel linear whose summed output enters a TP region again (identity
    #                              forward, gradient all-reduced backward): Mamba-1's x_proj, whose dt / B / C feed
    #                              every rank's channels
    gathered: bool = False  # HF's colwise_gather_output (a colwise linear entering tp itself, its output all-gathered
    #                         whole) / rowwise_split_input (a rowwise linear slicing its whole input): the module
    #                         around it runs whole on every rank (a full-width q/k norm, a fused qkv or gate_up split)
    transposed: bool = False  # a linear storing its weight [input, output] (HF's Conv1D: GPT-2's): tp splits its
    #                           weight on the other dimension (colwise: dim 1, rowwise: dim 0; a bias as ever)


_SIZES: dict[str, Callable[[ModelSpec], int]] = {
    "one": lambda s: 1,
    "vocab": lambda s: s.vocab,
    "hidden": lambda s: s.hidden,
    "heads": lambda s: s.heads,
    "kv_heads": lambda s: s.kv_heads,
    "ffn": lambda s: s.ffn,
    "q": lambda s: s.heads * s.attention_head_dim,  # LLaMA: heads x head_dim
    "kv": lambda s: s.kv_heads * s.attention_head_dim,
    "qkv": lambda s: (s.heads + 2 * s.kv_heads) * s.attention_head_dim,  # one fused q/k/v, by head (Persimmon)
    "gate_up": lambda s: 2 * s.ffn,  # one fused [gate; up] (Phi-3), split by column and gathered whole
    "inner": lambda s: s.intermediate,  # Mamba-2: expand x hidden = heads x head_dim
    "groups": lambda s: s.groups,
    "group_state": lambda s: s.groups * s.state,  # Mamba-2 B or C
    "conv": lambda s: s.conv,
    "experts": lambda s: s.experts,
    "shared_ffn": lambda s: s.shared_ffn,
}

_COUNT_NAMES = {"vocab": "vocabulary size", "heads": "number of heads", "kv_heads": "number of KV heads",
                "ffn": "MLP width", "groups": "number of groups (n_groups)", "q": "query width (heads x head_dim)",
                "kv": "key / value width (KV heads x head_dim)", "qkv": "fused q/k/v width",
                "gate_up": "fused gate/up width (2 x intermediate_size)",
                "k_heads": "number of key heads (linear_num_key_heads)"}


def size(spec: ModelSpec, name: str) -> int:
    """The model size called `name` (a key of the table's pieces and fans; "<i>.<size>": that size of the
    hybrid's part i, rules/layer_parts.py `parts_table`)."""
    if name in _SIZES:
        return _SIZES[name](spec)
    index, _, what = name.partition(".")
    return spec.parts[int(index)].size(what)


def _count_name(spec: ModelSpec, count: str) -> str:
    """A piece's count as the user reads it ("number of KV heads"; of a hybrid's part: "... of layers.*.mixer")."""
    if count in _SIZES:
        return _COUNT_NAMES.get(count, count)
    index, _, what = count.partition(".")
    return f"{_COUNT_NAMES.get(what, what)} of layers.*.{spec.parts[int(index)].path}"


_L, _E, _H = BlockKind.LAYER, BlockKind.EMBED, BlockKind.HEAD
_LINEAR = ("weight", "bias")

LLAMA = (
    Role("model.embed_tokens", _E, Strategy.VOCAB, (Piece("vocab", "vocab"),), fan="hidden"),
    Role("input_layernorm", _L, Strategy.REPLICATE, sequence=True),
    Role("self_attn", _L, Strategy.REGION, (Piece("heads", "heads"),), params=()),  # SDPA per head
    Role("self_attn.q_proj", _L, Strategy.COLWISE, (Piece("q", "heads"),), _LINEAR, fan="hidden"),
    Role("self_attn.k_proj", _L, Strategy.COLWISE, (Piece("kv", "kv_heads", share=True),), _LINEAR, fan="hidden"),
    Role("self_attn.v_proj", _L, Strategy.COLWISE, (Piece("kv", "kv_heads", share=True),), _LINEAR, fan="hidden"),
    Role("self_attn.o_proj", _L, Strategy.ROWWISE, (Piece("q", "heads"),), fan="hidden"),
    Role("post_attention_layernorm", _L, Strategy.REPLICATE, sequence=True),
    Role("mlp", _L, Strategy.REGION, (Piece("ffn", "ffn"),), params=()),  # act_fn(gate) * up
    Role("mlp.gate_proj", _L, Strategy.COLWISE, (Piece("ffn", "ffn"),), _LINEAR, fan="hidden"),
    Role("mlp.up_proj", _L, Strategy.COLWISE, (Piece("ffn", "ffn"),), _LINEAR, fan="hidden"),
    Role("mlp.down_proj", _L, Strategy.ROWWISE, (Piece("ffn", "ffn"),), fan="hidden"),
    Role("model.norm", _H, Strategy.REPLICATE, sequence=True),
    Role("lm_head", _H, Strategy.VOCAB, (Piece("vocab", "vocab"),), _LINEAR, fan="hidden"),  # Phi: a biased head
    Role("", _H, Strategy.VOCAB, (Piece("vocab", "vocab"),), params=()),  # vocab-parallel cross-entropy
)

# Mixture of experts: LLaMA's attention, norms, embedding and head, and the MoE block where the model's module
# tree has it (`spec.moe_paths`, `_moe_block`): router, routed experts and shared expert run whole on every tp
# rank, the experts split over ep (Megatron-Core's default without expert tensor parallelism). The block is no
# TP region, so no all-reduce; under sequence parallelism it routes this rank's shard of the tokens (its roles are
# `sequence` ones: their gradients summed over tp), as Megatron-Core runs MoE with tp.
_DENSE_MLP = ("mlp", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_LLAMA_NO_MLP = tuple(r for r in LLAMA if r.path not in _DENSE_MLP)

_INNER, _GN = Piece("inner", "heads"), Piece("group_state", "groups", whole=True)
MAMBA2 = (
    Role("backbone.embeddings", _E, Strategy.VOCAB, (Piece("vocab", "vocab"),), fan="hidden"),
    Role("norm", _L, Strategy.REPLICATE, sequence=True),
    Role("mixer", _L, Strategy.REGION, (Piece("heads", "heads"),), ("dt_bias", "A_log", "D")),
    Role("mixer.in_proj", _L, Strategy.COLWISE, (_INNER, _INNER, _GN, _GN, Piece("heads", "heads")), _LINEAR,
         fan="hidden"),
    Role("mixer.conv1d", _L, Strategy.COLWISE, (_INNER, _GN, _GN), _LINEAR, fan="conv"),
    Role("mixer.norm", _L, Strategy.COLWISE, (_INNER,)),  # gated RMSNorm over groups: by heads, synced if needed
    Role("mixer.out_proj", _L, Strategy.ROWWISE, (_INNER,), fan="hidden"),
    Role("backbone.norm_f", _H, Strategy.REPLICATE, sequence=True),
    Role("lm_head", _H, Strategy.VOCAB, (Piece("vocab", "vocab"),), _LINEAR, fan="hidden"),
    Role("", _H, Strategy.VOCAB, (Piece("vocab", "vocab"),), params=()),
)

# one table per sequence mixer of the layers (models/facts.py `mixer_of`): attention layers (any HF decoder
# calling the attention interface) and Mamba-2 SSD layers; the facts adjust it per model (`_base_table`)
TABLES: dict[Mixer, tuple[Role, ...]] = {Mixer.ATTENTION: LLAMA, Mixer.SSD: MAMBA2}


def table(spec: ModelSpec, strategies: tuple[tuple[str, str], ...] = ()) -> tuple[Role, ...]:
    """The model's table, with the plan's intra-op choices (`strategies`, see CHOICES) applied."""
    base = _base_table(spec)
    return _chosen(base, tuple(strategies)) if strategies else base


@functools.lru_cache(maxsize=256)
def _base_table(spec: ModelSpec) -> tuple[Role, ...]:
    """The family's table as the model's facts adjust it (models/facts.py): a MoE block at the model's own
    paths (`moe_paths`), head-indexed attention parameters (sinks) split with the heads, HF's
    modules whose gradient the placement propagation proves partial (`spec.grad_sum`, q/k norms:
    passes/capture/tp_proof.py) replicated with their gradient summed over tp, and
    an embedding whose forward is not a plain lookup (Gemma's scale) replicated: no vocab-parallel class
    swap may drop its forward (with it a tied LM head)."""
    if spec.parts:
        from autoshard.rules.layer_parts import parts_table  # a hybrid's table: the parts' rules

        base = parts_table(spec)
    else:
        dense = proposed_table(spec.tp_pairs) if spec.tp_pairs else _LLAMA_NO_MLP if spec.is_moe else TABLES[spec.mixer]
        base = dense + tuple(replace(r, sequence=True) for r in _moe_block(spec)) if spec.is_moe else dense
    out = []
    edges = dict(zip(_LLAMA_EDGES, spec.stack[1:])) if spec.stack and not spec.parts else {}
    for role in base:
        if role.block is not BlockKind.LAYER and role.path in edges:  # the model's own embedding, norm and head
            if not edges[role.path]:
                continue  # no final norm
            role = replace(role, path=edges[role.path])
        if role.block is BlockKind.LAYER and role.path in spec.transposed:
            role = replace(role, transposed=True)
        if role.path == "self_attn" and spec.head_params:
            role = replace(role, params=spec.head_params)
        if role.block is BlockKind.EMBED and role.strategy is Strategy.VOCAB and not spec.embedding_plain:
            role = replace(role, strategy=Strategy.REPLICATE)
        if role.block is BlockKind.HEAD and role.strategy is Strategy.VOCAB and not spec.embedding_plain and spec.tied:
            role = replace(role, strategy=Strategy.REPLICATE)
        out.append(role)
    # what the base holds beside the layers (ModelSpec.beside): a position table whose output sequence parallelism cuts
    # to the shard (replicated, as Gemma's embedding), a per-token module on the shard (its gradient summed over tp)
    out += [Role(path, _H if how == "after" else _E, Strategy.REPLICATE, sequence=how == "before")
            for path, how in spec.beside]
    if spec.beside:  # its forward reshapes by the input's length past the final norm (GPT-2's view): the sequence
        out = [replace(r, sequence=False) if r.block is _H else r for r in out]  # leaves the shard at that norm
    if spec.sequence_norms:  # the layer's own norms (Apertus' attention_layernorm, GPT-J's ln_1), not LLaMA's
        out = [r for r in out if not (r.block is BlockKind.LAYER and r.sequence and r.path not in moe_block_paths(spec))]
        out += [Role(path, _L, Strategy.REPLICATE, sequence=True) for path in spec.sequence_norms]
    if _gathers_attention(spec, out):
        # HF's gathered attention runs whole on every rank (`attention_whole`): its own ops (the attention itself,
        # full-width q/k norms) are this role's, on the whole sequence under sequence parallelism too
        out.append(Role(spec.attention_path, _L, Strategy.REPLICATE, params=()))
    kept = {r.path for r in out if one_kv_head(spec, r)}  # summed as shared pieces already (passes/rewrite.py)
    out += [Role(path, _L, Strategy.REPLICATE, grad_sum=True) for path in spec.grad_sum if path not in kept]
    return tuple(out)


def one_kv_head(spec: ModelSpec, role: Role) -> bool:
    """Whether `role` is a projection of multi-query attention's one KV head: whole on every tp rank, its gradient
    (this rank's query heads' part) summed over tp as any shared piece's."""
    return role.strategy is Strategy.COLWISE and bool(role.pieces) and all(
        p.share and size(spec, p.count) == 1 for p in role.pieces)


_LLAMA_EDGES = ("model.embed_tokens", "model.norm", "lm_head")  # LLaMA's paths of `ModelSpec.stack`'s last three


def moe_block_paths(spec: ModelSpec) -> frozenset[str]:
    """The paths inside a layer of a one-kind MoE model's block roles (`_moe_block`), empty otherwise: `sequence`
    roles that are not the layer's residual norms."""
    return frozenset(r.path for r in _moe_block(spec)) if spec.is_moe and not spec.parts else frozenset()


def _moe_block(spec: ModelSpec) -> tuple[Role, ...]:
    """A MoE block's roles at the model's own paths (`spec.moe_paths`): the block (routing, top-k, combine), the
    router (experts, hidden), the routed experts, the shared expert and its linears (shared_ffn x hidden each),
    and a one-output gate of the block ((1, hidden): Qwen2-MoE's shared_expert_gate)."""
    if len(spec.moe_paths) < 3:
        raise ValueError(f"{spec.name}: a mixture of experts ({spec.experts} experts) without its layout; give "
                         "ModelSpec.moe_paths = (router, experts, shared expert or '', ...) as paths inside a layer")
    router, experts, shared, *parts = spec.moe_paths
    return _moe_roles(router, experts, shared, tuple(
        Role(p, _L, Strategy.REPLICATE, fan="shared_ffn" if p.startswith(f"{shared}.") and shared else "one")
        for p in parts))


def _moe_roles(router: str, experts: str, shared: str, extra: tuple[Role, ...], *,
               params: tuple[str, ...] = ("gate_up_proj", "down_proj"), layers: tuple[int, ...] = ()) -> tuple[Role, ...]:
    """The roles of a MoE block at paths inside a layer (on `layers`: every layer when empty): the block, its
    router, the routed experts (parameters `params`), the shared expert, then `extra` (its parts)."""
    roles = (Role(experts.rpartition(".")[0], _L, Strategy.REPLICATE, params=(), layers=layers),
             Role(router, _L, Strategy.REPLICATE, fan="experts", layers=layers),
             Role(experts, _L, Strategy.EXPERT, params=params, layers=layers))
    if shared:
        roles += (Role(shared, _L, Strategy.REPLICATE, params=(), layers=layers),)
    return roles + extra


# the pieces of a layout proposed on the graph (passes/capture/tp_proposal.py), by piece length
_PROPOSED_PIECES = {"q": Piece("q", "heads"), "kv": Piece("kv", "kv_heads", share=True), "qkv": Piece("qkv", "heads"),
                    "ffn": Piece("ffn", "ffn"), "heads": Piece("heads", "heads")}
# a pair's strategy name -> (strategy, gathered): HF's gathered styles (models/facts.py GATHERED_STYLES) too
_PROPOSED = {"region": (Strategy.REGION, False), "colwise": (Strategy.COLWISE, False),
             "rowwise": (Strategy.ROWWISE, False), "colwise_gather_output": (Strategy.COLWISE, True),
             "rowwise_split_input": (Strategy.ROWWISE, True), "packed_colwise": (Strategy.COLWISE, False)}
# [gate; up], each split by the MLP width; [q; k; v] (GPT-2's c_attn), each split by the heads
_PACKED_PIECES = {"gate_up": (Piece("ffn", "ffn"), Piece("ffn", "ffn")),
                  "qkv": (Piece("q", "heads"), Piece("kv", "kv_heads", share=True), Piece("kv", "kv_heads", share=True))}


def proposed_table(pairs: tuple[tuple[str, str, str], ...]) -> tuple[Role, ...]:
    """The table of a layout read off the model (`ModelSpec.tp_pairs`: (path, strategy, piece length)): the
    Megatron pairs found on the graph of a model that declares no tp plan, or HF's declared plan where it
    gathers (colwise_gather_output / rowwise_split_input, passes/capture/tp_proposal.py `declared`), with LLaMA's embedding and head
    roles around them; the layer's norms are `ModelSpec.sequence_norms`' roles (`_base_table`). A gathered
    linear splits its whole width (any column split gathers back exactly): tp must divide it; a packed one
    (`packed_colwise`, a fused [gate; up] or [q; k; v] the graph proves cut so) each of its pieces."""
    layer = []
    for path, strategy, length in pairs:
        kind, gathered = _PROPOSED[strategy]
        params = () if kind is Strategy.REGION else ("weight",) if kind is Strategy.ROWWISE else _LINEAR
        pieces = (Piece(length, length),) if gathered else _PACKED_PIECES[length] if strategy == "packed_colwise" \
            else (_PROPOSED_PIECES[length],)
        layer.append(Role(path, _L, kind, pieces, params,
                          fan="one" if strategy == "region" else "hidden", gathered=gathered))
    return (*(r for r in LLAMA if r.block is _E), *layer, *(r for r in LLAMA if r.block is _H))


# -- intra-op choices: alternatives the runtime runs, decided per plan by the planner -----------------
# {choice: options}, the first option the default (Megatron's layout). A plan asks for the others with
# `Plan.strategies` ({"head": "replicate"}); `choice_violation` (called by rules/validity.py) checks it.
#   embedding  the EMBED block's VOCAB roles: vocab-parallel (rows split over tp, partial sums all-reduced
#              in forward) or replicated (the whole table on every rank, no collective; its gradient is the
#              full one on every rank, as for the RMSNorms)
#   head       the HEAD block's VOCAB roles, LM head and loss together: vocab-parallel logits and
#              cross-entropy (runtime/loss.py), or the whole LM head on every rank and the plain loss on
#              full logits (no collective; logits, their FLOPs and memory not divided by tp)
#   groups     Mamba-2's B/C pieces (`whole` pieces) when tp divides n_groups: split by group, or kept whole
#              on every rank as when tp does not divide them (the gated norm's sums synced over tp)
# A tied model (one weight for embedding and LM head) takes the same option for embedding and head.
CHOICES: dict[str, tuple[str, ...]] = {"embedding": ("vocab", "replicate"), "head": ("vocab", "replicate"),
                                       "groups": ("split", "whole")}
CHOICE_BLOCKS: dict[str, BlockKind] = {"embedding": BlockKind.EMBED, "head": BlockKind.HEAD, "groups": BlockKind.LAYER}


def block_strategies(strategies, kind: BlockKind) -> tuple[tuple[str, str], ...]:
    """The choices among `strategies` that change block `kind`'s roles (what its cost depends on)."""
    return tuple((k, o) for k, o in strategies if CHOICE_BLOCKS[k] is kind)


def choices(spec: ModelSpec, tp: int) -> dict[str, tuple[str, ...]]:
    """The intra-op choices `spec` has at `tp`: none at tp = 1; embedding and head where the table has
    VOCAB roles; groups where it has `whole` pieces and tp divides every one of their counts."""
    if tp == 1:
        return {}
    roles = table(spec)
    out = {}
    for name, kind in (("embedding", BlockKind.EMBED), ("head", BlockKind.HEAD)):
        if any(r.block is kind and r.strategy is Strategy.VOCAB for r in roles):
            out[name] = CHOICES[name]
    whole = [p for r in roles for p in r.pieces if p.whole]
    if whole and all(size(spec, p.count) % tp == 0 for p in whole):
        out["groups"] = CHOICES["groups"]
    return out


def choice_violation(spec: ModelSpec, tp: int, strategies, *, sequence_parallel: bool | tuple[bool, ...] = False,
                     chunks: int = 1) -> str | None:
    """Why the plan's `strategies` ({choice: option} pairs) cannot run `spec` at `tp` on `chunks`
    pipeline stages (model chunks), or None. A layer choice (`CHOICE_BLOCKS`: "groups") may name one
    option per chunk; the embedding and head live on one chunk each and take one option.
    `sequence_parallel`: the plan's, one bool or one per chunk. Under sequence parallelism the
    embedding (first chunk) and head (last chunk) stay vocab-parallel (the runtime's reduce-scatter /
    all-gather to and from the sequence shard sits in them)."""
    have = choices(spec, tp)
    given = dict(strategies)
    sp = sequence_parallel if isinstance(sequence_parallel, tuple) else (sequence_parallel,) * chunks
    if len(sp) != chunks:
        return (f"sequence_parallel lists {len(sp)} values, but the plan has {chunks} pipeline stages (pp x "
                f"virtual_stages); give one per stage, or one true/false for all")
    for name, option in given.items():
        if name not in have:
            known = ", ".join(f"{k} ({' / '.join(v)})" for k, v in have.items()) or "none (tp = 1)"
            return (f"strategies: {name!r} is not an intra-op choice of {spec.name} at tp={tp}; its choices: "
                    f"{known}; drop {name!r} from strategies")
        if isinstance(option, tuple):
            if CHOICE_BLOCKS[name] is not BlockKind.LAYER:
                return (f"strategies: {name} is decided once per plan (its block lives on one pipeline stage), "
                        f"got the list {list(option)}; give one of {', '.join(repr(o) for o in have[name])}")
            if len(option) != chunks:
                return (f"strategies: {name} lists {len(option)} options, but the plan has {chunks} pipeline stages "
                        f"(pp x virtual_stages); give one per stage, or one option for all")
        for one in (option if isinstance(option, tuple) else (option,)):
            if one not in have[name]:
                return (f"strategies: {name}={one!r} is not an option; use one of "
                        f"{', '.join(repr(o) for o in have[name])}")
    pick = {k: given.get(k, v[0]) for k, v in have.items()}
    for name, on in (("embedding", sp[0]), ("head", sp[-1])):
        if on and pick.get(name) == "replicate":
            where = "" if len(set(sp)) == 1 else f" on the {'first' if name == 'embedding' else 'last'} stage"
            return (f"strategies: {name}='replicate' with sequence_parallel{where}: the runtime enters and leaves "
                    f"the sequence shard in the vocab-parallel embedding and head; drop {name!r} from strategies "
                    f"or set sequence_parallel to false{where}")
    if spec.tied and "embedding" in pick and pick["embedding"] != pick.get("head"):
        return (f"strategies: {spec.name} ties its embedding and LM head (one weight), so embedding "
                f"({pick['embedding']}) and head ({pick['head']}) must take the same option")
    return None


def strategy_options(spec: ModelSpec, tp: int, *, sequence_parallel: bool = False
                     ) -> tuple[tuple[tuple[str, str], ...], ...]:
    """Every valid combination of the choices at `tp` (`choice_violation` and `tp_violation` pass), each as
    the sorted (choice, option) pairs that differ from the default (the default layout: ()). Empty when none
    is valid (a vocabulary tp does not divide, which only replicated embedding and head allow, under
    sequence parallelism, which needs them vocab-parallel)."""
    have = choices(spec, tp)
    out = []
    for combo in itertools.product(*have.values()):
        pairs = tuple(sorted((k, o) for (k, v), o in zip(have.items(), combo) if o != v[0]))
        if (choice_violation(spec, tp, pairs, sequence_parallel=sequence_parallel) is None
                and tp_violation(spec, tp, pairs) is None):
            out.append(pairs)
    return tuple(out)


def runnable_strategies(spec: ModelSpec, tp: int, *, sequence_parallel: bool = False
                        ) -> tuple[tuple[str, str], ...] | None:
    """The table's default layout at `tp` where it runs, else the first intra-op choices that do (a
    vocabulary tp does not divide: embedding and head replicated); None when none runs (that, under
    sequence parallelism). What `sweep` prices a mesh with and what an inference replica runs."""
    options = strategy_options(spec, tp, sequence_parallel=sequence_parallel)
    return options[0] if options else None


def canonical(spec: ModelSpec, tp: int, strategies) -> tuple[tuple[str, str], ...]:
    """`strategies` without the entries that name a default option (what `table` and the cost model key on)."""
    have = choices(spec, tp)
    return tuple(sorted((k, o) for k, o in dict(strategies).items() if k not in have or o != have[k][0]))


@functools.lru_cache(maxsize=256)
def _chosen(base: tuple[Role, ...], strategies: tuple[tuple[str, str], ...]) -> tuple[Role, ...]:
    pick = dict(strategies)
    replicated = {BlockKind.EMBED: pick.get("embedding") == "replicate", BlockKind.HEAD: pick.get("head") == "replicate"}
    out = []
    for role in base:
        if role.strategy is Strategy.VOCAB and replicated.get(role.block, False):
            role = replace(role, strategy=Strategy.REPLICATE)
        if pick.get("groups") == "whole" and any(p.whole for p in role.pieces):
            role = replace(role, pieces=tuple(replace(p, kept=True) if p.whole else p for p in role.pieces))
        out.append(role)
    return tuple(out)


@functools.lru_cache(maxsize=1024)
def groups_whole(spec: ModelSpec, tp: int, strategies=()) -> bool:
    """Whether some piece (Mamba-2's B/C) is kept whole on every rank at `tp` under `strategies`."""
    return any(any(whole_pieces(spec, r, tp)) for r in table(spec, strategies))


@functools.lru_cache(maxsize=256)
def base_path(spec: ModelSpec) -> str:
    """The base model's path, whose `layers` the LAYER roles sit under ("model", "backbone"): the table's
    own, read off its embedding role."""
    return next(r.path for r in table(spec) if r.block is BlockKind.EMBED).rpartition(".")[0]


def layers_path(spec: ModelSpec) -> str:
    """The path of the layer list the LAYER roles sit under: the model's own (`ModelSpec.stack`: GPT-J's
    transformer.h), else `<base>.layers`."""
    return spec.stack[0] if spec.stack else f"{base_path(spec)}.layers"


def layer_prefix(spec: ModelSpec, index: int) -> str:
    return f"{layers_path(spec)}.{index}"


# -- derived: how many parts, what tp may be ----------------------------------------------------------

def piece_parts(spec: ModelSpec, piece: Piece, tp: int) -> int | None:
    """Parts the piece is cut into at `tp` (tp, or the count when shared), None when tp cannot split it."""
    count = size(spec, piece.count)
    if count % tp == 0:
        return tp
    if piece.share and tp % count == 0:
        return count
    if piece.whole:
        return 1
    return None


def whole_pieces(spec: ModelSpec, role: Role, tp: int) -> tuple[bool, ...]:
    """Per piece of the role: kept whole on every rank at `tp` (a `whole` piece tp does not split)."""
    return tuple(p.whole and tp > 1 and (p.kept or size(spec, p.count) % tp != 0) for p in role.pieces)


def param_dim(role: Role, leaf: str) -> int:
    """The dimension tp splits parameter `leaf` of `role` on: a row-parallel weight its inputs (dim 1), any other its
    outputs (dim 0); a transposed linear's weight (HF's Conv1D, [input, output]) the other one."""
    dim = 1 if role.strategy is Strategy.ROWWISE else 0
    return 1 - dim if role.transposed and leaf == "weight" else dim


def role_strategy(role: Role, *, sequence_parallel: bool = False) -> Strategy:
    """What the role does in a plan: SEQUENCE for a replicated `sequence` role under sequence parallelism (routed
    experts stay EXPERT: split over ep, they route the shard's tokens)."""
    return Strategy.SEQUENCE if sequence_parallel and role.sequence and role.strategy is Strategy.REPLICATE \
        else role.strategy


def on_sequence_shard(spec: ModelSpec, kind: BlockKind, role: Role | None) -> bool:
    """Under sequence parallelism: does an op of block `kind` in `role` (None: the layer's own ops,
    the residual adds) run on a tp shard of the sequence? (the cost model divides it by tp)"""
    return (role is None and kind is BlockKind.LAYER) or (role is not None and role.sequence)


def role_parts(spec: ModelSpec, role: Role, tp: int) -> int:
    """Distinct slices of the role's split pieces at `tp` (1 for a replicated role; pieces kept
    whole, `whole_pieces`, do not count). Raises ValueError when tp cannot split it (`tp_violation`
    says why first) or its pieces disagree."""
    if role.strategy is Strategy.REPLICATE or not role.pieces or tp == 1:
        return 1
    kept = whole_pieces(spec, role, tp)
    parts = {piece_parts(spec, p, tp) for p, k in zip(role.pieces, kept) if not k}
    if None in parts or len(parts) > 1:
        raise ValueError(f"{role.path}: tp={tp} splits its pieces into {sorted(map(str, parts))} parts")
    return parts.pop() if parts else 1


def role_divisor(spec: ModelSpec, role: Role, tp: int) -> float:
    """What TP divides the role's work, activations and weights by: its parts, or, with pieces kept
    whole, the whole length over the length one rank holds."""
    parts = role_parts(spec, role, tp)
    kept = whole_pieces(spec, role, tp)
    if not any(kept):
        return float(parts)
    lengths = [size(spec, p.length) for p in role.pieces]
    held = sum(n if k else n / parts for n, k in zip(lengths, kept))
    return sum(lengths) / held


def attention_whole(spec: ModelSpec) -> bool:
    """Whether the attention module runs whole on every tp rank: HF's gathered q/k/v (`Role.gathered` linears in
    it, OLMo-2's, Phi-3's qkv_proj) give it every head."""
    return _gathers_attention(spec, table(spec))


def _gathers_attention(spec: ModelSpec, roles) -> bool:
    """Whether `roles` hold a gathered column-parallel linear inside the layer's attention (`attention_whole`)."""
    return any(r.block is BlockKind.LAYER and r.gathered and r.strategy is Strategy.COLWISE
               and r.path.startswith(f"{spec.attention_path}.") for r in roles)


def whole_modules(spec: ModelSpec) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The layer's modules that run whole on every tp rank (`attention_whole`: HF's gathered q / k / v; a hybrid's
    "attention_whole" parts), as (path in the layer, the layers holding it: () for every layer): under sequence
    parallelism each leaves the shard at its input (all-gathered, its gradient cut back to the shard) and runs as
    without it, its row-parallel output reduce-scattering back to the shard."""
    return tuple(dict.fromkeys((r.path.rpartition(".")[0], r.layers) for r in table(spec)
                               if r.block is BlockKind.LAYER and r.gathered and r.strategy is Strategy.COLWISE))


def kv_parts(spec: ModelSpec, tp: int) -> int:
    """Parts the KV heads are cut into at `tp` (min(tp, kv_heads) under GQA; tp where `tp_violation` passes; 1 where
    the attention runs whole, `attention_whole`), whatever the model calls its k / v projections. ValueError when tp
    cannot split them (`tp_violation` says why)."""
    if attention_whole(spec):
        return 1
    parts = piece_parts(spec, _PROPOSED_PIECES["kv"], tp)
    if parts is None:
        raise ValueError(f"tp={tp} cannot split the {spec.kv_heads} KV heads of {spec.name}")
    return parts


def tp_violation(spec: ModelSpec, tp: int, strategies=None) -> str | None:
    """The first count of `spec` that tp cannot split, worded for the user, or None. `strategies`: the
    plan's intra-op choices; a replicated role splits nothing, so with the embedding and head both
    replicated the vocabulary need not divide by tp (a user config's vocab of 32001). None: the most
    permissive choices (both replicated): the rule of the tp axis alone, which the search prunes by; the
    plan's own choices are then checked by `plan_violation` with them."""
    if tp == 1:
        return None
    return _tp_violation(spec, tp, _REPLICATED_VOCAB if strategies is None else _vocab_choices(strategies))


@functools.lru_cache(maxsize=4096)
def _tp_violation(spec: ModelSpec, tp: int, chosen: tuple[tuple[str, str], ...]) -> str | None:
    """`tp_violation` under the embedding / head options `chosen`, memoised (it reads the sharding table, ~40 us;
    the search asks for every mesh and micro-batch of every plan)."""
    # the vocabulary last: the counts no choice can replicate are the ones to name first
    for role in sorted(table(spec, chosen), key=lambda r: r.strategy is Strategy.VOCAB):
        if role.strategy is Strategy.REPLICATE:
            continue
        for piece in role.pieces:
            if piece_parts(spec, piece, tp) is None:
                count, what = size(spec, piece.count), _count_name(spec, piece.count)
                if piece.share:
                    return (f"tp ({tp}) and the {what} of {spec.name} ({count}) must divide one another "
                            f"(split, or each rank keeps one); use a tp that divides {count} or a multiple of it")
                if role.strategy is Strategy.VOCAB:
                    name = next(k for k, b in CHOICE_BLOCKS.items() if b is role.block)
                    return (f"tp ({tp}) does not divide the {what} of {spec.name} ({count}), which the "
                            f"vocab-parallel {name} splits; use a tp that divides {count}, or replicate the "
                            "embedding and LM head on every tp rank: strategies {\"embedding\": \"replicate\", "
                            "\"head\": \"replicate\"}")
                return f"tp ({tp}) does not divide the {what} of {spec.name} ({count}); use a tp that divides {count}"
    return None


_REPLICATED_VOCAB = (("embedding", "replicate"), ("head", "replicate"))


def _vocab_choices(strategies) -> tuple[tuple[str, str], ...]:
    """The embedding / head options among a plan's `strategies` (pairs or a mapping; others ignored)."""
    given = dict(strategies)
    return tuple((k, given[k]) for k in ("embedding", "head") if isinstance(given.get(k), str))


def role_of(spec: ModelSpec, kind: BlockKind, path: str, strategies=()) -> Role | None:
    """The innermost role of block `kind` that holds the module at `path` (a full module path of
    the captured graph, e.g. "model.layers.0.self_attn.q_proj"), or None (replicated)."""
    if kind is BlockKind.LAYER:
        parts = path.split(".")
        stack = layers_path(spec).split(".")
        n = len(stack) + 1
        if parts[:len(stack)] != stack or len(parts) < n:
            return None
        path = ".".join(parts[n:])
        if not path:
            return None  # the layer's own ops (residual adds)
        index = int(parts[n - 1]) if parts[n - 1].isdigit() else -1
    best = None
    for role in table(spec, strategies):
        if role.block is not kind or (role.layers and index not in role.layers):
            continue
        if role.path == path or (role.path and path.startswith(role.path + ".")):
            if best is None or len(role.path) > len(best.path):
                best = role
    return best


def role_at(spec: ModelSpec, path: str, strategies=()) -> Role | None:
    """The role of exactly the module at `path` (a full module path), or None."""
    for kind in (BlockKind.LAYER, BlockKind.EMBED, BlockKind.HEAD):
        role = role_of(spec, kind, path, strategies)
        if role is not None and _full(spec, role, path) == path:
            return role
    return None


def _full(spec: ModelSpec, role: Role, path: str) -> str:
    if role.block is not BlockKind.LAYER:
        return role.path
    n = len(layers_path(spec).split(".")) + 1
    return ".".join([*path.split(".")[:n], role.path])


# -- derived: the cost model's numbers ----------------------------------------------------------------

@functools.lru_cache(maxsize=1024)
def role_divisors(spec: ModelSpec, tp: int, strategies=(), kind: BlockKind | None = None) -> tuple[float, ...]:
    """`role_divisor` of every role of the table under `strategies`, in table order (memoised); with
    `kind`, of block `kind`'s roles only (the others 1.0: a block's cost reads its own roles, and the
    other blocks' choices in `strategies` need not suit `spec` at `tp`: the planner prices a block from
    any layout with its node-time stem, `block.node_stem`, perhaps one of another model)."""
    return tuple(role_divisor(spec, r, tp) if kind is None or r.block is kind else 1.0
                 for r in table(spec, strategies))


@functools.lru_cache(maxsize=1024)
def vocab_parallel(spec: ModelSpec, kind: BlockKind, strategies=()) -> bool:
    """Whether block `kind` has a vocab-parallel role under `strategies` (the embedding / LM head)."""
    return any(r.block is kind and r.strategy is Strategy.VOCAB for r in table(spec, strategies))


def node_divisor(spec: ModelSpec, kind: BlockKind, path: str, tp: int, strategies=()) -> float:
    """What TP divides the work and activations of an op at module `path` by (`role_divisor`)."""
    role = role_of(spec, kind, path, strategies)
    return 1.0 if role is None else role_divisor(spec, role, tp)


def role_numel(spec: ModelSpec, role: Role) -> int:
    """Elements of the role's split weight(s) (pieces x fan; for a vector, the pieces alone)."""
    if role.strategy is Strategy.EXPERT:
        return spec.expert_params  # every expert's gate, up and down
    length = sum(size(spec, p.length) for p in role.pieces) or size(spec, "hidden")
    return length * size(spec, role.fan) * max(1, len([p for p in role.params if p != "bias"]))


@functools.lru_cache(maxsize=1024)
def partial_grad_sizes(spec: ModelSpec, tp: int, strategies=()) -> tuple[tuple[float, float], ...]:
    """Elements of each gradient one layer all-reduces over tp for the slices several tp ranks hold (passes/rewrite.py
    `partial_grads`, runtime/tensor_parallel.py `partial_grad_reducer`): a role cut into fewer parts than tp (GQA's
    KV heads shared by tp / kv_heads ranks) sums a slot per part, its whole weight; one whose pieces are kept whole
    (Mamba-2's B / C groups) sums those pieces' rows. One (elements, share of the layers) per weight (`role_numel`'s;
    a bias, where the model has one, is a few hundred elements and no fact says whether it does: left out); a hybrid's
    part is on its own layers only (`Role.layers`). One KV head's projections are not here: they are
    `spec.grad_sum`'s (`one_kv_head`)."""
    out = []
    for role in table(spec, strategies) if tp > 1 else ():
        if role.block is not BlockKind.LAYER or not role.params or not role.pieces or one_kv_head(spec, role) or \
                role.strategy in (Strategy.REPLICATE, Strategy.EXPERT):
            continue
        kept, lengths = whole_pieces(spec, role, tp), [size(spec, p.length) for p in role.pieces]
        share = sum(n for n, k in zip(lengths, kept) if k) if any(kept) else (
            sum(lengths) if role_parts(spec, role, tp) < tp else 0)
        on = len(role.layers) / spec.layers if role.layers else 1.0
        out += [(float(share * size(spec, role.fan)), on) for p in role.params if share and p != "bias"]
    return tuple(out)


def params_per_rank(spec: ModelSpec, kind: BlockKind, total: float, tp: int, strategies=()) -> float:
    """See `_params_per_rank` (memoised: the planner asks for every layout)."""
    return _params_per_rank(spec, kind, total, tp, tuple(strategies))


@functools.lru_cache(maxsize=4096)
def _params_per_rank(spec: ModelSpec, kind: BlockKind, total: float, tp: int, strategies=()) -> float:
    """Parameters of one instance of block `kind` (`total` of them) that one TP rank holds: each
    role's weights over its parts (in table order, never more than `total`: a tied LM head's weight
    counts in the embedding); what no role names (biases) split by tp."""
    if tp == 1:
        return float(total)
    held, left = 0.0, float(total)
    for role in table(spec, strategies):
        if role.block is not kind or not role.params:
            continue
        n = min(float(role_numel(spec, role)), left)
        held += n / role_divisor(spec, role, tp)
        left -= n
    return held + left / tp


def selective_module(spec: ModelSpec, layer: int | None = None) -> str:
    """The layer submodule selective recompute checkpoints: the attention module / the Mamba-2
    mixer, whose forward holds one row-parallel all-reduce (rewrite and cost model both ask here): the
    layer's first REGION role, its sequence mixer ("" for a layer kind with none: a MoE layer of a hybrid).
    `layer`: of that layer of a hybrid, whose layers hold their mixers at several paths (Qwen3-Next's
    `linear_attn` and `self_attn`); None: of any layer (one kind, or a hybrid's kind view)."""
    return next((r.path for r in table(spec) if r.block is BlockKind.LAYER and r.strategy is Strategy.REGION
                 and (layer is None or not r.layers or layer in r.layers)), "")


# -- derived: the runtime's modules and the plan's placements ----------------------------------------

def modules(spec: ModelSpec, strategy: Strategy, kind: BlockKind = BlockKind.LAYER, strategies=()) -> tuple[str, ...]:
    """Full module paths of the roles of block `kind` with `strategy` (every layer's, for LAYER)."""
    return _paths(spec, kind, lambda r: r.strategy is strategy, strategies)


def gathered_modules(spec: ModelSpec, strategy: Strategy) -> tuple[str, ...]:
    """Full module paths of the gathered linears (`Role.gathered`) of `strategy`: COLWISE, those whose output is
    all-gathered; ROWWISE, those that slice their whole input."""
    return _paths(spec, BlockKind.LAYER, lambda r: r.gathered and r.strategy is strategy)


def output_region_modules(spec: ModelSpec) -> tuple[str, ...]:
    """Full module paths of the row-parallel linears whose summed output enters a TP region (`Role.output_region`)."""
    return _paths(spec, BlockKind.LAYER, lambda r: r.output_region)


def is_float8_role(role: Role | None) -> bool:
    """Whether FP8 training (plan precision "fp8", runtime/fp8.py) runs this role's GEMM in float8: a layer's
    projection (attention, MLP, Mamba-2 mixer, shared expert: a weight matrix one of whose sides is the
    hidden size or an MLP width), not the embedding or LM head (other blocks), norms (fan one), the router
    (fan experts; a (1, hidden) shared-expert gate: fan one), conv1d (fan conv) or the routed experts' grouped
    weights (`expert`), nor a transposed linear (HF's Conv1D, no nn.Linear for torchao to swap). The cost model
    prices these GEMMs at the float8 rate (passes/cost/cost.py)."""
    return (role is not None and role.block is BlockKind.LAYER and "weight" in role.params and not role.transposed
            and role.strategy in (Strategy.COLWISE, Strategy.ROWWISE, Strategy.REPLICATE)
            and role.fan in ("hidden", "shared_ffn"))


def float8_modules(spec: ModelSpec) -> tuple[str, ...]:
    """Full module paths of every layer's float8 linears (`is_float8_role`)."""
    return _paths(spec, BlockKind.LAYER, is_float8_role)


def sequence_modules(spec: ModelSpec) -> tuple[str, ...]:
    """Full module paths of the `sequence` roles (every layer's norms, then the final norm)."""
    return tuple(p for kind in BlockKind for p in _paths(spec, kind, lambda r: r.sequence))


def _paths(spec: ModelSpec, kind: BlockKind, keep: Callable[[Role], bool], strategies=()) -> tuple[str, ...]:
    roles = [r for r in table(spec, strategies) if r.block is kind and keep(r) and r.path]
    if kind is not BlockKind.LAYER:
        return tuple(r.path for r in roles)
    return tuple(f"{layer_prefix(spec, i)}.{r.path}" for i in range(spec.layers) for r in roles
                 if not r.layers or i in r.layers)


def block_placements(spec: ModelSpec, *, tp: int, sequence_parallel: bool | tuple[bool, ...] = False,
                     strategies=(), stages=()) -> tuple[tuple[str, str], ...]:
    """(module role, strategy) of every role at `tp`, as the plan and `autoshard show` name them:
    layer roles as "layers.*.<path>", the loss as "loss"; a split shared by several ranks (KV heads
    at tp > kv_heads) reads "colwise (2 parts)"; everything at tp = 1 is "replicate"; the norms
    under sequence parallelism "sequence". Stages that differ (`sequence_parallel` or a layer choice
    of `strategies` listed per stage, `stages` the plan's model chunks): the layer roles of each
    stage as "layers.<first>-<last>.<path>", the embedding's with the first stage's, the head's with
    the last's."""
    per_stage = isinstance(sequence_parallel, tuple) or any(isinstance(v, tuple) for _, v in strategies)
    if tp == 1:
        return (("all", Strategy.REPLICATE.value),)
    if not per_stage:
        return tuple(_role_placement(spec, r, tp, sequence_parallel) for r in table(spec, strategies))
    n = len(stages)
    sp = sequence_parallel if isinstance(sequence_parallel, tuple) else (sequence_parallel,) * n
    out = []
    for i, st in enumerate(stages):
        mine = tuple((k, v[i] if isinstance(v, tuple) else v) for k, v in strategies)
        for role in table(spec, mine):
            name, value = _role_placement(spec, role, tp, sp[i])
            if role.block is BlockKind.LAYER and st.end_layer > st.first_layer:
                out.append((f"layers.{st.first_layer}-{st.end_layer - 1}.{role.path}", value))
            elif (role.block is BlockKind.EMBED and i == 0) or (role.block is BlockKind.HEAD and i == n - 1):
                out.append((name, value))
    return tuple(out)


def _role_placement(spec: ModelSpec, role: Role, tp: int, sequence_parallel: bool) -> tuple[str, str]:
    held = ",".join(map(str, role.layers)) if role.layers else "*"
    name = f"layers.{held}.{role.path}" if role.block is BlockKind.LAYER else (role.path or "loss")
    value = role_strategy(role, sequence_parallel=sequence_parallel).value
    parts = role_parts(spec, role, tp)
    if role.strategy is not Strategy.REPLICATE and role.pieces and parts < tp:
        value = f"{value} ({parts} parts)"
    if any(whole_pieces(spec, role, tp)):
        value = f"{value} (groups whole)"
    if role.gathered:  # HF's colwise_gather_output / rowwise_split_input
        value = f"{value} ({'output gathered' if role.strategy is Strategy.COLWISE else 'input split'})"
    return name, value
