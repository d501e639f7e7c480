"""Speed of an expert-parallel step against the same model's data-parallel step, as a ratio (gloo).

Both sides run one training step (forward, backward, AdamW step) of the same HF
`MixtralForCausalLM` (a small config, below) on the same global batch, in the same spawned
world, at equal world size:

    dp  parallelize(plan=dict(dp=W))          every rank holds every expert
    ep  parallelize(plan=dict(ep=W))          each rank holds E/W experts; tokens by all-to-all

Method as bench/bench_runtime.py: built once, run alternately (A B, B A, ...) for `--steps`
repetitions after `--warmup`; a step is timed on rank 0 between two barriers (so it includes the
slowest rank); reported: median(ep) / median(dp) (> 1: ep slower) and the quartiles of the paired
ratios. On CPU the all-to-alls are gloo memcpy through the store and the expert GEMMs are small,
so this measures EP's overhead (dispatch, combine, counts exchange, the per-expert loop) against
DP's gradient all-reduce of all the experts; it says nothing about GPU speed.

    PYTHONPATH=. python bench/bench_ep.py [--world 2] [--steps 10] [--json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import autoshard
from autoshard.models.presets import build_model, get_spec


@dataclass(frozen=True, slots=True, kw_only=True)
class Options:
    world: int = 2
    steps: int = 10
    warmup: int = 2
    hidden: int = 256
    ffn: int = 512
    experts: int = 8
    layers: int = 2
    seq: int = 128
    batch: int = 8
    threads: int = 1


def _spec(opts: Options):
    return replace(get_spec("mixtral-tiny"), name="mixtral-bench", hidden=opts.hidden, ffn=opts.ffn,
                   experts=opts.experts, layers=opts.layers)


def _step(opts: Options, ids: torch.Tensor, plan: dict):
    dm = autoshard.parallelize(build_model(_spec(opts), seed=0), ids, plan=plan, global_batch=opts.batch,
                               optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    return lambda: dm.train_step(ids, ids)


def _worker(rank: int, opts: Options, store: str, out: str) -> None:
    os.environ.pop("WORLD_SIZE", None)
    torch.set_num_threads(opts.threads)
    dist.init_process_group("gloo", store=dist.FileStore(store, opts.world), rank=rank, world_size=opts.world)
    try:
        ids = torch.randint(0, 256, (opts.batch, opts.seq), generator=torch.Generator().manual_seed(1))
        rows = opts.batch // opts.world
        sides = (_step(opts, ids, dict(dp=opts.world, micro_batch=rows)),
                 _step(opts, ids, dict(ep=opts.world, micro_batch=rows)))
        for _ in range(opts.warmup):
            for side in sides:
                side()
        times = ([], [])
        for rep in range(opts.steps):
            for which in ((0, 1) if rep % 2 == 0 else (1, 0)):
                dist.barrier()
                start = time.perf_counter()
                sides[which]()
                dist.barrier()
                times[which].append(time.perf_counter() - start)
        if rank == 0:
            with open(out, "w") as f:
                json.dump({"dp_s": times[0], "ep_s": times[1]}, f)
    finally:
        dist.destroy_process_group()


def run(opts: Options) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(_worker, args=(opts, os.path.join(tmp, "store"), out), nprocs=opts.world, join=True)
        with open(out) as f:
            t = json.load(f)
    pairs = sorted(e / d for d, e in zip(t["dp_s"], t["ep_s"]))
    q = statistics.quantiles(pairs, n=4) if len(pairs) >= 4 else (pairs[0], statistics.median(pairs), pairs[-1])
    return {"options": asdict(opts), "dp_median_s": statistics.median(t["dp_s"]),
            "ep_median_s": statistics.median(t["ep_s"]),
            "ratio_ep_over_dp": statistics.median(t["ep_s"]) / statistics.median(t["dp_s"]),
            "paired_quartiles": list(q)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    result = run(Options(world=args.world, steps=args.steps, warmup=args.warmup))
    if args.json:
        print(json.dumps(result, indent=2))
        return
    o = result["options"]
    print(f"mixtral-bench (hidden {o['hidden']}, {o['experts']} experts of {o['ffn']}, {o['layers']} layers), "
          f"batch {o['batch']} x seq {o['seq']}, world {o['world']} on gloo:")
    print(f"  dp={o['world']}: {1e3 * result['dp_median_s']:.1f} ms/step   ep={o['world']}: "
          f"{1e3 * result['ep_median_s']:.1f} ms/step   ratio ep/dp {result['ratio_ep_over_dp']:.2f} "
          f"(paired quartiles {', '.join(f'{x:.2f}' for x in result['paired_quartiles'])})")


if __name__ == "__main__":
    main()
