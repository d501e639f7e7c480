"""Published GPU runs against the cost model, and the predicted MFU curve of llama-70b on H100s.

  python bench/bench_gpu_runs.py                      the issue's three calibration runs
  python bench/bench_gpu_runs.py --runs FILE.json     any runs file in the format of issue 12's
                                                      gpu_published_runs.json (held-out runs: the
                                                      errors printed are the check; nothing is fitted)
  python bench/bench_gpu_runs.py --curve              predicted MFU of llama-70b on 64..4096 H100,
                                                      global batch 1024, seq 8192 (best layout per size)

Each run is priced with its exact layout (mesh, micro-batch, ZeRO, recompute); models are HF LLaMA
configs built from the file's numbers. Prints predicted / measured step time and the error.
"""

from __future__ import annotations

import argparse
import json
import sys

from autoshard.hardware import load_hardware
from autoshard.ir import Mesh, Recompute
from autoshard.models.presets import Family, ModelSpec, get_spec
from autoshard.models.published import CALIBRATION_RUNS, PublishedRun
from autoshard.passes.cost import Layout, compile_table, estimate
from autoshard.passes.shapes import build_cost_table


def runs_from_file(path: str) -> list[PublishedRun]:
    data = json.loads(open(path).read())
    out = []
    for r in data["runs"]:
        m = r["model"]
        spec = ModelSpec(name=r["id"], family=Family.LLAMA, vocab=m["vocab"], hidden=m["hidden"], ffn=m["ffn"],
                         layers=m["layers"], heads=m["heads"], kv_heads=m["kv_heads"], tied=False)
        rec = r.get("recompute", "none")
        out.append(PublishedRun(id=r["id"], source=r.get("source", ""), spec=spec, hardware=r["hardware"],
                                mesh=Mesh(dp=r["dp"], pp=r["pp"], tp=r["tp"], cp=r["cp"]),
                                micro_batch=r["micro_batch"], global_batch=r["global_batch"], seq_len=r["seq_len"],
                                zero=r.get("zero", 1),
                                recompute=Recompute(rec if rec in ("none", "selective", "full") else "none"),
                                step_s=r["step_s"]))
    return out


def report(runs) -> None:
    print(f"{'run':32} {'pred s':>8} {'meas s':>8} {'error':>7} {'peak GB':>8} {'fits':>5} {'MFU %':>6}")
    errors = []
    for run in runs:
        ct = compile_table(build_cost_table(run.spec), run.spec)
        hw = load_hardware(run.hardware)
        lay = Layout(mesh=run.mesh, micro_batch=run.micro_batch, zero=run.zero, recompute=run.recompute)
        e = estimate(ct, run.spec, hw, lay, global_batch=run.global_batch, seq_len=run.seq_len)
        err = e.step_time_s / run.step_s - 1
        errors.append(abs(err))
        print(f"{run.id:32} {e.step_time_s:8.2f} {run.step_s:8.2f} {100 * err:+6.1f}% {e.memory_gb:8.1f} "
              f"{'yes' if e.fits else 'NO':>5} {100 * e.mfu:6.1f}")
    print(f"mean |error| {100 * sum(errors) / len(errors):.1f}%, max {100 * max(errors):.1f}%")


def curve(devices=(64, 128, 256, 512, 1024, 2048, 4096), global_batch=1024, seq_len=8192) -> None:
    from autoshard.commands.sweep import sweep

    spec = get_spec("llama-70b")
    table = build_cost_table(spec)
    hw = load_hardware("h100")
    print(f"llama-70b on H100, global batch {global_batch}, seq {seq_len}: best fitting layout per size "
          "(ZeRO 0-3, recompute none/selective/full, micro-batch 1)")
    print(f"{'devices':>7} {'dp pp tp cp':>14} {'zero':>4} {'recompute':>9} {'step s':>7} {'MFU %':>6} {'peak GB':>7}")
    for n in devices:
        rows = sweep(spec, table, hw, devices=n, global_batch=global_batch, seq_len=seq_len,
                     zeros=(0, 1, 2, 3), recomputes=tuple(Recompute))
        best = next((e for e in rows if e.fits), None)
        if best is None:
            print(f"{n:7} nothing fits (smallest {min(e.memory_gb for e in rows):.1f} GB)")
            continue
        m = best.layout.mesh
        print(f"{n:7} {m.dp:>4} {m.pp:>2} {m.tp:>2} {m.cp:>2} {best.layout.zero:>4} {best.layout.recompute.value:>9} "
              f"{best.step_time_s:7.2f} {100 * best.mfu:6.1f} {best.memory_gb:7.1f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", help="a runs JSON file (format of gpu_published_runs.json)")
    p.add_argument("--curve", action="store_true", help="print the llama-70b H100 MFU curve instead")
    args = p.parse_args(argv)
    if args.curve:
        curve()
    else:
        report(runs_from_file(args.runs) if args.runs else CALIBRATION_RUNS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
