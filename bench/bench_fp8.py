"""FP8 (torchao float8 training, plan precision "fp8") against bf16-mixed: step time and memory, as ratios.

    python bench/bench_fp8.py                      CPU, a world of one (the record: torch runs float8 GEMMs on
                                                   CPU by a reference path, so fp8 is expected to be SLOWER here;
                                                   the ratio says nothing about a GPU)
    python bench/bench_fp8.py --device cuda        an FP8 GPU (H100 / H200): also the cost model's prediction of
                                                   the same step on the `--hardware` profile, and peak memory

Both sides are `autoshard.parallelize(model, plan=dict(precision=...))` of the same HF `LlamaForCausalLM` (same
seed, same batch, AdamW), built once and run in alternating order (A B, B A, ...) for `--steps` repetitions after
`--warmup`; the ratio is median(fp8) / median(bf16-mixed) (> 1: fp8 slower), with the quartiles of the paired
per-repetition ratios as a noise gauge. Only the ratios mean anything; the milliseconds are this run's medians.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch

import autoshard
from autoshard.model_spec import Mixer, ModelSpec
from autoshard.models.presets import build_model


def _spec(args) -> ModelSpec:
    return ModelSpec(name=f"llama-h{args.hidden}", mixer=Mixer.ATTENTION, vocab=args.vocab, hidden=args.hidden,
                     ffn=args.ffn, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads, tied=False)


def _side(spec: ModelSpec, ids, precision: str, recipe: str | None, device: str):
    plan = dict(precision=precision, micro_batch=ids.shape[0], **({"fp8_recipe": recipe} if recipe else {}))
    model = build_model(spec, seed=0)
    dm = autoshard.parallelize(model, ids, plan=plan, global_batch=ids.shape[0], device=device,
                               optimizer=functools.partial(torch.optim.AdamW, lr=1e-4), compile=False)

    def step() -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        dm.train_step(ids, ids)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    return dm, step


def _predicted(spec: ModelSpec, hardware: str, batch: int, seq: int, recipe: str) -> dict:
    from autoshard.hardware import load_hardware
    from autoshard.ir import Mesh
    from autoshard.passes.cost.compiled import compile_table
    from autoshard.passes.cost.cost import estimate
    from autoshard.passes.cost.layout import Layout
    from autoshard.passes.capture.shapes import build_cost_table

    hw = load_hardware(hardware)
    ct = compile_table(build_cost_table(spec, kernels=hw.kernels), spec)
    out = {}
    for name, kw in (("bf16-mixed", dict(precision="bf16-mixed")), ("fp8", dict(precision="fp8", fp8_recipe=recipe))):
        e = estimate(ct, spec, hw, Layout(mesh=Mesh(), micro_batch=batch, **kw), global_batch=batch, seq_len=seq)
        out[name] = {"step_s": e.step_time_s, "memory_gb": e.memory_gb}
    out["ratio"] = out["fp8"]["step_s"] / out["bf16-mixed"]["step_s"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--recipe", default="tensorwise", choices=("tensorwise", "rowwise"))
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=704)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads on CPU")
    p.add_argument("--hardware", default="h200", help="profile the GPU run is predicted on")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    spec = _spec(args)
    ids = torch.randint(0, spec.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    sides = {"bf16-mixed": _side(spec, ids, "bf16-mixed", None, args.device),
             "fp8": _side(spec, ids, "fp8", args.recipe, args.device)}
    times = {k: [] for k in sides}
    order = list(sides)
    for i in range(args.warmup + args.steps):
        for name in (order if i % 2 == 0 else order[::-1]):
            t = sides[name][1]()
            if i >= args.warmup:
                times[name].append(t)
    med = {k: statistics.median(v) for k, v in times.items()}
    paired = sorted(a / b for a, b in zip(times["fp8"], times["bf16-mixed"]))
    q = statistics.quantiles(paired, n=4) if len(paired) >= 2 else [paired[0]] * 3
    out = {"device": args.device, "recipe": args.recipe, "model": spec.name, "batch": args.batch, "seq": args.seq,
           "median_ms": {k: 1e3 * v for k, v in med.items()}, "ratio_fp8_over_bf16": med["fp8"] / med["bf16-mixed"],
           "paired_ratio_quartiles": q}
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        out["peak_memory_gb"] = {}
        for name, (_, step) in sides.items():
            torch.cuda.reset_peak_memory_stats()
            step()
            out["peak_memory_gb"][name] = torch.cuda.max_memory_allocated() / 1e9
        out["predicted"] = _predicted(spec, args.hardware, args.batch, args.seq, args.recipe)
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"{spec.name} x{args.layers} layers, batch {args.batch} x {args.seq} on {args.device} ({args.recipe}): "
          f"bf16-mixed {out['median_ms']['bf16-mixed']:.1f} ms, fp8 {out['median_ms']['fp8']:.1f} ms, "
          f"fp8 / bf16 = {out['ratio_fp8_over_bf16']:.2f} (paired quartiles {q[0]:.2f}-{q[2]:.2f})")
    if "predicted" in out:
        print(f"predicted on {args.hardware}: fp8 / bf16 = {out['predicted']['ratio']:.2f}; "
              f"peak memory {out['peak_memory_gb']}")


if __name__ == "__main__":
    main()
