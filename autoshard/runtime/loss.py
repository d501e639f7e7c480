"""Causal language-model loss, the same number HF computes, for any split of the batch.

Contract: `causal_lm_loss(logits, labels, num_tokens=N)` returns
``sum over valid tokens of cross_entropy(logits[t], labels[t+1]) / N``. Labels are given
*unshifted*, exactly as to ``model(input_ids, labels=labels)``: the shift (pad with -100, drop
the first label) happens here, per sequence, so a batch split over data-parallel ranks or
micro-batches shifts the same way as the whole batch.

The whole contract: docs/modules/runtime.md (runtime/loss.py).
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
    count (docs/modules/runtime.md); None means this batch's own count.
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

    forward: the copy becomes its log-softmax (`_log_softmax_`), saved; the loss is minus its
    value at the target (with `group`, vocab-parallel logits: from the one rank whose slice holds
    it, a masked gather all-reduced).
    backward: d loss / d logits = softmax - one_hot(target), written over the saved log-softmax,
    in the logits' dtype; no communication (each rank owns its slice of the gradient). Without a
    group it is torch's own log-softmax backward a block of rows at a time: the gradient of
    `F.cross_entropy(logits.float())`, to the bit.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, group: dist.ProcessGroup | None) -> Tensor:
        work = logits.float() if logits.dtype != torch.float32 else logits.clone()  # (N, V_local)
        local_vocab = work.shape[-1]
        start = dist.get_rank(group) * local_vocab if group is not None else 0
        _log_softmax_(work, group)
        valid = target != IGNORE_INDEX
        local_target = target - start
        mine = valid & (local_target >= 0) & (local_target < local_vocab)
        safe = torch.where(mine, local_target, torch.zeros_like(local_target))
        picked = work.gather(-1, safe.unsqueeze(-1)).squeeze(-1) * mine  # (N,) log p(target)
        if group is not None:
            dist.all_reduce(picked, group=group)
        ctx.save_for_backward(work, safe, mine, valid)
        ctx.dtype, ctx.vocab_parallel = logits.dtype, group is not None
        return -picked * valid

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        work, safe, mine, valid = ctx.saved_tensors  # work: the log-softmax
        scale = grad_loss * valid  # (N,)
        rows = _block_rows(work)
        for i, block in enumerate(work.split(rows)):
            at = slice(i * rows, i * rows + block.shape[0])
            index = torch.arange(block.shape[0], device=block.device)
            if ctx.vocab_parallel:  # softmax x scale, minus scale at the target (this rank's slice)
                block.exp_().mul_(scale[at].unsqueeze(-1))
                block[index, safe[at]] -= scale[at] * mine[at]
            else:  # what nll_loss's backward hands log_softmax's: -scale at the target
                grad_out = torch.zeros_like(block)
                grad_out[index, safe[at]] = -scale[at]
                block.copy_(torch._log_softmax_backward_data(grad_out, block, -1, torch.float32))
        return work.to(ctx.dtype), None, None


_BLOCK_BYTES = 64 * 2**20  # the float32 temporaries of `_log_softmax_`, a block of rows at a time


def _block_rows(work: Tensor) -> int:
    return max(1, _BLOCK_BYTES // (4 * work.shape[-1]))


def _log_softmax_(work: Tensor, group: dist.ProcessGroup | None) -> None:
    """`work` (N, V_local) float32 becomes its log-softmax over the vocab, in place: torch's own
    log_softmax a block of rows at a time (the values F.cross_entropy computes), or with `group`
    over the vocab slices of the group (the global row max and sum of exps by all-reduce)."""
    rows = _block_rows(work)
    if group is None:
        for block in work.split(rows):
            block.copy_(torch.log_softmax(block, dim=-1))
        return
    row_max = work.max(dim=-1).values  # (N,)
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    work.sub_(row_max.unsqueeze(-1))
    sum_exp = torch.cat([block.exp().sum(dim=-1) for block in work.split(rows)])  # (N,)
    dist.all_reduce(sum_exp, group=group)
    work.sub_(sum_exp.log_().unsqueeze(-1))
