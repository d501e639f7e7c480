"""How context parallelism lays a sequence over its ranks: the layouts, a rank's place in its group,
and the split / gather of a full-sequence tensor (autograd through both).

The shared ground of runtime/context_parallel.py (which switches a model to CP) and of the mixers it
installs (cp_attention.py, cp_mamba.py); the terms are those of context_parallel.py's docstring.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
import torch.distributed as dist
from torch import Tensor

from autoshard.errors import InvalidConfigError
from autoshard.ir import is_positive_int
from autoshard.rules.validity import sequence_split_violation


class SeqLayout(str, Enum):
    BALANCED = "balanced"  # chunks i and 2cp-1-i of 2cp (causal attention)
    CONTIGUOUS = "contiguous"  # chunk i of cp (scans)


@dataclass(frozen=True, slots=True, kw_only=True)
class CPContext:
    """This rank's place in its CP group. `group` is None only when size == 1."""

    group: dist.ProcessGroup | None
    rank: int
    size: int

    def __post_init__(self) -> None:
        if not is_positive_int(self.size) or not 0 <= self.rank < self.size:
            raise InvalidConfigError(f"CP rank {self.rank} must lie in [0, {self.size}) and size must be >= 1")
        if self.size > 1 and self.group is None:
            raise InvalidConfigError(f"CP size {self.size} needs a process group, got None")

    @classmethod
    def from_group(cls, group: dist.ProcessGroup) -> CPContext:
        return cls(group=group, rank=dist.get_rank(group), size=dist.get_world_size(group))


def check_seq_len(seq_len: int, cp: int, layout: SeqLayout, *, min_local: int = 1) -> None:
    """Raise before any collective if `seq_len` cannot be split over `cp` ranks: the plan rule
    (rules/validity.sequence_split_violation) applied to the batch at hand."""
    why = sequence_split_violation(seq_len, cp, balanced=layout is SeqLayout.BALANCED, min_local=min_local)
    if why:
        raise InvalidConfigError(why)


def sequence_positions(seq_len: int, cp: int, rank: int, layout: SeqLayout) -> Tensor:
    """(S/cp,) int64: the global positions of the tokens rank `rank` holds, in its local order."""
    if layout is SeqLayout.CONTIGUOUS:
        local = seq_len // cp
        return torch.arange(rank * local, (rank + 1) * local)
    chunk = seq_len // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk)
    last = 2 * cp - 1 - rank
    return torch.cat([first, torch.arange(last * chunk, (last + 1) * chunk)])


def gathered_order(seq_len: int, cp: int, layout: SeqLayout) -> Tensor:
    """(S,) int64: index into the rank-order concatenation of all ranks' tokens that gives the
    natural order (natural = gathered[:, order])."""
    held = torch.cat([sequence_positions(seq_len, cp, r, layout) for r in range(cp)])
    return torch.argsort(held)


def split_sequence(x: Tensor, ctx: CPContext, layout: SeqLayout, *, dim: int = 1) -> Tensor:
    """This rank's slice of a full-sequence tensor (ids, labels, embeddings) along `dim`."""
    if ctx.size == 1:
        return x
    check_seq_len(x.shape[dim], ctx.size, layout)
    index = sequence_positions(x.shape[dim], ctx.size, ctx.rank, layout).to(x.device)
    return x.index_select(dim, index)


def all_gather_autograd(x: Tensor, ctx: CPContext, *, dim: int = 0) -> Tensor:
    """Concatenate every CP rank's `x` along `dim`, in rank order; the backward is a reduce-scatter (sum)."""
    from torch.distributed import _functional_collectives as fc

    gather = getattr(fc, "all_gather_single_autograd", None) or fc.all_gather_tensor_autograd
    moved = x.movedim(dim, 0).contiguous()  # gather along dim 0 only: no cat/chunk copies
    return gather(moved, gather_dim=0, group=ctx.group).movedim(0, dim)


def gather_sequence(x: Tensor, ctx: CPContext, layout: SeqLayout, *, dim: int = 1) -> Tensor:
    """Inverse of `split_sequence` over the group (autograd: the backward keeps this rank's slice)."""
    if ctx.size == 1:
        return x
    full = all_gather_autograd(x, ctx, dim=dim)
    order = gathered_order(full.shape[dim], ctx.size, layout).to(x.device)
    return full.index_select(dim, order)
