"""Selective-scan substitution: the Mamba-1 scan captured as one op, priced as mamba_ssm's fused kernel.

Contract
--------
`substituted(model)`: a context manager; while it is open, every Mamba-1 mixer of `model` (found by its
pattern: own `A_log`, `x_proj`, `dt_proj`, no `dt_bias`) calls `autoshard::selective_scan` where its forward
dispatches its scan (HF's `mamba_selective_scan`), instead of HF's token-by-token loop, so the traced graph
is the same for every (b, s). Outside a capture nothing changes: the runtime runs HF's scan.

The op, its saved chunk states, `SCAN_FLOPS` and their sources: docs/modules/capture.md
(passes/capture/selective_scan.py) and docs/decoders.md "The Mamba-1 selective scan at capture"."""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor, nn

from autoshard.models.dispatch import dispatch_points, scan_mixers, swapped, takes_scan
from autoshard.passes.capture.reference_ops import reference_grads

CHUNK = 2048  # tokens per chunk state of mamba_ssm's selective_scan_fwd kernel (kNThreads * kNItems = 128 * 16)


# -- the math (the real kernels: what the traced op means) --------------------------------------------------

def reference_scan(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None,
                   z: Tensor | None, delta_bias: Tensor | None, softplus: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(y, out, last state): the selective scan of selective_scan_fn's interface in fp32, u / delta / z (b, d, s),
    A (d, n), B / C (b, n, s), D / delta_bias (d,). `out` is y before the z gate."""
    dt = delta.float() + (delta_bias.float()[:, None] if delta_bias is not None else 0.0)
    dt = torch.nn.functional.softplus(dt) if softplus else dt
    decay = torch.exp(dt[..., None] * A.float()[:, None, :])  # (b, d, s, n)
    drive = dt[..., None] * B.float().transpose(1, 2)[:, None] * u.float()[..., None]  # (b, d, s, n)
    state = u.new_zeros(u.shape[0], u.shape[1], A.shape[1], dtype=torch.float32)  # (b, d, n)
    ys = []
    for t in range(u.shape[2]):
        state = decay[:, :, t] * state + drive[:, :, t]
        ys.append(torch.einsum("bdn,bn->bd", state, C[:, :, t].float()))
    out = torch.stack(ys, dim=-1) if ys else u.new_zeros(u.shape, dtype=torch.float32)  # (b, d, s)
    if D is not None:
        out = out + u.float() * D.float()[:, None]
    y = out * torch.nn.functional.silu(z.float()) if z is not None else out
    return y, out, state


def _chunks(s) -> int:
    return -(-s // CHUNK)


@functools.cache
def ops() -> tuple:
    """(forward, backward): the two ops, registered with torch.library once, on first use."""
    from torch.library import custom_op

    @custom_op("autoshard::selective_scan", mutates_args=())
    def scan(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor], z: Optional[Tensor],
             delta_bias: Optional[Tensor], delta_softplus: bool) -> tuple[Tensor, Tensor, Tensor]:
        y, out, last = reference_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus)
        b, d, s = u.shape
        x = u.new_zeros(b, d, _chunks(s), 2 * A.shape[1], dtype=A.dtype)  # the final state in the last chunk's
        if s:  # odd entries (mamba_ssm keeps each chunk's (decay product, state) pairs there)
            x[:, :, -1, 1::2] = last.to(A.dtype)
        kept = out.to(delta.dtype) if z is not None else delta.new_empty(0)
        return y.to(delta.dtype if z is None else z.dtype), kept, x

    @scan.register_fake
    def _(u, delta, A, B, C, D, z, delta_bias, delta_softplus):
        b, d, s = u.shape
        y = torch.empty_like(z) if z is not None else torch.empty_like(delta)  # out_z = empty_like(z)
        kept = torch.empty_like(delta) if z is not None else delta.new_empty(0)  # out = empty_like(delta)
        return y, kept, u.new_empty(b, d, _chunks(s), 2 * A.shape[1], dtype=A.dtype)

    @custom_op("autoshard::selective_scan_backward", mutates_args=())
    def scan_backward(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor],
                      z: Optional[Tensor], delta_bias: Optional[Tensor], dy: Tensor, x: Tensor, out: Tensor,
                      delta_softplus: bool) -> list[Tensor]:
        return reference_grads(lambda *t: reference_scan(*t, delta_softplus)[0], (u, delta, A, B, C, D, z, delta_bias), dy)

    @scan_backward.register_fake
    def _(u, delta, A, B, C, D, z, delta_bias, dy, x, out, delta_softplus):
        return [torch.empty_like(t) if t is not None else u.new_empty(0) for t in (u, delta, A, B, C, D, z, delta_bias)]

    def setup(ctx, inputs, output):
        ctx.softplus = inputs[-1]
        ctx.present = tuple(t is not None for t in inputs[:-1])
        ctx.save_for_backward(*inputs[:-1], output[2], output[1])

    def backward(ctx, dy, _dout, _dx):
        *inputs, x, out = ctx.saved_tensors
        grads = scan_backward(*inputs, dy, x, out, ctx.softplus)
        return (*(g if has else None for g, has in zip(grads, ctx.present)), None)

    scan.register_autograd(backward, setup_context=setup)
    return scan, scan_backward


def substitute_scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                    return_last_state=False, **_):
    """selective_scan_fn's interface (what HF's `mamba_selective_scan` takes) as the one traced op; the keywords
    choosing HF's torch alternatives (use_mambapy, use_associative_scan) compute the same scan and are dropped."""
    y, _, x = ops()[0](hidden_states, dt, A, B, C, D, z, delta_bias, delta_softplus)
    return (y, x[:, :, -1, 1::2]) if return_last_state else y


# -- cost -------------------------------------------------------------------------------------------------

def _forward_flops(u: Tensor, A: Tensor, D: Tensor | None, z: Tensor | None) -> int:
    b, d, s = u.shape
    return 9 * b * s * d * A.shape[1] + b * s * d * ((D is not None) + (z is not None))


SCAN_FLOPS = {  # op name -> FLOPs from its arguments' values (see the module docstring)
    "selective_scan": lambda args: _forward_flops(args[0], args[2], args[5], args[6]),
    "selective_scan_backward": lambda args: 3 * _forward_flops(args[0], args[2], args[5], args[6]),
}


# -- finding and swapping the dispatch points ---------------------------------------------------------------

def scan_dispatch(module: nn.Module) -> tuple[dict, str] | None:
    """(globals, name) of the function a Mamba-1 mixer's forward calls to scan (selective_scan_fn's signature),
    or None."""
    return next(iter(dispatch_points(module, takes_scan, substitute_scan)), None)


def substituted(model: nn.Module):
    """While open, the Mamba-1 mixers of `model` scan through `autoshard::selective_scan`; yields how many
    dispatch points were swapped (a mixer whose forward has none is traced as it is)."""
    return swapped((m for _, m in scan_mixers(model)), takes_scan, substitute_scan)
