"""What idle process groups cost a process (runtime/mesh.py `process_group`): the same plans timed on two gloo
ranks in a fresh world and beside `--idle` idle gloo groups (3 threads each), as a process that made a new set
of groups per `parallelize` held them. Prints both times and their ratio.

    python bench/bench_process_groups.py [--idle 1000] [--plans 12]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _rank(rank: int, world: int, idle: int, plans: int) -> None:
    import torch
    import torch.distributed as dist

    from tests.runtime.equivalence import check_plan
    from tests.runtime.test_equivalence import WORLD2

    held = [dist.new_group([0, 1]) for _ in range(idle)]
    for group in held[:50]:  # some of them connected, as used groups are
        dist.all_reduce(torch.ones(1), group=group)
    start = time.perf_counter()
    for preset, plan, logits in WORLD2[:plans]:
        check_plan(preset, plan, logits=logits)
    if rank == 0:
        print(f"{idle} idle groups: {plans} plans in {time.perf_counter() - start:.1f} s, "
              f"{len(os.listdir('/proc/self/task'))} threads", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle", type=int, default=1000)
    parser.add_argument("--plans", type=int, default=12)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from tests.runtime.dist_harness import run_ranks

    for idle in (0, args.idle):
        run_ranks(2, _rank, idle, args.plans)


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    main()
