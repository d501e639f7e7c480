"""Published GPU runs against the cost model, and the predicted MFU curve of llama-70b on H100s.

  python bench/bench_gpu_runs.py                      the issue's three calibration runs and issue 28's FP8 row
  python bench/bench_gpu_runs.py --runs FILE.json     any runs file in the format of issue 12's
                                                      gpu_published_runs.json (held-out runs: the
                                                      errors printed are the check; nothing is fitted);
                                                      a run may give "precision": "fp8" (and "fp8_recipe"),
                                                      a MoE model "experts", "top_k" (and "shared_ffn": a shared expert in Qwen2-MoE's layout)
  python bench/bench_gpu_runs.py --heldout            the held-out runs we gathered (bench/gpu_heldout_runs.json:
                                                      8B-405B, 8-2048 GPUs, TP/PP/VP/CP/FSDP/recompute, each
                                                      with its source); prints each row and the error
                                                      distribution of the 'exact' group
  python bench/bench_gpu_runs.py --curve              predicted MFU of llama-70b on 64..4096 H100,
                                                      global batch 1024, seq 8192 (best layout per size)

Each run is priced with its exact layout (mesh, micro-batch, ZeRO, recompute); models are HF LLaMA
configs built from the file's numbers. Prints predicted / measured step time and the error.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from autoshard.hardware import load_hardware
from autoshard.ir import Mesh, Recompute
from autoshard.model_spec import Mixer, ModelSpec
from autoshard.models.presets import get_spec, moe_layout
from autoshard.models.published import CALIBRATION_RUNS, FP8_CALIBRATION_RUNS, PublishedRun
from autoshard.passes.cost.compiled import compile_table
from autoshard.passes.cost.cost import estimate, model_flops_per_token
from autoshard.passes.cost.layout import Layout
from autoshard.passes.capture.shapes import build_cost_table


HELDOUT = Path(__file__).with_name("gpu_heldout_runs.json")


def runs_from_file(path: str | Path) -> list[PublishedRun]:
    data = json.loads(Path(path).read_text())
    out = []
    for r in data["runs"]:
        m = r["model"]
        moe = ({"experts": m["experts"], "top_k": m["top_k"], "shared_ffn": m.get("shared_ffn", 0),
                "moe_paths": moe_layout(m.get("shared_ffn", 0))} if m.get("experts") else {})  # a mixture of experts
        spec = ModelSpec(name=r["id"], mixer=Mixer.ATTENTION, vocab=m["vocab"], hidden=m["hidden"], ffn=m["ffn"],
                         layers=m["layers"], heads=m["heads"], kv_heads=m["kv_heads"], tied=False, **moe)
        rec = r.get("recompute", "none")
        run = PublishedRun(id=r["id"], source=r.get("source", ""), spec=spec, hardware=r["hardware"],
                           mesh=Mesh(dp=r["dp"], pp=r["pp"], tp=r["tp"], cp=r["cp"]),
                           micro_batch=r["micro_batch"], global_batch=r["global_batch"], seq_len=r["seq_len"],
                           zero=r.get("zero", 1),
                           recompute=Recompute(rec if rec in ("none", "selective", "full") else "none"),
                           schedule=r.get("schedule", "1f1b"), virtual_stages=r.get("virtual_stages", 1),
                           sequence_parallel=r.get("sequence_parallel", False), group=r.get("group", "exact"),
                           step_s=r["step_s"] or 0.0, precision=r.get("precision", "auto"),
                           fp8_recipe=r.get("fp8_recipe"))
        if r.get("step_tflops_per_gpu"):  # a published TFLOP/s per GPU: the step in this repo's MFU convention
            ct = _compiled(spec)
            tokens = run.global_batch * run.seq_len
            step = model_flops_per_token(ct, run.seq_len) * tokens / (run.mesh.size * r["step_tflops_per_gpu"] * 1e12)
            run = replace(run, step_s=step)
        out.append(run)
    return out


_TABLES: dict = {}


def _compiled(spec: ModelSpec):
    """The compiled cost table of a spec's shape (runs of one model share it)."""
    key = replace(spec, name="published")
    if key not in _TABLES:
        _TABLES[key] = compile_table(build_cost_table(key), key)
    return _TABLES[key]


def price(run: PublishedRun):
    """The cost model's estimate of one run with its exact layout."""
    lay = Layout(mesh=run.mesh, micro_batch=run.micro_batch, zero=run.zero, recompute=run.recompute,
                 schedule=run.schedule, virtual_stages=run.virtual_stages, sequence_parallel=run.sequence_parallel,
                 precision=run.precision, fp8_recipe=run.fp8_recipe)
    ct = _compiled(run.spec)
    return estimate(ct, ct.spec, load_hardware(run.hardware), lay, global_batch=run.global_batch,
                    seq_len=run.seq_len)


def report(runs) -> None:
    print(f"{'run':32} {'group':>6} {'layout':>26} {'pred s':>8} {'meas s':>8} {'error':>7} {'peak GB':>8} "
          f"{'fits':>5} {'MFU %':>6}")
    errors = []
    for run in runs:
        e = price(run)
        err = e.step_time_s / run.step_s - 1
        if run.group == "exact":
            errors.append(err)
        m = run.mesh
        lay = (f"d{m.dp} p{m.pp} t{m.tp}{'s' if run.sequence_parallel else ''} c{m.cp} z{run.zero} "
               f"{run.recompute.value[:4]}" + (f" v{run.virtual_stages}" if run.virtual_stages > 1 else ""))
        print(f"{run.id:32} {run.group[:6]:>6} {lay:>26} {e.step_time_s:8.2f} {run.step_s:8.2f} {100 * err:+6.1f}% "
              f"{e.memory_gb:8.1f} {'yes' if e.fits else 'NO':>5} {100 * e.mfu:6.1f}")
    if errors:
        mags = [abs(x) for x in errors]
        print(f"{len(errors)} exact runs: mean |error| {100 * statistics.mean(mags):.1f}%, median "
              f"{100 * statistics.median(mags):.1f}%, max {100 * max(mags):.1f}%, mean signed "
              f"{100 * statistics.mean(errors):+.1f}%, within 10%: {sum(x <= 0.10 for x in mags)}/{len(errors)}, "
              f"within 20%: {sum(x <= 0.20 for x in mags)}/{len(errors)}")


def curve(devices=(64, 128, 256, 512, 1024, 2048, 4096), global_batch=1024, seq_len=8192) -> None:
    """Per size: the best fitting layout of the sweep (ZeRO 0-3, every recompute level, sequence
    parallelism off / on, micro-batch 1, 1F1B), the best with ZeRO <= 1 (Megatron's distributed
    optimizer; ZeRO-3's per-block gathers are priced as one collective, see docs/cost_model.md),
    and the layout NVIDIA publishes for llama3.1-70b (TP4 PP4 CP2 VP5 + SP, held-out runs) at that size."""
    from autoshard.commands.sweep import sweep

    spec = get_spec("llama-70b")
    ct = compile_table(build_cost_table(spec), spec)
    hw = load_hardware("h100")
    print(f"llama-70b on H100, global batch {global_batch}, seq {seq_len}, micro-batch 1")
    print(f"{'devices':>7} {'which':>12} {'dp pp tp cp':>14} {'zero':>4} {'recompute':>9} {'SP':>3} {'step s':>7} "
          f"{'MFU %':>6} {'peak GB':>7}")

    def row(n, which, e):
        if e is None:
            print(f"{n:7} {which:>12} nothing fits")
            return
        m, lay = e.layout.mesh, e.layout
        sched = f" v{lay.virtual_stages}" if lay.virtual_stages > 1 else ""
        print(f"{n:7} {which:>12} {m.dp:>4} {m.pp:>2} {m.tp:>2} {m.cp:>2} {lay.zero:>4} {lay.recompute.value:>9} "
              f"{'on' if lay.sequence_parallel else 'off':>3} {e.step_time_s:7.2f} {100 * e.mfu:6.1f} "
              f"{e.memory_gb:7.1f}{sched}")

    for n in devices:
        for which, zeros in (("any ZeRO", (0, 1, 2, 3)), ("ZeRO <= 1", (0, 1))):
            rows = sweep(spec, ct, hw, devices=n, global_batch=global_batch, seq_len=seq_len, zeros=zeros,
                         recomputes=tuple(Recompute), sequence_parallel=(False, True))
            row(n, which, next((e for e in rows if e.fits), None))
        nemo = Layout(mesh=Mesh(dp=n // 32, pp=4, tp=4, cp=2), zero=1, schedule="interleaved-1f1b",
                      virtual_stages=5, sequence_parallel=True)
        row(n, "NeMo layout", estimate(ct, spec, hw, nemo, global_batch=global_batch, seq_len=seq_len))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", help="a runs JSON file (format of gpu_published_runs.json)")
    p.add_argument("--heldout", action="store_true", help=f"price the held-out runs ({HELDOUT.name})")
    p.add_argument("--curve", action="store_true", help="print the llama-70b H100 MFU curve instead")
    args = p.parse_args(argv)
    if args.curve:
        curve()
    elif args.heldout:
        report(runs_from_file(HELDOUT))
    else:
        report(runs_from_file(args.runs) if args.runs else (*CALIBRATION_RUNS, *FP8_CALIBRATION_RUNS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
