"""Context-parallel short convolution (LFM2's mixer): its causal conv continues the previous rank's tokens.

Contract: `install_cp_short_convs(model, ctx)` replaces the forward of every short-convolution mixer of `model` (found by
its pattern, models/layered.py `short_convs`: in_proj to [B; C; x], B * x through a depthwise causal conv1d, times C,
out_proj) with one that, fed this rank's contiguous slice of the sequence, returns exactly that slice of the
full-sequence output (training path, no cache): the conv reads the last kernel - 1 tokens of rank r - 1
(runtime/cp_mamba.py `conv_with_halo`, zeros on rank 0). Its own linears and conv run, so tp's splits of them apply.
The whole contract: docs/modules/runtime.md (runtime/cp_conv.py).
"""

from __future__ import annotations

from torch import Tensor, nn

from autoshard.errors import InvalidConfigError
from autoshard.runtime.cp_mamba import conv_with_halo
from autoshard.runtime.cp_sequence import CPContext


def cp_short_conv_forward(mixer: nn.Module, names: tuple[str, str, str], ctx: CPContext, hidden_states: Tensor,
                          cache=None, attention_mask: Tensor | None = None, **kwargs) -> Tensor:
    """The short convolution's forward for this rank's contiguous slice (b, L, d) -> (b, L, d)."""
    if cache is not None:
        raise InvalidConfigError("CP short convolution runs training forwards only (no generation cache); call the "
                                 "model with use_cache=False")
    if attention_mask is not None and attention_mask.dim() == 2:  # HF's padding mask on the mixer's input
        hidden_states = hidden_states * attention_mask[:, :, None].to(hidden_states.dtype)
    into, conv, out = (getattr(mixer, n) for n in names)
    b, c, x = into(hidden_states).chunk(3, dim=-1)  # (b, L, width) each
    return out(c * conv_with_halo(b * x, conv.weight, conv.bias, ctx).to(c.dtype))


def install_cp_short_convs(model: nn.Module, ctx: CPContext) -> int:
    """Replace the forward of every short-convolution mixer in `model` with the CP one; returns how many."""
    from autoshard.models.layered import short_convs

    found = short_convs(model)
    for module, names in found:
        def forward(hidden_states, cache=None, attention_mask=None, _mixer=module, _names=names, **kwargs):
            return cp_short_conv_forward(_mixer, _names, ctx, hidden_states, cache, attention_mask, **kwargs)

        module.forward = forward
    return len(found)
