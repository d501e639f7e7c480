"""ZeRO-3: parameters, gradients and optimizer state sharded over dp (x cp) by PyTorch's FSDP2.

Contract: `apply_zero3(model, group, device=..., offload=False)` calls
`torch.distributed.fsdp.fully_shard` on every decoder block (found by structure:
`models/facts.layer_list`), then on the whole model, over a 1-D
`DeviceMesh` made from `group` (the dp group, or dp x cp when cp > 1: `DeviceMesh.from_group`).
It runs after the tensor-parallel slicing (runtime/tensor_parallel.py) and the context-parallel
set-up, so each tp rank shards its own slices over its dp peers: FSDP2 composes with tp and cp
without knowing about them, and parameters stay DTensors over that mesh (`Shard(0)`).

The whole contract: docs/modules/runtime.md (runtime/zero3.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from autoshard.models.facts import layer_list

# torch.distributed.fsdp / .tensor load SymPy (through torch._dynamo), which the runtime must not load
# unless ZeRO-3 is asked for (tests/runtime/test_layering.py): they are imported inside the functions.


def apply_zero3(model: nn.Module, group: dist.ProcessGroup, *, device: torch.device, offload: bool = False,
                bf16: bool = False, expert_group: dist.ProcessGroup | None = None,
                experts: tuple[str, ...] = ()) -> None:
    """Shard `model` (in place) over `group` with FSDP2: one unit per decoder block plus the root;
    `bf16` (bf16-mixed): gathered in bf16, gradients reduced in fp32 (FSDP2's MixedPrecisionPolicy);
    `experts` (module paths, ep > 1): a unit each over `expert_group` first (docs/modules/runtime.md)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = DeviceMesh.from_group(group, device.type, mesh_dim_names=("dp_shard",))
    policy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    if experts:
        expert_mesh = DeviceMesh.from_group(expert_group, device.type, mesh_dim_names=("dp_shard_mod_ep",))
        for path in experts:
            fully_shard(model.get_submodule(path), mesh=expert_mesh, offload_policy=policy, mp_policy=mp)
    for block in _own_blocks(model):
        fully_shard(block, mesh=mesh, offload_policy=policy, mp_policy=mp)
    fully_shard(model, mesh=mesh, offload_policy=policy, mp_policy=mp)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            if hasattr(module, "set_force_sum_reduction_for_comms"):  # older torch lacks it (NCCL has PREMUL_SUM)
                module.set_force_sum_reduction_for_comms(True)


def _own_blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder blocks (found by structure, `models/facts.layer_list`: LLaMA's model.layers, GPT-2's and
    CodeGen's transformer.h, ...) that share no parameter with another block: a unit each. A block that does
    (Zamba2's layers call one shared transformer block) stays in the root's unit, as FSDP2 keeps a parameter
    in one unit only."""
    found = layer_list(model)
    if found is None:
        return []
    blocks = list(found[1])
    owners: dict[int, set[int]] = {}
    for i, block in enumerate(blocks):
        for p in block.parameters():
            owners.setdefault(id(p), set()).add(i)
    shared = {i for held in owners.values() if len(held) > 1 for i in held}
    return [block for i, block in enumerate(blocks) if i not in shared]


def full_tensor(t: Tensor) -> Tensor:
    """The whole (tp-local) tensor of a DTensor shard (collective over its mesh); others as they are."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # a DTensor (duck-typed: no import)


def like(full: Tensor, param: Tensor) -> Tensor:
    """`full` cut as `param` is held: its DTensor shard (local slicing, no communication), or itself."""
    if not hasattr(param, "device_mesh"):  # not a DTensor
        return full.to(param.device)
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
