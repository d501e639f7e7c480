"""Gated delta rule substitution: the linear attention of Qwen3-Next / Qwen3.5 / OLMo-hybrid captured as one op.

Contract
--------
`substituted(model)`: a context manager; while it is open, every module of `model` whose forward calls a gated
delta rule (a global taking query, key, value, g, beta and an initial state: HF's `torch_chunk_gated_delta_rule`,
fla's `chunk_gated_delta_rule`) calls `autoshard::gated_delta_rule` instead, so the traced graph is the same for
every (b, s) (HF's torch fallback loops over 64-token chunks). Outside a capture nothing changes: the runtime runs
HF's function. `FLOPS` prices the op as fla's chunked kernel runs it: docs/decoders.md "The gated delta rule at
capture"."""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor, nn

from autoshard.models.dispatch import swapped, takes_delta_rule
from autoshard.passes.capture.reference_ops import reference_grads

CHUNK = 64  # tokens per chunk of fla's chunk_gated_delta_rule (and HF's torch fallback's default chunk_size)
OP = "gated_delta_rule"  # the op's name (its traced node's target prefix is in cost_table.SCAN_TARGETS)


def reference_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None,
                         l2norm: bool) -> tuple[Tensor, Tensor]:
    """(output (b, s, hv, dv), final state (b, hv, dk, dv)) of the gated delta rule token by token in fp32, as HF's
    `torch_recurrent_gated_delta_rule` states it: q / k (b, s, hk, dk), v (b, s, hv, dv), g / beta (b, s, hv)."""
    hv = v.shape[2]
    q, k = (x.repeat_interleave(hv // x.shape[2], dim=2).float() for x in (q, k))
    if l2norm:
        q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    q = q * q.shape[-1] ** -0.5
    v, g, beta = v.float(), g.float(), beta.float()
    s = torch.zeros(v.shape[0], hv, k.shape[-1], v.shape[-1]) if state is None else state.float()
    outs = []
    for t in range(v.shape[1]):
        s = s * g[:, t].exp()[..., None, None]
        delta = (v[:, t] - (s * k[:, t, :, :, None]).sum(-2)) * beta[:, t, :, None]
        s = s + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append((s * q[:, t, :, :, None]).sum(-2))
    out = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)
    return out, s


@functools.cache
def ops() -> tuple:
    """(forward, backward): the two ops, registered with torch.library once, on first use."""
    from torch.library import custom_op

    @custom_op(f"autoshard::{OP}", mutates_args=())
    def rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Optional[Tensor],
             l2norm: bool) -> tuple[Tensor, Tensor]:
        out, last = reference_delta_rule(q, k, v, g, beta, state, l2norm)
        return out.to(q.dtype), last

    @rule.register_fake
    def _(q, k, v, g, beta, state, l2norm):
        return v.new_empty(v.shape, dtype=q.dtype), v.new_empty(v.shape[0], v.shape[2], k.shape[-1], v.shape[-1],
                                                                dtype=torch.float32)

    @custom_op(f"autoshard::{OP}_backward", mutates_args=())
    def rule_backward(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Optional[Tensor],
                      dout: Tensor, l2norm: bool) -> list[Tensor]:
        return reference_grads(lambda *t: reference_delta_rule(*t, l2norm)[0], (q, k, v, g, beta, state), dout)

    @rule_backward.register_fake
    def _(q, k, v, g, beta, state, dout, l2norm):
        return [torch.empty_like(t) if t is not None else q.new_empty(0) for t in (q, k, v, g, beta, state)]

    def setup(ctx, inputs, output):
        ctx.l2norm = inputs[-1]
        ctx.present = tuple(t is not None for t in inputs[:-1])
        ctx.save_for_backward(*inputs[:-1])

    def backward(ctx, dout, _dstate):
        grads = rule_backward(*ctx.saved_tensors, dout, ctx.l2norm)
        return (*(g if has else None for g, has in zip(grads, ctx.present)), None)

    rule.register_autograd(backward, setup_context=setup)
    return rule, rule_backward


def substitute_delta_rule(query, key, value, g, beta, chunk_size=CHUNK, initial_state=None, output_final_state=False,
                          use_qk_l2norm_in_kernel=False, **_):
    """HF's `torch_chunk_gated_delta_rule` interface (what the mixer's forward calls) as the one traced op; the
    chunk size and fla's varlen keywords (cu_seqlens) change how, not what, it computes."""
    out, last = ops()[0](query, key, value, g, beta, initial_state, bool(use_qk_l2norm_in_kernel))
    return out, (last if output_final_state else None)


def substituted(model: nn.Module):
    """While open, every module of `model` whose forward calls a gated delta rule calls `autoshard::gated_delta_rule`;
    yields how many dispatch points were swapped."""
    return swapped(list({type(m): m for m in model.modules()}.values()), takes_delta_rule, substitute_delta_rule)


# -- cost -------------------------------------------------------------------------------------------------

def _forward_flops(k: Tensor, v: Tensor) -> int:
    """fla's chunked forward per (token, value head): the chunk's k_beta k^T and q k^T (4 C dk), the two
    triangular solves against v and k (C (dk + dv)), the chunk attention times the new values (2 C dv), and three
    state products (k S, q S, k^T v_new: 6 dk dv)."""
    b, s, hv, dv = v.shape
    dk = k.shape[-1]
    return b * s * hv * (5 * CHUNK * dk + 3 * CHUNK * dv + 6 * dk * dv)


FLOPS = {  # op name -> FLOPs from its arguments; the backward recomputes the chunk states (fla's chunk.py backward)
    OP: lambda args: _forward_flops(args[1], args[2]),
    f"{OP}_backward": lambda args: 3 * _forward_flops(args[1], args[2]),
}
