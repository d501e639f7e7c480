"""Tensor-parallel placements of the values of a traced graph, and what an op rule is given.

DTensor's placements (torch/distributed/tensor/placement_types.py): `Replicate` (every rank holds the
whole tensor), `Shard(dim)` (each rank holds a slice along `dim`; `pieces`: packed pieces along `dim`
each split over tp, `outer`: the dim is (outer x split) merged), `Partial` (each rank holds a summand);
and two of the propagation's own: `Unknown` (past a finding) and `Zeros` (a zero tensor autograd makes,
placed as what it meets). `Context` is what an op rule reads besides the placements; a rule that cannot
place an op raises `Unprovable`. Used by passes/capture/placement_rules.py and propagate.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Replicate:
    def __str__(self) -> str:
        return "Replicate"


@dataclass(frozen=True, slots=True)
class Partial:
    def __str__(self) -> str:
        return "Partial"


@dataclass(frozen=True, slots=True)
class Shard:
    dim: int
    pieces: tuple[int, ...] = ()  # packed pieces along `dim` (whole lengths), each split over tp
    outer: int = 1  # `dim` is (outer, split) merged, split on the inner part (batch x heads in eager attention)

    def at(self, dim: int) -> Shard:
        return Shard(dim, self.pieces, self.outer)

    def __str__(self) -> str:
        extra = (f", pieces {list(self.pieces)}" if self.pieces else "") + (f", inside {self.outer}" if self.outer > 1 else "")
        return f"Shard({self.dim}{extra})"


@dataclass(frozen=True, slots=True)
class Unknown:
    """Past a finding: not proven either way (no second finding is reported from it)."""

    def __str__(self) -> str:
        return "unproven"


@dataclass(frozen=True, slots=True)
class Zeros:
    """A fresh zero-filled tensor made in backward by autograd (sized from the gradient it serves, so on a rank
    the local size): it takes the placement of whatever it meets (`fill_zeros`)."""

    def __str__(self) -> str:
        return "zeros"


R, P, X, Z = Replicate(), Partial(), Unknown(), Zeros()
Placement = Replicate | Partial | Shard | Unknown | Zeros
ZERO_FILLS = ("zeros", "new_zeros", "empty", "new_empty", "empty_strided")


def fill_zeros(ins):
    """`ins` with every `Zeros` placed as the other operands are: their split, else partial, else whole."""
    flat = [a for a in flatten(ins) if is_placement(a) and a is not Z]
    if len(flat) == len([a for a in flatten(ins) if is_placement(a)]):
        return ins
    dom = next((a for a in flat if isinstance(a, Shard)), P if P in flat else X if X in flat else R)
    return _map(ins, lambda a: dom if a is Z else a)


def flatten(xs):
    for x in xs:
        if isinstance(x, (list, tuple)):
            yield from flatten(x)
        else:
            yield x


def _map(xs, f):
    return type(xs)(_map(x, f) if isinstance(x, (list, tuple)) else f(x) for x in xs)


class Unprovable(Exception):
    """An op the placements cannot pass through: `kind` (a short name) and `detail` (what was found)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail = kind, detail


@dataclass(frozen=True, slots=True, kw_only=True)
class Context:
    """What a rule may read besides the placements: `shapes` mirrors `ins` (a tensor argument's
    shape, else None), `out` the output shape(s), `phase` "fwd" / "bwd", `counts` the head counts the
    attention module keeps as attributes (the rewrite sets them per rank), `repeats` the node's attention module's
    `num_key_value_groups` where the rewrite sets it per rank (its KV heads repeated for the local query heads),
    `rowwise`: the node is the output of a row-parallel linear, `names` mirrors `ins` with the parameter a tensor
    comes from."""

    shapes: tuple
    out: Any
    phase: str
    counts: frozenset[int] = frozenset()
    repeats: frozenset[int] = frozenset()
    rowwise: bool = False
    names: tuple = ()
    handled: list = None  # findings the runtime handles (appended by rules; see `constant_size`)




def is_placement(a) -> bool:
    return isinstance(a, (Replicate, Partial, Shard, Unknown, Zeros))

