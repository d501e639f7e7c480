"""Context-parallel gated DeltaNet (Qwen3-Next, Qwen3.5, OLMo-hybrid): its state passed between ranks (contiguous).

Contract: `install_cp_delta_rules(model, ctx)` wraps the forward of every module whose forward calls a gated delta
rule (models/dispatch.py `delta_mixers`) so that, fed this rank's contiguous slice of the sequence, it returns exactly
that slice of the full-sequence output (training path, no cache). HF's own forward runs (its projections, norms and
tp's splits of them); only its dispatch points are swapped while it runs: the causal conv continues rank r - 1's
tokens (runtime/cp_scan.py `cp_conv`), and the rule (`cp_delta_rule`) runs three times: from a zero state (its final
state S_0), on zero values from the identity (M, the product of its transitions exp(g) (I - beta k k^T), since the
state is affine in the one it starts from), and, once every rank's (S_0, M) is all-gathered and composed into the
state entering its slice, from that state (its output).
The whole contract: docs/modules/runtime.md (runtime/cp_delta.py).
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn

from autoshard.errors import InvalidConfigError
from autoshard.models.dispatch import (delta_mixers, delta_split, dispatch_points, swapping_forward, takes_conv,
                                       takes_delta_rule)
from autoshard.runtime.cp_scan import cp_conv, training_only
from autoshard.runtime.cp_sequence import CPContext, all_gather_autograd


def entering_state(final: Tensor, transition: Tensor, ctx: CPContext) -> Tensor:
    """The state entering this rank's slice (b, h, dk, dv), from every rank's final state from zero `final`
    (b, h, dk, dv) and its slice's transition `transition` (b, h, dk, dk): rank j's entering state times M_j plus
    its S_0, rank after rank. Rank 0's is zeros, still in the graph, so every rank runs the reduce-scatters."""
    dv = final.shape[-1]
    gathered = all_gather_autograd(torch.cat([final, transition], dim=-1).unsqueeze(0), ctx)  # (cp, b, h, dk, dv+dk)
    state = gathered[0, ..., :dv] * 0.0
    for j in range(ctx.rank):
        state = gathered[j, ..., dv:] @ state + gathered[j, ..., :dv]
    return state


def cp_delta_rule(original, ctx: CPContext):
    """A gated delta rule's interface for this rank's slice: `original` from zero, on zero values from the identity,
    then from the entering state (see the module docstring)."""
    def rule(query, key, value, g, beta, *args, initial_state=None, output_final_state=False, **kwargs):
        if initial_state is not None or output_final_state:
            raise InvalidConfigError("a CP gated DeltaNet runs training forwards only (no generation cache); call the "
                                     "model with use_cache=False")
        if kwargs.get("cu_seqlens") is not None:  # packed sequences: their bounds are not where the ranks' are
            raise InvalidConfigError("a CP gated DeltaNet takes no packed sequences (cu_seqlens); give one sequence per "
                                     "row, padding marked with label -100")
        _, final = original(query, key, value, g, beta, *args, initial_state=None, output_final_state=True, **kwargs)
        b, _, heads, dk = *value.shape[:3], key.shape[-1]
        eye = torch.eye(dk, dtype=final.dtype, device=final.device).expand(b, heads, dk, dk)
        _, transition = original(query, key, value.new_zeros(*value.shape[:3], dk), g, beta, *args,
                                 initial_state=eye, output_final_state=True, **kwargs)
        start = entering_state(final.float(), transition.float(), ctx)
        out, _ = original(query, key, value, g, beta, *args, initial_state=start.to(final.dtype),
                          output_final_state=False, **kwargs)
        return out, None
    return rule


def install_cp_delta_rules(model: nn.Module, ctx: CPContext) -> int:
    """Wrap the forward of every gated DeltaNet of `model` with the CP dispatch points; returns how many. Raises for
    one whose forward calls no one causal conv CP can swap (models/dispatch.py `delta_split`). Every rule point
    (HF's chunked form and its one-token recurrent form, which only a cache reaches) runs the chunked original."""
    found = delta_mixers(model)
    for path, mixer in found:
        why = delta_split(mixer)
        if why:
            raise InvalidConfigError(f"cp is refused for {path}: {why}; use cp=1")
        rules = [where[name] for where, name in dispatch_points(mixer, takes_delta_rule, object())]
        chunked = next((f for f in rules if "chunk_size" in inspect.signature(f).parameters), rules[0])
        swapping_forward(mixer, ((takes_delta_rule, cp_delta_rule(chunked, ctx)), (takes_conv, cp_conv(ctx))),
                         training_only)
    return len(found)
