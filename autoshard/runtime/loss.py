"""Causal language-model loss, the same number HF computes, for any split of the batch.

Contract: `causal_lm_loss(logits, labels, num_tokens=N)` returns
``sum over valid tokens of cross_entropy(logits[t], labels[t+1]) / N``. Labels are given
*unshifted*, exactly as to ``model(input_ids, labels=labels)``: the shift (pad with -100, drop
the first label) happens here, per sequence, so a batch split over data-parallel ranks or
micro-batches shifts the same way as the whole batch.

Terms: a *valid* token is one whose shifted label is not -100. `N` is the count of valid tokens
of the **global** batch (all micro-batches, all dp ranks): summing the returned values over
micro-batches and dp ranks gives the global mean, never a mean of means. With ``num_tokens=None``
the denominator is this call's own count (HF's ``reduction="mean"``).

Vocab parallelism: with ``tp_group`` the logits are this rank's contiguous vocab slice
``[rank * V_local, (rank + 1) * V_local)`` of the tp group (the LM head split column-wise over
the vocab); the cross-entropy is computed with three all-reduces of (tokens,) vectors and no
rank ever holds the full logits. The loss is then the same on every rank of the group and its
gradient is this rank's slice of the full gradient.

Memory (what `passes/cost.py` `logits_bytes` prices): the cross-entropy runs in place on one
float32 copy of the logits, as Megatron-LM's fused vocab-parallel cross-entropy does: the copy
becomes the softmax, which is all it keeps for backward, and backward turns it into the gradient
in place. Per logit: the logits as the head wrote them (2 B in bf16) and 4 B, never the
float32 logits, log-softmax and gradient side by side that ``F.cross_entropy(logits.float())``
holds. Backward runs once (a second one raises autograd's in-place error).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100


def shift_labels(labels: Tensor) -> Tensor:
    """(b, s) labels -> (b, s) targets: target[t] = labels[t + 1], -100 at the end (as HF)."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def count_tokens(labels: Tensor) -> int:
    """Number of valid tokens (shifted label != -100) in unshifted `labels`."""
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


def causal_lm_loss(logits: Tensor, labels: Tensor, *, num_tokens: int | Tensor | None = None,
                   tp_group: dist.ProcessGroup | None = None, shifted: bool = False) -> Tensor:
    """Summed token cross-entropy of this batch divided by `num_tokens` (a 0-d float32 tensor).

    logits: (b, s, V) full logits, or (b, s, V / tp) this rank's vocab slice when `tp_group`
    is given. labels: (b, s) unshifted, -100 = ignore. num_tokens: the global valid-token
    count (see the module docstring); None means this batch's own count.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree; "
                         "expected logits (b, s, vocab) and labels (b, s)")
    # shifted=True: `labels` are already targets (context parallelism shifts over the whole sequence)
    target = (labels if shifted else shift_labels(labels)).reshape(-1)  # (b*s,)
    group = tp_group if tp_group is not None and dist.get_world_size(tp_group) > 1 else None
    total = _CrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), target, group).sum()
    if num_tokens is None:
        num_tokens = int((target != IGNORE_INDEX).sum())
    if isinstance(num_tokens, Tensor):
        num_tokens = num_tokens.to(total.device, total.dtype)
    return total / num_tokens


class _CrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy, 0 at ignored tokens, in place on one float32 copy of the logits.

    forward: the copy minus the row max, exponentiated and divided by the row sum: the softmax,
    saved; loss = log(sum of exps) - (target logit - max). With `group` (vocab-parallel logits) the
    max, the sum of exps and the target logit (from the one rank whose slice holds it, a masked
    gather) are all-reduced over the group.
    backward: d loss / d logits = softmax - one_hot(target), written over the saved softmax, in
    the logits' dtype; no communication (each rank owns its slice of the gradient).
    """

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, group: dist.ProcessGroup | None) -> Tensor:
        work = logits.float() if logits.dtype != torch.float32 else logits.clone()  # (N, V_local)
        local_vocab = work.shape[-1]
        start = dist.get_rank(group) * local_vocab if group is not None else 0
        row_max = work.max(dim=-1).values  # (N,)
        if group is not None:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        work.sub_(row_max.unsqueeze(-1))
        valid = target != IGNORE_INDEX
        local_target = target - start
        mine = valid & (local_target >= 0) & (local_target < local_vocab)
        safe = torch.where(mine, local_target, torch.zeros_like(local_target))
        target_logit = work.gather(-1, safe.unsqueeze(-1)).squeeze(-1) * mine  # (N,)
        work.exp_()
        sum_exp = work.sum(dim=-1)  # (N,)
        if group is not None:
            dist.all_reduce(sum_exp, group=group)
            dist.all_reduce(target_logit, group=group)
        work.div_(sum_exp.unsqueeze(-1))  # the softmax
        ctx.save_for_backward(work, safe, mine, valid)
        ctx.dtype = logits.dtype
        return (sum_exp.log() - target_logit) * valid

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        softmax, safe, mine, valid = ctx.saved_tensors
        scale = (grad_loss * valid).unsqueeze(-1)  # (N, 1)
        grad = softmax.mul_(scale)
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, safe] -= scale.squeeze(-1) * mine
        return grad.to(ctx.dtype), None, None
