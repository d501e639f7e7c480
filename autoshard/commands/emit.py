"""`autoshard plan --emit ENGINE`: a solved plan in an engine's own terms (autoshard/engines/).

Prints (or writes to `--out`) a shell script (accelerate: Python settings): comments with the plan, what the engine cannot express
and what the plan costs without it (the projected run, re-priced), then the launch command. For
torchtitan's Hugging Face backend the model's config.json is written next to `--out`.
"""

from __future__ import annotations

from pathlib import Path

from autoshard.errors import InvalidConfigError


def emit_training(args, plan, spec, hw, table) -> int:
    from autoshard.engines import accelerate, megatron, torchtitan
    from autoshard.engines.training_run import price, run_of_plan
    from autoshard.passes.cost.compiled import compile_table

    # Megatron fuses the norms, RoPE and SwiGLU (Transformer Engine) of every model; the others run the layers as
    # autoshard's runtime does (rules/kernels.py)
    ct = compile_table(table if table is not None else _table(spec, hw), spec,
                       layers_compiled=True if args.emit == "megatron" else None)
    engine = {"megatron": megatron, "torchtitan": torchtitan, "accelerate": accelerate}[args.emit]
    gb, sl = plan.global_batch, plan.seq_len
    run, notes = engine.project(ct, hw, spec, run_of_plan(plan), global_batch=gb, seq_len=sl,
                                moe_imbalance=args.moe_imbalance)
    priced = price(ct, hw, spec, run, global_batch=gb, seq_len=sl, moe_imbalance=args.moe_imbalance)
    planned = plan.predicted["step_time_s"]
    lines = [f"# {spec.name} on {plan.devices}x {hw.name}, global batch {gb}, seq {sl}: autoshard plan for {args.emit}",
             f"# plan: {run_of_plan(plan).describe()}: {planned:.4g} s/step"]
    if notes:
        lines += [f"# {args.emit} cannot express: {n}" for n in notes]
        lines.append(f"# without them: {run.describe()}: {priced['step_time_s']:.4g} s/step "
                     f"({100 * (priced['step_time_s'] / planned - 1):+.1f}%), peak {priced['memory_gb']:.1f} GB"
                     f"{'' if priced['fits'] else ' (DOES NOT FIT)'}")
    else:
        lines.append(f"# {args.emit} expresses the whole plan: {priced['step_time_s']:.4g} s/step")
    if args.emit == "accelerate":
        lines.append(f"# launch: {accelerate.launch(hw, plan.devices)}  (train.py builds its Accelerator so:)")
        text = "\n".join(lines) + "\n" + accelerate.script(spec, run, global_batch=gb, seq_len=sl)
        return write(args, text)
    if args.emit == "megatron":
        words = megatron.arguments(spec, run, global_batch=gb, seq_len=sl)
        launch = megatron.launch(hw, plan.devices)
        if hw.name.startswith("ascend"):
            lines.append("# Ascend: MindSpeed-LLM takes the same arguments (HCCL backend); see docs/engines.md")
    else:
        config_dir = str(Path(args.out).with_suffix("").as_posix() + "-hf-config") if args.out else "./hf-config"
        words = torchtitan.arguments(spec, run, global_batch=gb, seq_len=sl, hf_config_dir=config_dir)
        launch = torchtitan.launch(hw, plan.devices)
        if any(w.startswith("--hf_model") for w in words):
            _write_hf_config(spec, config_dir if args.out else None)
            lines.append(f"# the model through torchtitan's Hugging Face backend: its config.json in {config_dir}")
    lines.append(launch + " \\\n    " + " \\\n    ".join(words))
    return write(args, "\n".join(lines) + "\n")


def write(args, text: str) -> int:
    """Print `text`, or write it to `--out`."""
    if args.out:
        try:
            Path(args.out).write_text(text)
        except OSError as e:
            raise InvalidConfigError(f"cannot write {args.out}: {e.strerror}") from None
        print(f"{args.emit} {'settings' if args.emit == 'accelerate' else 'launch command' + ('s' if args.emit in ('vllm', 'sglang') else '')} written to {args.out}")
    else:
        print(text, end="")
    return 0


def _table(spec, hw):
    from autoshard.passes.capture.shapes import build_cost_table

    return build_cost_table(spec, kernels=hw.kernels)


def _write_hf_config(spec, directory: str | None) -> None:
    if directory is None:
        return
    spec.hf_config().save_pretrained(directory)
