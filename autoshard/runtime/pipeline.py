"""Pipeline parallelism: stage modules run under `torch.distributed.pipelining` schedules.

Contract: `PipelineRunner(model, spec, stages, pp_group=..., device=...)` is built on every rank
of the world at once (it creates process groups). Rank i of `pp_group` runs stage i, the module
`build_stage_module(model, spec, stages[i])` (see `stages.py`), wrapped in a `PipelineStage`
and driven by `ScheduleGPipe` or `Schedule1F1B`; no scheduler of our own.

The whole contract: docs/modules/runtime.md (runtime/pipeline.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)

from autoshard.errors import InvalidConfigError
from autoshard.ir import POSITIVE_INT, Precision, Schedule, Stage, check_schedule, check_stages, stage_rank
from autoshard.model_spec import ModelSpec
from autoshard.rules.schedules import check_chunks
from autoshard.runtime.data_parallel import take_grad
from autoshard.runtime.loss import causal_lm_loss
from autoshard.runtime.mesh import process_group
from autoshard.runtime.precision import Autocast
from autoshard.runtime.stages import build_stage_module, original_names


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineOptions:
    schedule: Schedule = Schedule.ONE_F_ONE_B
    micro_batch: int = 1
    virtual_stages: int = 1  # model chunks per rank (interleaved-1f1b, zero-bubble)
    precision: Precision = Precision.FP32  # resolved for the device; bf16-mixed: each chunk's forward autocasts
    free_other_stages: bool = True  # replace the parameters of other ranks' stages by meta tensors
    # tp under sequence parallelism: stages exchange 1/tp of the sequence; one per model chunk when they differ
    # (each sequence-parallel chunk then converts to and from the whole sequence at its boundaries, stages.py)
    sequence_shards: int | tuple[int, ...] = 1

    def __post_init__(self) -> None:
        if not isinstance(self.schedule, Schedule):
            object.__setattr__(self, "schedule", _parse_schedule(self.schedule))
        POSITIVE_INT.check("micro_batch", self.micro_batch)


def _parse_schedule(value) -> Schedule:
    try:
        return Schedule(str(value).lower())
    except ValueError:
        raise InvalidConfigError(f"unknown pipeline schedule {value!r}; "
                                 f"known: {', '.join(s.value for s in Schedule)}") from None


def _schedule_class(schedule: Schedule, virtual_stages: int) -> type:
    """torch's schedule for `schedule` with `virtual_stages` chunks per rank (placement: ir.stage_rank)."""
    if schedule is Schedule.GPIPE:
        return ScheduleGPipe
    if schedule is Schedule.ONE_F_ONE_B:
        return Schedule1F1B
    if schedule is Schedule.INTERLEAVED_1F1B:
        return ScheduleInterleaved1F1B
    return ScheduleZBVZeroBubble if virtual_stages == 2 else ScheduleInterleavedZeroBubble


class PipelineRunner:
    """This rank's pipeline chunks and the schedules that drive them (docs/modules/runtime.md)."""

    def __init__(self, model: nn.Module, spec: ModelSpec, stages: Sequence[Stage], *,
                 pp_group: dist.ProcessGroup, device: torch.device | str,
                 options: PipelineOptions = PipelineOptions(), tp_group: dist.ProcessGroup | None = None,
                 cp=None, sequence_group: dist.ProcessGroup | None = None) -> None:
        pp, virtual = dist.get_world_size(pp_group), options.virtual_stages
        check_schedule(options.schedule, virtual, pp=pp)
        self.stages = check_stages(stages, num_layers=spec.layers, pp=pp * virtual)  # (a wrapper's config: no count)
        self.options = options
        self.pp_group, self.tp_group = pp_group, tp_group
        self.device = torch.device(device)
        self.rank = dist.get_rank(pp_group)
        # rank of every chunk (model order), and this rank's chunks
        self.placement = tuple(stage_rank(i, pp=pp, virtual_stages=virtual, schedule=options.schedule)
                               for i in range(len(self.stages)))
        self.local = tuple(i for i, r in enumerate(self.placement) if r == self.rank)
        self.first_rank, self.last_rank = self.placement[0], self.placement[-1]
        self.has_first, self.has_last = self.rank == self.first_rank, self.rank == self.last_rank
        self.cp = cp  # context parallelism: runtime.context_parallel.CPRuntime or None
        positions = cp.positions if cp is not None else None
        shards = options.sequence_shards
        shards = shards if isinstance(shards, tuple) else (shards,) * len(self.stages)
        mixed = len(set(shards)) > 1  # the boundaries carry the whole sequence (build_stage_module)
        self.chunks = [build_stage_module(model, spec, self.stages[i], positions=positions,
                                          sequence_shards=shards[i],
                                          boundary_group=sequence_group if mixed and shards[i] > 1 else None)
                       for i in self.local]
        self.module = nn.ModuleList(self.chunks)  # every parameter of this rank's chunks
        self.names = original_names(model, self.module)  # stage name -> original name
        # what every pp rank holds, by original name, for gather(); shapes/dtypes from this rank's model
        held = [original_names(model, build_stage_module(model, spec, st)).values() for st in self.stages]
        self._held = [tuple(dict.fromkeys(n for i in range(len(self.stages)) if self.placement[i] == r
                                          for n in held[i])) for r in range(pp)]
        self._meta = {name: (p.shape, p.dtype) for name, p in model.named_parameters()}
        # tied embeddings on two ranks: each holds a copy whose gradients are summed (on one rank: one tensor)
        split = pp > 1 and self.first_rank != self.last_rank
        self._tied = _tied_parameter(model, spec) if split else None
        self._tied_group = _tied_pair_group(pp_group, self.first_rank, self.last_rank) if self._tied is not None \
            else None
        self._cache: dict[tuple, object] = {}
        if options.free_other_stages:
            _free_parameters(model, keep={id(p) for p in self.module.parameters()})

    # -- training ---------------------------------------------------------------------------
    def parameters(self):
        return self.module.parameters()

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor, *,
             num_tokens: int | torch.Tensor | None = None) -> torch.Tensor:
        """Forward and backward of this pipeline's batch; the summed loss on every pp rank."""
        if num_tokens is None:  # only right when this pipeline sees the whole batch (dp = 1)
            num_tokens = int((labels[..., 1:] != -100).sum())
        if self.cp is not None:  # this rank's slice of the sequence, labels shifted over the whole sequence
            input_ids, _, labels = self.cp.local_inputs(input_ids, labels)
        schedule = self._schedule(tuple(input_ids.shape), train=True)
        args = (input_ids.to(self.device),) if self.has_first else ()
        target = labels.to(self.device) if self.has_last else None
        losses: list[torch.Tensor] = []
        schedule.step(*args, target=target, losses=losses if self.has_last else None, return_outputs=False,
                      loss_kwargs={"num_tokens": num_tokens})
        self.sync_tied_grads()
        loss = torch.stack(losses).sum().detach() if self.has_last else torch.zeros((), device=self.device)
        dist.broadcast(loss, group=self.pp_group, group_src=self.last_rank)
        return loss

    def sync_tied_grads(self) -> None:
        """Sum the tied embedding's gradient over the first and last stage (no-op when untied)."""
        if self._tied_group is None or not (self.has_first or self.has_last):
            return
        param = self._tied
        grad = take_grad(param)  # bf16-mixed: the fp32 main gradient (runtime/data_parallel.py)
        if grad is None:
            grad = param.grad = torch.zeros_like(param)
        dist.all_reduce(grad, group=self._tied_group)

    # -- evaluation and checks ---------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits of the whole batch (local vocab slice under TP) on every rank of the pp group."""
        if self.cp is not None:  # this cp rank's slice of the sequence: the caller gathers the rest
            input_ids = self.cp.local_inputs(input_ids, None)[0]
        with torch.no_grad():
            if len(self.chunks) == 1:
                schedule = self._schedule(tuple(input_ids.shape), train=False)
                out = schedule.step(*((input_ids.to(self.device),) if self.has_first else ()))
            else:
                out = self._forward_chunks(input_ids.to(self.device))
        header = torch.zeros(4, dtype=torch.int64, device=self.device)  # (b, s, v, dtype index)
        if self.has_last:
            header.copy_(torch.tensor([*out.shape, _DTYPES.index(out.dtype)]))
        dist.broadcast(header, group=self.pp_group, group_src=self.last_rank)
        b, s, v, code = header.tolist()
        if not self.has_last:
            out = torch.empty((b, s, v), dtype=_DTYPES[code], device=self.device)
        dist.broadcast(out, group=self.pp_group, group_src=self.last_rank)
        return out

    def _forward_chunks(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """Several chunks per rank, forward only (evaluation): the chunks in model order on the whole
        batch, each activation sent to the next chunk's rank (torch's multi-chunk schedules have no
        forward-only mode for the V placement); the logits on the rank of the last chunk."""
        x = input_ids if self.has_first else None
        modules = dict(zip(self.local, self.chunks))
        for i, owner in enumerate(self.placement):
            prev = self.placement[i - 1] if i else owner
            if prev != owner and self.rank == prev:
                header = torch.tensor([*x.shape, _DTYPES.index(x.dtype)], device=self.device)  # (b, s, h, dtype)
                dist.send(header, group=self.pp_group, group_dst=owner)
                dist.send(x.contiguous(), group=self.pp_group, group_dst=owner)
            elif prev != owner and self.rank == owner:
                header = torch.empty(4, dtype=torch.int64, device=self.device)
                dist.recv(header, group=self.pp_group, group_src=prev)
                *shape, code = header.tolist()
                x = torch.empty(shape, dtype=_DTYPES[code], device=self.device)
                dist.recv(x, group=self.pp_group, group_src=prev)
            if self.rank == owner:
                x = self._wrap(modules[i])(x)
        return x if self.has_last else None

    def gather(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """{original name: tensor} of every stage on every pp rank; `tensors` holds this stage's."""
        out: dict[str, torch.Tensor] = {}
        for index, held in enumerate(self._held):
            names = [n for n in held if n not in out]
            for dtype in dict.fromkeys(self._meta[n][1] for n in names):
                group = [n for n in names if self._meta[n][1] == dtype]
                if index == self.rank:
                    flat = torch.cat([tensors[n].detach().reshape(-1).to(self.device, dtype) for n in group])
                else:
                    flat = torch.empty(sum(self._meta[n][0].numel() for n in group), dtype=dtype,
                                       device=self.device)
                dist.broadcast(flat, group=self.pp_group, group_src=index)
                for name, piece in zip(group, flat.split([self._meta[n][0].numel() for n in group])):
                    out[name] = piece.view(self._meta[name][0])
        return out

    # -- schedules ---------------------------------------------------------------------------
    def _schedule(self, shape: tuple[int, ...], *, train: bool):
        """The schedule for batches of `shape`, built on first use (PipelineStage infers shapes then)."""
        key = (shape, train)
        if key not in self._cache:
            batch = shape[0]
            micro = self.options.micro_batch
            if batch % micro:
                raise InvalidConfigError(f"the pipeline's batch ({batch}) is not divisible by micro_batch ({micro}); "
                                         f"choose a micro_batch that divides {batch}")
            pp, chunks = dist.get_world_size(self.pp_group), batch // micro
            schedule = self.options.schedule
            if train:  # the one rule (rules/validity.check_plan calls it too): what torch's schedules accept
                check_chunks(schedule, self.options.virtual_stages, pp=pp, microbatches=chunks,
                             layers=len(self.stages))
            stages = [PipelineStage(self._wrap(module), index, len(self.stages), self.device, group=self.pp_group)
                      for index, module in zip(self.local, self.chunks)]
            for stage in stages:  # (a no-op for parameters without main gradients)
                _main_grads_after_weight_pass(stage)
            cls = _schedule_class(schedule, self.options.virtual_stages)
            if not train and cls in (ScheduleGPipe, Schedule1F1B):
                cls = ScheduleGPipe  # forward only
            try:
                if cls in (ScheduleGPipe, Schedule1F1B):
                    made = cls(stages[0], chunks, loss_fn=self._loss if train else None, scale_grads=False)
                else:  # the multi-chunk schedules (no loss function: forward only)
                    made = cls(stages, chunks, loss_fn=self._loss if train else None, scale_grads=False)
            except ValueError as e:  # torch's own checks (micro-batch counts)
                raise InvalidConfigError(f"schedule {schedule.value!r} with pp {pp}, {self.options.virtual_stages} "
                                         f"virtual stage(s) and {chunks} micro-batches: {e}") from None
            self._cache[key] = made
        return self._cache[key]

    def _wrap(self, module: nn.Module) -> nn.Module:
        """The module a PipelineStage runs: the chunk, under autocast for bf16-mixed."""
        if self.options.precision is Precision.FP32:
            return module
        return Autocast(module, self.options.precision, self.device)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor, num_tokens) -> torch.Tensor:
        return causal_lm_loss(logits, labels, num_tokens=num_tokens, tp_group=self.tp_group,
                              shifted=self.cp is not None)


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _main_grads_after_weight_pass(stage: PipelineStage) -> None:
    """Zero-bubble schedules run a separate weight pass that writes `.grad` itself (torch's
    `stage_backward_weight`), past the main-gradient hook (runtime/data_parallel.py): after each
    such pass, add `.grad` into the fp32 main gradients, so micro-batches still sum in fp32 (bf16-mixed) and
    in the gradient buffer (ZeRO-1/2)."""
    run, params = stage.backward_weight_one_chunk, list(stage.submod.parameters())

    def backward_weight_one_chunk(*args, **kwargs):
        run(*args, **kwargs)
        for p in params:
            take_grad(p)

    stage.backward_weight_one_chunk = backward_weight_one_chunk


def _tied_parameter(model: nn.Module, spec: ModelSpec) -> nn.Parameter | None:
    """The embedding weight when the LM head shares it (tied embeddings), else None. The head is the model's own
    output embeddings, as HF's get_output_embeddings() names them (BioGPT's output_projection, not lm_head)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else getattr(model, "lm_head", None)
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head_weight = getattr(head, "weight", None)
    if embed is not None and head_weight is not None and head_weight is getattr(embed, "weight", None):
        return head_weight
    return None


def _free_parameters(model: nn.Module, *, keep: set[int]) -> None:
    """Replace every parameter of `model` not in `keep` (by id) with a meta tensor of its shape.

    Each rank then holds only its stage's weights; a parameter shared by two modules (tied
    embeddings) stays shared. Names and shapes in `model.named_parameters()` are unchanged.
    """
    replaced: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or id(param) in keep or param.device.type == "meta":
                continue
            if id(param) not in replaced:
                replaced[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"),
                                                   requires_grad=param.requires_grad)
            module._parameters[name] = replaced[id(param)]


def _tied_pair_group(pp_group: dist.ProcessGroup, first: int, last: int) -> dist.ProcessGroup | None:
    """The 2-rank group {rank of the first chunk, rank of the last} of this rank's pipeline (`first`,
    `last`: pp ranks; collective over the world).

    Every rank learns every pipeline's (first, last) pair by one all_gather_object, then all ranks
    create the groups in the same order, as `new_group` requires.
    """
    ranks = dist.get_process_group_ranks(pp_group)
    mine = (ranks[first], ranks[last])
    pairs: list = [None] * dist.get_world_size()
    dist.all_gather_object(pairs, mine)
    group = None
    for pair in sorted(set(map(tuple, pairs))):
        made = process_group(pair)
        if pair == mine:
            group = made
    return group
