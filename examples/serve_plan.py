"""Plan serving under latency targets offline, then run one replica of the plan with dm.generate.

    # 1. anywhere, no accelerator, no weights: the highest-throughput configuration meeting the targets
    python examples/serve_plan.py plan --out serve.json
    #    (the same as: autoshard plan --model llama-tiny --hardware h100 --devices 8 --inference \
    #                   --prompt-len 512 --output-len 64 --ttft-slo 0.05 --tpot-slo 0.005 --out serve.json)
    # 2. one replica of the plan's (decode) pool, here on gloo: tp * pp * ep processes
    torchrun --nproc-per-node <tp*pp*ep> examples/serve_plan.py run serve.json

`run` builds the model under the plan file itself (`parallelize(model, ids, plan="serve.json")`:
one replica, checked by generation's rules, so no global batch is needed), generates greedily with
the KV cache sharded like the weights, and checks the tokens against HF's single-process
`generate` on rank 0.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import autoshard
from autoshard.commands import plan_inference
from autoshard.commands.common import cost_table_for
from autoshard.hardware import load_hardware
from autoshard.inference_plan import InferencePlan
from autoshard.models.presets import build_model, get_spec

MODEL = "llama-tiny"


def make_plan(args) -> None:
    spec, table = cost_table_for(MODEL, spinner=False)
    hw = load_hardware(args.hardware)
    args.model, args.no_disaggregation = MODEL, False
    plan = plan_inference.make_plan(spec, table, hw, args)  # what `autoshard plan --inference` runs
    plan.save(args.out)
    pred = plan.predicted
    pools = "; ".join(f"{p.role} {p.replicas} x tp{p.tp} pp{p.pp}, batch {p.batch}" for p in plan.pools)
    print(f"{MODEL} on {args.devices}x {hw.name}: {pools}; TTFT {pred['ttft_s'] * 1e3:.2f} ms, "
          f"TPOT {pred['tpot_s'] * 1e3:.3f} ms, {pred['throughput_tokens_per_s']:.4g} tokens/s -> {args.out}")
    print(f"runner-up: {plan.solver['runner_up']['why']}")


def run_replica(args) -> None:
    plan = InferencePlan.load(args.plan_file)
    replica = plan.replica_plan()
    spec = get_spec(plan.model)
    batch = min(plan.pools[-1].batch, args.max_batch)
    prompt = torch.randint(3, spec.vocab, (batch, args.prompt_len), generator=torch.Generator().manual_seed(0))
    dm = autoshard.parallelize(build_model(spec, seed=0), prompt, plan=args.plan_file)  # any batch generates
    out = dm.generate(prompt, max_new_tokens=args.new_tokens)
    if dist.get_rank() == 0:
        expected = build_model(spec, seed=0).generate(prompt, max_new_tokens=args.new_tokens, do_sample=False)
        print(f"replica {replica}: generated {tuple(out.shape)} tokens; matches HF generate: "
              f"{torch.equal(out, expected)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description="plan serving offline, then run one replica under torchrun")
    sub = parser.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("plan", help="plan and write the serving plan file")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--hardware", default="h100")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--ttft-slo", type=float, default=0.05)
    p.add_argument("--tpot-slo", type=float, default=0.005)
    p.add_argument("--out", default="serve.json")
    r = sub.add_parser("run", help="load the plan file and generate with one replica (under torchrun)")
    r.add_argument("plan_file")
    r.add_argument("--prompt-len", type=int, default=16, help="a short prompt for the CPU demo")
    r.add_argument("--new-tokens", type=int, default=8)
    r.add_argument("--max-batch", type=int, default=4, help="at most this many sequences in the CPU demo")
    args = parser.parse_args()
    make_plan(args) if args.mode == "plan" else run_replica(args)


if __name__ == "__main__":
    main()
