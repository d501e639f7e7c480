"""Cost of the per-step batch check (runtime/agreement.py) as a ratio to the step without it.

`DistributedModel.train_step` = the batch check (shape, vocabulary, positions, a BLAKE2b digest each of
input_ids' and labels' bytes: one host sync, then one all_gather of 6 int64 per rank) + `_step`, the
training step itself. On one spawned world of 2 gloo ranks, for each plan (dp2, tp2, pp2) the
same model and batch run `_step` (baseline) and `train_step` (candidate) in alternating order
(bench_runtime's `_time_pair`); the ratio is median(train_step) / median(_step), > 1 meaning the
check costs that much. The check alone (`_check_batch`) is timed too, as a share of the step.
Only ratios mean anything; the milliseconds are this run's medians on this machine. Last, the
digest alone (`tensor_digest`, BLAKE2b of the bytes) of one tensor at production batch sizes, the part
of the check that grows with the batch (the rest is one small all_gather).

    python bench/bench_agreement.py [--steps 10] [--seq 128] [--batch 8] ...  (bench_runtime's options)
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_runtime import Options, Timing, _adamw, _batch, _model, _time_pair, format_table, parse_args  # noqa: E402

import autoshard  # noqa: E402

PLANS = {"dp2": dict(dp=2), "tp2": dict(tp=2), "pp2": dict(pp=2, micro_batch=2)}


def _compare(opts: Options) -> list[dict]:
    ids, labels = _batch(opts)
    out = []
    for name, plan in PLANS.items():
        dm = autoshard.parallelize(_model(opts), ids, plan=plan, global_batch=opts.batch, optimizer=_adamw(opts))
        base, cand = _time_pair(lambda: dm._step(ids, labels), lambda: dm.train_step(ids, labels), opts)
        check = []
        for _ in range(opts.steps):
            dist.barrier()
            start = time.perf_counter()
            dm._check_batch(ids, labels, global_batch=opts.batch)
            check.append(time.perf_counter() - start)
        out.append(dict(name=name, base_s=base, cand_s=cand, check_s=check))
    return out


def _worker(rank: int, world: int, store: str, opts: Options, path: str) -> None:
    torch.set_num_threads(opts.threads)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        rows = _compare(opts)
        if rank == 0:
            with open(path, "w") as f:
                json.dump(rows, f)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    _, opts = parse_args(argv)
    print(f"llama: hidden {opts.hidden}, ffn {opts.ffn}, {opts.layers} layers, vocab {opts.vocab}, seq {opts.seq}, "
          f"batch {opts.batch}; {opts.warmup} warm-up + {opts.steps} timed steps each side, 2 gloo ranks", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rows.json")
        mp.spawn(_worker, args=(2, os.path.join(tmp, "store"), opts, path), nprocs=2, join=True)
        with open(path) as f:
            rows = json.load(f)
    timings = [Timing(name=r["name"], baseline="_step (no check)", candidate="train_step",
                      base_s=tuple(r["base_s"]), cand_s=tuple(r["cand_s"])) for r in rows]
    print(format_table(timings))
    for r in rows:
        check, step = statistics.median(r["check_s"]), statistics.median(r["base_s"])
        print(f"{r['name']}: the check alone {1e3 * check:.2f} ms = {check / step:.3f} of a step without it")
    from autoshard.runtime.agreement import tensor_digest

    for rows, seq in ((8, 4096), (256, 4096), (1024, 4096)):
        ids = torch.randint(0, 32000, (rows, seq))
        times = []
        for _ in range(3):
            start = time.perf_counter()
            tensor_digest(ids)
            times.append(time.perf_counter() - start)
        print(f"digest of a ({rows}, {seq}) batch: {1e3 * statistics.median(times):.1f} ms "
              f"({ids.numel() * 8 / statistics.median(times) / 1e9:.2f} GB/s)")


if __name__ == "__main__":
    main()
