"""Context parallelism (CP): the sequence of every sample split over a group of ranks.

Contract: `CPContext(group=..., rank=..., size=...)` names the CP group of this rank.
`enable_context_parallel(model, ctx)` switches an unmodified HF `LlamaForCausalLM` or
`Mamba2ForCausalLM` so that its forward, fed this rank's slice of the sequence
(`split_sequence`) with this rank's real position ids (`sequence_positions`), computes exactly
this rank's slice of the full-sequence forward, and its backward the matching gradients
(summed over the CP group they give the full-sequence gradients).

The whole contract: docs/modules/runtime.md (runtime/context_parallel.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from autoshard.errors import UnsupportedOpError
from autoshard.runtime.cp_sequence import CPContext, SeqLayout, gather_sequence, sequence_positions, split_sequence
from autoshard.runtime.mesh import process_group

IGNORE_INDEX = -100


# -- layouts ---------------------------------------------------------------------------------

def layout_of(model: nn.Module) -> SeqLayout:
    """The sequence layout CP uses for `model`, by its sequence mixers (models/facts.py `mixer_of`,
    models/facts.py `ssd_mixers`): causal attention alone balanced, any SSD or Mamba-1 scan, gated DeltaNet or short
    convolution contiguous (a hybrid's attention then runs on the contiguous chunks); raises for a model with neither."""
    from autoshard.models.facts import mixer_of, ssd_mixers
    from autoshard.models.layered import short_convs
    from autoshard.models.dispatch import delta_mixers, scan_mixers

    # (Mamba-1's scans and gated DeltaNets pass their state, LFM2's short convolutions continue the previous chunk)
    if ssd_mixers(model) or scan_mixers(model) or delta_mixers(model) or short_convs(model):
        return SeqLayout.CONTIGUOUS
    if mixer_of(model) == "attention":  # causal attention (MoE MLPs are per token)
        return SeqLayout.BALANCED
    raise UnsupportedOpError(
        f"context parallelism has no rule for {type(model).__name__}: it holds no HF attention module and no SSD "
        "scan (Mamba-2), the sequence mixers autoshard splits the sequence of; run this model with cp=1"
    )


def has_attention(model: nn.Module) -> bool:
    from autoshard.models.facts import is_attention

    return any(is_attention(m) for m in model.modules())


def split_targets(labels: Tensor, ctx: CPContext, layout: SeqLayout) -> Tensor:
    """Shift (b, S) labels over the whole sequence (target[t] = labels[t+1], -100 last), then split."""
    shifted = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    return split_sequence(shifted, ctx, layout, dim=-1)


def split_batch(input_ids: Tensor, labels: Tensor | None, ctx: CPContext,
                layout: SeqLayout) -> tuple[Tensor, Tensor, Tensor | None]:
    """(b, S) ids and unshifted labels -> this rank's (ids, position ids (1, S/cp), shifted targets)."""
    positions = sequence_positions(input_ids.shape[-1], ctx.size, ctx.rank, layout).to(input_ids.device)[None]
    targets = None if labels is None else split_targets(labels, ctx, layout)
    return split_sequence(input_ids, ctx, layout), positions, targets


# -- switching a model ----------------------------------------------------------------------

def enable_context_parallel(model: nn.Module, ctx: CPContext) -> SeqLayout:
    """Switch `model`'s attention (LLaMA) and / or SSD mixers (Mamba-2, hybrids) to their CP versions, in place.

    Returns the layout the inputs must be split with. With ctx.size == 1 nothing changes.
    Raises UnsupportedOpError (before any collective) for a model with no CP rule.
    """
    layout = layout_of(model)
    if ctx.size == 1:
        return layout
    model.config.use_cache = False  # a cache would hold only this rank's slice
    if has_attention(model):
        from autoshard.runtime.cp_attention import install_cp_attention

        install_cp_attention(model, ctx, layout)
    if layout is SeqLayout.CONTIGUOUS:
        from autoshard.models.facts import ssd_mixers
        from autoshard.runtime.cp_conv import install_cp_short_convs
        from autoshard.runtime.cp_mamba import install_cp_mixers
        from autoshard.runtime.cp_delta import install_cp_delta_rules
        from autoshard.runtime.cp_scan import install_cp_scans

        if ssd_mixers(model):
            install_cp_mixers(model, ctx)
        install_cp_scans(model, ctx)
        install_cp_delta_rules(model, ctx)
        install_cp_short_convs(model, ctx)
    return layout


# -- the runtime's side (autoshard.api / DistributedModel) ---------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class CPRuntime:
    """What `DistributedModel` needs for cp > 1: this rank's context, the model's layout, and the
    dp x cp group over which replicated gradients are summed (and ZeRO shards optimizer state)."""

    ctx: CPContext
    layout: SeqLayout
    grad_group: dist.ProcessGroup
    attention: bool = True  # the model holds attention layers: its rotary needs the real positions

    def local_inputs(self, input_ids: Tensor, labels: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
        """(b, S) ids and unshifted labels -> this rank's ids, position ids and *shifted* targets."""
        return split_batch(input_ids, labels, self.ctx, self.layout)

    def positions(self, local_len: int) -> Tensor:
        """(1, local_len) global positions of this rank's tokens (pipeline stages rebuild them)."""
        return sequence_positions(local_len * self.ctx.size, self.ctx.size, self.ctx.rank, self.layout)[None]

    def model_kwargs(self, position_ids: Tensor) -> dict[str, Tensor]:
        """Extra forward kwargs of the base model: attention layers need the real positions (rotary)."""
        return {"position_ids": position_ids} if self.attention else {}

    def full_sequence(self, local: Tensor) -> Tensor:
        """Every rank's slice (b, S/cp, ...) -> the whole sequence (b, S, ...) in natural order."""
        return gather_sequence(local, self.ctx, self.layout)


def data_context_group(mesh, coords) -> tuple[list[list[int]], int]:
    """The dp x cp rank sets of the mesh (one per pp, ep and tp index), and the index of this rank's set."""
    from autoshard.runtime.mesh import axes_ranks, rank_of

    sets = axes_ranks(mesh, ("dp", "cp"))
    me = rank_of(coords, mesh)
    return sets, next(i for i, ranks in enumerate(sets) if me in ranks)


def setup_context_parallel(model: nn.Module, mesh, groups) -> CPRuntime | None:
    """Collective over the world when mesh.cp > 1 (creates the dp x cp groups); installs the CP
    attention / mixers on `model`. None when cp == 1. `groups` is `runtime.mesh.Groups`."""
    if mesh.cp == 1:
        return None
    layout = layout_of(model)  # raises before any collective for a model with no CP rule
    sets, mine = data_context_group(mesh, groups.coords)
    made = [process_group(ranks, backend=groups.backend) for ranks in sets]
    ctx = CPContext.from_group(groups.cp)
    enable_context_parallel(model, ctx)
    return CPRuntime(ctx=ctx, layout=layout, grad_group=made[mine], attention=has_attention(model))
