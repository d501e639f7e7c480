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
the vocab); the cross-entropy is computed with two all-reduces of (tokens,) vectors and no
rank ever holds the full logits. The loss is then the same on every rank of the group and its
gradient is this rank's slice of the full gradient.
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
    flat = logits.float().reshape(-1, logits.shape[-1])  # (b*s, V_local)
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        total = F.cross_entropy(flat, target, ignore_index=IGNORE_INDEX, reduction="sum")
    else:
        total = _VocabParallelCrossEntropy.apply(flat, target, tp_group).sum()
    if num_tokens is None:
        num_tokens = int((target != IGNORE_INDEX).sum())
    if isinstance(num_tokens, Tensor):
        num_tokens = num_tokens.to(total.device, total.dtype)
    return total / num_tokens


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of vocab-sharded logits; 0 at ignored tokens.

    forward: global max and sum of exp by all-reduce over the tp group; the target logit
    comes from the one rank whose slice holds it (all-reduce of a masked gather).
    backward: d loss / d logits = softmax - one_hot(target), restricted to this slice; no
    communication (each rank owns its slice of the gradient).
    """

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, group: dist.ProcessGroup) -> Tensor:
        local_vocab = logits.shape[-1]
        start = dist.get_rank(group) * local_vocab
        row_max = logits.max(dim=-1).values  # (N,)
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - row_max.unsqueeze(-1)  # (N, V_local)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)  # (N,)
        dist.all_reduce(sum_exp, group=group)
        valid = target != IGNORE_INDEX
        local_target = target - start
        mine = valid & (local_target >= 0) & (local_target < local_vocab)
        safe = torch.where(mine, local_target, torch.zeros_like(local_target))
        target_logit = shifted.gather(-1, safe.unsqueeze(-1)).squeeze(-1) * mine  # (N,)
        dist.all_reduce(target_logit, group=group)
        loss = (sum_exp.log() - target_logit) * valid
        ctx.save_for_backward(exp, sum_exp, safe, mine, valid)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        exp, sum_exp, safe, mine, valid = ctx.saved_tensors
        scale = (grad_loss * valid).unsqueeze(-1)  # (N, 1)
        grad = exp / sum_exp.unsqueeze(-1) * scale
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, safe] -= scale.squeeze(-1) * mine
        return grad, None, None
