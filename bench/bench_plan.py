"""Plan time for llama-70b on 1024 H100s (global batch 1024, seq 4096): a fresh machine, a warm one, a
re-plan in process at a new (batch, seq), and the curve over device counts and layer counts.

Run: python bench/bench_plan.py [--quick]

Issue 13 item 6's targets: `autoshard plan` in at most 10 s on a fresh machine (an empty
AUTOSHARD_CACHE_DIR: the presets' cost tables ship in the package, so nothing is traced), and
re-planning in process at a new (batch, seq) with the table loaded in under 1 s. Every figure is
given as wall seconds and CPU seconds (time.process_time, or the child's user + system time for the
CLI runs): the machine this runs on may be shared, and the load average (printed) inflates wall
time, CPU time much less. The curve runs in one process with the table loaded (in-process memos of
the cost model are cleared per row by compiling the table again).
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time

CLI = ["plan", "--model", "llama-70b", "--hardware", "h100", "--devices", "1024", "--global-batch", "1024",
       "--seq-len", "4096", "--json"]


def _load() -> str:
    return "load average " + " / ".join(f"{x:.1f}" for x in os.getloadavg())


def cli_plan(cache_dir: str) -> tuple[float, float, dict]:
    """(wall s, CPU s, plan JSON) of one `autoshard plan` process with AUTOSHARD_CACHE_DIR=cache_dir."""
    import json

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "autoshard.cli", *CLI], capture_output=True, text=True, check=True,
                         env={**os.environ, "AUTOSHARD_CACHE_DIR": cache_dir})
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, json.loads(out.stdout)


def timed(fn):
    t0, c0 = time.perf_counter(), time.process_time()
    value = fn()
    return time.perf_counter() - t0, time.process_time() - c0, value


def _describe(plan) -> str:
    p = plan if isinstance(plan, dict) else plan.to_json()
    mesh = " ".join(f"{k}{v}" for k, v in p["mesh"].items() if v > 1)
    return (f"{mesh} mb{p['micro_batch']} ZeRO-{p['zero']} SP {p['sequence_parallel']} "
            f"strategies {p['strategies'] or 'default'}, {p['predicted']['step_time_s']:.3f} s/step, "
            f"{p['solver']['status']}, {p['solver']['layouts_solved']} of {p['solver']['layouts']} layouts solved")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the llama-70b / 1024 H100 figures only, no curve")
    args = ap.parse_args()
    print(_load(), f"on {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory(prefix="autoshard-bench-cache-") as empty:
        wall, cpu, plan = cli_plan(empty)
        print(f"fresh machine, `autoshard {' '.join(CLI)}` (empty cache): {wall:.1f} s wall, {cpu:.1f} s CPU; "
              f"{_describe(plan)}")
        wall, cpu, _ = cli_plan(empty)
        print(f"warm (the same command again, same cache dir): {wall:.1f} s wall, {cpu:.1f} s CPU")

    from autoshard.hardware import load_hardware
    from autoshard.models.presets import get_spec
    from autoshard.passes import cost
    from autoshard.passes.shapes import build_cost_table
    from autoshard.passes.solve import solve

    hw = load_hardware("h100")
    spec = get_spec("llama-70b")
    wall, cpu, ct = timed(lambda: cost.compile_table(build_cost_table(spec, kernels=hw.kernels), spec))
    print(f"in process: cost table read + compiled {wall:.2f} s wall, {cpu:.2f} s CPU")
    run = lambda b, s, d=1024, table=ct, sp=spec: solve(sp, hw, devices=d, global_batch=b, seq_len=s, table=table,
                                                       fingerprint="bench")
    wall, cpu, plan = timed(lambda: run(1024, 4096))
    print(f"in process, first solve (global batch 1024, seq 4096): {wall:.2f} s wall, {cpu:.2f} s CPU; {_describe(plan)}")
    for b, s in ((512, 8192), (2048, 2048), (1024, 4096)):
        wall, cpu, plan = timed(lambda: run(b, s))
        print(f"re-plan in process at global batch {b}, seq {s}: {wall:.2f} s wall, {cpu:.2f} s CPU; {_describe(plan)}")
    print(_load())
    if args.quick:
        return
    from autoshard.errors import InfeasiblePlanError

    print("layers  devices  wall_s  cpu_s  layouts solved/total  plan   (llama-70b config on h100, batch 1024, seq 4096)")
    for layers, devices in [(n, 64) for n in (2, 8, 20, 40, 80)] + [(80, d) for d in (8, 512, 1024, 4096)]:
        sp = get_spec("llama-70b", layers=layers)
        table = cost.compile_table(build_cost_table(sp, kernels=hw.kernels), sp)  # fresh memos per row
        try:
            wall, cpu, plan = timed(lambda: run(1024, 4096, devices, table, sp))
        except InfeasiblePlanError as e:  # e.g. 70B with Adam state on 8 devices: the answer is "no plan"
            print(f"{layers:6d}  {devices:7d}  no plan fits: {str(e).split(': ', 1)[-1][:90]}")
            continue
        print(f"{layers:6d}  {devices:7d}  {wall:6.2f}  {cpu:5.2f}  {plan.solver['layouts_solved']:>7d}/"
              f"{plan.solver['layouts']:<7d}  {_describe(plan).split(',')[0]}", flush=True)
    print(_load())


if __name__ == "__main__":
    main()
