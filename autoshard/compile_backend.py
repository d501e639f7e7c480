"""`autoshard.backend(model, plan=...)`: a torch.compile backend that shards Dynamo's graph.

    compiled = torch.compile(model, backend=autoshard.backend(model, plan=dict(dp=2, tp=2)))
    loss = compiled(local_ids, labels=local_labels).loss    # this rank's dp shard of the batch
    loss.backward(); optimizer.step()                       # optimizer over model.parameters()

Calling convention (it is DistributedDataParallel's): every rank runs the same loop; each
rank passes *its own shard* of the global batch (global_batch / dp rows, where the dp index of
a rank is `autoshard.runtime.mesh.coords_of(rank, mesh).dp`; tp peers pass the same rows); the
returned loss is the mean over dp of the ranks' losses, equal on every rank; gradients arrive
summed over the mesh so every rank's parameters hold the full gradient of that mean loss and
a plain optimizer over `model.parameters()` takes the same step everywhere.

What it does not do (each refused with a clear error): pp > 1, cp > 1, ep > 1, ZeRO, tp for
models other than LLaMA-style attention / MLP (Mamba-2's mixer bakes its head counts into
Dynamo's graph as constants: use `autoshard.parallelize` for Mamba-2 tensor parallelism), and
parameter memory sharding (parameters stay full size; see `passes/shard_graph.py`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autoshard.errors import InvalidConfigError
from autoshard.ir import Plan
from autoshard.models.presets import Family, spec_from_hf_config
from autoshard.passes.rewrite import Replicate, check_plan, shard_program
from autoshard.passes.shard_graph import shard_graph
from autoshard.runtime.mesh import backend_for, build_groups, init_default_group


def backend(model: nn.Module, *, plan: Plan | Mapping | str | Path, global_batch: int | None = None,
            device: str | torch.device = "cpu") -> Callable:
    """A torch.compile backend running `model`'s graph as this rank's part of `plan` (dp x tp).

    Collective: every rank calls it (it creates the process groups). `global_batch` only feeds
    the plan's divisibility checks (default: dp).
    """
    from autoshard.api import _resolve_plan  # the one reader of plan dicts / files

    config = getattr(model, "config", None)
    if config is None:
        raise InvalidConfigError(f"{type(model).__name__} has no HF .config; autoshard.backend takes a HF "
                                 "LlamaForCausalLM or Mamba2ForCausalLM")
    spec = spec_from_hf_config(config, name=getattr(config, "name_or_path", "") or config.model_type)
    device = torch.device(device)
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    plan = _resolve_plan(plan, spec=spec, world=world, seq_len=1, global_batch=global_batch or world,
                         hardware="auto")
    _check_supported(plan, spec)
    check_plan(plan, spec, world_size=world)  # every rank, before any collective
    init_default_group(backend=backend_for(device), env=dict(os.environ), device=device)
    groups = build_groups(plan.mesh, device=device, backend=backend_for(device))
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    program = shard_program(plan, spec, shapes, tp_rank=groups.coords.tp)
    # embedding and LM head stay whole under the backend (the loss is HF's own, on full logits)
    vocab = {program.vocab_embed and f"{program.vocab_embed}.weight", program.vocab_head and f"{program.vocab_head}.weight"}
    program = _replace_placements(program, {name: Replicate() for name in vocab if name})
    names = {id(p): name for name, p in model.named_parameters()}

    def compile_fn(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        param_names = {node.name: names.get(id(value)) for node, value in zip(placeholders, example_inputs)}
        return shard_graph(gm, param_names, program, groups).forward

    compile_fn.plan = plan
    compile_fn.groups = groups
    return compile_fn


def _check_supported(plan: Plan, spec) -> None:
    mesh = plan.mesh
    for axis in ("pp", "cp", "ep"):
        if getattr(mesh, axis) > 1:
            raise InvalidConfigError(f"{axis}={getattr(mesh, axis)} is not supported by the torch.compile backend "
                                     "(it shards data and tensors only); use autoshard.parallelize for pipeline "
                                     "and context parallelism")
    if plan.zero:
        raise InvalidConfigError(f"zero={plan.zero}: the torch.compile backend keeps optimizer state whole; use "
                                 "zero=0 here or autoshard.parallelize for ZeRO-1")
    if mesh.tp > 1 and spec.family is not Family.LLAMA:
        raise InvalidConfigError(f"tp={mesh.tp} for {spec.family.value}: Dynamo bakes the Mamba-2 mixer's head "
                                 "counts into the graph, so the backend cannot shard it; use "
                                 "autoshard.parallelize for Mamba-2 tensor parallelism, or tp=1 here")


def _replace_placements(program, overrides: Mapping[str, Any]):
    import dataclasses

    placements = tuple((name, overrides.get(name, placement)) for name, placement in program.placements)
    return dataclasses.replace(program, placements=placements)
