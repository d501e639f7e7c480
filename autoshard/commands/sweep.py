"""`autoshard sweep`: price every valid (DP, PP, TP, CP, EP) layout of a model on a cluster.

Builds the model's cost table once (passes/capture/shapes), then runs the cost model (passes/cost/cost) on
every mesh that passes the divisibility rules (rules/validity), for the given or every ZeRO level
and recompute mode ("auto" keeps, per mesh, the fastest option that fits, else the smallest).
Sequence parallelism: off, on every stage, or with `--sequence-parallel auto` also chosen per
pipeline stage (`stage_mix`: the plan key's per-stage list, docs/plan_format.md), as `autoshard plan`
chooses it.
Prints a table best first (fitting layouts by step time, then the rest), or `--json`, and can
plot MFU against memory per device (`--plot f.png`).
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from typing import Sequence

from autoshard.commands.common import (MOE_IMBALANCE_HELP, check_moe_imbalance, check_positions, check_plot_path, cost_table_for,
                                       check_schedule_flags, imbalance, memory_text, model_for, positive_int,
                                       print_refusals, seconds_text)
from autoshard.errors import InvalidConfigError
from autoshard.ir import Recompute, Schedule

ZERO_CHOICES = ("0", "1", "2", "3", "auto")
RECOMPUTE_CHOICES = ("none", "selective", "full", "auto")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "sweep", help="price every valid (DP, PP, TP, CP, EP) layout: step time, tokens/s, memory, MFU",
        description="Price every valid (DP, PP, TP, CP, EP) layout of a model on N devices with the cost "
        "model: step time, tokens/s, peak memory per device, MFU (paper convention), whether it fits. "
        "Best first. A model whose layers are of several kinds (a hybrid: Bamba, Nemotron-H, DeepSeek-V3's "
        "dense and MoE layers, ...) is priced under dp, pp and tp (each layer part by its own rule), each pipeline "
        "stage as the sum of its own layers.")
    p.add_argument("--model", required=True, help="preset name (llama-7b, mamba2-1b, ...) or package.module:factory")
    p.add_argument("--hardware", required=True,
                   help="device profile: ascend-910b, a100-80g, h100, h200, cpu, or a JSON profile file")
    p.add_argument("--devices", required=True, type=positive_int, help="number of devices (world size)")
    p.add_argument("--global-batch", required=True, type=positive_int, help="sequences per optimizer step")
    p.add_argument("--seq-len", required=True, type=positive_int, help="tokens per sequence (at least 2: the loss predicts each next token)")
    p.add_argument("--micro-batch", type=positive_int, default=1, help="sequences per micro-batch (default 1)")
    p.add_argument("--zero", choices=ZERO_CHOICES, default="auto",
                   help="ZeRO level (2 and 3 need pp = 1), or auto: the fastest that fits per layout (default auto)")
    p.add_argument("--recompute", choices=RECOMPUTE_CHOICES, default="auto",
                   help="activation recomputation, or auto: the fastest that fits per layout (default auto)")
    p.add_argument("--sequence-parallel", choices=("off", "on", "auto"), default="off",
                   help="Megatron-LM sequence parallelism (norms and residual stream on a 1/tp shard of the "
                   "sequence) on every layout with tp > 1 that allows it, or auto: off, on, and under pp chosen "
                   "per pipeline stage (the column then lists each stage's, e.g. on/-), the best per layout "
                   "(default off)")
    p.add_argument("--schedule", choices=("1f1b", "gpipe", "interleaved-1f1b", "zero-bubble"),
                   help="pipeline schedule of every layout with pp > 1 (default: 1F1B, GPipe where there are fewer "
                   "micro-batches than stages; interleaved-1f1b when --virtual-stages > 1)")
    p.add_argument("--virtual-stages", type=positive_int, default=1, metavar="V",
                   help="model chunks per pipeline rank for interleaved-1f1b / zero-bubble (default 1); layouts "
                   "whose pp x V chunks the schedule cannot run are left out")
    p.add_argument("--moe-imbalance", type=imbalance, default=1.0, metavar="X", help=MOE_IMBALANCE_HELP)
    p.add_argument("--json", action="store_true", help="print a JSON list, one object per layout, best first")
    p.add_argument("--plot", metavar="FILE.png", help="write a PNG of MFU against memory per device")
    p.add_argument("--limit", type=positive_int, default=None, help="show only the first N rows of the table")
    p.set_defaults(run=run)


def sweep(spec, table, hw, *, devices: int, global_batch: int, seq_len: int, micro_batch: int = 1,
          zeros: Sequence[int] = (1,), recomputes: Sequence[Recompute] = (Recompute.NONE,),
          sequence_parallel: Sequence[bool] = (False,), moe_imbalance: float = 1.0, schedule: str | None = None,
          virtual_stages: int = 1) -> list:
    """Every valid mesh priced; per mesh the best (fits first, then step time) of the options (the
    ZeRO levels that go with the mesh: ZeRO-2/3 need pp = 1, ZeRO-3 ep = 1; sequence parallelism where
    the mesh allows it; `moe_imbalance` for a mixture of experts). `schedule` / `virtual_stages`: the
    pipeline schedule of every mesh with pp > 1 (None: 1F1B, GPipe with fewer micro-batches than
    stages); a mesh the schedule cannot run (`schedules.check_chunks`) is left out. Returns `Estimate`s,
    best first."""
    from autoshard.passes.cost.compiled import compile_table, mixed_violation
    from autoshard.passes.cost.cost import estimate
    from autoshard.passes.cost.layout import Layout
    from autoshard.rules.validity import sequence_parallel_violation, valid_meshes, zero_violation
    from autoshard.rules.sharding import runnable_strategies

    meshes = valid_meshes(spec, devices, global_batch=global_batch, seq_len=seq_len, micro_batch=micro_batch)
    ct = compile_table(table, spec)
    if ct.kinds:  # layers of several kinds: the layouts the per-kind tables price (dp x pp, ep for MoE kinds)
        priced = [m for m in meshes if mixed_violation(ct, Layout(mesh=m)) is None]
        if not priced:
            raise InvalidConfigError(mixed_violation(ct, Layout(mesh=meshes[0])) + f"; {devices} devices leave none")
        meshes = priced
    out = []
    for mesh in meshes:
        allowed = sequence_parallel_violation(spec, mesh, seq_len) is None  # else the mesh is priced without
        # the table's default layout where it runs, else the first intra-op choices that do (a vocabulary
        # tp does not divide: embedding and head replicated, which sequence parallelism does not go with)
        layouts = {sp: st for sp in {sp and allowed for sp in sequence_parallel}
                   for st in [runnable_strategies(spec, mesh.tp, sequence_parallel=sp)] if st is not None}
        sps = set(layouts)
        # 1F1B needs m >= pp micro-batches (the validator's rule); with fewer the runtime runs GPipe
        base = Layout(mesh=mesh, micro_batch=micro_batch)
        chosen = _schedule(spec, mesh, base.microbatches(global_batch), schedule, virtual_stages)
        if chosen is None:
            continue
        sched, v = chosen
        options = []
        for z in (z for z in zeros if zero_violation(mesh, z) is None):
            for r in recomputes:
                lay = Layout(mesh=mesh, micro_batch=micro_batch, zero=z, recompute=r, moe_imbalance=moe_imbalance,
                             schedule=sched, virtual_stages=v)
                if mixed_violation(ct, lay):
                    continue
                uniform = {sp: estimate(ct, spec, hw, replace(lay, sequence_parallel=sp, strategies=layouts[sp]),
                                        global_batch=global_batch, seq_len=seq_len) for sp in sorted(sps)}
                options += uniform.values()
                if mesh.pp > 1 and len(uniform) == 2:  # both asked for and allowed: also per stage
                    options += filter(None, [stage_mix(ct, hw, lay, uniform, global_batch=global_batch,
                                                       seq_len=seq_len)])
        if not options:
            continue
        fitting = [e for e in options if e.fits]
        out.append(min(fitting, key=lambda e: e.step_time_s) if fitting else min(options, key=lambda e: e.memory_gb))
    if not out and schedule is not None and all(m.pp > 1 for m in meshes):
        raise InvalidConfigError(f"--schedule {schedule} --virtual-stages {virtual_stages}: no valid mesh runs it "
                                 f"({spec.layers} layers, global batch {global_batch})")
    if not out:
        raise InvalidConfigError(f"no valid mesh goes with ZeRO-{max(zeros)}: {zero_violation(meshes[0], max(zeros))}")
    return sorted(out, key=lambda e: (not e.fits, e.step_time_s))


def _schedule(spec, mesh, microbatches: int, schedule: str | None, virtual_stages: int):
    """(schedule, virtual stages) of `mesh`, or None when the asked schedule cannot run on it."""
    from autoshard.ir import check_schedule
    from autoshard.rules.schedules import check_chunks

    if mesh.pp == 1:
        return "1f1b", 1
    if schedule is None and virtual_stages == 1:
        return ("gpipe" if microbatches < mesh.pp else "1f1b"), 1
    sched = schedule or "interleaved-1f1b"
    try:
        check_schedule(Schedule(sched), virtual_stages, pp=mesh.pp)
        check_chunks(sched, virtual_stages, pp=mesh.pp, microbatches=microbatches, layers=spec.layers)
    except InvalidConfigError:
        return None
    return sched, virtual_stages


def stage_mix(ct, hw, layout, uniform: dict, *, global_batch: int, seq_len: int):
    """`layout` (sequence parallelism off, pp > 1, an even split) with sequence parallelism chosen per
    pipeline stage: an `Estimate` whose `stage_sequence_parallel` lists each stage's choice, or None where
    the best choice is the same on every stage (`uniform` {False: estimate, True: estimate} has those).
    Each stage takes the option that fits and is faster there (ties: off); the step time grows with
    every stage's time and the DP tail does not depend on the choice, so no other per-stage choice of
    this split and recompute level is faster. Priced by the planner's per-stage tables
    (passes/solve/solve_model.py `mesh_problem`: where the stages differ every boundary carries the whole
    sequence, a sequence-parallel stage gathers what it sends, runtime/stages.py); the time and memory
    breakdowns are the uniform layout's of the slowest stage's choice, as `autoshard plan` reports a
    per-stage plan."""
    from autoshard.ir import even_stages
    from autoshard.passes.solve.solve_model import Assignment, evaluate, mesh_problem

    r, pp = layout.recompute, layout.mesh.pp
    problem = mesh_problem(ct, hw, replace(layout, stage_choices=("sequence_parallel",)), global_batch=global_batch,
                           seq_len=seq_len, recomputes=(r,))
    layers = tuple(st.layers for st in even_stages(ct.spec.layers, pp))
    picks = []
    for i, n in enumerate(layers):
        cells = [(float(problem.time_s[i, problem.option(r, v), n]), v) for v in (0, 1)  # variant 1: on
                 if problem.mem_bytes[i, problem.option(r, v), n] <= hw.memory_bytes]
        if not cells:
            return None
        picks.append(min(cells)[1])
    if len(set(picks)) == 1:
        return None
    ev = evaluate(problem, Assignment(layers=layers, recompute=(r,) * pp, variant=tuple(picks)))
    base = uniform[bool(picks[max(range(pp), key=lambda i: ev.stage_s[i])])]
    step = ev.step_s
    return replace(base, layout=layout, step_time_s=step, tokens_per_s=global_batch * seq_len / step,
                   mfu=base.mfu * base.step_time_s / step, memory_gb=ev.peak_bytes / 1e9,
                   mean_memory_gb=sum(ev.stage_bytes) / pp / 1e9, fits=ev.peak_bytes <= hw.memory_bytes,
                   stage_times_s=ev.stage_s, stage_memory_gb=tuple(b / 1e9 for b in ev.stage_bytes),
                   stage_sequence_parallel=tuple(bool(v) for v in picks))


def run(args) -> int:
    from autoshard.hardware import load_hardware

    if args.plot:
        check_plot_path(args.plot)
    from autoshard.rules.validity import valid_meshes

    check_schedule_flags(args.schedule, args.virtual_stages)
    hw = load_hardware(args.hardware)
    spec, module = model_for(args.model)
    check_moe_imbalance(spec, args.moe_imbalance)
    check_positions(spec, module, args.seq_len, "sweep --seq-len")
    valid_meshes(spec, args.devices, global_batch=args.global_batch, seq_len=args.seq_len,
                 micro_batch=args.micro_batch)  # no valid layout: say so before tracing the model
    _, table = cost_table_for(args.model, spinner=not args.json, spec=spec, module=module, kernels=hw.kernels)
    zeros = (0, 1, 2, 3) if args.zero == "auto" else (int(args.zero),)
    recomputes = tuple(Recompute) if args.recompute == "auto" else (Recompute(args.recompute),)
    results = sweep(spec, table, hw, devices=args.devices, global_batch=args.global_batch, seq_len=args.seq_len,
                    micro_batch=args.micro_batch, zeros=zeros, recomputes=recomputes,
                    sequence_parallel={"off": (False,), "on": (True,), "auto": (False, True)}[args.sequence_parallel],
                    moe_imbalance=args.moe_imbalance, schedule=args.schedule, virtual_stages=args.virtual_stages)
    if args.plot:
        write_plot(results, hw, args.plot, title=f"{spec.name} on {args.devices}x {hw.name}, "
                   f"global batch {args.global_batch}, seq {args.seq_len}")
    if args.json:
        json.dump([e.to_json() for e in results], sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        _print_table(results, hw, spec, args, mixed=table.mixed)
        if table.mixed:
            kinds = ", ".join(f"{b.count} {b.name}" for b in table.layer_blocks())
            ep = "ep (its MoE layers' experts; the others data-parallel), " if spec.is_moe else ""
            print(f"layers of {len(table.layer_blocks())} kinds ({kinds}): each stage priced as the sum of its own "
                  f"layers; {ep}dp, pp, cp{' and tp' if spec.parts else ''} priced, {'' if spec.parts else 'tp, '}"
                  "selective recompute and ZeRO-3 not for a mixed stack yet")
    return 0


def _print_table(results, hw, spec, args, *, mixed: bool = False) -> None:
    from rich.console import Console
    from rich.table import Table

    rows = results[: args.limit] if args.limit else results
    table = Table(title=f"{spec.name} on {args.devices}x {hw.name} ({memory_text(hw.memory_gb)}), global batch "
                  f"{args.global_batch}, seq {args.seq_len}: {len(results)} layouts, best first")
    for col in ("#", "dp", "pp", "tp", "cp", "ep", "sp", "schedule", "zero", "recompute", "mb", "step s", "ktok/s", "mem avg", "peak",
                "MFU %", "fits"):
        table.add_column(col, justify="left" if col == "recompute" else "right")
    for i, e in enumerate(rows, 1):
        m, lay = e.layout.mesh, e.layout
        table.add_row(str(i), str(m.dp), str(m.pp), str(m.tp), str(m.cp), str(m.ep),
                      _sp_cell(e), lay.schedule.value + (f" x{lay.virtual_stages}" if lay.virtual_stages > 1 else "")
                      if m.pp > 1 else "-", str(lay.zero),
                      lay.recompute.value, str(lay.micro_batch), seconds_text(e.step_time_s),
                      f"{e.tokens_per_s / 1e3:.1f}",
                      memory_text(e.mean_memory_gb), memory_text(e.memory_gb), f"{100 * e.mfu:.1f}", "yes" if e.fits else "[red]no[/red]")
    Console(width=140).print(table)
    from autoshard.rules.validity import excluded_eps

    replicated = sorted({e.layout.mesh.tp for e in results if e.layout.strategies})
    if replicated:  # the layouts a plan must name its strategies for (the default layout does not run there)
        tps = ", ".join(map(str, replicated))
        print(f"tp {tps}: {'does' if len(replicated) == 1 else 'do'} not divide the vocabulary of {spec.name} ({spec.vocab}), so those rows replicate the "
              'embedding and LM head: plan key strategies {"embedding": "replicate", "head": "replicate"}')
    excluded = excluded_eps(spec, args.devices, [e.layout.mesh for e in results])
    # one line: every ep > 1 is out for the same reason (a mixed stack's: the line after the table)
    if excluded and not spec.is_moe and not mixed:
        print(f"ep > 1 excluded: {spec.name} has no experts (not a mixture-of-experts model)")
    for ep, why in excluded if spec.is_moe else ():
        print(f"ep={ep} excluded: {why}")
    print_refusals(spec)
    if results and not results[0].fits:
        print(f"no layout fits in {memory_text(hw.memory_gb)}; the smallest needs "
              f"{memory_text(min(e.memory_gb for e in results))}")


def _sp_cell(e) -> str:
    """The sp column: on / -, or each stage's where they differ (on/-)."""
    return "/".join("on" if x else "-" for x in e.stage_sequence_parallel or (e.layout.sequence_parallel,))


def write_plot(results, hw, path: str, *, title: str) -> None:
    """MFU against peak memory per device, one point per layout, device memory as a line, best marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for fits, color, label in ((True, "tab:blue", "fits"), (False, "tab:gray", "does not fit")):
        pts = [e for e in results if e.fits is fits]
        ax.scatter([e.memory_gb for e in pts], [100 * e.mfu for e in pts], c=color, s=18, label=label)
    ax.axvline(hw.memory_gb, color="tab:red", linestyle="--", label=f"device memory {memory_text(hw.memory_gb)}")
    best = next((e for e in results if e.fits), None)
    if best is not None:
        m = best.layout.mesh
        ax.scatter([best.memory_gb], [100 * best.mfu], marker="*", s=250, c="tab:orange", zorder=3,
                   label=f"best: dp{m.dp} pp{m.pp} tp{m.tp} cp{m.cp}")
    ax.set_xlabel("memory per device (GB, peak)")
    ax.set_ylabel("MFU (%)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    try:
        fig.savefig(path, dpi=110)
    except OSError as e:
        raise InvalidConfigError(f"cannot write plot {path}: {e.strerror}") from None
    finally:
        plt.close(fig)
