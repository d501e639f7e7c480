"""`autoshard show`: explain a plan file: mesh, stages, placements, predicted cost, why this mesh."""

from __future__ import annotations

from collections import defaultdict

from autoshard.commands.common import memory_text


def add_parser(sub) -> None:
    p = sub.add_parser("show", help="explain a plan file: mesh, stages, placements, predicted cost",
                       description="Print a plan written by `autoshard plan --out`: the mesh, the layers of each "
                       "pipeline stage, the op placements grouped by kind, the predicted step time / memory / MFU "
                       "with their breakdown, and why this mesh beat the runner-up.")
    p.add_argument("plan", help="plan JSON file")
    p.add_argument("--json", action="store_true", help="print the validated plan as JSON instead of the summary")
    p.set_defaults(run=run)


def run(args) -> int:
    import json

    from autoshard.inference_plan import InferencePlan, read_plan_file

    plan = read_plan_file(args.plan)  # a training plan, or `autoshard plan --inference`'s
    validate(plan, source=args.plan)
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
    elif isinstance(plan, InferencePlan):
        from autoshard.commands.plan_inference import render as render_inference

        render_inference(plan)
    else:
        render(plan)
    return 0


def validate(plan, *, source: str = "the plan") -> None:
    """The plan validator (rules/validity.py `check_plan`, what `parallelize` runs; for an inference plan
    `generate_violation` of each pool's replica, what `parallelize` and `dm.generate` run) on the plan's
    model, when it is a preset or a `package.module:factory` that imports; InvalidConfigError
    (one line, exit 2) when the runtime would refuse the plan; a warning on stderr when its fingerprint
    (not blank) is not that model's: `parallelize` will refuse it as made for another model."""
    import sys

    from autoshard.errors import InvalidConfigError, UnknownNameError
    from autoshard.fingerprint import fingerprint_module
    from autoshard.passes.capture.shipped import fingerprint_spec
    from autoshard.inference_plan import InferencePlan
    from autoshard.ir import Mesh
    from autoshard.models.presets import get_spec, resolve_model
    from autoshard.rules.validity import check_plan, generate_violation

    try:
        spec, module = resolve_model(plan.model, device="meta") if ":" in plan.model else (get_spec(plan.model), None)
    except UnknownNameError as e:  # a user model this machine cannot build: nothing to check it against
        print(f"autoshard show: warning: {source}: the plan is shown unchecked: {e}", file=sys.stderr)
        return
    try:
        if isinstance(plan, InferencePlan):
            for pool in plan.pools:
                why = generate_violation(spec, Mesh(tp=pool.tp, pp=pool.pp, ep=pool.ep))
                if why:
                    raise InvalidConfigError(f"the {pool.role} pool's replica (tp{pool.tp} x pp{pool.pp} x "
                                             f"ep{pool.ep}): {why}")
        else:
            check_plan(plan, spec)
    except InvalidConfigError as e:  # which file, and that parallelize would refuse it
        raise InvalidConfigError(f"{source}: parallelize would refuse this plan: {e}") from None
    if plan.fingerprint.strip():
        expected = fingerprint_spec(spec) if module is None else fingerprint_module(module)
        if plan.fingerprint != expected:
            print(f"autoshard show: warning: {source} names model {plan.model!r}, but its fingerprint "
                  f"{plan.fingerprint} is not that model's ({expected}): it was made for another model or edited, "
                  f"and parallelize will refuse it; make it again with `autoshard plan --model {plan.model}`",
                  file=sys.stderr)


def _expert_line(plan, pred) -> str | None:
    """Why this ep (MoE presets): experts per rank, what the all-to-alls cost, what ep saved, and the
    best plan the planner found with another ep (`solver.ep_runner_up`)."""
    from autoshard.models.presets import PRESETS

    spec = PRESETS.get(plan.model)
    if spec is None or not spec.is_moe:
        return None
    ep = plan.mesh.ep
    time = pred.get("time_breakdown_s", {})
    line = (f"expert parallelism: ep={ep} keeps {spec.experts // ep} of the {spec.experts} experts per rank "
            f"(top-{spec.top_k}); ep folds into data parallelism: {plan.mesh.dp * ep} ranks split the batch, "
            f"dense gradients reduced over dp x ep x cp ({plan.mesh.dp * ep * plan.mesh.cp}), expert gradients "
            f"over dp x cp ({plan.mesh.dp * plan.mesh.cp})")
    if ep > 1:
        line += (f"; dispatch/combine all-to-alls {time.get('ep_comm', 0):.3g} s/step, in exchange for 1/{ep} of "
                 "the expert weights, gradients and optimizer state per rank")
    for other in dict(plan.solver).get("other_eps", ()):  # why this ep won (passes/solve/planner.py _other_eps)
        if "mesh" in other:
            mesh = " ".join(f"{k}{v}" for k, v in other["mesh"].items() if v > 1) or "single"
            line += f"\n  ep={other['ep']}: the best plan with it ({mesh}) takes {other['step_time_s']:.4g} s/step; " \
                    f"{other['why']}"
        else:
            line += f"\n  ep={other['ep']}: {other['why']}"
    return line


def render(plan) -> None:
    from rich.console import Console
    from rich.table import Table

    from autoshard.rules.sharding import CHOICES

    con = Console()
    pred, solver = dict(plan.predicted), dict(plan.solver)
    con.print(f"[bold]{plan.model}[/] on {plan.devices} x {plan.hardware}, global batch {plan.global_batch}, "
              f"seq {plan.seq_len}  (fingerprint {plan.fingerprint})")
    con.print(f"mesh: {plan.mesh}  ({', '.join(f'{k}={v}' for k, v in plan.mesh.as_dict().items())}), "
              f"micro-batch {plan.micro_batch}, ZeRO-{plan.zero}"
              + (" with optimizer offload to host memory" if plan.offload_optimizer else ""))
    precision = plan.precision.value + (" (bf16-mixed on an accelerator, fp32 on CPU)"
                                        if plan.precision.value == "auto" else "")
    if plan.fp8_recipe is not None:  # torchao's float8 training on the layers' projections (runtime/fp8.py)
        precision += (f", torchao float8 recipe {plan.fp8_recipe.value} on the attention / MLP projections "
                      "(embedding, head, norms, router: bf16)")
    con.print(f"precision: {precision}; pipeline schedule: {plan.schedule.value}, "
              f"{plan.virtual_stages} virtual stage(s) per rank")
    sp = plan.stage_sequence_parallel
    if any(sp):
        where = "on" if all(sp) else "on in stages " + ", ".join(str(i) for i, on in enumerate(sp) if on) + \
            " (a boundary next to one carries the whole sequence)"
        con.print(f"sequence parallel: {where} (norms and residual stream on a 1/{plan.mesh.tp} shard of the "
                  "sequence; all-gather / reduce-scatter in place of the TP all-reduces)")
    if plan.mesh.tp > 1:  # the intra-op choices (rules/sharding.py CHOICES); the placements below follow them
        chosen = dict(plan.strategies)
        named = {k: ("per stage " + " / ".join(v) if isinstance(v, tuple) else v) for k, v in chosen.items()}
        con.print("intra-op strategies: " + ", ".join(f"{k} {named.get(k, v[0])}"
                                                      for k, v in CHOICES.items() if k in chosen or k != "groups")
                  + ("" if chosen else " (the sharding table's default)"))
    pp, chunked = plan.mesh.pp, plan.virtual_stages > 1
    # interleaved schedules: a row per model chunk, the time and memory of the rank that runs it
    stages = Table(title="pipeline stages" + (f" (model chunks; chunk i runs on rank i mod {pp})" if chunked else ""))
    columns = ("chunk" if chunked else "stage", "layers", "holds", "recompute") + (("strategy",) if plan.per_stage else ()) + (
        ("rank", "rank's s/micro-batch", "rank's memory") if chunked else ("time/micro-batch s", "memory"))
    for col in columns:
        stages.add_column(col)
    times, mems = pred.get("stage_time_s", []), pred.get("stage_memory_gb", [])
    for i, st in enumerate(plan.stages):
        holds = " + ".join(x for x, on in (("embed", st.embed), ("head", st.head)) if on) or "-"
        layers = f"{st.first_layer}-{st.end_layer - 1}" if st.layers else "none"
        mine = ", ".join(["sequence parallel" if sp[i] else "no SP"]
                         + [f"{k} {v}" for k, v in plan.stage_strategies(i) if isinstance(dict(plan.strategies)[k], tuple)])
        rank = i % pp if chunked else i
        stages.add_row(str(i), f"{layers} ({st.layers})", holds, st.recompute.value,
                       *((mine,) if plan.per_stage else ()), *((str(rank),) if chunked else ()),
                       _num(times, rank), memory_text(mems[rank]) if rank < len(mems) else "-")
    con.print(stages)
    kinds = _kind_table(pred.get("layer_kinds"), plan.stages)
    if kinds is not None:
        con.print(kinds)
    groups = defaultdict(list)
    for op, placement in plan.placements:
        groups[placement].append(op)
    con.print("placements (tp axis):")
    for placement, ops in groups.items():
        con.print(f"  {placement:>12}: {', '.join(ops)}")
    if pred:
        con.print(f"predicted: step {pred.get('step_time_s', 0):.4g} s, {pred.get('tokens_per_s', 0):.4g} tokens/s, "
                  f"MFU {100 * pred.get('mfu', 0):.1f}% (of the bf16 dense peak, at any precision), "
                  f"peak memory {memory_text(pred.get('memory_gb', 0))}")
        for title, key, text in (("time", "time_breakdown_s", lambda v: f"{v:.3g} s"),
                                 ("memory", "memory_breakdown_gb", memory_text)):
            parts = pred.get(key, {})
            con.print(f"  {title}: " + ", ".join(f"{k} {text(v)}" for k, v in parts.items() if v))
    expert = _expert_line(plan, pred)
    if expert:
        con.print(expert)
    if solver:
        con.print(f"solver: {solver.get('status')}, gap {100 * solver.get('gap', 0):.2f}%, "
                  f"{solver.get('solve_time_s', 0):.1f} s, {solver.get('layouts_solved')} of "
                  f"{solver.get('layouts')} layouts solved")
        ru = solver.get("runner_up")
        if ru:
            mesh = " ".join(f"{k}{v}" for k, v in ru["mesh"].items() if v > 1) or "single"
            best = pred.get("step_time_s", 0)
            slower = f" ({100 * (ru['step_time_s'] / best - 1):.1f}% slower)" if best > 0 else ""
            con.print(f"runner-up: {mesh} ZeRO-{ru.get('zero')} at {ru['step_time_s']:.4g} s/step{slower}: "
                      f"{ru['why']}")


def _kind_table(rows, stages):
    """The per-kind breakdown of a mixed stack's plan (`predicted.layer_kinds`, passes/solve/ranges.py
    `kind_breakdown`): a row per stage, a column per layer kind (its layers there, their seconds per
    micro-batch and memory per device), and a last row with each kind's layers and share of all the layers'
    time; None for a model whose layers are of one kind."""
    from rich.table import Table

    if not rows:
        return None
    table = Table(title="layer kinds (per stage: layers, s/micro-batch, memory per device)")
    for col in ("stage", *(r["kind"] for r in rows)):
        table.add_column(col)
    for i in range(len(stages)):
        cells = [f"{r['layers'][i]}: {r['time_s'][i]:.3g} s, {memory_text(r['memory_gb'][i])}"
                 if r["layers"][i] else "-" for r in rows]
        table.add_row(str(i), *cells)
    total = sum(sum(r["time_s"]) for r in rows) or 1.0
    table.add_row("all", *(f"{sum(r['layers'])} layers, {100 * sum(r['time_s']) / total:.0f}% of layer time"
                           for r in rows))
    return table


def _num(values, i: int) -> str:
    return f"{values[i]:.4g}" if i < len(values) else "-"
