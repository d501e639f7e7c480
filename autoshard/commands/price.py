"""`autoshard price`: price one given layout, and how far it is from the best plan on the same cluster.

Training: the layout from flags (`--dp --tp --pp --cp --ep --schedule --virtual-stages
--sequence-parallel --zero --recompute --micro-batch`), from an engine's command line
(`--from-megatron "ARGS"`, `--from-torchtitan "ARGS"`) or from a plan file (`--plan FILE`), priced by
the planner's own figures (engines/training_run.py; a Megatron command line on a cost table of the kernels
the profile's stack runs, `DeviceProfile.stack_kernels`), then the planner's best plan for the same model,
devices and batch, how much faster it is and the time terms that differ. Serving (`--inference`,
commands/price_inference.py): one tp x pp x ep replica at a batch, TTFT / TPOT / throughput / memory.
Bad or contradictory flags are one-line errors naming the flag.
"""

from __future__ import annotations

import json
from dataclasses import replace

from autoshard.commands.common import (MOE_IMBALANCE_HELP, check_moe_imbalance, check_schedule_flags, cost_table_for,
                                       imbalance,
                                       memory_text, model_for, positive_int, seconds_text)
from autoshard.errors import InvalidConfigError

AXES = ("dp", "tp", "pp", "cp", "ep")
LAYOUT_FLAGS = AXES + ("schedule", "virtual_stages", "sequence_parallel", "zero", "recompute", "micro_batch", "precision",
                       "fp8_recipe")


def add_parser(sub) -> None:
    from autoshard.commands import price_inference

    p = sub.add_parser("price", help="price one given layout (flags, a Megatron / torchtitan command line, a plan) "
                       "against the best plan for the same cluster",
                       description="Price one training layout: step time, tokens/s, MFU, memory per pipeline stage, "
                       "whether it fits, and the best plan for the same devices with how much faster it is and why. "
                       "With --inference: one serving layout (TTFT, TPOT, throughput, memory) against the best.")
    p.add_argument("--model", help="preset or package.module:factory (with --from-megatron the model's sizes may "
                   "come from the command line instead)")
    p.add_argument("--hardware", required=True, help="device profile name (h100, ascend-910b, ...) or a JSON file")
    p.add_argument("--devices", type=positive_int, help="world size (default: the product of the axes given)")
    p.add_argument("--global-batch", type=positive_int, help="sequences per step (or --global-batch-size of the "
                   "engine's command line)")
    p.add_argument("--seq-len", type=positive_int, help="tokens per sequence (or the engine's --seq-length)")
    g = p.add_argument_group("the layout (training)")
    for axis in AXES:
        g.add_argument(f"--{axis}", type=positive_int, help=f"{axis} size (default 1; dp: what the others leave)")
    g.add_argument("--schedule", choices=("1f1b", "gpipe", "interleaved-1f1b", "zero-bubble"),
                   help="pipeline schedule (default 1f1b; interleaved-1f1b with --virtual-stages > 1)")
    g.add_argument("--virtual-stages", type=positive_int, help="model chunks per pipeline rank (default 1); pp x v "
                   "must divide the layers")
    g.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallelism (needs tp > 1)")
    g.add_argument("--zero", type=int, choices=(0, 1, 2, 3), help="ZeRO level (default 1: Megatron's distributed "
                   "optimizer)")
    g.add_argument("--recompute", choices=("none", "selective", "full"), help="activation recomputation (default none)")
    g.add_argument("--micro-batch", type=positive_int, help="sequences per micro-batch (default 1)")
    g.add_argument("--precision", choices=("bf16-mixed", "fp8", "fp32"), help="numerics (default: the device's, "
                   "bf16-mixed on accelerators); fp8: the projections' GEMMs in float8 (torchao)")
    g.add_argument("--fp8-recipe", choices=("tensorwise", "rowwise"), help="with --precision fp8 (default tensorwise)")
    g.add_argument("--from-megatron", metavar='"ARGS"', help="a Megatron-LM / MindSpeed-LLM command line (its "
                   "parallel sizes, batch, recompute (uniform, selective or block), optimizer (MindSpeed's "
                   "--reuse-fp32-param too) and, without --model, model sizes), priced with the kernels the "
                   "profile's stack runs (ascend-910b: MindSpeed-LLM's torch SSD scan)")
    g.add_argument("--from-torchtitan", metavar='"ARGS"', help="a torchtitan.train command line, read by torchtitan's "
                   "own parser (pip install torchtitan==0.3.0 triton)")
    g.add_argument("--plan", metavar="FILE", help="a plan file from autoshard plan --out")
    p.add_argument("--moe-imbalance", type=imbalance, default=1.0, metavar="X", help=MOE_IMBALANCE_HELP)
    p.add_argument("--no-best", action="store_true", help="do not solve for the best plan to compare with")
    p.add_argument("--json", action="store_true", help="print JSON")
    price_inference.add_arguments(p)
    p.set_defaults(run=run)


def _given(args, names) -> list[str]:
    return [f"--{n.replace('_', '-')}" for n in names if getattr(args, n) not in (None, False)]


def run(args) -> int:
    if args.inference:
        from autoshard.commands import price_inference

        return price_inference.run(args)
    from autoshard.commands.price_inference import INFERENCE_ONLY

    stray = _given(args, INFERENCE_ONLY)
    if stray:
        raise InvalidConfigError(f"{', '.join(stray)} only go with --inference; add it or drop them")
    sources = _given(args, ("from_megatron", "from_torchtitan", "plan"))
    if len(sources) > 1:
        raise InvalidConfigError(f"{' and '.join(sources)}: give one source of the layout")
    if sources and _given(args, LAYOUT_FLAGS):
        raise InvalidConfigError(f"{', '.join(_given(args, LAYOUT_FLAGS))} and {sources[0]} both give the layout; "
                                 "drop one")
    from autoshard.hardware import load_hardware

    hw = load_hardware(args.hardware)
    run_, spec, module, global_batch, seq_len, devices, note = _layout(args)
    if args.plan:
        from autoshard.ir import Plan

        planned_on = Plan.load(args.plan).hardware
        if planned_on != hw.name:
            raise InvalidConfigError(f"--hardware {args.hardware} but the plan {args.plan} is for {planned_on}; give "
                                     f"--hardware {planned_on} (or plan again for {hw.name})")
    check_moe_imbalance(spec, args.moe_imbalance)
    # a Megatron command line is a run of the profile's stack (MindSpeed-LLM on ascend-910b): priced with the
    # kernels that stack runs (hardware.StackRecipe `kernels`); the best plan with what autoshard's runtime runs
    kernels = hw.stack_kernels(spec.mixer.value) if args.from_megatron else hw.kernels
    if kernels != hw.kernels:
        note += f", with {hw.stack}'s kernels ({', '.join(kernels) or 'none'})"
    table = cost_table_for(spec.name, spinner=not args.json, spec=spec, module=module, kernels=kernels)[1]
    own = table if kernels == hw.kernels or args.no_best else cost_table_for(
        spec.name, spinner=not args.json, spec=spec, module=module, kernels=hw.kernels)[1]
    from autoshard.engines.training_run import compare, price
    from autoshard.passes.cost.compiled import compile_table

    # a Megatron run fuses its norms, RoPE and SwiGLU (Transformer Engine) in every model; autoshard's own layout
    # fuses them where its runtime compiles the layers (rules/kernels.py)
    ct = compile_table(table, spec, layers_compiled=True if args.from_megatron else None)
    priced = price(ct, hw, spec, run_, global_batch=global_batch, seq_len=seq_len, moe_imbalance=args.moe_imbalance)
    best = None if args.no_best else _best(spec, hw, own, devices, global_batch, seq_len, args.moe_imbalance, module)
    out = {"model": spec.name, "hardware": hw.name, "devices": devices, "global_batch": global_batch,
           "seq_len": seq_len, "layout": run_.describe(), "predicted": priced, "source": note}
    if best is not None:
        plan, best_pred = best
        out["best"] = {"layout": _plan_run(plan).describe(), "predicted": best_pred,
                       "comparison": compare(priced, best_pred)}
    if args.json:
        print(json.dumps(out, indent=2, default=str))
    else:
        _print(out, hw)
    return 0


def _plan_run(plan):
    from autoshard.engines.training_run import run_of_plan

    return run_of_plan(plan)


def _best(spec, hw, table, devices, global_batch, seq_len, moe_imbalance, module):
    from autoshard.passes.solve.planner import solve

    fingerprint = None
    if module is not None:
        from autoshard.fingerprint import fingerprint_module

        fingerprint = fingerprint_module(module)
    try:
        plan = solve(spec, hw, devices=devices, global_batch=global_batch, seq_len=seq_len, table=table,
                     fingerprint=fingerprint, moe_imbalance=moe_imbalance)
    except InvalidConfigError as e:  # the given layout is priced; say why there is nothing to compare with
        raise InvalidConfigError(f"the best plan for {devices} devices could not be solved: {e}; add --no-best") from None
    return plan, dict(plan.predicted)


def _layout(args):
    """(run, spec, module, global batch, seq len, devices, where the layout came from)."""
    from autoshard.engines import megatron, torchtitan
    from autoshard.engines.training_run import TrainingRun, default_strategies, run_of_plan
    from autoshard.ir import Mesh, Plan, Precision, Recompute, Schedule, fp8_recipe_of

    spec = module = None
    if args.model:
        spec, module = model_for(args.model)
    if args.plan:
        plan = Plan.load(args.plan)
        if spec is None:
            spec, module = model_for(plan.model)
        gb, sl = args.global_batch or plan.global_batch, args.seq_len or plan.seq_len
        return run_of_plan(plan), spec, module, gb, sl, _devices(args, plan.devices), f"plan {args.plan}"
    if args.from_megatron:
        devices = _need_devices(args, "--from-megatron")
        parsed = megatron.parse(args.from_megatron, spec=spec, devices=devices)
        if spec is None:
            spec = megatron.spec_of(parsed.model)
        megatron.check_model(spec, parsed.model, source="--from-megatron")
        gb, sl = _batch(args, parsed.global_batch, parsed.seq_len, "--global-batch-size", "--seq-length")
        return default_strategies(spec, parsed.run), spec, module, gb, sl, devices, "--from-megatron" + (
            f" (not priced: {', '.join(parsed.ignored)})" if parsed.ignored else "")
    if spec is None:
        raise InvalidConfigError("give --model (or --from-megatron with the model's sizes, or --plan)")
    if args.from_torchtitan:
        devices = _need_devices(args, "--from-torchtitan")
        run_, gb0, sl0 = torchtitan.parse(args.from_torchtitan, spec=spec, devices=devices)
        gb, sl = _batch(args, gb0, sl0, "--training.global_batch_size", "--training.seq_len")
        return default_strategies(spec, run_), spec, module, gb, sl, devices, "--from-torchtitan"
    sizes = {a: getattr(args, a) for a in AXES}
    given = 1
    for a in ("tp", "pp", "cp", "ep"):
        given *= sizes[a] or 1
    devices = args.devices
    if sizes["dp"] is None:
        if devices is None:
            raise InvalidConfigError("give --devices or --dp (dp x pp x tp x cp x ep is the device count)")
        if devices % given:
            raise InvalidConfigError(f"--devices {devices} is not a multiple of pp x tp x cp x ep = {given}")
        sizes["dp"] = devices // given
    mesh = Mesh(**{a: sizes[a] or 1 for a in AXES})
    if devices is not None and mesh.size != devices:
        raise InvalidConfigError(f"--dp {mesh.dp} x --pp {mesh.pp} x --tp {mesh.tp} x --cp {mesh.cp} x --ep {mesh.ep} = "
                                 f"{mesh.size}, not --devices {devices}")
    v = args.virtual_stages or 1
    check_schedule_flags(args.schedule, v)
    schedule = Schedule(args.schedule or ("interleaved-1f1b" if v > 1 else "1f1b"))
    if v > 1 and spec.layers % (mesh.pp * v):
        raise InvalidConfigError(f"--virtual-stages {v}: pp x v = {mesh.pp * v} model chunks do not divide the "
                                 f"{spec.layers} layers of {spec.name}")
    if args.sequence_parallel and mesh.tp == 1:
        raise InvalidConfigError("--sequence-parallel needs --tp > 1")
    gb, sl = _batch(args, None, None, "--global-batch", "--seq-len")
    run_ = TrainingRun(mesh=mesh, micro_batch=args.micro_batch or 1, zero=1 if args.zero is None else args.zero,
                       schedule=schedule, virtual_stages=v, recompute=(Recompute(args.recompute or "none"),),
                       sequence_parallel=(bool(args.sequence_parallel),))
    if args.fp8_recipe and args.precision != "fp8":
        raise InvalidConfigError(f"--fp8-recipe {args.fp8_recipe} needs --precision fp8")
    precision = Precision(args.precision or "auto")
    run_ = replace(run_, precision=precision, fp8_recipe=fp8_recipe_of(precision, args.fp8_recipe))
    return default_strategies(spec, run_), spec, module, gb, sl, mesh.size, "flags"


def _need_devices(args, flag: str) -> int:
    if args.devices is None:
        raise InvalidConfigError(f"{flag} needs --devices (the engine's world size)")
    return args.devices


def _devices(args, devices: int) -> int:
    if args.devices is not None and args.devices != devices:
        raise InvalidConfigError(f"--devices {args.devices} but the plan is for {devices} devices")
    return devices


def _batch(args, gb, sl, gb_flag: str, sl_flag: str) -> tuple[int, int]:
    if args.global_batch and gb and args.global_batch != gb:
        raise InvalidConfigError(f"--global-batch {args.global_batch} but the command line's {gb_flag} is {gb}")
    if args.seq_len and sl and args.seq_len != sl:
        raise InvalidConfigError(f"--seq-len {args.seq_len} but the command line's {sl_flag} is {sl}")
    gb, sl = args.global_batch or gb, args.seq_len or sl
    missing = [f for f, v in (("--global-batch", gb), ("--seq-len", sl)) if not v]
    if missing:
        raise InvalidConfigError(f"give {' and '.join(missing)}")
    return gb, sl


def _print(out: dict, hw) -> None:
    p = out["predicted"]
    print(f"{out['model']} on {out['devices']}x {hw.name}, global batch {out['global_batch']}, seq {out['seq_len']}")
    print(f"layout ({out['source']}): {out['layout']}")
    print(f"  step {seconds_text(p['step_time_s'])} s, {p['tokens_per_s'] / 1e3:.1f} ktok/s, MFU "
          f"{100 * p['mfu']:.1f}%, peak memory {memory_text(p['memory_gb'])} of {memory_text(hw.memory_gb)}: "
          f"{'fits' if p['fits'] else 'DOES NOT FIT'}")
    print("  memory per stage: " + ", ".join(memory_text(g) for g in p["stage_memory_gb"]))
    print("  time: " + ", ".join(f"{k.replace('_', ' ')} {v:.3g} s" for k, v in p["time_breakdown_s"].items() if v))
    if "best" in out:
        b = out["best"]
        print(f"best plan: {b['layout']}")
        print(f"  step {seconds_text(b['predicted']['step_time_s'])} s, MFU {100 * b['predicted']['mfu']:.1f}%, peak "
              f"{memory_text(b['predicted']['memory_gb'])}: {b['comparison']}")
