"""Placement rules per aten op: how a tensor-parallel placement passes through one op of the traced graph.

Contract: `RULES[name](node, ins, ctx) -> placement` (a tuple of placements for an op with several
outputs). `name` is the op's overload packet name ("mm", "view", ...); `ins` mirrors `node.args`
with every tensor argument replaced by its placement (passes/capture/placements.py: `Replicate`,
`Shard(dim)`, `Partial`) and every other argument kept; `ctx` is the node's `Context` (its phase, the
shapes of its inputs and output, the sizes the rewrite sets per rank). A rule that cannot place the op
raises `Unprovable(kind, detail)`; passes/capture/propagate.py records it as a named finding. An op with
no rule taking a split or partial tensor is a finding too ("no placement rule"), never silently
replicated. Shapes are the traced (whole) shapes; a rule is independent of the tp degree.

The whole contract: docs/modules/capture.md (passes/capture/placement_rules.py).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

from autoshard.passes.capture.placements import (P, R, X, Z, ZERO_FILLS, Context, Placement, Shard, Unprovable,
                                                  is_placement as _is_pl)


def _tensors(ins, shapes, names=()):
    """(placement, shape, name) of every tensor argument, lists flattened."""
    out = []
    for i, (a, s) in enumerate(zip(ins, shapes)):
        n = names[i] if i < len(names) else None
        if isinstance(a, (list, tuple)) and isinstance(s, (list, tuple)):
            out += [(x, y, m) for x, y, m in zip(a, s, n or [None] * len(a)) if _is_pl(x)]
        elif _is_pl(a):
            out.append((a, s, n))
    return out


def _dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _named(name) -> str:
    return f" ({name})" if name else ""


# -- elementwise ----------------------------------------------------------------------------------

def pointwise(node, ins, ctx, *, linear: tuple[int, ...] = ()) -> Placement:
    """Elementwise with broadcasting. `linear`: argument positions the op is linear in (a Partial there
    stays Partial when every other tensor operand is replicated, e.g. add, mul by a replicated factor)."""
    ts = _tensors(ins, ctx.shapes, ctx.names)
    if any(p is X for p, _, _ in ts):
        return X
    out_nd = len(ctx.out) if isinstance(ctx.out, tuple) else 0
    partial = [i for i, (p, _, _) in enumerate(ts) if p is P]
    if partial:
        lin = _linear_ok(ins, ctx, linear)
        if not lin or any(p is not R and p is not P for p, _, _ in ts):
            raise Unprovable("partial into a nonlinear op", f"aten.{_op(node)} takes a partial sum (a summand on each "
                             "rank) where the whole value is needed; an all-reduce is missing before it")
        return P
    dims = {_dim(p.dim, len(s)) + out_nd - len(s) for p, s, _ in ts if isinstance(p, Shard)}
    if not dims:
        return R
    if len(dims) > 1:
        raise Unprovable("operands split on different dims", f"aten.{_op(node)} combines tensors split on dims {sorted(dims)}")
    d = dims.pop()
    kinds = {replace(p, dim=0) for p, _, _ in ts if isinstance(p, Shard)}
    if len(kinds) > 1:
        raise Unprovable("operands split differently", f"aten.{_op(node)} combines {', '.join(map(str, kinds))}")
    for p, s, name in ts:
        k = d - (out_nd - len(s))
        if p is R and 0 <= k < len(s) and s[k] != 1:
            raise Unprovable("replicated meets split", f"aten.{_op(node)}: a whole operand{_named(name)} of shape "
                             f"{list(s)} meets an operand split on dim {d}; shard it with the others or keep both whole")
    return kinds.pop().at(d)


def _linear_ok(ins, ctx, linear) -> bool:
    """Whether every Partial operand sits at a position the op is linear in, at most one of them
    multiplied (for mul / div the other factors replicated)."""
    ps = [i for i, a in enumerate(ins) if a is P]
    return bool(ps) and all(i in linear for i in ps)


def _op(node) -> str:
    return getattr(getattr(node.target, "overloadpacket", None), "__name__", str(node.target))


POINTWISE = ("rsqrt", "sqrt", "exp", "log", "silu", "gelu", "tanh", "sigmoid", "relu", "softplus", "pow", "where",
             "clamp", "clamp_min", "clamp_max", "masked_fill", "ge", "le", "gt", "lt", "eq", "ne", "logical_and",
             "logical_or", "logical_not", "bitwise_not", "bitwise_and", "bitwise_or", "abs", "sin", "cos", "erf",
             "reciprocal", "silu_backward", "gelu_backward", "tanh_backward", "sigmoid_backward", "softplus_backward",
             "threshold_backward", "floor_divide", "remainder", "maximum", "minimum", "sign", "exp2", "log1p",
             "expm1", "round", "floor", "ceil", "trunc", "isnan", "isinf", "logical_and_", "fill", "addcmul",
             "addcdiv", "lerp", "where_", "nan_to_num", "leaky_relu", "elu", "square")
# linear in every tensor operand (a sum of partials is partial) / in the operand at these positions
LINEAR = {"add": (0, 1), "add_": (0, 1), "sub": (0, 1), "sub_": (0, 1), "neg": (0,), "_to_copy": (0,), "clone": (0,),
          "detach": (0,), "alias": (0,), "lift_fresh_copy": (0,), "contiguous": (0,), "copy": (1,), "copy_": (1,),
          "mul": (0, 1), "mul_": (0, 1), "div": (0,), "div_": (0,), "rsub": (0, 1),
          # an activation's backward is linear in the incoming gradient (its first operand)
          **{f"{act}_backward": (0,) for act in ("silu", "gelu", "tanh", "sigmoid", "softplus", "threshold", "elu",
                                                 "leaky_relu", "hardtanh", "mish", "hardswish", "hardsigmoid")}}


def _linear(name):
    positions = LINEAR[name]
    additive = name.startswith(("add", "sub", "rsub"))

    def rule(node, ins, ctx):
        ts = [a for a in ins if _is_pl(a)]
        if P in ts and X not in ts:
            if additive and any(a is not P for a in ts):
                raise Unprovable("partial plus whole", f"aten.{name} adds a whole tensor to a partial sum (each rank "
                                 "would add it once); an all-reduce is missing before it")
            if not additive and sum(a is P for a in ts) > 1:
                raise Unprovable("product of partials", f"aten.{name} multiplies two partial sums")
        return pointwise(node, ins, ctx, linear=positions)
    return rule


def _creation(node, ins, ctx) -> Placement:
    """A new tensor of given sizes (zeros, arange, full, ...): whole on every rank; zeros made in backward
    take the placement of what they meet (`Zeros`)."""
    return Z if ctx.phase == "bwd" and _op(node) in ZERO_FILLS else R


def _like(node, ins, ctx) -> Placement:
    """zeros_like / ones_like / empty_like: the input's placement (a partial input gives a whole one)."""
    p = ins[0]
    return R if p is P else p


# -- matrix products ------------------------------------------------------------------------------

def _einsum(node, ins, ctx, spec: str) -> Placement:
    """A product written in einsum notation ("mk,kn->mn", DTensor's `_einsum_strategies`): a letter split in
    one operand must be split in every operand that has it; a split contracted letter gives a partial sum."""
    lhs, out = spec.split("->")
    terms = lhs.split(",")
    ops = [a for a in ins if _is_pl(a)][:len(terms)]
    names = [n for a, n in zip(ins, ctx.names or [None] * len(ins)) if _is_pl(a)][:len(terms)]
    if any(p is X for p in ops):
        return X
    if any(p is P for p in ops):
        if sum(p is P for p in ops) == 1 and all(p is R or p is P for p in ops):
            return P
        raise Unprovable("partial into a product", f"aten.{_op(node)} multiplies a partial sum with a split operand")
    split = {}
    for term, p in zip(terms, ops):
        if isinstance(p, Shard):
            split.setdefault(term[p.dim], []).append(p)
    if not split:
        return R
    if len(split) > 1:
        raise Unprovable("operands split on different dims", f"aten.{_op(node)} ({spec}) has operands split on "
                         f"{' and '.join(sorted(split))}; one of them is split on the wrong dim (a row-parallel "
                         "linear marked colwise?)")
    letter = next(iter(split))
    for term, p, name in zip(terms, ops, names):
        if letter in term and p is R:
            raise Unprovable("replicated meets split", f"aten.{_op(node)} ({spec}): the whole operand{_named(name)} "
                             f"meets an operand split on its {'contracted' if letter not in out else 'output'} dim "
                             f"{letter!r}; split it too (colwise / rowwise pair) or keep both whole")
    kinds = {replace(p, dim=0) for p in split[letter]}
    if len(kinds) > 1:
        raise Unprovable("operands split differently", f"aten.{_op(node)} ({spec}) takes {', '.join(map(str, kinds))}")
    return kinds.pop().at(out.index(letter)) if letter in out else P


def _mm(node, ins, ctx):
    return _einsum(node, ins, ctx, "mk,kn->mn")


def _bmm(node, ins, ctx):
    return _einsum(node, ins, ctx, "bmk,bkn->bmn")


def _addmm(node, ins, ctx, spec="mk,kn->mn"):
    """bias + a @ b: the product's placement, the bias broadcast over the rows; a partial product takes its bias
    once, after the row-parallel all-reduce (only at a row-parallel linear's output)."""
    bias, prod = ins[0], _einsum(node, ins[1:], _shifted(ctx), spec)
    if bias is X or prod is X:
        return X
    if prod is P:
        if bias is R and ctx.rowwise:
            return P
        raise Unprovable("bias on a partial sum", f"aten.{_op(node)} adds a bias to a partial sum outside a "
                         "row-parallel linear (each rank would add it once)")
    nd = len(ctx.out)
    if isinstance(prod, Shard):
        bshape = ctx.shapes[0]
        k = prod.dim - (nd - len(bshape))
        if 0 <= k < len(bshape) and bshape[k] != 1 and bias not in (prod.at(k), Shard(k)):
            raise Unprovable("replicated meets split", f"aten.{_op(node)}: the bias{_named(ctx.names[0])} is "
                             f"{bias}, the product split on dim {prod.dim}")
        return prod
    if bias is not R:
        raise Unprovable("replicated meets split", f"aten.{_op(node)}: a split bias{_named(ctx.names[0])} on a whole product")
    return R


def _baddbmm(node, ins, ctx):
    return _addmm(node, ins, ctx, "bmk,bkn->bmn")


def _shifted(ctx: Context) -> Context:
    return Context(shapes=ctx.shapes[1:], out=ctx.out, phase=ctx.phase, counts=ctx.counts, repeats=ctx.repeats,
                   rowwise=ctx.rowwise, names=ctx.names[1:], handled=ctx.handled)


def _grouped(node, ins, ctx):
    """torch._grouped_mm (the routed experts): whole on every tp rank (experts split over ep, not tp)."""
    ops = [a for a in ins if _is_pl(a)]
    if X in ops:
        return X
    if all(p is R for p in ops):
        return R
    if all(p in (R, P) for p in ops) and sum(p is P for p in ops) == 1 and ins[0] is P:
        return P
    raise Unprovable("split experts", f"aten.{_op(node)} (grouped expert GEMM) takes {', '.join(map(str, ops))}; "
                     "the experts run whole on every tp rank")


# -- views ----------------------------------------------------------------------------------------

def _transpose(node, ins, ctx):
    p, nd = ins[0], len(ctx.shapes[0])
    if not isinstance(p, Shard):
        return p
    a, b = (_dim(ins[1], nd), _dim(ins[2], nd)) if len(ins) > 2 else (0, 1)
    return p.at({a: b, b: a}.get(p.dim, p.dim))


def _permute(node, ins, ctx):
    p, nd = ins[0], len(ctx.shapes[0])
    if not isinstance(p, Shard):
        return p
    order = [_dim(d, nd) for d in ins[1]]
    return p.at(order.index(p.dim))


def _unsqueeze(node, ins, ctx, *, at: int = 1):
    """The output gains the dim `ins[at]` names: a split dim at or after it moves up one."""
    p = ins[0]
    if not isinstance(p, Shard):
        return p
    d = _dim(ins[at], len(ctx.out))
    return p.at(p.dim + (d <= p.dim))


def _squeeze(node, ins, ctx):
    p, shape = ins[0], ctx.shapes[0]
    if not isinstance(p, Shard):
        return p
    dims = range(len(shape)) if len(ins) < 2 else [ins[1]] if isinstance(ins[1], int) else ins[1]
    gone = {_dim(d, len(shape)) for d in dims if shape[_dim(d, len(shape))] == 1}
    return p.at(p.dim - sum(1 for d in gone if d < p.dim))


def _complex(node, ins, ctx):
    """view_as_complex (..., 2) -> (...) / view_as_real (...) -> (..., 2): a split dim other than the pair stays."""
    p = ins[0]
    if isinstance(p, Shard) and p.dim >= min(len(ctx.out), len(ctx.shapes[0])) - (_op(node) == "view_as_complex"):
        raise Unprovable("op along the split dim", f"aten.{_op(node)} pairs the dim tp splits")
    return p


def _expand(node, ins, ctx):
    """A split dim follows; a whole tensor broadcast on one size-1 dim, behind a dim of size 1, to a count the rewrite
    sets per rank (HF's `repeat_kv` of multi-query attention: its one KV head, (batch, 1, 1, seq, head_dim), repeated
    `num_key_value_groups` times for the local query heads) is, on each rank, its slice of the whole expansion:
    split there."""
    p = ins[0]
    if p is R and ctx.phase == "fwd":
        src = (1,) * (len(ctx.out) - len(ctx.shapes[0])) + tuple(ctx.shapes[0])
        grown = [d for d, (a, b) in enumerate(zip(src, ctx.out)) if a == 1 and b != 1]
        if len(grown) == 1 and 0 < grown[0] and ctx.out[grown[0] - 1] == 1 and ctx.out[grown[0]] in ctx.repeats:
            if ctx.handled is not None:
                ctx.handled.append(f"a whole tensor expanded by the count {ctx.out[grown[0]]} (an attribute of the "
                                   "module the rewrite sets per rank)")
            return Shard(grown[0])
    if not isinstance(p, Shard):
        return p
    return p.at(p.dim + len(ctx.out) - len(ctx.shapes[0]))


def _view(node, ins, ctx):
    """view / reshape: the split dim follows into the group of dims it is merged or split into; split dims
    keep the split on their outermost part. A forward view that splits the split dim with a constant size
    (not -1) is a finding: on a rank the dim is shorter (StableLM's view by `self.num_heads`); where the
    attention module keeps that count as an attribute the rewrite sets per rank, it is handled."""
    p, src, dst = ins[0], tuple(ctx.shapes[0]), tuple(ctx.out)
    if not isinstance(p, Shard) or src == dst:
        return p
    group = _group(src, dst, p.dim)
    if group is None:
        raise Unprovable("view across the split dim", f"aten.{_op(node)} {list(src)} -> {list(dst)} regroups the split dim {p.dim}")
    ins_g, outs_g = group
    if p.outer > 1:  # (outer x split) unflattened: the split goes to the dim after `outer`
        return _unflatten(node, p, src, dst, outs_g)
    lead_in = next(i for i in ins_g if src[i] != 1)
    lead_out = next(o for o in outs_g if dst[o] != 1)
    if p.dim != lead_in:
        ahead = math.prod(src[i] for i in ins_g if i < p.dim)
        if len(outs_g) == 1 and not p.pieces:  # merged behind outer dims (batch x heads for a bmm)
            return Shard(outs_g[0], (), ahead)
        raise Unprovable("view of an inner split dim", f"aten.{_op(node)} {list(src)} -> {list(dst)} regroups the split "
                         f"dim {p.dim} behind an outer one")
    if p.pieces and len(outs_g) > 1 and len(p.pieces) > 1:
        raise Unprovable("fused projection", f"aten.{_op(node)} {list(src)} -> {list(dst)} splits a packed dim of pieces {list(p.pieces)}")
    if len(outs_g) > 1 and ctx.phase == "fwd":
        _constant_size(node, ins, ctx, lead_out)
    return Shard(lead_out, p.pieces if len(outs_g) == 1 else ())


def _constant_size(node, ins, ctx, dim: int) -> None:
    """A forward view that splits the split dim must size its outer part -1 (or by an attribute the rewrite sets)."""
    sizes = ins[1] if len(ins) > 1 and isinstance(ins[1], (list, tuple)) else ()
    literal = sizes[dim] if dim < len(sizes) else -1
    if literal == -1:
        return
    if literal not in ctx.counts:
        raise Unprovable("constant view size", f"aten.{_op(node)} to {list(sizes)} splits the split dim with the "
                         f"constant size {literal}; on each rank it is smaller (use -1 or the tensor's own size)")
    if ctx.handled is not None:
        ctx.handled.append(f"a view by the constant count {literal} (an attribute of the module the rewrite sets per rank)")


def _unflatten(node, p: Shard, src, dst, outs_g) -> Shard:
    ahead = 1
    for o in outs_g:
        if ahead == p.outer and dst[o] != 1:
            return Shard(o)
        ahead *= dst[o]
    raise Unprovable("view of an inner split dim", f"aten.{_op(node)} {list(src)} -> {list(dst)} does not unflatten "
                     f"the split (outer {p.outer}) back")


def _group(src, dst, d):
    """(source dims, target dims) of the smallest group of whole dims, holding source dim `d`, whose sizes
    multiply to the same number in both shapes; None when there is none."""
    i = j = 0
    while i < len(src) or j < len(dst):
        gi, gj, a, b = [i], [j] if j < len(dst) else [], src[i] if i < len(src) else 1, dst[j] if j < len(dst) else 1
        i, j = i + 1, j + 1
        while a != b:
            if a < b and i < len(src):
                a *= src[i]; gi.append(i); i += 1
            elif j < len(dst):
                b *= dst[j]; gj.append(j); j += 1
            else:
                return None
        while i < len(src) and src[i] == 1 and d != i:  # trailing size-1 dims join the group
            gi.append(i); i += 1
        if d in gi:
            return gi, gj or [len(dst) - 1]
    return None


# -- reductions, softmax, normalisation --------------------------------------------------------------

def _reduction(node, ins, ctx, *, summing: bool):
    """sum / mean / amax ... over `dims`: over the split dim a sum gives a partial sum, anything else
    (a mean, a max, a norm's mean of squares over the full width: OLMo2's q/k norm) is a finding."""
    p, shape = ins[0], ctx.shapes[0]
    if p is X or p is R:
        return p
    dims = ins[1] if len(ins) > 1 and ins[1] is not None else list(range(len(shape)))
    dims = {_dim(d, len(shape)) for d in ([dims] if isinstance(dims, int) else dims)}
    keep = bool(ins[2]) if len(ins) > 2 and isinstance(ins[2], bool) else bool(node.kwargs.get("keepdim", False))
    if p is P:
        if _op(node) in ("sum", "mean"):
            return P
        raise Unprovable("partial into a nonlinear op", f"aten.{_op(node)} of a partial sum")
    if p.dim in dims:
        if summing:
            return P
        raise Unprovable("reduction over the split dim", f"aten.{_op(node)} over dims {sorted(dims)} of a tensor "
                         f"{list(shape)} split on dim {p.dim}: each rank sees only its slice (a full-width norm?)")
    return p.at(p.dim if keep else p.dim - sum(1 for d in dims if d < p.dim))


def _max_dim(node, ins, ctx):
    """max.dim / min.dim (values, indices) along a dim that is not split; max / min of all elements is a reduction."""
    p = ins[0]
    if len(ins) < 2:
        return _reduction(node, ins, ctx, summing=False)
    if p is P:
        raise Unprovable("partial into a nonlinear op", f"aten.{_op(node)} of a partial sum")
    out = _reduction(node, ins, ctx, summing=False)
    return out, out


def _softmax(node, ins, ctx):
    """_softmax(x, dim) / _softmax_backward_data(grad, out, dim): split on another dim only."""
    ts = [a for a in ins if _is_pl(a)]
    dim = next(a for a in ins if isinstance(a, int) and not isinstance(a, bool))
    nd = len(ctx.out)
    if any(p is X for p in ts):
        return X
    if any(p is P for p in ts):
        raise Unprovable("partial into a nonlinear op", f"aten.{_op(node)} of a partial sum")
    dims = {p.dim for p in ts if isinstance(p, Shard)}
    if not dims:
        return R
    if _dim(dim, nd) in dims or len(dims) > 1 or any(p is R for p in ts):
        raise Unprovable("reduction over the split dim", f"aten.{_op(node)} over dim {dim} with operands {', '.join(map(str, ts))}")
    return ts[0]


def _layer_norm(node, ins, ctx):
    """native_layer_norm(x, shape, w, b) -> (out, mean, rstd): normalises the last len(shape) dims."""
    p, shape, n = ins[0], ctx.shapes[0], len(ins[1])
    if p is X:
        return X, X, X
    if any(isinstance(a, Shard) for a in ins[2:4]) or p is P:
        raise Unprovable("split norm weight", f"aten.{_op(node)}: the weight or input is {p}; a layer norm runs whole")
    if isinstance(p, Shard) and p.dim >= len(shape) - n:
        raise Unprovable("reduction over the split dim", f"aten.{_op(node)} normalises dims {list(shape[-n:])} of a "
                         f"tensor split on dim {p.dim}")
    return p, p, p


def _layer_norm_backward(node, ins, ctx):
    """native_layer_norm_backward(grad, x, shape, mean, rstd, w, b, mask) -> (dx, dw, db)."""
    g, x = ins[0], ins[1]
    if X in (g, x):
        return X, X, X
    if g is P and x is R:
        return P, P, P
    if g != x:
        raise Unprovable("operands split on different dims", f"aten.{_op(node)}: gradient {g}, input {x}")
    return (R, R, R) if g is R else (g, P, P)


# -- attention ----------------------------------------------------------------------------------

def _attention(node, ins, ctx):
    """The fused attention ops, forward and backward (q, k, v as (batch, heads, seq, head_dim)): split by
    heads (dim 1) or whole; a mask, and the KV head of multi-query attention, whole and broadcast over heads. Every
    output split like q, but the backward's gradient of such a broadcast operand: a partial sum."""
    ts = _tensors(ins, ctx.shapes, ctx.names)
    n_out = len(ctx.out) if isinstance(ctx.out, list) else 1
    if any(p is X for p, _, _ in ts):
        return (X,) * n_out
    heads = [p for p, s, _ in ts if isinstance(p, Shard)]
    if not heads:
        if any(p is P for p, _, _ in ts):
            raise Unprovable("partial into a nonlinear op", f"aten.{_op(node)} of a partial sum")
        return (R,) * n_out
    if any(p.dim != 1 for p in heads):
        raise Unprovable("attention split off the heads", f"aten.{_op(node)} with operands split on dims "
                         f"{sorted({p.dim for p in heads})}; attention splits by heads (dim 1)")
    for p, s, name in ts:
        if p is P or (p is R and len(s) > 1 and s[1] != 1 and len(s) >= 3):
            raise Unprovable("replicated meets split", f"aten.{_op(node)}: an operand{_named(name)} of shape {list(s)} "
                             f"is {p} while q / k / v are split by heads")
    outs = ctx.out if isinstance(ctx.out, list) else [ctx.out]
    # an output with one head (the backward's gradient of a KV head every query head reads: multi-query) sums over
    # this rank's query heads only: partial
    return tuple(R if not isinstance(s, tuple) or len(s) < 2 else P if len(s) >= 3 and s[1] == 1 else Shard(1)
                 for s in outs)


# -- packing: cat / split / slice -------------------------------------------------------------------

def _cat(node, ins, ctx):
    """cat(tensors, dim): operands split alike on another dim; along the split dim, the operands (each
    split) become the pieces of a packed dim. Empty operands (a fresh KV cache) are skipped."""
    shapes = ctx.shapes[0]
    ts = [(p, s, n) for p, s, n in zip(ins[0], shapes, (ctx.names[0] if ctx.names else None) or [None] * len(shapes))
          if _is_pl(p) and math.prod(s) > 0]
    dim = _dim(ins[1] if len(ins) > 1 else node.kwargs.get("dim", 0), len(ctx.out))
    kinds = {p for p, _, _ in ts}
    if X in kinds:
        return X
    if all(isinstance(p, Shard) and p.dim == dim and p.outer == 1 for p in kinds):  # packed: pieces side by side
        return Shard(dim, tuple(n for p, s, _ in ts for n in (p.pieces or (s[dim],))))
    if len(kinds) == 1:
        return kinds.pop()
    bad = next(((n or f"shape {list(s)}") for p, s, n in ts if p is R), "")
    raise Unprovable("replicated meets split" if bad else "operands split differently",
                     f"aten.cat along dim {dim} joins {', '.join(map(str, [p for p, _, _ in ts]))}"
                     + (f": a whole operand ({bad}) beside split ones (a per-head parameter kept whole?)" if bad else ""))


def _stack(node, ins, ctx):
    """stack(tensors, dim): operands placed alike; a split dim at or after `dim` moves one on."""
    kinds = {p for p in ins[0] if _is_pl(p)}
    dim = _dim(ins[1] if len(ins) > 1 else node.kwargs.get("dim", 0), len(ctx.out))
    if X in kinds:
        return X
    if len(kinds) != 1:
        raise Unprovable("replicated meets split", f"aten.stack joins {', '.join(map(str, kinds))}")
    p = kinds.pop()
    return p.at(p.dim + (p.dim >= dim)) if isinstance(p, Shard) else p


def _split(node, ins, ctx):
    """split / split_with_sizes / chunk / unbind along `dim`: off the split dim, every part keeps it; on a
    packed split dim, parts that are whole groups of pieces keep theirs; else a finding: a fused projection
    (Phi-3's qkv_proj, GLM-4's gate_up_proj) cut on the dim tp splits."""
    p, shape = ins[0], ctx.shapes[0]
    outs = ctx.out
    dim = _dim(ins[2] if len(ins) > 2 else node.kwargs.get("dim", 0), len(shape))
    if not isinstance(p, Shard) or p.dim != dim:
        return tuple(p for _ in outs)
    sizes = [s[dim] for s in outs]
    return tuple(_packed_part(node, p, shape, sum(sizes[:i]), n) for i, n in enumerate(sizes))


def _packed_part(node, p: Shard, shape, start: int, length: int) -> Shard:
    bounds = [0]
    for n in p.pieces:
        bounds.append(bounds[-1] + n)
    if start in bounds and start + length in bounds and p.pieces:
        sub = tuple(n for a, n in zip(bounds, p.pieces) if start <= a < start + length)
        return Shard(p.dim, sub if len(sub) > 1 else ())
    raise Unprovable("fused projection", f"aten.{_op(node)} cuts [{start}:{start + length}] out of dim {p.dim} of "
                     f"{list(shape)}, the dim tp splits{' into pieces ' + str(list(p.pieces)) if p.pieces else ''}: "
                     "a fused projection needs its pieces split one by one (packed pieces)")


def _slice(node, ins, ctx):
    p, shape = ins[0], ctx.shapes[0]
    dim = _dim(ins[1] if len(ins) > 1 else 0, len(shape))
    if not isinstance(p, Shard) or p.dim != dim or tuple(ctx.out) == tuple(shape):
        return p
    if p.pieces and (ins[4] if len(ins) > 4 else 1) != 1:  # every other column of packed pieces (gate, up interleaved)
        raise Unprovable("fused projection", f"aten.{_op(node)} cuts dim {p.dim} of {list(shape)} with step {ins[4]}, "
                         "the dim tp splits into packed pieces: a strided cut is none of them")
    start = ins[2] if len(ins) > 2 and ins[2] is not None else 0
    start = start + shape[dim] if start < 0 else min(start, shape[dim])
    return _packed_part(node, p, shape, start, ctx.out[dim])


def _slice_backward(node, ins, ctx):
    """slice_backward(grad, sizes, dim, start, end, step): the gradient padded back to the input."""
    p = ins[0]
    if isinstance(p, Shard) and p.dim == _dim(ins[2], len(ctx.out)):
        raise Unprovable("fused projection", f"aten.{_op(node)} pads a gradient along the dim tp splits")
    return p


def _select(node, ins, ctx):
    p, nd = ins[0], len(ctx.shapes[0])
    if not isinstance(p, Shard):
        return p
    d = _dim(ins[1], nd)
    if d == p.dim:
        raise Unprovable("index on the split dim", f"aten.{_op(node)} picks one index of the dim tp splits")
    return p.at(p.dim - (d < p.dim))


def _select_backward(node, ins, ctx):
    return _unsqueeze(node, ins, ctx, at=2)  # select's gradient (grad, sizes, dim, index) regains the picked dim


def _along(positions: str):
    """An op along one dim given at `positions` ("1": args[1]; "-2:": the last two dims; "pad": the padded
    last dims): the split dim must be another one."""
    def rule(node, ins, ctx):
        p, shape = ins[0], ctx.shapes[0]
        if not isinstance(p, Shard):
            return p
        nd = len(shape)
        if positions == "pad":  # (left, right) pairs from the last dim backwards; only padded dims count
            dims = {nd - 1 - i for i in range(len(ins[1]) // 2) if ins[1][2 * i] or ins[1][2 * i + 1]}
        elif positions == "-2:":
            dims = {nd - 2, nd - 1}
        else:
            arg = ins[int(positions)] if len(ins) > int(positions) else node.kwargs.get("dim", node.kwargs.get("dims"))
            dims = {_dim(d, nd) for d in (arg if isinstance(arg, (list, tuple)) else [arg])}
        if p.dim in dims:
            raise Unprovable("op along the split dim", f"aten.{_op(node)} runs along dim {p.dim}, the dim tp splits")
        return p
    return rule


def _repeat_interleave(node, ins, ctx):
    """repeat_interleave(x, n, dim): along the split dim each rank repeats its own slice (groups -> heads)."""
    p = ins[0]
    return Shard(p.dim, ()) if isinstance(p, Shard) else p


# -- routing and indexing -----------------------------------------------------------------------

def _scatter_gather(node, ins, ctx):
    """scatter / gather / index_select along `dim` (args[1]): every tensor operand split alike on another dim
    keeps it (the backward of a max along the rows); else whole operands only (`_whole`)."""
    ts = _tensors(ins, ctx.shapes, ctx.names)
    kinds = {p for p, _, _ in ts}
    if len(kinds) == 1 and isinstance(p := kinds.pop(), Shard) and isinstance(ins[1], int) \
            and _dim(ins[1], len(ctx.shapes[0])) != p.dim:
        return p
    return _whole(node, ins, ctx)


def _whole(node, ins, ctx):
    """Routing and indexing (topk, sort, scatter, index, gather, histc, cumsum of counts ...): whole
    operands only. A split one here is a head-indexed tensor or router the table does not split."""
    ts = _tensors(ins, ctx.shapes, ctx.names)
    if any(p is X for p, _, _ in ts):
        return _like_out(ctx, X)
    split = [(p, n) for p, _, n in ts if p is not R]
    if split:
        raise Unprovable("index of a split tensor", f"aten.{_op(node)} indexes or routes over "
                         f"{', '.join(f'{p}{_named(n)}' for p, n in split)}; it runs on whole tensors only")
    return _like_out(ctx, R)


def _like_out(ctx, p):
    return tuple(p for _ in ctx.out) if isinstance(ctx.out, list) else p


ROUTING = ("topk", "sort", "argsort", "scatter", "scatter_add", "scatter_reduce", "index", "index_put", "index_put_",
           "gather", "histc", "index_select", "index_add", "bincount", "one_hot", "embedding",
           "embedding_dense_backward", "masked_scatter", "argmax", "argmin", "nonzero", "unique",
           "searchsorted", "bucketize", "masked_select", "new_zeros_like")


def _convolution(node, ins, ctx):
    """convolution(x, w, b, ..., groups): a depthwise conv (groups = channels, Mamba-2's conv1d) split by
    channel: x split on dim 1, w and b on dim 0."""
    x, w, b, groups = ins[0], ins[1], ins[2], ins[8]
    if X in (x, w, b):
        return X
    if x is R and w is R and b in (R, None):
        return R
    chans = ctx.shapes[0][1]
    if isinstance(x, Shard) and x.dim == 1 and isinstance(w, Shard) and w.dim == 0 and groups == chans:
        return Shard(1, x.pieces)
    raise Unprovable("split convolution", f"aten.{_op(node)} with input {x}, weight {w}, groups {groups}; only a "
                     "depthwise conv splits by channel")


def _convolution_backward(node, ins, ctx):
    g, x, w = ins[0], ins[1], ins[2]
    if X in (g, x, w):
        return X, X, X
    if g is R and x is R and w is R:
        return R, R, R
    if isinstance(g, Shard) and g == x and isinstance(w, Shard) and w.dim == 0:
        return x, w, Shard(0, w.pieces)
    raise Unprovable("split convolution", f"aten.{_op(node)} with gradient {g}, input {x}, weight {w}")


def _getitem(node, ins, ctx):
    p = ins[0]
    return p[ins[1]] if isinstance(p, tuple) else p


RULES: dict[str, Callable] = {
    **{name: pointwise for name in POINTWISE}, **{name: _linear(name) for name in LINEAR},
    **{name: _whole for name in ROUTING},
    **{name: _creation for name in ("zeros", "ones", "full", "empty", "arange", "scalar_tensor", "new_zeros",
                                    "new_ones", "new_empty", "new_full", "empty_strided", "rand", "randn", "tensor",
                                    "_tensor_constant", "linspace", "eye")},
    **{name: _like for name in ("zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "bernoulli")},
    "native_dropout": lambda n, i, c: (_like(n, i, c),) * 2, "native_dropout_backward": pointwise,
    "mm": _mm, "bmm": _bmm, "addmm": _addmm, "baddbmm": _baddbmm, "_grouped_mm": _grouped,
    "t": _transpose, "transpose": _transpose, "permute": _permute, "unsqueeze": _unsqueeze, "squeeze": _squeeze,
    "expand": _expand, "view_as_complex": _complex, "view_as_real": _complex, "view": _view, "_unsafe_view": _view, "reshape": _view,
    "sum": lambda n, i, c: _reduction(n, i, c, summing=True), "mean": lambda n, i, c: _reduction(n, i, c, summing=False),
    "amax": lambda n, i, c: _reduction(n, i, c, summing=False), "var": lambda n, i, c: _reduction(n, i, c, summing=False),
    "logsumexp": lambda n, i, c: _reduction(n, i, c, summing=False),
    "scatter": _scatter_gather, "gather": _scatter_gather, "index_select": _scatter_gather, "max": _max_dim, "min": _max_dim, "_softmax": _softmax, "_safe_softmax": _softmax, "_log_softmax": _softmax, "_softmax_backward_data": _softmax,
    "_log_softmax_backward_data": _softmax,
    "native_layer_norm": _layer_norm, "native_layer_norm_backward": _layer_norm_backward,
    **{name: _attention for name in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                                     "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                                     "_scaled_dot_product_flash_attention_for_cpu_backward",
                                     "_scaled_dot_product_flash_attention_backward",
                                     "_scaled_dot_product_efficient_attention_backward",
                                     "_scaled_dot_product_cudnn_attention_backward")},
    "cat": _cat, "stack": _stack, "split": _split, "split_with_sizes": _split, "chunk": _split, "unbind": _split,
    "slice": _slice, "slice_backward": _slice_backward, "select": _select, "select_backward": _select_backward,
    "cumsum": _along("1"), "flip": _along("1"), "tril": _along("-2:"), "triu": _along("-2:"),
    "constant_pad_nd": _along("pad"), "repeat_interleave": _repeat_interleave,
    "convolution": _convolution, "convolution_backward": _convolution_backward, "getitem": _getitem,
}
