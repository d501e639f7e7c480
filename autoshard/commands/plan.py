"""`autoshard plan`: solve for the fastest plan with CP-SAT and write it as JSON; with `--inference`,
the highest-throughput serving plan under TTFT / TPOT targets (`commands/plan_inference.py`)."""

from __future__ import annotations

import json
import sys
import time

from autoshard.commands import plan_inference
from autoshard.commands.common import (MOE_IMBALANCE_HELP, check_moe_imbalance, check_positions, check_output_path, cost_table_for,
                                       imbalance, model_for, positive_float, positive_int, print_refusals)
from autoshard.errors import InvalidConfigError


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="solve for the fastest plan (CP-SAT) and export it as JSON",
                       description="Capture the model, build its cost table, and solve (per candidate mesh, one "
                       "CP-SAT model over pipeline stage boundaries, per-stage recomputation, ZeRO level and "
                       "micro-batch size) for the fastest training step that fits in device memory. On a profile "
                       "with FP8 tensor cores (h100, h200) the precision is searched too: bf16-mixed or fp8 with "
                       "torchao's tensorwise / rowwise recipe (docs/fp8.md); MFU is always of the bf16 peak.")
    p.add_argument("--model", required=True,
                   help="preset name (e.g. llama-7b, mamba2-tiny) or package.module:factory returning the model")
    p.add_argument("--hardware", required=True, help="device profile name (e.g. ascend-910b, h100) or a JSON file")
    p.add_argument("--devices", required=True, type=positive_int, help="number of devices (world size)")
    p.add_argument("--global-batch", type=positive_int, help="sequences per training step (training plans)")
    p.add_argument("--seq-len", type=positive_int, help="tokens per sequence, at least 2 (training plans)")
    p.add_argument("--time-limit", type=positive_float, default=10.0, metavar="SEC",
                   help="CP-SAT work budget per layout in deterministic seconds (default 10); the result "
                   "does not depend on the machine or its load, and the search over layouts always finishes")
    p.add_argument("--moe-imbalance", type=imbalance, default=1.0, metavar="X", help=MOE_IMBALANCE_HELP)
    p.add_argument("--out", help="write the plan to this JSON file")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of a summary")
    p.add_argument("--emit", choices=TRAINING_ENGINES + SERVING_ENGINES,
                   help="print the plan in that engine's own terms instead (with --out: write it there): the "
                   "launch command and, for training, what the engine cannot express and what the plan costs "
                   "without it; megatron / torchtitan / accelerate for training, vllm / sglang with --inference")
    p.add_argument("--model-path", metavar="PATH", help="with --emit vllm / sglang: the weights (a Hugging Face "
                   "directory or hub id) the launch command serves (default ./MODEL)")
    plan_inference.add_arguments(p)
    p.set_defaults(run=run)


TRAINING_ENGINES = ("megatron", "torchtitan", "accelerate")
SERVING_ENGINES = ("vllm", "sglang")

# flags that only one kind of plan reads: given to the other kind they would be silently ignored
TRAINING_ONLY = ("global_batch", "seq_len", "time_limit", "moe_imbalance")
INFERENCE_ONLY = ("prompt_len", "output_len", "ttft_slo", "tpot_slo", "no_disaggregation", "plot", "request_rate")
DEFAULTS = {"time_limit": 10.0, "moe_imbalance": 1.0, "no_disaggregation": False}


def _flags_given(args, names) -> list[str]:
    return [f"--{n.replace('_', '-')}" for n in names if getattr(args, n) not in (None, DEFAULTS.get(n))]


def run(args) -> int:
    if args.inference:
        stray = _flags_given(args, TRAINING_ONLY)
        if stray:
            raise InvalidConfigError(f"{', '.join(stray)} only appl{'ies' if len(stray) == 1 else 'y'} to training "
                                     f"plans: drop {'it' if len(stray) == 1 else 'them'} with --inference (serving takes --prompt-len, --output-len, "
                                     "--ttft-slo, --tpot-slo), or drop --inference to plan training")
        if args.emit in TRAINING_ENGINES:
            raise InvalidConfigError(f"--emit {args.emit} writes a training plan; serving plans (--inference) emit "
                                     f"{' or '.join(SERVING_ENGINES)}")
        return plan_inference.run(args)
    if args.emit in SERVING_ENGINES or args.model_path:
        raise InvalidConfigError(f"{'--emit ' + args.emit if args.emit in SERVING_ENGINES else '--model-path'} goes "
                                 "with --inference (a serving plan); training plans emit "
                                 f"{', '.join(TRAINING_ENGINES)}")
    stray = _flags_given(args, INFERENCE_ONLY)
    if stray:
        raise InvalidConfigError(f"{', '.join(stray)} only appl{'ies' if len(stray) == 1 else 'y'} with --inference "
                                 f"(serving plans); add --inference, or drop {'it' if len(stray) == 1 else 'them'} to plan training")
    missing = [f"--{n.replace('_', '-')}" for n in ("global_batch", "seq_len") if getattr(args, n) is None]
    if missing:
        raise InvalidConfigError(f"a training plan needs {' and '.join(missing)} (or give --inference with "
                                 "--prompt-len, --output-len, --ttft-slo, --tpot-slo to plan serving)")
    from autoshard.hardware import load_hardware
    from autoshard.rules.validity import valid_meshes

    if args.out:
        check_output_path(args.out, "--out")
    hw = load_hardware(args.hardware)
    spec, module = model_for(args.model)
    check_moe_imbalance(spec, args.moe_imbalance)
    check_positions(spec, module, args.seq_len, "plan --seq-len")
    valid_meshes(spec, args.devices, global_batch=args.global_batch, seq_len=args.seq_len)  # none: say why, at once
    from autoshard.passes.solve.planner import solve

    table = fingerprint = None  # a preset: solve builds (or reads) the table once the layouts are known valid
    if module is not None:
        from autoshard.fingerprint import fingerprint_module

        _, table = cost_table_for(args.model, spinner=not args.json, spec=spec, module=module,
                                  kernels=hw.kernels)
        fingerprint = fingerprint_module(module)
    with _progress(enabled=not args.json) as progress:
        plan = solve(spec, hw, devices=args.devices, global_batch=args.global_batch, seq_len=args.seq_len,
                     time_limit_s=args.time_limit, progress=progress, table=table, fingerprint=fingerprint,
                     moe_imbalance=args.moe_imbalance)
    if args.emit:
        from autoshard.commands.emit import emit_training

        return emit_training(args, plan, spec, hw, table)
    if args.out:
        plan.save(args.out)
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
    else:
        from autoshard.commands.show import render

        render(plan)
        print_refusals(spec)
        if table is not None and table.mixed and plan.mesh.cp == 1 and not any(a == "cp" for a, _ in spec.refused):
            print("cp not searched: a stack of several layer kinds searches cp only where no layout without it fits "
                  "(planner.solve); `autoshard price --cp N` prices one")
        if args.out:
            print(f"plan written to {args.out}")
    return 0


class _progress:
    """A rich progress line while the search runs longer than a second (stderr, TTY or not)."""

    def __init__(self, *, enabled: bool) -> None:
        self.enabled, self.start, self.bar, self.task = enabled, time.perf_counter(), None, None

    def __enter__(self):
        return self.update

    def update(self, done: int, total: int, best: float) -> None:
        if not self.enabled or time.perf_counter() - self.start < 1.0:
            return
        if self.bar is None:
            from rich.console import Console
            from rich.progress import Progress

            self.bar = Progress(console=Console(file=sys.stderr), transient=True)
            self.bar.start()
            self.task = self.bar.add_task("solving layouts", total=total)
        self.bar.update(self.task, completed=done, description=f"solving layouts (best {best:.3g} s/step)")

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()
