"""Plan offline on a laptop, run the plan later on the cluster without solving again.

    # 1. on any machine, no accelerator, no weights: solve and export the plan
    python examples/plan_offline.py plan --devices 2 --out plan.json
    #    (the same as: autoshard plan --model llama-tiny --hardware cpu --devices 2 \
    #                   --global-batch 8 --seq-len 32 --out plan.json)
    # 2. on the cluster (here: 2 CPU processes on gloo): load it and train
    torchrun --nproc-per-node 2 examples/plan_offline.py run plan.json

`parallelize(..., plan="plan.json")` checks that the file was made for this model (its
fingerprint: module tree and parameter shapes) and this world size, and refuses it otherwise.
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.distributed as dist

import autoshard
from autoshard.hardware import load_hardware
from autoshard.models.presets import build_model, get_spec
from autoshard.passes.solve.planner import solve

MODEL, GLOBAL_BATCH, SEQ_LEN = "llama-tiny", 8, 32


def make_plan(args) -> None:
    plan = solve(get_spec(MODEL), load_hardware(args.hardware), devices=args.devices, global_batch=GLOBAL_BATCH,
                 seq_len=SEQ_LEN, time_limit_s=args.time_limit)
    plan.save(args.out)
    print(f"{MODEL} on {args.devices}x {args.hardware}: mesh {plan.mesh}, micro-batch {plan.micro_batch}, "
          f"ZeRO-{plan.zero}, predicted {plan.predicted['step_time_s']:.3g} s/step -> {args.out}")


def run_plan(args) -> None:
    spec = get_spec(MODEL)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, spec.vocab, (GLOBAL_BATCH, SEQ_LEN), generator=gen)
    dm = autoshard.parallelize(build_model(spec, seed=0), ids, plan=args.plan_file, global_batch=GLOBAL_BATCH,
                               optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    for step in range(args.steps):
        loss = dm.train_step(ids, ids)
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss.item():.4f} (mesh {dm.plan.mesh} from {args.plan_file})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description="solve a plan offline, then run it under torchrun")
    sub = parser.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("plan", help="solve and write the plan file")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--hardware", default="cpu")
    p.add_argument("--time-limit", type=float, default=10.0)
    p.add_argument("--out", default="plan.json")
    r = sub.add_parser("run", help="load the plan file and train a few steps (under torchrun)")
    r.add_argument("plan_file")
    r.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    make_plan(args) if args.mode == "plan" else run_plan(args)


if __name__ == "__main__":
    main()
