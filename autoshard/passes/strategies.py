"""Sharding rules: for each aten op, the placements of its inputs and outputs over one mesh axis.

Contract
  * A *placement* says how a tensor lives on the devices of one mesh axis (DTensor's terms):
    `Shard(dim)` (split along tensor dim `dim`), `Replicate()` (full copy on each device) or
    `Partial(reduce)` (each device holds a summand; the full value is their sum / average).
  * A *rule* is registered per aten op with `@sharding_rule("aten.mm.default", ...)` and maps an
    `OpInfo` (target, input/output shapes, non-tensor arguments) to the op's candidate
    `OpStrategy`s: one placement per tensor input and per tensor output, all computed locally
    (no communication inside the op). Contractions are written in einsum notation
    (`einsum_strategies("mk,kn->mn")`): sharding a kept index shards the output, sharding a
    contracted index leaves the output `Partial`.
  * Every rule's candidates include all-`Replicate`. An op with no rule gets only that
    candidate, and `graph_strategies` warns once per such op, naming it.
  * `transition(src, dst)` is the collective that turns one placement into another
    (Partial->Replicate: all-reduce, Shard->Replicate: all-gather, Partial->Shard:
    reduce-scatter, Shard(i)->Shard(j): all-to-all); the cost model prices it.
Terms: "dim" is a tensor dimension, "axis" a mesh axis; rules are per single mesh axis.
"""

from __future__ import annotations

import operator
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from autoshard.passes.collectives import Collective

__all__ = [
    "Collective", "OpInfo", "OpStrategy", "Partial", "Placement", "Replicate", "Shard",
    "einsum_strategies", "graph_strategies", "op_info", "registered_ops", "sharding_rule",
    "strategies_for", "transition",
]


@dataclass(frozen=True, slots=True)
class Shard:
    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class Replicate:
    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True)
class Partial:
    reduce: str = "sum"  # "sum" or "avg"

    def __str__(self) -> str:
        return "P" if self.reduce == "sum" else f"P({self.reduce})"


Placement = Shard | Replicate | Partial
R = Replicate()


@dataclass(frozen=True, slots=True, kw_only=True)
class OpStrategy:
    """One way to run an op locally: a placement per tensor input and per tensor output."""

    inputs: tuple[Placement | None, ...]  # None for a non-tensor argument
    outputs: tuple[Placement, ...]

    @property
    def replicated(self) -> bool:
        return all(p is None or isinstance(p, Replicate) for p in self.inputs + self.outputs)

    def __str__(self) -> str:
        ins = ",".join("-" if p is None else str(p) for p in self.inputs)
        return f"({ins})->({','.join(map(str, self.outputs))})"


@dataclass(frozen=True, slots=True, kw_only=True)
class OpInfo:
    """What a rule may look at: the op, the shapes of tensor inputs (None for other
    arguments), the shapes of tensor outputs, and the raw non-tensor arguments."""

    target: str
    in_shapes: tuple[tuple[int, ...] | None, ...]
    out_shapes: tuple[tuple[int, ...], ...]
    args: tuple[Any, ...] = ()

    def arg(self, i: int, default: Any = None) -> Any:
        return self.args[i] if i < len(self.args) else default


def transition(src: Placement, dst: Placement) -> Collective | None:
    """The collective that turns `src` into `dst` on one mesh axis (None: a local op or nothing)."""
    if src == dst or isinstance(dst, Partial) and isinstance(src, Replicate):
        return None  # equal, or keep the value on one rank and zeros elsewhere
    if isinstance(src, Replicate):
        return None  # Replicate -> Shard: each rank slices its part locally
    if isinstance(src, Partial):
        return Collective.ALL_REDUCE if isinstance(dst, Replicate) else Collective.REDUCE_SCATTER
    if isinstance(dst, Replicate):
        return Collective.ALL_GATHER
    if isinstance(dst, Shard):
        return Collective.ALL_TO_ALL
    return None  # Shard -> Partial: zero-pad locally


# -- registry --------------------------------------------------------------------------------
Rule = Callable[[OpInfo], Iterable[OpStrategy]]
_RULES: dict[str, Rule] = {}  # filled once by the decorators below; a table, never mutated later


def sharding_rule(*targets: Any) -> Callable[[Rule], Rule]:
    """Register `rule` for aten ops given as OpOverloads or as their names ("aten.mm.default")."""

    def register(rule: Rule) -> Rule:
        for target in targets:
            _RULES[str(target)] = rule
        return rule

    return register


def registered_ops() -> tuple[str, ...]:
    return tuple(sorted(_RULES))


def _replicated(info: OpInfo) -> OpStrategy:
    return OpStrategy(inputs=tuple(None if s is None else R for s in info.in_shapes),
                      outputs=tuple(R for _ in info.out_shapes))


def strategies_for(info: OpInfo) -> tuple[OpStrategy, ...]:
    """Candidates for one op, all-Replicate first; only that one if the op has no rule."""
    rule = _RULES.get(info.target)
    found = [] if rule is None else [s for s in rule(info) if not s.replicated]
    unique = dict.fromkeys([_replicated(info), *found])
    return tuple(unique)


# -- einsum contractions -----------------------------------------------------------------------
def einsum_strategies(equation: str, info: OpInfo | None = None) -> tuple[OpStrategy, ...]:
    """Strategies of a contraction "mk,kn->mn": shard one index at a time.

    A kept index (in the output) shards every operand that has it and the output;
    a contracted index shards the operands and leaves the output Partial(sum).
    Operands without the index stay replicated. `info` pads non-tensor arguments.
    """
    lhs, out = equation.replace(" ", "").split("->")
    operands = lhs.split(",")
    result = []
    for index in dict.fromkeys("".join(operands)):
        ins = tuple(Shard(op.index(index)) if index in op else R for op in operands)
        output = Shard(out.index(index)) if index in out else Partial()
        result.append(OpStrategy(inputs=ins, outputs=(output,)))
    if info is not None:
        result = [_pad_inputs(s, info) for s in result]
    return tuple(result)


def _pad_inputs(strategy: OpStrategy, info: OpInfo) -> OpStrategy:
    """Spread tensor-input placements over info's argument slots (None for non-tensors)."""
    tensor_places = iter(strategy.inputs)
    ins = tuple(None if s is None else next(tensor_places, R) for s in info.in_shapes)
    return OpStrategy(inputs=ins, outputs=strategy.outputs)


@sharding_rule("aten.mm.default")
def _mm(info: OpInfo):
    return einsum_strategies("mk,kn->mn", info)


@sharding_rule("aten.bmm.default")
def _bmm(info: OpInfo):
    return einsum_strategies("bmk,bkn->bmn", info)


@sharding_rule("aten.addmm.default")
def _addmm(info: OpInfo):
    # bias (n) broadcast over m: shard it with n, replicate otherwise; Partial output keeps it
    # on one rank only (the Replicate -> Partial transition), which is local.
    result = []
    for s in einsum_strategies("mk,kn->mn"):
        out = s.outputs[0]
        bias = Shard(0) if out == Shard(1) else Partial() if isinstance(out, Partial) else R
        result.append(_pad_inputs(OpStrategy(inputs=(bias, *s.inputs), outputs=s.outputs), info))
    return result


# -- dim-wise rules (pointwise, reductions, views) -----------------------------------------------
def _rank(shape: tuple[int, ...] | None) -> int:
    return -1 if shape is None else len(shape)


def _broadcast_dim(out_shape: tuple[int, ...], in_shape: tuple[int, ...] | None, d: int) -> Placement | None:
    """Input placement matching output Shard(d) under right-aligned broadcasting."""
    if in_shape is None:
        return None
    j = d - (len(out_shape) - len(in_shape))
    return Shard(j) if 0 <= j and in_shape[j] == out_shape[d] and in_shape[j] != 1 else R


def _pointwise(info: OpInfo, *, skip: Iterable[int] = (), linear: str = "") -> list[OpStrategy]:
    """Shard any output dim not in `skip` (negative dims allowed) in every input that has it.

    linear="unary": Partial in -> Partial out; "add": all Partial; "mul": one Partial, rest R.
    """
    out = info.out_shapes[0]
    n_out = len(info.out_shapes)
    skipped = {d % len(out) for d in skip} if out else set()
    result = []
    for d in range(len(out)):
        if d in skipped or out[d] == 1:
            continue
        ins = tuple(_broadcast_dim(out, s, d) for s in info.in_shapes)
        result.append(OpStrategy(inputs=ins, outputs=(Shard(d),) * n_out))
    tensors = [i for i, s in enumerate(info.in_shapes) if s is not None and len(s) > 0]
    if linear in ("unary", "add") and tensors:
        ins = tuple(Partial() if i in tensors else (None if s is None else R) for i, s in enumerate(info.in_shapes))
        result.append(OpStrategy(inputs=ins, outputs=(Partial(),) * n_out))
    if linear == "mul":
        for k in tensors:
            ins = tuple(Partial() if i == k else (None if s is None else R) for i, s in enumerate(info.in_shapes))
            result.append(OpStrategy(inputs=ins, outputs=(Partial(),) * n_out))
    return result


_LINEAR_UNARY = ("aten.neg.default", "aten.clone.default", "aten._to_copy.default", "aten.alias.default",
                 "aten.detach.default", "aten.lift_fresh_copy.default", "aten.mul.Scalar", "aten.div.Scalar")
_NONLINEAR = ("aten.pow.Tensor_Scalar", "aten.rsqrt.default", "aten.silu.default", "aten.silu_backward.default",
              "aten.sigmoid.default", "aten.exp.default", "aten.cos.default", "aten.sin.default",
              "aten.softplus.default", "aten.softplus_backward.default", "aten.clamp.default",
              "aten.where.self", "aten.masked_fill.Scalar", "aten.ge.Scalar", "aten.le.Scalar",
              "aten.gt.Scalar", "aten.lt.Scalar", "aten.eq.Scalar", "aten.bitwise_not.default",
              "aten.logical_and_.default", "aten.logical_and.default", "aten.ones_like.default",
              "aten.zeros_like.default", "aten.full_like.default", "aten.tanh.default", "aten.gelu.default",
              "aten.add.Scalar", "aten.sub.Scalar", "aten.reciprocal.default", "aten.sqrt.default",
              "aten.log.default", "aten.abs.default", "aten.maximum.default", "aten.minimum.default")


@sharding_rule(*_LINEAR_UNARY)
def _linear_unary(info: OpInfo):
    return _pointwise(info, linear="unary")


@sharding_rule("aten.add.Tensor", "aten.sub.Tensor")
def _add(info: OpInfo):
    return _pointwise(info, linear="add")


@sharding_rule("aten.mul.Tensor", "aten.div.Tensor")
def _mul(info: OpInfo):
    return _pointwise(info, linear="mul" if info.target == "aten.mul.Tensor" else "")


@sharding_rule(*_NONLINEAR)
def _nonlinear(info: OpInfo):
    return _pointwise(info)


@sharding_rule("aten.tril.default", "aten.triu.default")
def _triangle(info: OpInfo):
    return _pointwise(info, skip=(-1, -2))


@sharding_rule("aten.cumsum.default", "aten._log_softmax.default", "aten._softmax.default", "aten.slice.Tensor",
               "aten.slice_backward.default", "aten._log_softmax_backward_data.default",
               "aten._softmax_backward_data.default")
def _along_dim(info: OpInfo):
    """Ops that mix values along one dim (the first int argument): shard the others."""
    dim = next(a for a in info.args if isinstance(a, int) and not isinstance(a, bool))
    if info.target == "aten.slice_backward.default":
        dim = info.arg(2)
    return _pointwise(info, skip=(dim,), linear="unary" if "slice" in info.target else "")


@sharding_rule("aten.flip.default", "aten.constant_pad_nd.default")
def _flip_pad(info: OpInfo):
    rank = len(info.out_shapes[0])
    if info.target == "aten.flip.default":
        skip = tuple(info.arg(1))
    else:  # pad is (last_lo, last_hi, second_last_lo, ...)
        pads = list(info.arg(1))
        skip = tuple(rank - 1 - i // 2 for i in range(0, len(pads), 2) if pads[i] or pads[i + 1])
    return _pointwise(info, skip=skip)


@sharding_rule("aten.cat.default")
def _cat(info: OpInfo):
    return _pointwise(info, skip=(info.arg(1, 0),), linear="add")


@sharding_rule("aten.split_with_sizes.default", "aten.split.Tensor")
def _split(info: OpInfo):
    return _pointwise(info, skip=(info.arg(2, 0),), linear="unary")


@sharding_rule("aten.mean.dim", "aten.sum.dim_IntList", "aten.sum.default", "aten.mean.default",
               "aten.amax.default")
def _reduce(info: OpInfo):
    shape = info.in_shapes[0]
    dims = info.arg(1) if len(info.args) > 1 and info.args[1] is not None else list(range(len(shape)))
    dims = {d % len(shape) for d in ([dims] if isinstance(dims, int) else dims)} if shape else set()
    keepdim = bool(info.arg(2, False))
    kind = "avg" if "mean" in info.target else "sum"
    result = []
    for d in range(len(shape)):
        if shape[d] == 1:
            continue
        if d in dims:
            if "amax" not in info.target:
                result.append(OpStrategy(inputs=(Shard(d),) + (None,) * (len(info.in_shapes) - 1),
                                         outputs=(Partial(kind),)))
            continue
        out_dim = d if keepdim else d - sum(1 for r in dims if r < d)
        result.append(OpStrategy(inputs=(Shard(d),) + (None,) * (len(info.in_shapes) - 1), outputs=(Shard(out_dim),)))
    if "amax" not in info.target:
        result.append(OpStrategy(inputs=(Partial(),) + (None,) * (len(info.in_shapes) - 1), outputs=(Partial(),)))
    return result


def _remap(info: OpInfo, mapping: dict[int, int], *, linear: bool = True) -> list[OpStrategy]:
    """Single-input ops that move dims: input Shard(i) -> output Shard(mapping[i])."""
    shape = info.in_shapes[0]
    pad = (None,) * (len(info.in_shapes) - 1)
    result = [OpStrategy(inputs=(Shard(i),) + pad, outputs=(Shard(o),))
              for i, o in mapping.items() if shape[i] != 1]
    if linear:
        result.append(OpStrategy(inputs=(Partial(),) + pad, outputs=(Partial(),)))
    return result


def view_dim_map(in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> dict[int, int]:
    """Input dims whose sharding survives a reshape, and where they land.

    Dims are matched in groups of equal product; within a group only the outermost input dim
    can stay sharded and it shards the outermost output dim (a contiguous block per rank).
    """
    mapping: dict[int, int] = {}
    i = o = 0
    while i < len(in_shape) and o < len(out_shape):
        while i < len(in_shape) and in_shape[i] == 1:
            i += 1
        while o < len(out_shape) and out_shape[o] == 1:
            o += 1
        if i == len(in_shape) or o == len(out_shape):
            break
        first_in, first_out = i, o
        p_in, p_out = in_shape[i], out_shape[o]
        i, o = i + 1, o + 1
        while p_in != p_out:
            if p_in < p_out:
                p_in *= in_shape[i]
                i += 1
            else:
                p_out *= out_shape[o]
                o += 1
        mapping[first_in] = first_out
    return mapping


@sharding_rule("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default")
def _view(info: OpInfo):
    return _remap(info, view_dim_map(info.in_shapes[0], info.out_shapes[0]))


@sharding_rule("aten.expand.default")
def _expand(info: OpInfo):
    shape, out = info.in_shapes[0], info.out_shapes[0]
    lead = len(out) - len(shape)
    return _remap(info, {i: i + lead for i in range(len(shape)) if shape[i] == out[i + lead]})


@sharding_rule("aten.permute.default", "aten.transpose.int", "aten.t.default")
def _permute(info: OpInfo):
    rank = len(info.in_shapes[0])
    if info.target == "aten.permute.default":
        order = [d % rank for d in info.arg(1)]
    else:
        order = list(range(rank))
        a, b = (info.arg(1) % rank, info.arg(2) % rank) if rank > 1 and len(info.args) > 2 else (0, rank - 1)
        order[a], order[b] = order[b], order[a]
    return _remap(info, {src: dst for dst, src in enumerate(order)})


@sharding_rule("aten.unsqueeze.default", "aten.squeeze.dim", "aten.select.int")
def _insert_remove(info: OpInfo):
    rank = len(info.in_shapes[0])
    if info.target == "aten.unsqueeze.default":
        at = info.arg(1) % (rank + 1)
        return _remap(info, {i: i + (i >= at) for i in range(rank)})
    at = info.arg(1) % rank
    return _remap(info, {i: i - (i > at) for i in range(rank) if i != at})


@sharding_rule("aten.select_backward.default")
def _select_backward(info: OpInfo):
    rank = len(info.out_shapes[0])
    at = info.arg(2) % rank
    return _remap(info, {i: i + (i >= at) for i in range(rank - 1)})


@sharding_rule("<built-in function getitem>")
def _getitem(info: OpInfo):
    shape = info.in_shapes[0]
    return [OpStrategy(inputs=(p, None), outputs=(p,)) for p in
            [Shard(d) for d in range(len(shape)) if shape[d] != 1] + [Partial()]]


@sharding_rule("aten.arange.default", "aten.arange.start", "aten.zeros.default", "aten.ones.default",
               "aten.scalar_tensor.default", "aten.full.default", "aten.empty.memory_format")
def _factory(info: OpInfo):
    return []  # created in full on every rank: replicated is their only placement


# -- model ops: embedding, attention, depthwise conv, loss ---------------------------------------
@sharding_rule("aten.embedding.default")
def _embedding(info: OpInfo):
    weight, idx = info.in_shapes[0], info.in_shapes[1]
    out_rank = len(info.out_shapes[0])
    pad = (None,) * (len(info.in_shapes) - 2)
    result = [
        OpStrategy(inputs=(Shard(1), R) + pad, outputs=(Shard(out_rank - 1),)),  # hidden-sharded table
        OpStrategy(inputs=(Shard(0), R) + pad, outputs=(Partial(),)),  # vocab-parallel: masked lookup
    ]
    result += [OpStrategy(inputs=(R, Shard(d)) + pad, outputs=(Shard(d),)) for d in range(len(idx)) if idx[d] != 1]
    return result if len(weight) == 2 else []


@sharding_rule("aten.embedding_dense_backward.default")
def _embedding_backward(info: OpInfo):
    grad, idx = info.in_shapes[0], info.in_shapes[1]
    pad = (None,) * (len(info.in_shapes) - 2)
    result = [
        OpStrategy(inputs=(Shard(len(grad) - 1), R) + pad, outputs=(Shard(1),)),
        OpStrategy(inputs=(R, R) + pad, outputs=(Shard(0),)),  # vocab-parallel: accumulate own rows
    ]
    result += [OpStrategy(inputs=(Shard(d), Shard(d)) + pad, outputs=(Partial(),))
               for d in range(len(idx)) if idx[d] != 1]
    return result


_ATTENTION = ("aten._scaled_dot_product_flash_attention_for_cpu.default",
              "aten._scaled_dot_product_flash_attention.default",
              "aten._scaled_dot_product_efficient_attention.default",
              "aten._scaled_dot_product_cudnn_attention.default")


@sharding_rule(*_ATTENTION, *(t.replace(".default", "_backward.default") for t in _ATTENTION))
def _attention(info: OpInfo):
    """(B, H, S, E) operands: shard the batch (0) or the heads (1) of every 4-d tensor and of
    every output with those dims (logsumexp is (B, H, S)); scalars (seeds) stay replicated."""
    result = []
    for d in (0, 1):
        if any(s is not None and len(s) == 4 and s[d] == 1 for s in info.in_shapes):
            continue
        ins = tuple(None if s is None else Shard(d) if len(s) >= 3 else R for s in info.in_shapes)
        outs = tuple(None if s is None else Shard(d) if len(s) >= 2 else R for s in info.out_shapes)
        result.append(OpStrategy(inputs=ins, outputs=outs))
    return result


def _depthwise(info: OpInfo, weight: tuple[int, ...] | None) -> bool:
    groups = info.arg(9 if "backward" in info.target else 8, 1)
    return weight is not None and groups > 1 and weight[1] == 1


@sharding_rule("aten.convolution.default")
def _convolution(info: OpInfo):
    """x (B, C, L), w (C_out, C_in/groups, K): shard the batch, or the channels when depthwise."""
    x, w, bias = info.in_shapes[0], info.in_shapes[1], info.in_shapes[2]
    pad = (None,) * (len(info.in_shapes) - 3)
    result = [OpStrategy(inputs=(Shard(0), R, None if bias is None else R) + pad, outputs=(Shard(0),))]
    if _depthwise(info, w):
        result.append(OpStrategy(inputs=(Shard(1), Shard(0), None if bias is None else Shard(0)) + pad,
                                 outputs=(Shard(1),)))
    return result if x and x[0] != 1 or len(result) > 1 else []


@sharding_rule("aten.convolution_backward.default")
def _convolution_backward(info: OpInfo):
    """(grad_out, input, weight) -> (grad_input, grad_weight, grad_bias)."""
    pad = (None,) * (len(info.in_shapes) - 3)
    n_out = len(info.out_shapes)

    def outs(*places):
        return tuple(None if s is None else p for s, p in zip(info.out_shapes, places[:n_out]))

    result = [OpStrategy(inputs=(Shard(0), Shard(0), R) + pad, outputs=outs(Shard(0), Partial(), Partial()))]
    if _depthwise(info, info.in_shapes[2]):
        result.append(OpStrategy(inputs=(Shard(1), Shard(1), Shard(0)) + pad,
                                 outputs=outs(Shard(1), Shard(0), Shard(0))))
    return result


@sharding_rule("aten.nll_loss_forward.default")
def _nll_loss(info: OpInfo):
    """(logits (N, C), target (N)) -> (loss, total_weight): shard the tokens; the loss is a
    partial sum (reduction=sum) or partial mean over equal shards (reduction=mean)."""
    logits = info.in_shapes[0]
    if logits is None or len(logits) != 2:
        return []
    kind = "avg" if info.arg(3, 1) == 1 else "sum"
    ins = (Shard(0), Shard(0)) + tuple(None if s is None else R for s in info.in_shapes[2:])
    return [OpStrategy(inputs=ins, outputs=(Partial(kind), Partial()))]


@sharding_rule("aten.nll_loss_backward.default")
def _nll_loss_backward(info: OpInfo):
    """(grad_out, logits, target, weight, reduction, ignore_index, total_weight) -> grad (N, C)."""
    logits = info.in_shapes[1]
    if logits is None or len(logits) != 2:
        return []
    ins = (R, Shard(0), Shard(0)) + tuple(None if s is None else R for s in info.in_shapes[3:])
    return [OpStrategy(inputs=ins, outputs=(Shard(0),))]


# -- applying the rules to a captured graph ----------------------------------------------------
def _shape(value: Any) -> tuple[int, ...] | None:
    shape = getattr(value, "shape", None)
    return None if shape is None else tuple(shape)


def op_info(node) -> OpInfo:
    """The `OpInfo` of an fx call_function node whose tensors carry `meta["val"]` (fake tensors).

    Tensor-list arguments (cat's inputs) count as one tensor input each; getitem sees the
    selected element of its source's output tuple.
    """
    target = str(node.target)
    in_shapes: list[tuple[int, ...] | None] = []
    for a in node.args:
        items = a if isinstance(a, (list, tuple)) and a and all(hasattr(x, "meta") for x in a) else [a]
        for x in items:
            val = x.meta.get("val") if hasattr(x, "meta") else None
            if node.target is operator.getitem and isinstance(val, (list, tuple)):
                val = val[node.args[1]]
            in_shapes.append(_shape(val))
    val = node.meta.get("val")
    outs = val if isinstance(val, (list, tuple)) else (val,)
    return OpInfo(target=target, in_shapes=tuple(in_shapes), out_shapes=tuple(_shape(v) for v in outs),
                  args=_plain_args(node))


def _plain_args(node) -> tuple[Any, ...]:
    """Positional arguments with fx nodes replaced by None (rules read ints and lists only)."""
    def plain(a):
        if hasattr(a, "meta"):
            return None
        if isinstance(a, (list, tuple)):
            return type(a)(plain(x) for x in a)
        return a

    return tuple(plain(a) for a in node.args)


def graph_strategies(gm) -> dict[str, tuple[OpStrategy, ...]]:
    """Candidates for every call_function node of `gm`, by node name.

    Ops without a rule run replicated; each such op is named in ONE warning per call.
    """
    result: dict[str, tuple[OpStrategy, ...]] = {}
    missing: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        info = op_info(node)
        if info.target not in _RULES:
            missing[info.target] = missing.get(info.target, 0) + 1
        result[node.name] = strategies_for(info)
    for target, count in missing.items():
        warnings.warn(f"{target} has no sharding rule ({count} node(s)); they run replicated. "
                      f"Register one with @sharding_rule({target!r}) in autoshard/passes/strategies.py",
                      stacklevel=2)
    return result


# -- op-group placements (what the cost model prices and the runtime emits) -------------------
# name -> (weight placement, input placement, output placement) on the tp axis; nn.Linear
# weights are (out_features, in_features), so "colwise" is the mm rule's kept index n sharded
# (weight Shard(0)) and "rowwise" its contracted index k (output Partial -> all-reduce).
GROUP_PLACEMENTS: dict[str, tuple[Placement | None, Placement, Placement]] = {
    "replicate": (R, R, R),
    "colwise": (Shard(0), R, Shard(-1)),
    "rowwise": (Shard(1), Shard(-1), Partial()),
    "heads": (None, Shard(1), Shard(1)),  # attention core / SSD scan over (B, H, S, E)
    "channels": (Shard(0), Shard(1), Shard(1)),  # depthwise conv1d over (B, C, L)
    "vocab": (Shard(0), R, Partial()),  # vocab-parallel embedding (masked lookup)
    "vocab_logits": (Shard(0), R, Shard(-1)),  # LM head: logits sharded over the vocabulary
}
