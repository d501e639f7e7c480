"""The device mesh on torch.distributed: rank coordinates, process groups per axis, backend.

Contract: ranks are laid out row-major over the axes ``(pp, dp, ep, cp, tp)``: tp is innermost
(tp peers have contiguous ranks, so they share a node), pp outermost. For a mesh and a global
rank, `coords_of` gives the rank's index on every axis and `build_groups` creates one process
group per axis for the peers that differ only on that axis (every rank creates every group, in
the same order, as torch.distributed requires).

The whole contract: docs/modules/runtime.md (runtime/mesh.py).
"""

from __future__ import annotations

import atexit
import gc
import itertools
import sys
import weakref
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from autoshard.errors import InvalidConfigError
from autoshard.ir import Mesh, is_positive_number
from autoshard.rules.ranks import MESH_AXES


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


DEFAULT_TIMEOUT_S = 300.0  # a collective that waits longer than this ends the job (see init_default_group)


def check_timeout(timeout_s) -> None:
    """InvalidConfigError unless `timeout_s` is a positive finite number of seconds (a string or inf
    reached timedelta as a TypeError / OverflowError)."""
    if not (is_positive_number(timeout_s) and timeout_s < 1e9):
        raise InvalidConfigError(f"timeout_s must be a positive number of seconds (below 1e9), got {timeout_s!r}")


def init_default_group(*, backend: str, env: dict[str, str], device: torch.device,
                       timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Create the default process group from the torchrun environment unless one exists.

    Under torchrun's agent store (`TORCHELASTIC_USE_AGENT_STORE`), the store outlives the workers: a
    restarted worker would read the previous attempt's keys (gloo: the dead rank 0's address) and wait
    on a peer that no longer exists. The store is therefore namespaced by `TORCHELASTIC_RESTART_COUNT`.
    `timeout_s` bounds every collective (gloo: each operation; nccl: the watchdog), so a lost or hung
    peer ends the job after that long instead of torch's 10 minutes.
    """
    if dist.is_initialized():
        return
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        if "RANK" in env or "WORLD_SIZE" in env:
            raise InvalidConfigError(f"torchrun environment incomplete: {', '.join(missing)} not set; "
                                     "launch with torchrun or call torch.distributed.init_process_group first")
        # a plain `python script.py`: a world of one
        env = {**env, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}
    check_timeout(timeout_s)
    # dynamo first: imported after a group exists (autoshard's capture imports it), it keeps the default
    # group alive past destroy_process_group and gloo's threads abort the process at exit
    import torch._dynamo  # noqa: F401

    timeout = timedelta(seconds=timeout_s)
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    if world == 1 and env.get("MASTER_PORT", "0") == "0":
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        _OWN_WORLD.append(weakref.ref(dist.group.WORLD))
        return
    store = None
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # the agent hosts the store: a client, per attempt
        agent = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=False, timeout=timeout)
        store = dist.PrefixStore(f"autoshard/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", agent)
    kwargs = dict(store=store) if store is not None else dict(init_method="env://")
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout,
                            device_id=device if device.type != "cpu" else None, **kwargs)
    _OWN_WORLD.append(weakref.ref(dist.group.WORLD))


_MADE: dict[tuple, object] = {}  # (default group, ranks, backend, timeout) -> the group `process_group` made
_OWN_WORLD: list = []  # weak references to the default groups `init_default_group` made (`_release_groups`)


def _release_groups() -> None:
    """At exit, before the interpreter's teardown: destroy the default group autoshard made and free every group.
    A gloo worker thread drops a finished collective's work (and the Python tensors it holds) just after the
    caller's wait returns; doing that during the teardown kills the thread inside a destructor and aborts the
    process ("terminate called without an active exception", gdb: ~AsyncAllgatherWork taking the GIL in
    Py_FinalizeEx; about 1 run in 20 of examples/train_llama.py under torchrun). Freed here, with the
    interpreter whole, a group's destructor releases the GIL and joins its threads once their work is done.
    Not after an uncaught exception: a collective of this rank still in flight would hold the exit until it ends."""
    _MADE.clear()
    if getattr(sys, "last_exc", None) or getattr(sys, "last_value", None):  # failing: end now, as before
        return
    if _OWN_WORLD and dist.is_initialized() and dist.group.WORLD is _OWN_WORLD[-1]():
        dist.destroy_process_group()
    _OWN_WORLD.clear()
    gc.collect()


atexit.register(_release_groups)


def process_group(ranks, *, backend: str | None = None, timeout_s: float | None = None):
    """`dist.new_group(ranks)`, made once per process for each (ranks, backend, timeout) and reused by every
    later `parallelize` in it (a notebook, a test over many plans): a gloo group holds 3 threads until it is
    destroyed, and a process holding thousands of them runs ~15x slower (bench/bench_process_groups.py).
    Collective over the world as `new_group` is: every rank asks for the same groups in the same order, so
    every rank finds the same ones already made. A new default group (the world destroyed and initialised
    again) starts afresh; destroying one of these groups alone is not supported (the other ranks would not
    make it again)."""
    world = dist.group.WORLD
    for stale in [k for k in _MADE if k[0] is not world]:  # of a destroyed world: let them go
        del _MADE[stale]
    key = (world, tuple(ranks), backend, timeout_s)
    if key not in _MADE:
        timeout = {} if timeout_s is None else dict(timeout=timedelta(seconds=timeout_s))
        _MADE[key] = dist.new_group(list(ranks), backend=backend, **timeout)
    return _MADE[key]


def build_groups(mesh: Mesh, *, device: torch.device, backend: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> Groups:
    """Process groups of this rank for every axis of `mesh` (collective: all ranks call it); a collective
    on any of them fails after `timeout_s` seconds."""
    rank = dist.get_rank()
    mine = {}
    for axis in MESH_AXES:
        for ranks in axis_ranks(mesh, axis):
            group = process_group(ranks, backend=backend, timeout_s=timeout_s)
            if rank in ranks:
                mine[axis] = group
    if mesh.ep > 1:
        for ranks in axes_ranks(mesh, ("dp", "ep", "cp")):
            group = process_group(ranks, backend=backend)
            if rank in ranks:
                mine["replicas"] = group
    return Groups(mesh=mesh, rank=rank, coords=coords_of(rank, mesh), backend=backend, device=device, **mine)


ROLL_CALL_S = 5.0  # how long a rank whose collective failed waits for the others to answer


def silent_ranks(*, wait_s: float = ROLL_CALL_S) -> list[int]:
    """After a failed collective: the ranks that do not answer a roll call in the default group's store
    within `wait_s` (they died or hang). Every rank whose collective failed answers, so the survivors of
    one failure name the same ranks. The store outlives workers under torchrun (the agent hosts it)."""
    import time

    from torch.distributed.distributed_c10d import _get_default_store

    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        store = _get_default_store()
        store.set(f"autoshard/roll_call/{rank}", "1")
        deadline = time.monotonic() + wait_s
        while True:
            missing = [r for r in range(world) if not store.check([f"autoshard/roll_call/{r}"])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.1)
    except Exception:  # noqa: BLE001  (the store itself is gone: nothing more to learn)
        return []


class PeerLostError(RuntimeError):
    """A collective failed because a peer rank died or hung (the message names it)."""


def peer_lost(error: BaseException) -> PeerLostError:
    """`error` (a failed collective) restated naming this rank and the ranks that did not answer."""
    rank = dist.get_rank()
    silent = silent_ranks()
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    who = (f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} did not answer within "
           f"{ROLL_CALL_S:g} s (died or hung)") if silent else "every rank answered after the failure"
    return PeerLostError(f"rank {rank}: a collective failed: {first[:300]}; {who}. Under torchrun --max-restarts "
                         "the job restarts; resume it with dm.load_checkpoint(dir, missing_ok=True)")
