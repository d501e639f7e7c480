"""Plan time for llama-70b on 1024 H100s (global batch 1024, seq 4096): a fresh machine, a warm one, a
re-plan in process at each new (batch, seq) of issue 13 (512 / 8192, 2048 / 2048, 4096 / 1024, 256 / 16384,
then 1024 / 4096 again), and the curve over device counts and layer counts.

Run: python bench/bench_plan.py [--quick | --curve | --memo-growth]
     python bench/bench_plan.py --against CHECKOUT [--rounds N]   (A/B of the re-plans against another commit)

Issue 13 item 6's targets: `autoshard plan` in at most 10 s on a fresh machine (an empty
AUTOSHARD_CACHE_DIR: the presets' cost tables ship in the package, so nothing is traced), and
re-planning in process at a new (batch, seq) with the table loaded in under 1 s. Every figure is
given as wall seconds and CPU seconds (time.process_time, or the child's user + system time for the
CLI runs): the machine this runs on may be shared, and the load average (printed) inflates wall
time, CPU time much less. The fresh-machine row is the median of three runs, each with its own empty
cache dir (the warm row: three more with one), and names what the CLI process spent importing (one
more run under `python -X importtime`; a shipped preset's plan imports neither torch nor
transformers, tests/test_cli_imports.py). The curve runs in one process with the table loaded (in-process memos of
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


def cli_plan(cache_dir: str, *, python_flags: tuple[str, ...] = ()) -> tuple[float, float, dict, str]:
    """(wall s, CPU s, plan JSON, stderr) of one `autoshard plan` process with AUTOSHARD_CACHE_DIR=cache_dir."""
    import json

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, *python_flags, "-m", "autoshard.cli", *CLI], capture_output=True, text=True,
                         check=True, env={**os.environ, "AUTOSHARD_CACHE_DIR": cache_dir})
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, json.loads(out.stdout), out.stderr


HEAVY = ("torch", "transformers", "sympy", "numpy", "ortools")


def cli_imports() -> str:
    """What the fresh CLI spends importing the heavy packages (`python -X importtime`, cumulative s of
    each top-level import; an importtime run is itself a little slower)."""
    with tempfile.TemporaryDirectory(prefix="autoshard-bench-cache-") as empty:
        err = cli_plan(empty, python_flags=("-X", "importtime"))[3]
    spent = {}
    for line in err.splitlines():
        parts = line.split("|")
        if line.startswith("import time:") and len(parts) == 3 and parts[2].strip() in HEAVY:
            spent[parts[2].strip()] = spent.get(parts[2].strip(), 0) + int(parts[1]) / 1e6
    return ", ".join(f"{m} {spent[m]:.2f} s" if m in spent else f"{m} not imported" for m in HEAVY)


def timed(fn):
    t0, c0 = time.perf_counter(), time.process_time()
    value = fn()
    return time.perf_counter() - t0, time.process_time() - c0, value


def _describe(plan) -> str:
    p = plan if isinstance(plan, dict) else plan.to_json()
    mesh = " ".join(f"{k}{v}" for k, v in p["mesh"].items() if v > 1)
    return (f"{mesh} mb{p['micro_batch']} ZeRO-{p['zero']}{' offload' if p.get('offload_optimizer') else ''} SP {p['sequence_parallel']} "
            f"strategies {p['strategies'] or 'default'}, {p['predicted']['step_time_s']:.3f} s/step, "
            f"{p['solver']['status']}, {p['solver']['layouts_solved']} of {p['solver']['layouts']} layouts solved")


SHAPES = ((512, 8192), (2048, 2048), (4096, 1024), (256, 16384), (1024, 4096))  # the re-plans, in order


def _plan_json(plan) -> str:
    """The whole plan JSON less what may differ between two searches that find the same plan: the solve's wall
    time and the count of layouts whose tables were solved (a tighter bound skips more; reported apart)."""
    import json

    p = plan.to_json()
    p["solver"].pop("solve_time_s")
    p["solver"].pop("layouts_solved")
    return json.dumps(p, sort_keys=True)


def replans() -> dict:
    """CPU seconds of the first solve (1024 / 4096) and of each re-plan of SHAPES in this process, with the
    predicted step times and the whole plan JSON (`_plan_json`: a checkout's plans, to compare A with B to the
    bit)."""
    from autoshard.hardware import load_hardware
    from autoshard.models.presets import get_spec
    from autoshard.passes.cost.compiled import compile_table
    from autoshard.passes.capture.shapes import build_cost_table
    from autoshard.passes.solve.planner import solve

    hw, spec = load_hardware("h100"), get_spec("llama-70b")
    ct = compile_table(build_cost_table(spec, kernels=hw.kernels), spec)
    out = {}
    for name, (b, s) in (("first solve 1024/4096", (1024, 4096)), *((f"re-plan {b}/{s}", (b, s)) for b, s in SHAPES)):
        _, cpu, plan = timed(lambda: solve(spec, hw, devices=1024, global_batch=b, seq_len=s, table=ct,
                                           fingerprint="bench"))
        out[name] = (cpu, plan.predicted["step_time_s"], _plan_json(plan), plan.solver["layouts_solved"])
    return out


def against(baseline: str, rounds: int) -> None:
    """A/B in one sitting: `replans` in a fresh process of this checkout and of `baseline` (a checkout of
    another commit, e.g. a `git worktree`), alternately, `rounds` times each; medians and their ratio, whether
    the plans agree (`_plan_json`: the whole plan JSON but the solve time and the layouts solved) and the layouts
    solved on each side."""
    import json
    import statistics

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs: dict = {here: [], baseline: []}
    for _ in range(rounds):
        for tree in runs:
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--replans-json"], capture_output=True,
                                 text=True, check=True, env={**os.environ, "PYTHONPATH": tree})
            runs[tree].append(json.loads(out.stdout))
            print(f"{_load()}: {tree}: " + ", ".join(f"{k} {r[0]:.2f}" for k, r in runs[tree][-1].items()),
                  flush=True)
    mine, base = runs[here], runs[baseline]
    for key in mine[0]:
        a, b = (statistics.median(r[key][0] for r in rs) for rs in (mine, base))
        same = {r[key][1] for r in mine} == {r[key][1] for r in base}
        plans = {r[key][2] for r in mine + base if len(r[key]) > 2}  # (a baseline before the JSON was written: none)
        whole = "" if all(len(r[key]) <= 2 for r in base) else (
            ", the same plan JSON" if len(plans) == 1 else ", DIFFERENT plan JSON")
        solved = " -> ".join(str(sorted({r[key][3] for r in rs if len(r[key]) > 3})) for rs in (base, mine))
        print(f"{key}: median {a:.2f} s CPU here, {b:.2f} s at the baseline, ratio {a / b:.2f}; "
              f"{'the same' if same else 'DIFFERENT'} predicted step time{whole}; layouts solved {solved}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the llama-70b / 1024 H100 figures only, no curve")
    ap.add_argument("--curve", action="store_true", help="the curve over layer and device counts only")
    ap.add_argument("--memo-growth", action="store_true",
                    help="16 sequence lengths planned in one process: the memo entries the blocks hold, the max RSS")
    ap.add_argument("--against", metavar="CHECKOUT", help="A/B of the re-plans only: this checkout against another")
    ap.add_argument("--rounds", type=int, default=5, help="with --against: fresh processes per checkout")
    ap.add_argument("--replans-json", action="store_true", help=argparse.SUPPRESS)  # --against's child
    args = ap.parse_args()
    if args.replans_json:
        import json

        print(json.dumps(replans()))
        return
    if args.against:
        against(os.path.abspath(args.against), args.rounds)
        return
    print(_load(), f"on {os.cpu_count()} CPUs")
    if args.curve:
        curve()
        return
    if args.memo_growth:
        memo_growth()
        return
    runs = []
    for _ in range(3):
        with tempfile.TemporaryDirectory(prefix="autoshard-bench-cache-") as empty:
            runs.append(cli_plan(empty)[:3])
    wall, cpu, plan = sorted(runs, key=lambda r: r[1])[1]
    print(f"fresh machine, `autoshard {' '.join(CLI)}` (empty cache), median of 3 by CPU: {wall:.1f} s wall, "
          f"{cpu:.1f} s CPU (runs: {', '.join(f'{w:.1f} / {c:.1f}' for w, c, _ in runs)} s wall / CPU); "
          f"{_describe(plan)}")
    print(f"fresh machine, imports (python -X importtime): {cli_imports()}")
    with tempfile.TemporaryDirectory(prefix="autoshard-bench-cache-") as empty:
        cli_plan(empty)
        runs = [cli_plan(empty)[:2] for _ in range(3)]
        wall, cpu = sorted(runs, key=lambda r: r[1])[1]
        print(f"warm (the same command again, same cache dir), median of 3 by CPU: {wall:.1f} s wall, {cpu:.1f} s CPU")

    from autoshard.hardware import load_hardware
    from autoshard.models.presets import get_spec
    from autoshard.passes.cost.compiled import compile_table
    from autoshard.passes.capture.shapes import build_cost_table
    from autoshard.passes.solve.planner import solve

    hw = load_hardware("h100")
    spec = get_spec("llama-70b")
    wall, cpu, ct = timed(lambda: compile_table(build_cost_table(spec, kernels=hw.kernels), spec))
    print(f"in process: cost table read + compiled {wall:.2f} s wall, {cpu:.2f} s CPU")
    run = lambda b, s, d=1024, table=ct, sp=spec: solve(sp, hw, devices=d, global_batch=b, seq_len=s, table=table,
                                                       fingerprint="bench")
    wall, cpu, plan = timed(lambda: run(1024, 4096))
    print(f"in process, first solve (global batch 1024, seq 4096): {wall:.2f} s wall, {cpu:.2f} s CPU; {_describe(plan)}")
    for b, s in SHAPES:
        wall, cpu, plan = timed(lambda: run(b, s))
        print(f"re-plan in process at global batch {b}, seq {s}: {wall:.2f} s wall, {cpu:.2f} s CPU; {_describe(plan)}")
    print(_load())
    if not args.quick:
        curve()


def memo_growth() -> None:
    """llama-70b on 1024 H100s, global batch 1024, sequence lengths 1024, 2048 ... 16384 planned in one process with
    one table: after each plan, the entries of the cost model's block memos (a block's `memo`, and its `shaped` memo
    where there is one: passes/cost/shape_memo.py) and the process's max RSS."""
    from autoshard.hardware import load_hardware
    from autoshard.models.presets import get_spec
    from autoshard.passes.cost.compiled import compile_table
    from autoshard.passes.capture.shapes import build_cost_table
    from autoshard.passes.solve.planner import solve

    hw, spec = load_hardware("h100"), get_spec("llama-70b")
    ct = compile_table(build_cost_table(spec, kernels=hw.kernels), spec)
    for s in range(1024, 16385, 1024):
        _, cpu, _ = timed(lambda: solve(spec, hw, devices=1024, global_batch=1024, seq_len=s, table=ct, fingerprint="bench"))
        held = sum(len(b.memo) + len(getattr(b, "shaped", ())) for b in ct.blocks.values())
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        print(f"seq {s}: {cpu:.2f} s CPU, {held} block memo entries, max RSS {rss:.0f} MiB", flush=True)
    print(_load())


def curve() -> None:
    """Plan time over layer counts (64 devices) and device counts (80 layers), llama-70b's config on h100, batch
    1024, seq 4096, in process, the table compiled afresh per row (the cost model's memos start empty; the
    layouts' codes and Layouts built by earlier rows of the process are reused)."""
    from autoshard.errors import InfeasiblePlanError
    from autoshard.hardware import load_hardware
    from autoshard.models.presets import get_spec
    from autoshard.passes.cost.compiled import compile_table
    from autoshard.passes.capture.shapes import build_cost_table
    from autoshard.passes.solve.planner import solve

    hw = load_hardware("h100")
    run = lambda b, s, d, table, sp: solve(sp, hw, devices=d, global_batch=b, seq_len=s, table=table,
                                           fingerprint="bench")

    print("layers  devices  wall_s  cpu_s  layouts solved/total  plan   (llama-70b config on h100, batch 1024, seq 4096)")
    for layers, devices in [(n, 64) for n in (2, 8, 20, 40, 80)] + [(80, d) for d in (8, 512, 1024, 4096)]:
        sp = get_spec("llama-70b", layers=layers)
        table = compile_table(build_cost_table(sp, kernels=hw.kernels), sp)  # fresh memos per row
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
