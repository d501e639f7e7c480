"""The device mesh on torch.distributed: rank coordinates, process groups per axis, backend.

Contract: ranks are laid out row-major over the axes ``(pp, dp, ep, cp, tp)``: tp is innermost
(tp peers have contiguous ranks, so they share a node), pp outermost. For a mesh and a global
rank, `coords_of` gives the rank's index on every axis and `build_groups` creates one process
group per axis for the peers that differ only on that axis (every rank creates every group, in
the same order, as torch.distributed requires).

Expert parallelism folds into data parallelism (Megatron-Core, torchtitan; docs/expert_parallel.md):
the ep peers of a rank hold different experts of the same layers and different rows of the batch,
so for the dense layers they are data-parallel replicas. With ep > 1 `build_groups` also creates
`replicas`, the dp x ep x cp group over which dense gradients are summed (and the loss); expert
gradients are summed over dp x cp only, since the all-to-all already brought every ep peer's
tokens to the rank that holds the expert. ep sits inside dp and outside cp and tp, so an ep
group spans the fewest nodes that the inner axes leave.

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

MESH_AXES = ("pp", "dp", "ep", "cp", "tp")  # outermost first


@dataclass(frozen=True, slots=True, kw_only=True)
class Coords:
    """A rank's index on every mesh axis."""

    pp: int = 0
    dp: int = 0
    ep: int = 0
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
    ep: dist.ProcessGroup
    replicas: dist.ProcessGroup | None = None  # ep > 1: dp x ep x cp, where dense gradients are summed

    def size(self, axis: str) -> int:
        return getattr(self.mesh, axis)


def coords_of(rank: int, mesh: Mesh) -> Coords:
    """Index of global `rank` on each axis of `mesh` (row-major over pp, dp, ep, cp, tp)."""
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
    return axes_ranks(mesh, (axis,))


def axes_ranks(mesh: Mesh, axes: tuple[str, ...]) -> list[list[int]]:
    """All groups spanning `axes`: lists of global ranks that differ only on those axes (rank order)."""
    others = [a for a in MESH_AXES if a not in axes]
    groups = []
    for fixed in itertools.product(*(range(getattr(mesh, a)) for a in others)):
        base = dict(zip(others, fixed))
        members = itertools.product(*(range(getattr(mesh, a)) for a in axes))
        groups.append(sorted(rank_of(Coords(**base, **dict(zip(axes, m))), mesh) for m in members))
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
    mine = {}
    for axis in MESH_AXES:
        for ranks in axis_ranks(mesh, axis):
            group = dist.new_group(ranks, backend=backend)
            if rank in ranks:
                mine[axis] = group
    if mesh.ep > 1:
        for ranks in axes_ranks(mesh, ("dp", "ep", "cp")):
            group = dist.new_group(ranks, backend=backend)
            if rank in ranks:
                mine["replicas"] = group
    return Groups(mesh=mesh, rank=rank, coords=coords_of(rank, mesh), backend=backend, device=device, **mine)
