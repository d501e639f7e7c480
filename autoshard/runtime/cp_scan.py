"""Context-parallel Mamba-1 selective scan: state passing between ranks (contiguous layout).

Contract: `install_cp_scans(model, ctx)` wraps the forward of every Mamba-1 mixer of `model` (found by its pattern:
models/dispatch.py `is_selective_scan`) so that, fed this rank's contiguous slice of the sequence, it returns exactly that
slice of the full-sequence output (training path, no cache). HF's own forward runs (Mamba's, Falcon-Mamba's B / C / dt
norms, Jamba's), only its kernel dispatch points are swapped while it runs, found by signature (models/
dispatch.py): the causal conv continues rank r - 1's tokens (runtime/cp_mamba.py `conv_with_halo`), the scan runs the
original kernel from a zero state, then adds what the state entering the slice contributes (its decay to each token,
read through C; `prefix_state` gathers every rank's final state and log-decay), and the fused whole-mixer kernel
(mamba_ssm's `mamba_inner_fn`, which would read the whole sequence's weights and skip both) is declined.
The whole contract: docs/modules/runtime.md (runtime/cp_scan.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from autoshard.errors import InvalidConfigError
from autoshard.models.dispatch import (declined, scan_mixers, split_points, swapping_forward, takes_conv, takes_fused,
                                       takes_scan)
from autoshard.runtime.cp_mamba import conv_with_halo, prefix_state
from autoshard.runtime.cp_sequence import CPContext

CHUNK = 256  # tokens per piece of the entering state's contribution (bounds its (b, d, chunk, n) transient)


def _from_start(steps: Tensor, A: Tensor, C: Tensor, start: Tensor) -> Tensor:
    """(b, d, L): what the state entering the slice, `start` (b, d, n), adds to each token's scan output: decayed by
    exp(A x the dt summed up to it), `steps` (b, d, L) those sums, A (d, n), read through C (b, n, L). In pieces of
    CHUNK tokens, recomputed in the backward (`checkpoint`), so no (b, d, L, n) tensor is kept."""
    pieces = []
    for lo in range(0, steps.shape[-1], CHUNK):
        decay = (steps[:, :, lo:lo + CHUNK, None] * A[:, None]).exp()  # (b, d, c, n)
        pieces.append(torch.einsum("bdcn,bnc->bdc", decay * start[:, :, None], C[:, :, lo:lo + CHUNK]))
    return torch.cat(pieces, dim=-1)


def cp_scan(local_scan, ctx: CPContext):
    """selective_scan_fn's interface for this rank's slice: `local_scan` (the original) from a zero state, plus the
    entering state's contribution, then the D skip and the z gate as HF's scan applies them."""
    def scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
             return_last_state=False, **kwargs):
        if return_last_state:
            raise InvalidConfigError("CP Mamba-1 scan runs training forwards only (no generation cache); call the "
                                     "model with use_cache=False")
        y, final = local_scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=delta_bias,
                              delta_softplus=delta_softplus, return_last_state=True, **kwargs)
        step = dt.float() + (delta_bias.float()[:, None] if delta_bias is not None else 0.0)
        steps = (F.softplus(step) if delta_softplus else step).cumsum(-1)  # (b, d, L): as the scan discretizes
        A = A.float()
        start = prefix_state(final.float(), steps[..., -1:] * A, ctx)  # (b, d, n)
        extra = checkpoint(_from_start, steps, A, C.float(), start, use_reentrant=False)
        out = (y.float() + extra).to(y.dtype)
        if D is not None:
            out = out + hidden_states * D[None, :, None]
        return out * F.silu(z) if z is not None else out
    return scan


def cp_conv(ctx: CPContext):
    """causal_conv1d_fn's interface for this rank's slice (b, c, L): the conv continues rank r - 1's tokens."""
    from transformers.activations import ACT2FN

    def conv(hidden_states, weight, bias=None, activation=None, **kwargs):
        out = conv_with_halo(hidden_states.transpose(1, 2), weight.unsqueeze(1), bias, ctx).transpose(1, 2)
        return (ACT2FN[activation](out) if activation is not None else out).to(hidden_states.dtype)
    return conv


def training_only(args, kwargs) -> None:
    """A CP mixer's call check: no generation cache (a cache would hold only this rank's slice of the states)."""
    if (args[1:] and args[1] is not None) or kwargs.get("cache") is not None or kwargs.get("cache_params") is not None:
        raise InvalidConfigError("a CP recurrent mixer runs training forwards only (no generation cache); call the "
                                 "model with use_cache=False")


def install_cp_scans(model: nn.Module, ctx: CPContext) -> int:
    """Wrap the forward of every Mamba-1 mixer of `model` with the CP dispatch points; returns how many. Raises for
    a mixer whose forward calls no one scan and conv CP can swap (models/dispatch.py `split_points`)."""
    found = scan_mixers(model)
    for path, mixer in found:
        points = split_points(mixer)
        if isinstance(points, str):
            raise InvalidConfigError(f"cp is refused for {path}: {points}; use cp=1")
        (where, name), _ = points
        swapping_forward(mixer, ((takes_scan, cp_scan(where[name], ctx)), (takes_conv, cp_conv(ctx)),
                                 (takes_fused, declined)), training_only)
    return len(found)
