"""Carry out a `ShardProgram` on an unmodified HF model, in place.

Contract: `apply_tensor_parallel(model, program, group)` leaves `model` with every parameter
replaced by this rank's slice (same names, ties kept), module size attributes set, and the
collectives of the program inserted:

* regions: a forward pre-hook passes the module's hidden-states input through
  `copy_to_group` (identity forward, gradient all-reduce backward);
* rowwise linears become `RowParallelLinear` (partial output all-reduced, bias added once);
* the vocab embedding becomes `VocabParallelEmbedding`, the LM head `VocabParallelHead`
  (its output is this rank's vocab slice of the logits: use the vocab-parallel loss);
* `checkpoint` modules rerun their forward in backward (torch.utils.checkpoint, non-reentrant).

A model built on the meta device is materialised here one module at a time (HF's own
`_init_weights`, same seed on every rank) and sliced at once, so no rank holds more than one
full block. The class swaps keep parameter names, so `model.named_parameters()` still uses
the original HF names (what `full_state_dict` reports).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from autoshard.ir import Replicate, Shard, ShardProgram
from autoshard.runtime.comm import copy_to_group, reduce_from_group
from autoshard.runtime.data_parallel import take_grad


def shard_tensor(full: Tensor, placement: Replicate | Shard) -> Tensor:
    """This rank's slice of `full` (a new contiguous tensor)."""
    if isinstance(placement, Replicate):
        return full.detach().clone()
    pieces = [full.narrow(placement.dim, start, length) for start, length in placement.ranges()]
    return torch.cat(pieces, dim=placement.dim).contiguous() if len(pieces) > 1 else pieces[0].contiguous()


def unshard(slices: Sequence[Tensor], placement: Replicate | Shard) -> Tensor:
    """The full tensor from every tp rank's slice (`slices` in tp-rank order)."""
    if isinstance(placement, Replicate):
        return slices[0]
    distinct = slices[:: len(slices) // placement.parts]  # ranks holding the same slice agree
    per_piece = [s.split(list(placement.local_sizes()), dim=placement.dim) for s in distinct]
    pieces = [per_piece[0][i] if placement.kept_whole(i) else torch.cat([p[i] for p in per_piece], dim=placement.dim)
              for i in range(len(placement.segments))]
    return torch.cat(pieces, dim=placement.dim)


class RowParallelLinear(nn.Linear):
    """A linear holding rows of W^T (columns of the input): y = all_reduce(x_local W_local^T) + b."""

    tp_group: dist.ProcessGroup

    def forward(self, x: Tensor) -> Tensor:
        y = reduce_from_group(F.linear(x, self.weight), self.tp_group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Rows [vocab_start, vocab_start + rows) of the table; other ids contribute zeros, then sum."""

    tp_group: dist.ProcessGroup
    vocab_start: int

    def forward(self, ids: Tensor) -> Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # (b, s, h)
        return reduce_from_group(out.masked_fill(outside.unsqueeze(-1), 0.0), self.tp_group)


class VocabParallelHead(nn.Linear):
    """LM head split over the vocab: replicated hidden in, this rank's logits slice out."""

    tp_group: dist.ProcessGroup

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(copy_to_group(x, self.tp_group), self.weight, self.bias)


def apply_tensor_parallel(model: nn.Module, program: ShardProgram, group: dist.ProcessGroup | None, *,
                          seed: int = 0) -> None:
    """Slice `model`'s parameters and insert the collectives of `program` (in place)."""
    _materialize(model, seed=seed)
    placements = dict(program.placements)
    holders = _holders(model)
    for name, param in list(model.named_parameters()):
        new = nn.Parameter(shard_tensor(param.data, placements.get(name, Replicate())),
                           requires_grad=param.requires_grad)
        for module, attr in holders[id(param)]:
            setattr(module, attr, new)
    for path, attr, value in program.attrs:
        setattr(model.get_submodule(path), attr, value)
        if attr == "ssd_norm_group_size":  # a Mamba-2 norm group spans ranks: runtime/ssd.py gated_norm syncs
            model.get_submodule(path).ssd_tp_group = group
    for path in program.regions:
        model.get_submodule(path).register_forward_pre_hook(
            functools.partial(_enter_region, group=group), with_kwargs=True)
    swaps = [(p, RowParallelLinear) for p in program.rowwise]
    swaps += [(p, cls) for p, cls in ((program.vocab_embed, VocabParallelEmbedding),
                                      (program.vocab_head, VocabParallelHead)) if p]
    for path, cls in swaps:
        module = model.get_submodule(path)
        module.__class__ = cls
        module.tp_group = group
        if cls is VocabParallelEmbedding:
            module.vocab_start = program.placement(f"{path}.weight").index * module.weight.shape[0]
            module.num_embeddings = module.weight.shape[0]
        elif cls is VocabParallelHead:
            module.out_features = module.weight.shape[0]
    for path in program.checkpoint:
        _checkpoint_forward(model.get_submodule(path))


def partial_grad_reducer(model: nn.Module, program: ShardProgram, group: dist.ProcessGroup | None):
    """A `GradSync.prepare` callback that sums the gradients of slices held by several tp ranks
    (`program.partial_grads`, e.g. one KV head serving the query heads of tp / kv_heads ranks, or
    Mamba-2's B/C rows kept whole on every rank)."""
    placements = dict(program.placements)
    partial = {id(p): placements[n] for n, p in model.named_parameters() if n in program.partial_grads}

    def prepare(params: Sequence[nn.Parameter]) -> None:
        for param in params:
            placement = partial.get(id(param))
            grad = take_grad(param)  # bf16-mixed: the fp32 main gradient (runtime/data_parallel.py)
            if placement is None or grad is None:
                continue
            if any(placement.whole):  # (not under ZeRO-3: the rows are cut over dp there)
                _sum_whole_pieces(grad, placement, group)
                continue
            # ZeRO-3: the dp shard of the gradient (FSDP2 cuts every tp rank's slice at the same rows)
            grad = grad.to_local() if hasattr(grad, "to_local") else grad  # a DTensor
            slots = grad.new_zeros((placement.parts, *grad.shape))  # one slot per distinct slice
            slots[placement.index] = grad
            dist.all_reduce(slots, group=group)
            grad.copy_(slots[placement.index])

    return prepare if partial else None


def _sum_whole_pieces(grad: Tensor, placement: Shard, group) -> None:
    """Sum over tp, in place, the rows of the pieces every rank holds whole (each rank's gradient
    there is the part its own heads contributed)."""
    starts, offset = [], 0
    for i, n in enumerate(placement.local_sizes()):
        if placement.kept_whole(i):
            starts.append(torch.arange(offset, offset + n, device=grad.device))
        offset += n
    rows = torch.cat(starts)
    part = grad.index_select(placement.dim, rows).contiguous()
    dist.all_reduce(part, group=group)
    grad.index_copy_(placement.dim, rows, part)


def _enter_region(module: nn.Module, args: tuple, kwargs: dict, *, group) -> tuple[tuple, dict]:
    if args:
        return (copy_to_group(args[0], group), *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": copy_to_group(kwargs["hidden_states"], group)}


def _checkpoint_forward(module: nn.Module) -> None:
    forward = module.forward

    def checkpointed(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed


def _holders(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """id(parameter) -> every (module, attribute) holding it (tied weights have several)."""
    out: dict[int, list] = {}
    for module in model.modules():
        for attr, param in module._parameters.items():
            if param is not None:
                out.setdefault(id(param), []).append((module, attr))
    return out


def _materialize(model: nn.Module, *, seed: int) -> None:
    """Allocate and initialise (HF `_init_weights`) the meta tensors of `model`, module by module."""
    init = getattr(model, "_init_weights", None)
    if not any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        return
    if init is None:
        raise TypeError(f"{type(model).__name__} was built on the meta device and has no HF _init_weights; "
                        "build it on cpu or load weights first")
    holders = _holders(model)
    torch.manual_seed(seed)
    for module in model.modules():
        own = (*module.parameters(recurse=False), *module.buffers(recurse=False))
        if any(t.is_meta for t in own):
            module.to_empty(device="cpu", recurse=True)
            with torch.no_grad():
                module.apply(init)
    for ids in holders.values():  # re-tie what to_empty untied (the first holder wins, as HF ties)
        first = getattr(*ids[0])
        for module, attr in ids[1:]:
            setattr(module, attr, first)
