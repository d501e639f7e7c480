"""Context-parallel Mamba-2 mixer: state passing between ranks (contiguous layout).

Contract: `install_cp_mixers(model, ctx)` replaces the forward of every Mamba-2 SSD mixer of
`model` (found by its pattern, not its class: runtime/ssd.py `install_mixer_forward`) with `cp_mixer_forward`: fed this rank's contiguous slice of L = S/cp tokens, it returns
exactly this slice of the full-sequence mixer output (training path, no cache), with the
module's own in_proj / conv1d / norm / out_proj, so tensor-parallel wrappers of those still
apply (sizes are read off the parameters, not the config: heads may be TP-local).

The whole contract: docs/modules/runtime.md (runtime/cp_mamba.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autoshard.errors import InvalidConfigError
from autoshard.rules.validity import sequence_split_violation
from autoshard.runtime.cp_sequence import CPContext, all_gather_autograd
from autoshard.runtime.ssd import (gated_norm, head_groups, install_mixer_forward, local_sizes, projected,
                                   scan_head_group, ssd_chunk_scan, ssd_scan)

__all__ = ["conv_with_halo", "cp_mixer_forward", "install_cp_mixers", "prefix_state", "ssd_chunk_scan"]


def prefix_state(final: Tensor, total: Tensor, ctx: CPContext) -> Tensor:
    """This rank's initial state from every rank's slice-final state `final` (b, *state) and its log-decay over the
    slice `total` (b, *lead), `lead` the leading dims of the state's that one decay spans (Mamba-2: a head's (b, h) of
    (b, h, p, n); Mamba-1: each channel and state entry, (b, d, n), the state's own shape)."""
    b, size = final.shape[0], final[0].numel()
    packed = torch.cat([final.reshape(b, -1), total.reshape(b, -1)], dim=1).contiguous()
    gathered = all_gather_autograd(packed, ctx).view(ctx.size, b, -1)
    states = gathered[..., :size].reshape(ctx.size, *final.shape)
    decays = gathered[..., size:].reshape(ctx.size, *total.shape)
    ends = decays.cumsum(0)
    start_r = ends[ctx.rank] - decays[ctx.rank]  # log-decay from sequence start to this rank's start
    before = (torch.arange(ctx.size, device=final.device) < ctx.rank).view(-1, *[1] * total.dim())
    weight = (start_r[None] - ends).masked_fill(~before, float("-inf")).exp()  # (cp, b, *lead)
    return (weight.view(*weight.shape, *[1] * (final.dim() - total.dim())) * states).sum(0)


def conv_with_halo(xbc: Tensor, weight: Tensor, bias: Tensor | None, ctx: CPContext) -> Tensor:
    """Causal depthwise conv1d (weight (c, 1, k)) of this rank's slice (b, L, c), continuing rank r-1's tokens."""
    b, L, channels = xbc.shape
    halo = weight.shape[-1] - 1
    why = sequence_split_violation(L * ctx.size, ctx.size, balanced=False, min_local=halo)  # the plan's cp rule
    if why:
        raise InvalidConfigError(why)
    tails = xbc[:, L - halo:].contiguous()  # (b, k-1, c)
    tails = all_gather_autograd(tails, ctx).view(ctx.size, b, halo, channels)
    prev = tails[(ctx.rank - 1) % ctx.size] * float(ctx.rank > 0)  # zeros on rank 0, still in the graph
    full = torch.cat([prev, xbc], dim=1).transpose(1, 2)  # (b, c, k-1+L)
    return F.conv1d(full.to(weight.dtype), weight, bias, groups=channels).transpose(1, 2)


def cp_mixer_forward(mixer: nn.Module, ctx: CPContext, hidden_states: Tensor, cache=None,
                     attention_mask: Tensor | None = None, **kwargs) -> Tensor:
    """The SSD mixer's forward for this rank's contiguous slice (b, L, d) -> (b, L, d)."""
    if cache is not None:
        raise InvalidConfigError("CP Mamba-2 mixer runs training forwards only (no generation cache); "
                                 "call the model with use_cache=False")
    dtype = hidden_states.dtype
    if attention_mask is not None:
        hidden_states = hidden_states * attention_mask[:, :, None].to(dtype)
    proj = projected(mixer, hidden_states)  # (b, L, 2 d_in + 2 g n + h), Falcon-H1's multipliers included
    heads, head_dim, groups, n = local_sizes(mixer)
    inner = heads * head_dim
    gate, xbc, dt = proj.split([inner, inner + 2 * groups * n, heads], dim=-1)
    xbc = mixer.act(conv_with_halo(xbc, mixer.conv1d.weight, mixer.conv1d.bias, ctx)).to(dtype)
    if attention_mask is not None:
        xbc = xbc * attention_mask[:, :, None].to(dtype)
    x, B, C = xbc.split([inner, groups * n, groups * n], dim=-1)
    b, L, _ = x.shape

    A = -torch.exp(mixer.A_log.float())  # (h,)
    group_of = head_groups(mixer, heads, groups, x.device)
    # the local scan from a zero state: runtime/ssd.py's memory-efficient kernel (D skip included)
    y, final = ssd_scan(x.view(b, L, heads, head_dim), dt, A, B.view(b, L, groups, n), C.view(b, L, groups, n),
                        chunk=mixer.chunk_size, D=mixer.D, dt_bias=mixer.dt_bias, dt_limit=mixer.time_step_limit,
                        head_group=scan_head_group(mixer, heads, groups, x.device), final_state=True)
    lo, hi = mixer.time_step_limit
    dt = F.softplus(dt + mixer.dt_bias.to(dt.dtype)).clamp(min=lo, max=hi).float()  # (b, L, h), as HF
    log_decay = (dt * A).cumsum(1)  # (b, L, h)
    start = prefix_state(final, log_decay[:, -1], ctx)  # (b, h, p, n)
    C = C.float().view(b, L, groups, n).index_select(2, group_of)  # (b, L, h, n)
    y = y + torch.einsum("blhn,bhpn->blhp", C, start) * log_decay.exp()[..., None]
    y = gated_norm(mixer, y.reshape(b, L, inner), gate)
    return mixer.out_proj(y.to(dtype))


def install_cp_mixers(model: nn.Module, ctx: CPContext) -> int:
    """Replace the forward of every Mamba-2 SSD mixer in `model` with the CP one; returns how many."""
    count = install_mixer_forward(model, lambda mixer, *args, **kwargs: cp_mixer_forward(mixer, ctx, *args, **kwargs))
    if count == 0:
        raise InvalidConfigError(f"{type(model).__name__} has no Mamba-2 SSD mixer; CP mixers cannot be installed")
    return count
