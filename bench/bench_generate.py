"""Decode time per token of `dm.generate` at tp 2 against single-process HF `generate`, as a ratio.

    python bench/bench_generate.py [--family llama|mamba2] [--reps 5] [--new-tokens 32] [--json]

Both sides generate greedily from the same prompts with the same weights (a LLaMA or Mamba-2 of
`--hidden` width, `--layers` layers, built from one seed), in the same two spawned gloo processes:
the baseline is HF's `model.generate(ids, max_new_tokens=N, do_sample=False)` on rank 0 alone (the
other rank waits at a barrier), the candidate `parallelize(plan=dict(tp=2)).generate` on both
ranks. Decode time per token = (time of N new tokens - time of 1 new token) / (N - 1), which
takes the prefill out. The two sides run alternately (A B, B A, ...) for `--reps` repetitions
after one warm-up; the ratio is median(autoshard) / median(HF) (> 1: autoshard slower), with the
quartiles of the paired per-repetition ratios. Each rank uses one intra-op thread, so on a CPU
tp 2 has no more arithmetic per token than HF has: what the ratio shows is the cost of the
collectives per layer (two all-reduces for LLaMA, one for Mamba-2, and the logits all-gather)
on gloo against the halved weight reads. Only ratios mean anything.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import autoshard
from autoshard.model_spec import ModelSpec
from autoshard.models.presets import build_model, get_spec


def _spec(args) -> ModelSpec:
    from dataclasses import replace

    base = get_spec("llama-tiny" if args.family == "llama" else "mamba2-tiny")
    if args.family == "llama":
        return replace(base, hidden=args.hidden, ffn=int(args.hidden * 2.75) // 8 * 8, heads=8, kv_heads=4,
                       layers=args.layers, vocab=args.vocab)
    return replace(base, hidden=args.hidden, heads=2 * args.hidden // 32, head_dim=32, groups=2,
                   layers=args.layers, vocab=args.vocab)


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _per_token(run, new_tokens: int) -> float:
    long = _timed(lambda: run(new_tokens))
    short = _timed(lambda: run(1))
    return (long - short) / (new_tokens - 1)


def _worker(rank: int, world: int, store: str, args, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    spec = _spec(args)
    ids = torch.randint(3, spec.vocab, (args.batch, args.prompt_len), generator=torch.Generator().manual_seed(0))
    ref = build_model(spec, seed=0) if rank == 0 else None
    dm = autoshard.parallelize(build_model(spec, seed=0), ids, plan=dict(tp=2), global_batch=args.batch)

    def hf(n):
        if rank == 0:
            with torch.no_grad():
                ref.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n)

    def ours(n):
        dm.generate(ids, max_new_tokens=n)

    for fn in (hf, ours):  # warm-up
        _per_token(fn, 3)
    base, cand = [], []
    for rep in range(args.reps):
        pair = ((hf, base), (ours, cand)) if rep % 2 == 0 else ((ours, cand), (hf, base))
        for fn, sink in pair:
            sink.append(_per_token(fn, args.new_tokens))
    if rank == 0:
        ratios = sorted(c / b for b, c in zip(base, cand))
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        result = {"family": args.family, "hidden": spec.hidden, "layers": spec.layers, "batch": args.batch,
                  "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "reps": args.reps,
                  "hf_ms_per_token": 1e3 * statistics.median(base),
                  "tp2_ms_per_token": 1e3 * statistics.median(cand),
                  "ratio_tp2_over_hf": statistics.median(cand) / statistics.median(base),
                  "paired_ratio_quartiles": [q[0], q[2]]}
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=("llama", "mamba2"), default="llama")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_worker, args=(2, os.path.join(tmp, "store"), args, out), nprocs=2, join=True)
        result = json.load(open(out))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{result['family']} hidden {result['hidden']} x {result['layers']} layers, batch {result['batch']}, "
              f"prompt {result['prompt_len']}: decode {result['hf_ms_per_token']:.2f} ms/token HF generate, "
              f"{result['tp2_ms_per_token']:.2f} ms/token autoshard tp2: ratio {result['ratio_tp2_over_hf']:.2f} "
              f"(paired quartiles {result['paired_ratio_quartiles'][0]:.2f}-{result['paired_ratio_quartiles'][1]:.2f})")


if __name__ == "__main__":
    main()
