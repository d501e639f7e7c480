"""Run a function on N gloo ranks (spawned once) and surface every rank's traceback in pytest."""

from __future__ import annotations

import os
import sys
import tempfile
import traceback

import torch
# before any process group: importing dynamo after one exists keeps the default group alive past
# destroy_process_group, and its gloo threads then abort the process at exit (`terminate called without an
# active exception`, about 1 run in 5); autoshard.runtime.mesh.init_default_group does the same
import torch._dynamo  # noqa: F401
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world: int, store_path: str, fn, args, errors: str) -> None:
    os.environ.pop("WORLD_SIZE", None)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
        fn(rank, world, *args)
    except BaseException:
        with open(f"{errors}.{rank}", "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # done and passed: leave without the interpreter's teardown, where a group some object still holds
    # has its gloo threads destroyed under it (the same abort at exit)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(world: int, fn, *args) -> None:
    """Call fn(rank, world, *args) on `world` spawned processes; fail with the ranks' tracebacks."""
    with tempfile.TemporaryDirectory() as tmp:
        errors = os.path.join(tmp, "error")
        try:
            mp.spawn(_worker, args=(world, os.path.join(tmp, "store"), fn, args, errors), nprocs=world, join=True)
        except Exception as e:
            reports = [open(os.path.join(tmp, n)).read() for n in sorted(os.listdir(tmp)) if n.startswith("error.")]
            raise AssertionError("\n".join([f"distributed run failed: {e}", *reports])) from None
