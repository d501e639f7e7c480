"""Engines: published Megatron / NeMo layouts priced as they ran, and how much of each plan the engines express.

  python bench/bench_engines.py            NVIDIA's Llama-3.1-70B (64 H100) and 405B (512 H100) layouts through
                                           `autoshard price --from-megatron`, predicted / measured step time
  python bench/bench_engines.py --express  every preset on h100 and ascend-910b at 8 and 16 devices: in how many
                                           plans Megatron / torchtitan / accelerate express the whole plan, and the
                                           projected run's step time over the plan's (median, worst)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys

from autoshard.cli import main as cli

SIZES_405B = ("--num-layers 126 --hidden-size 16384 --ffn-hidden-size 53248 --num-attention-heads 128 "
              "--group-query-attention --num-query-groups 8 --vocab-size 128256 --untie-embeddings-and-output-weights")
# dgxc-benchmarking v25.04 llama3.1 (bench/gpu_heldout_runs.json): id, devices, Megatron arguments, measured s
PUBLISHED = (
    ("llama3.1-70b-h100-64", 64, "--tensor-model-parallel-size 4 --pipeline-model-parallel-size 4 --context-parallel-size 2 "
     "--num-virtual-stages-per-pipeline-rank 5 --sequence-parallel --micro-batch-size 1 --global-batch-size 128 "
     "--seq-length 8192 --use-distributed-optimizer --bf16", "llama-70b", 14.66),
    ("llama3.1-405b-h100-512", 512, "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 8 --context-parallel-size 2 "
     "--num-virtual-stages-per-pipeline-rank 8 --account-for-embedding-in-pipeline-split "
     "--account-for-loss-in-pipeline-split --sequence-parallel --micro-batch-size 1 --global-batch-size 256 "
     f"--seq-length 8192 --use-distributed-optimizer --bf16 {SIZES_405B}", None, 19.78),
)


def published() -> None:
    print(f"{'run':26} {'predicted s':>11} {'measured s':>10} {'error':>7} {'peak GB':>8} {'fits':>5}")
    for run_id, devices, args, model, measured in PUBLISHED:
        argv = ["price", "--hardware", "h100", "--devices", str(devices), "--no-best", "--json", "--from-megatron", args]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            cli(argv + (["--model", model] if model else []))
        p = json.loads(out.getvalue())["predicted"]
        print(f"{run_id:26} {p['step_time_s']:11.2f} {measured:10.2f} {100 * (p['step_time_s'] / measured - 1):+6.1f}% "
              f"{p['memory_gb']:8.1f} {'yes' if p['fits'] else 'NO':>5}")


def express() -> None:
    from autoshard.engines import accelerate, megatron, torchtitan
    from autoshard.engines.training_run import price, run_of_plan
    from autoshard.errors import AutoshardError
    from autoshard.hardware import load_hardware
    from autoshard.models.presets import get_spec, preset_names
    from autoshard.passes.capture.shapes import build_cost_table
    from autoshard.passes.cost.compiled import compile_table
    from autoshard.passes.solve.planner import solve

    engines = {"megatron": megatron, "torchtitan": torchtitan, "accelerate": accelerate}
    whole = {e: 0 for e in engines}
    ratios = {e: [] for e in engines}
    solved = 0
    for name in preset_names():
        for hw_name in ("h100", "ascend-910b"):
            for devices in (8, 16):
                spec, hw = get_spec(name), load_hardware(hw_name)
                try:
                    plan = solve(spec, hw, devices=devices, global_batch=4 * devices, seq_len=2048)
                except AutoshardError:
                    continue
                solved += 1
                ct = compile_table(build_cost_table(spec, kernels=hw.kernels), spec)
                for e, engine in engines.items():
                    try:
                        run, notes = engine.project(ct, hw, spec, run_of_plan(plan), global_batch=plan.global_batch,
                                                    seq_len=plan.seq_len)
                    except AutoshardError:
                        continue  # the engine has no such model (torchtitan: Mamba-2)
                    step = price(ct, hw, spec, run, global_batch=plan.global_batch, seq_len=plan.seq_len)["step_time_s"]
                    whole[e] += not notes
                    ratios[e].append(step / plan.predicted["step_time_s"])
    print(f"{solved} plans solved")
    for e in engines:
        r = ratios[e]
        print(f"{e:11} expresses {whole[e]}/{len(r)} plans whole; projected / planned step time: median "
              f"{statistics.median(r):.3f}, worst {max(r):.3f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--express", action="store_true", help="how much of each preset's plan the engines express")
    args = p.parse_args(argv)
    express() if args.express else published()
    return 0


if __name__ == "__main__":
    sys.exit(main())
