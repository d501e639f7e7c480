"""The device mesh on torch.distributed: rank coordinates, process groups per axis, backend.

Contract: ranks are laid out row-major over the axes ``(pp, dp, cp, tp)``: tp is innermost
(tp peers have contiguous ranks, so they share a node), pp outermost. For a mesh and a global
rank, `coords_of` gives the rank's index on every axis and `build_groups` creates one process
group per axis for the peers that differ only on that axis (every rank creates every group, in
the same order, as torch.distributed requires). ``ep`` must be 1 here (the models have no
experts).

The backend follows the device: gloo on CPU, nccl on CUDA, hccl on an Ascend NPU
(`torch_npu` is imported only when an NPU is asked for).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from autoshard.errors import InvalidConfigError
from autoshard.ir import Mesh

MESH_AXES = ("pp", "dp", "cp", "tp")  # outermost first


@dataclass(frozen=True, slots=True, kw_only=True)
class Coords:
    """A rank's index on every mesh axis."""

    pp: int = 0
    dp: int = 0
    cp: int = 0
    tp: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Groups:
    """The process groups of one rank: one per mesh axis (each of size `mesh.<axis>`)."""

    mesh: Mesh
    rank: int
    coords: Coords
    backend: str
    device: torch.device
    pp: dist.ProcessGroup
    dp: dist.ProcessGroup
    cp: dist.ProcessGroup
    tp: dist.ProcessGroup

    def size(self, axis: str) -> int:
        return getattr(self.mesh, axis)


def coords_of(rank: int, mesh: Mesh) -> Coords:
    """Index of global `rank` on each axis of `mesh` (row-major over pp, dp, cp, tp)."""
    index = {}
    for axis in reversed(MESH_AXES):
        rank, index[axis] = divmod(rank, getattr(mesh, axis))
    return Coords(**index)


def rank_of(coords: Coords, mesh: Mesh) -> int:
    """Inverse of `coords_of`."""
    rank = 0
    for axis in MESH_AXES:
        rank = rank * getattr(mesh, axis) + getattr(coords, axis)
    return rank


def axis_ranks(mesh: Mesh, axis: str) -> list[list[int]]:
    """All groups along `axis`: lists of global ranks that differ only in their `axis` index."""
    others = [a for a in MESH_AXES if a != axis]
    groups = []
    for fixed in itertools.product(*(range(getattr(mesh, a)) for a in others)):
        base = dict(zip(others, fixed))
        groups.append([rank_of(Coords(**base, **{axis: i}), mesh) for i in range(getattr(mesh, axis))])
    return groups


def backend_for(device: torch.device | str) -> str:
    """The collective backend for `device`: gloo (cpu), nccl (cuda), hccl (npu)."""
    kind = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    if kind == "npu":
        try:
            import torch_npu  # noqa: F401  (registers the npu device and the hccl backend)
        except ImportError:
            raise InvalidConfigError("device 'npu' needs the torch_npu package (Ascend); install torch_npu "
                                     "or run on device='cpu' / 'cuda'") from None
        return "hccl"
    try:
        return dist.get_default_backend_for_device(kind)
    except (RuntimeError, ValueError) as e:
        raise InvalidConfigError(f"no torch.distributed backend for device {kind!r}: {e}") from None


def init_default_group(*, backend: str, env: dict[str, str], device: torch.device) -> None:
    """Create the default process group from the torchrun environment unless one exists."""
    if dist.is_initialized():
        return
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        if "RANK" in env or "WORLD_SIZE" in env:
            raise InvalidConfigError(f"torchrun environment incomplete: {', '.join(missing)} not set; "
                                     "launch with torchrun or call torch.distributed.init_process_group first")
        # a plain `python script.py`: a world of one
        env = {**env, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}
    if env["WORLD_SIZE"] == "1" and env.get("MASTER_PORT", "0") == "0":
        store = dist.HashStore()
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timedelta(minutes=10))
        return
    dist.init_process_group(backend, init_method="env://", rank=int(env["RANK"]),
                            world_size=int(env["WORLD_SIZE"]), timeout=timedelta(minutes=10),
                            device_id=device if device.type != "cpu" else None)


def build_groups(mesh: Mesh, *, device: torch.device, backend: str) -> Groups:
    """Process groups of this rank for every axis of `mesh` (collective: all ranks call it)."""
    rank = dist.get_rank()
    if mesh.ep != 1:
        raise InvalidConfigError(f"ep={mesh.ep}: expert parallelism needs a model with experts; "
                                 "LLaMA and Mamba-2 have none, use ep=1")
    mine = {}
    for axis in MESH_AXES:
        for ranks in axis_ranks(mesh, axis):
            group = dist.new_group(ranks, backend=backend)
            if rank in ranks:
                mine[axis] = group
    return Groups(mesh=mesh, rank=rank, coords=coords_of(rank, mesh), backend=backend, device=device, **mine)
