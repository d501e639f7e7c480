"""The rank order of a mesh: the one definition runtime/mesh.py lays ranks out by and the cost model reads
each collective group's spacing (stride) from. Ranks are row-major over `MESH_AXES`, tp innermost (tp
peers have contiguous ranks, so they share a node), pp outermost."""

from __future__ import annotations

import math

from autoshard.ir import Mesh

MESH_AXES = ("pp", "dp", "ep", "cp", "tp")  # outermost first


def group_stride(mesh: Mesh, *axes: str) -> int:
    """The mean rank spacing of a group whose members differ on `axes` (e.g. "dp", "ep", "cp"): the ranks
    its outermost axis spans over the group's size. For axes adjacent in `MESH_AXES` that is the
    innermost one's stride (tp: 1, cp: tp, dp x ep x cp: tp); the experts' dp x cp skips ep (ep x tp)."""
    outer = min(MESH_AXES.index(a) for a in axes)
    span = math.prod(getattr(mesh, a) for a in MESH_AXES[outer:])
    return span // math.prod(getattr(mesh, a) for a in axes)
