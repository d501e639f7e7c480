"""Mamba-2 memory on the Ascend 910B: what the cost model prices, per term, for a plan and for a MindSpeed-LLM run.

  python bench/bench_mamba2_910b.py              mamba2-7b on 8 x 910B (the paper's setup: global batch 1024,
                                                 seq 4096, micro-batch 1, ZeRO-1), every valid mesh, and the two
                                                 public MindSpeed rows
  python bench/bench_mamba2_910b.py --quick      the (4,1,2,1) layout only (no trace of the two public configs)
  python bench/bench_mamba2_910b.py --rows FILE  also a measured table (the paper's format: setup, rows of dp, pp,
                                                 tp, cp, mem_gb): each row's memory error, the median, fit / no fit

Two prices of every layout, both `estimate` (passes/cost/cost.py) on the `ascend-910b` profile, which lists the
SSD autoshard's runtime runs there (`ssd_chunk_scan`, runtime/ssd.py) and names its stack's Mamba-2 recipe
(hardware.StackRecipe):

* `plan`   the layout as an autoshard plan runs it: recompute none, no sequence parallelism, a separate bf16 copy,
           the memory-efficient scan (a cost table of the profile's `kernels`);
* `stack`  the same layout as MindSpeed-LLM runs it (`cost.as_stack_runs`): the recipe's block recompute of 48
           layers per stage, `--sequence-parallel`, `--reuse-fp32-param`, on a cost table of the recipe's kernels
           (`ssd_chunk_scan_torch`: MindSpeed's SSD in torch ops under autograd; `DeviceProfile.stack_kernels`).
           The sources: the profile's `recipes`.

The public check (no held-out row is read without --rows): MindSpeed-LLM's own CI baselines on 8 NPUs
(tests/st/baseline_results/mamba2_8b_tp4_pp1_cp2_recompute_4k_ptd.json and
tests/pipeline/st/baseline/mamba2_2.7b_tp1_pp1.json at commit 3b457672; "memo info", MiB), priced with the
settings of their scripts (their own recompute counts in place of the recipe's).
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path

from autoshard.hardware import load_hardware
from autoshard.ir import Mesh
from autoshard.models.presets import get_spec
from autoshard.passes.capture.shapes import build_cost_table
from autoshard.passes.cost.cost import Layout, as_stack_runs, compile_table, estimate
from autoshard.rules.validity import valid_meshes

GB = 1e9
MIB = 2**20

# (name, spec changes from mamba2-7b, mesh, micro-batch, global batch, layers recomputed per stage,
#  measured allocated after the step (state) MiB, measured max allocated MiB)
PUBLIC = (
    ("MindSpeed CI mamba2-8b tp4 cp2 mb2 (recompute 1 of 56)",
     dict(name="mamba2-8b-mindspeed", vocab=256000, layers=56, chunk=128), Mesh(tp=4, cp=2), 2, 8, 1,
     21636.57, 48114.83),
    ("MindSpeed CI mamba2-2.7b dp4 cp2 mb1 (recompute 48 of 64)",
     dict(name="mamba2-2.7b-mindspeed", vocab=256000, hidden=2560, heads=80, groups=1, layers=64, chunk=256,
          tied=True), Mesh(dp=4, cp=2), 1, 8, 48, 22327.53, 37752.81),
)


def tables(spec, hw) -> dict[bool, object]:
    """The compiled cost table an autoshard plan (False) and a run of the profile's stack (True) are priced on."""
    own = compile_table(build_cost_table(spec, kernels=hw.kernels), spec)
    kernels = hw.stack_kernels(spec.mixer.value)
    return {False: own, True: own if kernels == hw.kernels else compile_table(build_cost_table(spec, kernels=kernels),
                                                                             spec)}


def price(cts, spec, hw, mesh, *, micro_batch, global_batch, seq_len, stack: bool, recompute_layers=None):
    """`estimate` of `mesh` at ZeRO-1, as a plan states it or (`stack`) as the profile's stack runs it
    (`recompute_layers`: a script's own block-recompute count in place of the recipe's); `cts`: `tables`'."""
    ct = cts[stack]
    layout = Layout(mesh=mesh, micro_batch=micro_batch, zero=1)
    if stack:
        layout = as_stack_runs(ct, hw, layout)
        if recompute_layers is not None:
            layout = replace(layout, recompute_layers=recompute_layers)
    return estimate(ct, spec, hw, layout, global_batch=global_batch, seq_len=seq_len)


def terms(e) -> dict:
    m = e.memory
    return {k: getattr(m, k) / GB for k in ("weights", "grads", "optimizer", "activations", "logits", "buffers")}


def show(label, e) -> str:
    t = terms(e)
    return (f"{label:6s} " + " ".join(f"{k[:5]} {v:6.2f}" for k, v in t.items())
            + f" | peak {e.memory_gb:6.1f} mean {e.mean_memory_gb:6.1f}" + ("  fits" if e.fits else "  does not fit"))


def heldout(path: Path, cts, spec, hw) -> None:
    """Each measured row priced as the stack runs it: memory error of the device average, fit against ran."""
    table = json.loads(path.read_text())
    setup = table.get("setup", {})
    kw = dict(micro_batch=setup.get("micro_batch", 1), global_batch=setup.get("global_batch", 1024),
              seq_len=setup.get("seq_len", 4096))
    errors, steps = [], []
    print(f"\n{path.name}: dp pp tp cp | mean GB pred / meas | error | peak GB | fits / ran")
    for r in table["rows"]:
        e = price(cts, spec, hw, Mesh(dp=r["dp"], pp=r["pp"], tp=r["tp"], cp=r["cp"]), stack=True, **kw)
        measured = r.get("mem_gb", r.get("memory_gb"))
        ran = isinstance(measured, (int, float)) and not r.get("oom")  # no figure, or marked OOM: did not run
        err = (e.mean_memory_gb - measured) / measured if ran else None
        if ran:
            errors.append(abs(err))
        if isinstance(r.get("step_s"), (int, float)):
            steps.append((e.step_time_s, r["step_s"]))
        print(f"  {r['dp']:2} {r['pp']:2} {r['tp']:2} {r['cp']:2} | {e.mean_memory_gb:5.1f} / "
              f"{measured if ran else '-':>5} | {f'{err:+.1%}' if ran else '':>6} | {e.memory_gb:5.1f} | "
              f"{'fits' if e.fits else 'no fit'} / {'ran' if ran else 'did not run'}")
    if errors:
        print(f"median memory error {statistics.median(errors):.1%} over {len(errors)} rows that ran")
    pairs = [(a, b) for i, a in enumerate(steps) for b in steps[i + 1:] if a[1] != b[1]]
    if pairs:
        ordered = sum((a[0] < b[0]) == (a[1] < b[1]) for a, b in pairs)
        print(f"step times: {ordered} of {len(pairs)} pairs ordered as measured")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the (4,1,2,1) layout only")
    ap.add_argument("--rows", type=Path, help="a measured Mamba-2 910B table (the paper's format) to check")
    args = ap.parse_args(argv)
    hw = load_hardware("ascend-910b")
    spec = get_spec("mamba2-7b")
    setup = dict(micro_batch=1, global_batch=1024, seq_len=4096)
    cts = tables(spec, hw)
    meshes = [Mesh(dp=4, tp=2)] if args.quick else valid_meshes(spec, 8, **setup)
    print(f"mamba2-7b on 8 x ascend-910b ({hw.stack}), global batch 1024, seq 4096, micro-batch 1, ZeRO-1; GB "
          f"(fits: peak <= {hw.memory_gb:.0f})")
    for mesh in meshes:
        print(f"\n(dp {mesh.dp}, pp {mesh.pp}, tp {mesh.tp}, cp {mesh.cp})")
        for label, stack in (("plan", False), ("stack", True)):
            print(show(label, price(cts, spec, hw, mesh, stack=stack, **setup)))
    if args.rows:
        heldout(args.rows, cts, spec, hw)
    if args.quick:
        return 0
    print("\nPublic MindSpeed-LLM rows (8 NPUs, seq 4096), priced with their scripts' settings:")
    for label, changes, mesh, mb, gb, k, state_mib, peak_mib in PUBLIC:
        s = replace(spec, **changes)
        e = price(tables(s, hw), s, hw, mesh, micro_batch=mb, global_batch=gb, seq_len=4096, stack=True, recompute_layers=k)
        t = terms(e)
        state = t["weights"] + t["grads"] + t["optimizer"]
        print(f"{label}: state {state:5.2f} GB predicted / {state_mib * MIB / GB:5.2f} measured; peak "
              f"{e.memory_gb:5.2f} predicted / {peak_mib * MIB / GB:5.2f} measured (max allocated)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
