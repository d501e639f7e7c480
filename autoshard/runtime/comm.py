"""Collectives with the autograd transpose they need (Megatron's conjugate pairs).

Contract: each function is differentiable and its backward is the *transpose* of its forward
on the group, so a model split over tp computes the same gradients as the unsplit model.

The whole contract: docs/modules/runtime.md (runtime/comm.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def _size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_reduce(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


class _GatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        n, rank = _size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(n, dim=-1)[rank].contiguous(), None


class _SumOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_reduce(grad, ctx.group), None


def all_gather_dim(x: Tensor, group: dist.ProcessGroup, dim: int) -> Tensor:
    """Every rank's `x` concatenated along `dim`, in rank order (no autograd)."""
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def reduce_scatter_dim(x: Tensor, group: dist.ProcessGroup, dim: int) -> Tensor:
    """This rank's slice along `dim` of the sum of every rank's `x` (no autograd). gloo has no
    reduce-scatter: there it is an all-reduce of which each rank keeps its slice."""
    n, rank = _size(group), dist.get_rank(group)
    if x.shape[dim] % n:
        from autoshard.errors import InvalidConfigError

        raise InvalidConfigError(f"sequence_parallel: {x.shape[dim]} tokens along dim {dim} cannot be split over "
                                 f"tp={n}; give a sequence length that tp (x cp) divides")
    if dist.get_backend(group) == "gloo":
        return _all_reduce(x, group).chunk(n, dim=dim)[rank].contiguous()
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] // n, *moved.shape[1:]))
    dist.reduce_scatter_tensor(out, moved, group=group)
    return out.movedim(0, dim).contiguous()


class _SequenceCollective(torch.autograd.Function):
    """All-gather (`gather`) or reduce-scatter along `dim`; the backward is the other one."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup, dim: int, gather: bool) -> Tensor:
        ctx.group, ctx.dim, ctx.gather = group, dim, gather
        return (all_gather_dim if gather else reduce_scatter_dim)(x, group, dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return (reduce_scatter_dim if ctx.gather else all_gather_dim)(grad, ctx.group, ctx.dim), None, None, None


class _SliceCollective(torch.autograd.Function):
    """All-gather along `dim` (`gather`) with backward keeping this rank's slice, or keeping the
    slice with backward all-gathering (the full tensor and its gradient the same on every rank)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup, dim: int, gather: bool) -> Tensor:
        ctx.group, ctx.dim, ctx.gather = group, dim, gather
        return all_gather_dim(x, group, dim) if gather else _own_slice(x, group, dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        out = _own_slice(grad, ctx.group, ctx.dim) if ctx.gather else all_gather_dim(grad, ctx.group, ctx.dim)
        return out, None, None, None


def _own_slice(x: Tensor, group: dist.ProcessGroup, dim: int) -> Tensor:
    n = _size(group)
    if x.shape[dim] % n:
        from autoshard.errors import InvalidConfigError

        raise InvalidConfigError(f"sequence_parallel: {x.shape[dim]} tokens along dim {dim} cannot be split over "
                                 f"tp={n}; give a sequence length that tp (x cp) divides")
    return x.chunk(n, dim=dim)[dist.get_rank(group)].contiguous()


def gather_sequence(x: Tensor, group: dist.ProcessGroup | None, dim: int = 1) -> Tensor:
    """Leave the sequence shard for a stage that runs on the whole sequence: all-gather along `dim`,
    the (whole, same on every rank) gradient cut back to this rank's slice."""
    return x if _size(group) == 1 else _SliceCollective.apply(x, group, dim, True)


def split_sequence(x: Tensor, group: dist.ProcessGroup | None, dim: int = 1) -> Tensor:
    """Enter the sequence shard from the whole sequence (the same on every rank): this rank's slice
    along `dim`, the gradient all-gathered."""
    return x if _size(group) == 1 else _SliceCollective.apply(x, group, dim, False)


def gather_from_sequence(x: Tensor, group: dist.ProcessGroup | None, dim: int = 1) -> Tensor:
    """Enter a TP region under sequence parallelism: the whole sequence from every rank's shard
    (all-gather along `dim`), the gradient reduce-scattered back to the shards."""
    return x if _size(group) == 1 else _SequenceCollective.apply(x, group, dim, True)


def reduce_scatter_to_sequence(x: Tensor, group: dist.ProcessGroup | None, dim: int = 1) -> Tensor:
    """Leave a TP region under sequence parallelism: partial outputs summed and split along `dim`
    (reduce-scatter), the gradient all-gathered."""
    return x if _size(group) == 1 else _SequenceCollective.apply(x, group, dim, False)


def sum_over_group(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """The sum of every rank's `x`, used by every rank for its own slice: all-reduce both ways."""
    return x if _size(group) == 1 else _SumOverGroup.apply(x, group)


def copy_to_group(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Enter a tensor-parallel region: identity forward, all-reduce of the gradient backward."""
    return x if _size(group) == 1 else _CopyToGroup.apply(x, group)


def reduce_from_group(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Leave a tensor-parallel region: sum the partial outputs forward, identity backward."""
    return x if _size(group) == 1 else _ReduceFromGroup.apply(x, group)


def gather_last_dim(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Concatenate every rank's last-dim slice (e.g. vocab-parallel logits -> full logits)."""
    return x if _size(group) == 1 else _GatherLastDim.apply(x, group)


def split_last_dim(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """This rank's last-dim slice of a tensor whole on every rank, the gradient all-gathered (the transpose of
    `gather_last_dim`: HF's rowwise_split_input)."""
    return x if _size(group) == 1 else _SliceCollective.apply(x, group, -1, False)
