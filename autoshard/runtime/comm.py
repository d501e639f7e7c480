"""Collectives with the autograd transpose they need (Megatron's conjugate pairs).

Contract: each function is differentiable and its backward is the *transpose* of its forward
on the group, so a model split over tp computes the same gradients as the unsplit model:

    copy_to_group       forward identity        backward all-reduce (sum)   ("f")
    reduce_from_group   forward all-reduce      backward identity           ("g")
    gather_last_dim     forward all-gather      backward keep own slice
                        (concat on the last dim)
    sum_over_group      forward all-reduce      backward all-reduce (sum)
                        (a total every rank uses for its own slice: the gated norm's
                        sums of squares when a norm group spans ranks)

They call torch.distributed directly, not `_c10d_functional.all_reduce`, whose autograd in
torch 2.13 all-reduces again in backward (the trap in DESIGN.md). With a group of size 1 they
are the identity and launch nothing.
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
