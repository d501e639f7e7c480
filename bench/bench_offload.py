"""Optimizer offload on one CUDA device: peak device memory and step time of ZeRO-3 with
`offload_optimizer` against ZeRO-3 without it, as ratios measured in the same process.

    python bench/bench_offload.py [--preset llama-1b --layers 4 --batch 4 --seq 512 --steps 4]

A world of one (NCCL): FSDP2 shards over one rank, so the difference is exactly what offload moves
(parameters, gradients and AdamW state in host memory, the optimizer step on the CPU). Each side is
built fresh, warmed up for one step, then `--steps` steps are timed (median). fp32 throughout (the
runtime's precision on this path). Needs CUDA; prints one JSON object.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch

import autoshard
from autoshard.models.presets import build_model, get_spec


def measure(spec, *, offload: bool, batch: int, seq: int, steps: int) -> dict:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    ids = torch.randint(0, spec.vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    dm = autoshard.parallelize(build_model(spec, seed=0), ids, global_batch=batch, device="cuda:0",
                               plan=dict(zero=3, offload_optimizer=offload, micro_batch=batch, precision="fp32"),
                               optimizer=functools.partial(torch.optim.AdamW, lr=1e-4))
    dm.train_step(ids, ids)  # warm-up: allocates the optimizer state
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dm.train_step(ids, ids)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    out = {"peak_gb": torch.cuda.max_memory_allocated() / 1e9, "step_s": statistics.median(times)}
    del dm
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama-1b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    spec = get_spec(args.preset, layers=args.layers)
    params = sum(p.numel() for p in build_model(spec, device="meta").parameters())
    on = measure(spec, offload=False, batch=args.batch, seq=args.seq, steps=args.steps)
    off = measure(spec, offload=True, batch=args.batch, seq=args.seq, steps=args.steps)
    print(json.dumps({"preset": args.preset, "layers": args.layers, "params": params, "zero3": on,
                      "zero3_offload": off, "peak_memory_ratio": off["peak_gb"] / on["peak_gb"],
                      "step_time_ratio": off["step_s"] / on["step_s"]}, indent=1))


if __name__ == "__main__":
    main()
