"""Planning speed on two large mixed layer stacks (issue 25 item 2): Nemotron-H-56B (118 layers: Mamba-2,
attention, MLP) and DeepSeek-V3 (61 layers, 3 dense then MoE) on 1024 H100, built from their published configs
on the meta device (autoshard/models/hybrids.py: no weights materialised), one layer of each kind traced on
fake tensors. Wall and CPU seconds both (the CPU time is what the plan costs on a machine others share), and
the seconds of them the interpreter spent in full garbage collections: a pass walks the whole process heap (torch,
transformers and the captured models: ~1M objects, 0.35-0.6 s a pass here) and lands in whichever plan crosses
CPython's threshold, so it is shown apart.

Reports per model: the capture (model on meta, a layer per kind traced: once per machine, then read from the
on-disk cache), the first plan in the process from the table (the target: under 5 s), and re-plans in the same
process at another global batch and at a longer and a shorter sequence length (the target: under 1 s), with the
plan each found.
dp, pp, cp, tp and ep run on these hybrids; what the runtime still refuses on a hybrid (models/layered.py
`hybrid_refusals`: tp, sequence parallelism and ep only where a layer holds a part no rule splits) is searched here all the same (the spec's `refused` cleared): this measures the planner on the whole
space, a little more than the runtime runs; `autoshard plan` on these models searches only what `parallelize` runs.

    python bench/bench_mixed_plan.py [--models nemotron-h-56b,deepseek-v3] [--devices 1024]
"""

from __future__ import annotations

import argparse
from dataclasses import replace
import gc
import os
import time

MODELS = {"nemotron-h-56b": "autoshard.models.hybrids:nemotron_h_56b", "deepseek-v3": "autoshard.models.hybrids:deepseek_v3"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--devices", type=int, default=1024)
    ap.add_argument("--hardware", default="h100")
    args = ap.parse_args()
    os.environ.setdefault("AUTOSHARD_CACHE_DIR", "off")  # time the capture itself, not a cache read

    from autoshard.fingerprint import fingerprint_module
    from autoshard.hardware import load_hardware
    from autoshard.models.presets import resolve_model
    from autoshard.passes.capture.shapes import build_cost_table
    from autoshard.passes.cost.compiled import compile_table
    from autoshard.passes.solve.planner import solve

    hw = load_hardware(args.hardware)
    passes = []  # the start and stop of each of the interpreter's full (generation 2) garbage collections
    gc.callbacks.append(lambda phase, info: passes.append(time.perf_counter()) if info["generation"] == 2 else None)
    for name in args.models.split(","):
        t0 = time.perf_counter()
        spec, model = resolve_model(MODELS[name], device="meta")
        spec = replace(spec, refused=())  # the whole space: see the module docstring
        table = compile_table(build_cost_table(spec, model=model, kernels=hw.kernels), spec)
        capture = time.perf_counter() - t0
        fingerprint = fingerprint_module(model)  # as `autoshard plan` passes it (else solve builds a model of the spec)
        print(f"{name}: {spec.layers} layers of {len(table.kinds)} kinds "
              f"({', '.join(f'{table.layer_kinds.count(k)} {n}' for k, n in enumerate(table.kind_names))}), "
              f"{model.num_parameters() / 1e9:.1f}B parameters; capture {capture:.2f} s")
        for label, batch, seq in (("plan", 1024, 4096), ("re-plan", 2048, 4096), ("re-plan", 1024, 8192),
                                  ("re-plan", 1024, 4096), ("re-plan", 1024, 2048)):
            passes.clear()
            t0, c0 = time.perf_counter(), time.process_time()
            plan = solve(spec, hw, devices=args.devices, global_batch=batch, seq_len=seq, table=table,
                         fingerprint=fingerprint)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            pred, solver = plan.predicted, plan.solver
            full = sum(b - a for a, b in zip(passes[::2], passes[1::2]))
            print(f"  {label:8s} batch {batch} seq {seq}: {wall:.2f} s wall, {cpu:.2f} s CPU, {full:.2f} s of it in "
                  f"full collections ({solver['layouts_solved']} of "
                  f"{solver['layouts']} layouts solved) -> {plan.mesh}, micro-batch {plan.micro_batch}, "
                  f"ZeRO-{plan.zero}, stages {[st.layers for st in plan.stages]}, "
                  f"step {pred['step_time_s']:.3g} s, MFU {100 * pred['mfu']:.1f}%, {pred['memory_gb']:.1f} GB")


if __name__ == "__main__":
    main()
