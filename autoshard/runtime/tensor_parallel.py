"""Carry out a `ShardProgram` on an unmodified HF model, in place.

Contract: `apply_tensor_parallel(model, program, group)` leaves `model` with every parameter
replaced by this rank's slice (same names, ties kept), module size attributes set, and the
collectives of the program inserted.

The whole contract: docs/modules/runtime.md (runtime/tensor_parallel.py).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from autoshard.ir import Replicate, Shard, ShardProgram
from autoshard.runtime.comm import (all_gather_dim, copy_to_group, gather_from_sequence, gather_last_dim, gather_sequence,
                                    reduce_from_group, reduce_scatter_to_sequence, split_last_dim, split_sequence)
from autoshard.runtime.data_parallel import take_grad

SEQ_DIM = 1  # hidden states are (batch, sequence, hidden)


def token_dim(x: Tensor) -> int:
    """The dim sequence parallelism splits `x` on: the sequence of (batch, sequence, hidden) hidden states, or the
    tokens of a (tokens, hidden) view an MLP flattens them to (OPT's): its rank-major gather there is per-token work,
    and the row-parallel output's reduce-scatter hands each rank its own tokens back in their order."""
    return SEQ_DIM if x.dim() > 2 else 0


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
    sequence_parallel: bool = False

    def forward(self, x: Tensor) -> Tensor:
        return self.reduce_and_add_bias(F.linear(x, self.weight))

    def reduce_and_add_bias(self, y: Tensor) -> Tensor:
        """The local partial product `y` summed over tp (reduce-scattered along the sequence under sequence
        parallelism), then the bias, once (runtime/fp8.py's float8 row-parallel linear calls it too)."""
        y = (reduce_scatter_to_sequence(y, self.tp_group, token_dim(y)) if self.sequence_parallel
             else reduce_from_group(y, self.tp_group))
        return y if self.bias is None else y + self.bias


class RowParallelConv1D(nn.Module):
    """HF's Conv1D (GPT-2's; weight stored [input, output]) holding rows of its weight: y = all_reduce(x_local
    W_local) + b, as RowParallelLinear sums. No nn.Linear: torchao's float8 swap leaves it alone, as the cost model
    prices it (rules/sharding.py `is_float8_role`)."""

    tp_group: dist.ProcessGroup
    sequence_parallel: bool = False

    def forward(self, x: Tensor) -> Tensor:
        return RowParallelLinear.reduce_and_add_bias(self, torch.matmul(x, self.weight))


class VocabParallelEmbedding(nn.Embedding):
    """Rows [vocab_start, vocab_start + rows) of the table; other ids contribute zeros, then sum."""

    tp_group: dist.ProcessGroup
    vocab_start: int
    sequence_parallel: bool = False  # the output is this rank's shard of the sequence (reduce-scatter)

    def forward(self, ids: Tensor) -> Tensor:
        local = ids - self.vocab_start
        rows = self.weight.shape[0]
        outside = (local < 0) | (local >= rows)
        pad = None if self.padding_idx is None else self.padding_idx - self.vocab_start  # HF's padding row: no gradient
        pad = pad if pad is not None and 0 <= pad < rows else None
        out = F.embedding(local.masked_fill(outside, 0), self.weight, pad).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(out, self.tp_group, SEQ_DIM)  # (b, s / tp, h)
        return reduce_from_group(out, self.tp_group)  # (b, s, h)


class VocabParallelHead(nn.Linear):
    """LM head split over the vocab: replicated hidden in, this rank's logits slice out."""

    tp_group: dist.ProcessGroup
    sequence_parallel: bool = False  # the input is this rank's shard of the sequence: all-gathered first

    def forward(self, x: Tensor) -> Tensor:
        if not self.sequence_parallel:
            return F.linear(copy_to_group(x, self.tp_group), self.weight, self.bias)
        full = gather_from_sequence(x, self.tp_group, SEQ_DIM)
        with _ShardSaved(full, x, self.tp_group):
            return F.linear(full, self.weight, self.bias)


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
    for name, placement in program.buffers:  # indexed like a sharded parameter (Falcon-H1's mup_vector)
        module, _, attr = name.rpartition(".")
        holder = model.get_submodule(module)
        holder.register_buffer(attr, shard_tensor(getattr(holder, attr), placement),
                               persistent=attr not in holder._non_persistent_buffers_set)
    for path, attr, value in program.attrs:
        setattr(model.get_submodule(path), attr, value)
        if attr == "ssd_norm_group_size":  # a Mamba-2 norm group spans ranks: runtime/ssd.py gated_norm syncs
            model.get_submodule(path).ssd_tp_group = group
    on = set(program.sequence_paths)  # the modules of the sequence-parallel stages (every one when uniform)
    for path in program.regions:
        if path in on:
            _gather_in_forward(model.get_submodule(path), group, keep_shard=not _recomputed(path, program))
        else:
            model.get_submodule(path).register_forward_pre_hook(
                functools.partial(_enter_region, group=group), with_kwargs=True)
    for path in program.sequence_wholes:  # HF's gathered attention: leaves the shard at its input, runs whole
        _whole_in_forward(model.get_submodule(path), group)
    # a row-parallel weight split on dim 0 is a transposed linear's (rules/sharding.py `param_dim`)
    swaps = [(p, RowParallelConv1D if getattr(placements.get(f"{p}.weight"), "dim", 1) == 0 else RowParallelLinear)
             for p in program.rowwise]
    swaps += [(p, cls) for p, cls in ((program.vocab_embed, VocabParallelEmbedding),
                                      (program.vocab_head, VocabParallelHead)) if p]
    for path, cls in swaps:
        module = model.get_submodule(path)
        module.__class__ = cls
        module.tp_group = group
        # a row-parallel linear inside a region (Mamba-1's x_proj) sums its output on the gathered sequence
        module.sequence_parallel = path in on and path not in program.output_regions
        if cls is VocabParallelEmbedding:
            module.vocab_start = program.placement(f"{path}.weight").index * module.weight.shape[0]
            module.num_embeddings = module.weight.shape[0]
        elif cls is VocabParallelHead:
            module.out_features = module.weight.shape[0]
    for path in program.output_regions:  # its summed output feeds every rank's channels: gradient all-reduced
        model.get_submodule(path).register_forward_hook(lambda module, args, out: copy_to_group(out, group))
    for path in program.gather_outputs:  # HF's colwise_gather_output: enters tp itself, its output gathered whole
        module = model.get_submodule(path)
        module.register_forward_pre_hook(lambda module, args: (copy_to_group(args[0], group), *args[1:]))
        module.register_forward_hook(lambda module, args, out: gather_last_dim(out, group))
    for path in program.split_inputs:  # HF's rowwise_split_input: its whole input's columns of this rank
        model.get_submodule(path).register_forward_pre_hook(
            lambda module, args: (split_last_dim(args[0], group), *args[1:]))
    for path in program.sequence_splits:  # a replicated embedding: its output enters the sequence shard
        module = model.get_submodule(path)
        module.sequence_parallel = True  # (`sequence_parallel_off` turns it off)
        module.register_forward_hook(
            lambda module, args, out: split_sequence(out, group, SEQ_DIM) if module.sequence_parallel else out)
    for path in program.sequence_gathers:  # a replicated LM head: its input leaves the sequence shard
        module = model.get_submodule(path)
        module.sequence_parallel = True
        module.register_forward_pre_hook(lambda module, args: (
            (gather_sequence(args[0], group, SEQ_DIM), *args[1:]) if module.sequence_parallel else args))
    for path in program.checkpoint:
        _checkpoint_forward(model.get_submodule(path))


def partial_grad_reducer(model: nn.Module, program: ShardProgram, group: dist.ProcessGroup | None):
    """A `GradSync.prepare` callback that sums the gradients of slices held by several tp ranks
    (`program.partial_grads`, e.g. one KV head serving the query heads of tp / kv_heads ranks, or
    Mamba-2's B/C rows kept whole on every rank), and under sequence parallelism those computed
    from a sequence shard (`sequence_grad_reducer`)."""
    placements = dict(program.placements)
    partial = {id(p): placements[n] for n, p in model.named_parameters() if n in program.partial_grads}
    sequence = sequence_grad_reducer(model, program, group)

    def prepare(params: Sequence[nn.Parameter]) -> None:
        if sequence is not None:
            sequence(params)
        for param in params:
            placement = partial.get(id(param))
            grad = take_grad(param)  # bf16-mixed: the fp32 main gradient (runtime/data_parallel.py)
            if placement is None or grad is None:
                continue
            if isinstance(placement, Replicate):  # a replicated weight used on this rank's heads only (q/k norms)
                local = grad.to_local() if hasattr(grad, "to_local") else grad
                dist.all_reduce(local, group=group)
                continue
            if any(placement.whole):
                _sum_whole_pieces(grad, placement, group)
                continue
            # ZeRO-3: the dp shard of the gradient (FSDP2 cuts every tp rank's slice at the same rows)
            grad = grad.to_local() if hasattr(grad, "to_local") else grad  # a DTensor
            slots = grad.new_zeros((placement.parts, *grad.shape))  # one slot per distinct slice
            slots[placement.index] = grad
            dist.all_reduce(slots, group=group)
            grad.copy_(slots[placement.index])

    return prepare if partial else sequence


def _sum_whole_pieces(grad: Tensor, placement: Shard, group) -> None:
    """Sum over tp, in place, the rows of the pieces every rank holds whole (each rank's gradient
    there is the part its own heads contributed). Under ZeRO-3 `grad` is this rank's dp shard (a DTensor
    cut along dim 0 as `torch.chunk` cuts, at the same rows on every tp rank, which share their dp
    coordinate): the rows of the pieces that fall in it."""
    starts, offset = [], 0
    for i, n in enumerate(placement.local_sizes()):
        if placement.kept_whole(i):
            starts.append(torch.arange(offset, offset + n, device=grad.device))
        offset += n
    rows = torch.cat(starts)
    if hasattr(grad, "to_local"):  # a DTensor (duck-typed: no import)
        local = grad.to_local()
        if placement.dim == 0:
            mesh = grad.device_mesh
            first = mesh.get_local_rank() * -(-grad.shape[0] // mesh.size())
            rows = rows[(rows >= first) & (rows < first + local.shape[0])] - first
        grad = local
        if rows.numel() == 0:  # no whole row in this shard (nor in the tp peers' same shard)
            return
    part = grad.index_select(placement.dim, rows).contiguous()
    dist.all_reduce(part, group=group)
    grad.index_copy_(placement.dim, rows, part)


def sequence_grad_reducer(model: nn.Module, program: ShardProgram, group: dist.ProcessGroup | None):
    """A `GradSync.prepare` callback summing over tp the gradients each rank computed from its
    sequence shard under sequence parallelism (`program.sequence_grads`: norm weights, row-parallel
    biases); None without it. Under ZeRO-3 the gradient is this rank's dp shard (a DTensor), cut at
    the same rows on every tp rank."""
    names = set(program.sequence_grads)
    params = [p for n, p in model.named_parameters() if n in names]
    if not params or group is None:
        return None
    ids = {id(p) for p in params}

    def prepare(params_: Sequence[nn.Parameter]) -> None:
        grads = [take_grad(p) for p in params_ if id(p) in ids]  # bf16-mixed: the fp32 main gradients
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads if g is not None]
        if not local:
            return
        flat = torch.cat([g.reshape(-1) for g in local])  # one collective for all of them
        dist.all_reduce(flat, group=group)
        for g, part in zip(local, flat.split([g.numel() for g in local])):
            g.copy_(part.view_as(g))

    return prepare


def _recomputed(path: str, program: ShardProgram) -> bool:
    """Is the module at `path` rerun in backward (itself or a module holding it checkpointed)?"""
    return any(path == c or path.startswith(c + ".") for c in program.checkpoint)


def _gather_in_forward(module: nn.Module, group, *, keep_shard: bool) -> None:
    """Sequence parallelism: the region's forward all-gathers its hidden-states input first; with
    `keep_shard` the gathered input is saved for backward as the shard (`_ShardSaved`)."""
    forward = module.forward

    def gathered(*args, **kwargs):
        if not module.sequence_parallel:  # `sequence_parallel_off`: the input is the whole sequence
            args, kwargs = _enter_region(module, args, kwargs, group=group)
            return forward(*args, **kwargs)
        local = _region_input(args, kwargs)
        full = gather_from_sequence(local, group, token_dim(local))
        args, kwargs = _replaced(args, kwargs, local, full)
        if not keep_shard:
            return forward(*args, **kwargs)
        with _ShardSaved(full, local, group):
            return forward(*args, **kwargs)

    module.forward = gathered
    module.sequence_parallel = True


def _whole_in_forward(module: nn.Module, group) -> None:
    """Sequence parallelism around a module that runs whole on every tp rank (HF's gathered attention): its
    hidden-states input all-gathered along the sequence first, the (whole, same on every rank) gradient cut back
    to this rank's shard (`gather_sequence`); inside it runs as without sequence parallelism."""
    forward = module.forward

    def whole(*args, **kwargs):
        if module.sequence_parallel:  # (`sequence_parallel_off`: the input is the whole sequence already)
            local = _region_input(args, kwargs)
            args, kwargs = _replaced(args, kwargs, local, gather_sequence(local, group, SEQ_DIM))
        return forward(*args, **kwargs)

    module.forward = whole
    module.sequence_parallel = True


@contextlib.contextmanager
def sequence_parallel_off(model: nn.Module) -> Iterator[None]:
    """Within: every module of `model` that runs sequence parallelism (a region's gather, a row-parallel
    linear's or the vocab embedding's reduce-scatter, the head's gather) takes and gives the whole
    sequence instead, as without sequence parallelism (docs/modules/runtime.md); restored on exit."""
    on = [m for m in model.modules() if getattr(m, "sequence_parallel", False) is True]
    for m in on:
        m.sequence_parallel = False
    try:
        yield
    finally:
        for m in on:
            m.sequence_parallel = True


class _ShardSaved(torch.autograd.graph.saved_tensors_hooks):
    """While active, a tensor saved for backward that is `full` (or a view of it), the all-gather of
    every rank's `local`, is kept as a reference to `local` and gathered again on first use in
    backward (once for all such tensors of this forward); other saved tensors are kept as they are."""

    def __init__(self, full: Tensor, local: Tensor, group) -> None:
        self.storage, self.nbytes = full.untyped_storage().data_ptr(), full.untyped_storage().nbytes()
        self.local, self.group, self.full = local.detach(), group, None
        self.dtype = full.dtype
        super().__init__(self._pack, self._unpack)

    def _pack(self, t: Tensor):
        if t.device.type == "meta" or t.dtype != self.dtype or t.layout is not torch.strided:
            return t
        try:
            storage = t.untyped_storage()
            if storage.data_ptr() != self.storage or storage.nbytes() != self.nbytes:
                return t
        except RuntimeError:  # a tensor with no plain storage (e.g. one einsum saves): not the gathered input
            return t
        return (self, tuple(t.shape), t.stride(), t.storage_offset())

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, Tensor):
            return packed
        owner, shape, stride, offset = packed
        if owner.full is None:  # gathered again, once, when backward first needs it
            owner.full = all_gather_dim(owner.local, owner.group, token_dim(owner.local))
        return owner.full.as_strided(shape, stride, offset)


def _enter_region(module: nn.Module, args: tuple, kwargs: dict, *, group) -> tuple[tuple, dict]:
    """The region's input (`_region_input`) entering tp: identity forward, its gradient all-reduced backward; wherever
    the same tensor is passed again that argument is the entered tensor too, so every use's gradient is summed."""
    x = _region_input(args, kwargs)
    return _replaced(args, kwargs, x, copy_to_group(x, group))


def _region_input(args: tuple, kwargs: dict) -> torch.Tensor:
    """A tp region's input: its first positional argument, else its `hidden_states`."""
    return args[0] if args else kwargs["hidden_states"]


def _replaced(args: tuple, kwargs: dict, x: torch.Tensor, new: torch.Tensor) -> tuple[tuple, dict]:
    """The call's arguments with every one that is `x` (the same tensor passed again: CTRL's attention takes its
    input as v, k and q) replaced by `new`."""
    return tuple(new if a is x else a for a in args), {k: new if v is x else v for k, v in kwargs.items()}


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
