"""`autoshard price --inference`: one serving layout (tp x pp x ep per replica, replicas, batch) priced by
`passes/serving/serving.py`'s model (`estimate_serving`), against the best plan (`plan_serving`) for the same
devices and latency targets (the given ones, else the layout's own TTFT and TPOT: the best plan at
least as fast)."""

from __future__ import annotations

import json

from autoshard.commands.common import memory_text, positive_int, positive_seconds
from autoshard.errors import InfeasiblePlanError, InvalidConfigError

INFERENCE_ONLY = ("batch", "prompt_len", "output_len", "ttft_slo", "tpot_slo", "replicas")
TRAINING_ONLY = ("dp", "cp", "schedule", "virtual_stages", "sequence_parallel", "zero", "recompute", "micro_batch",
                 "from_megatron", "from_torchtitan", "plan", "global_batch", "seq_len")


def add_arguments(p) -> None:
    g = p.add_argument_group("serving (with --inference; the layout takes --tp --pp --ep)")
    g.add_argument("--inference", action="store_true", help="price a serving layout instead of a training one")
    g.add_argument("--batch", type=positive_int, help="concurrent sequences per replica")
    g.add_argument("--replicas", type=positive_int, help="replicas (default: --devices / (tp x pp x ep))")
    g.add_argument("--prompt-len", type=positive_int, metavar="P", help="prompt tokens per request")
    g.add_argument("--output-len", type=positive_int, metavar="O", help="generated tokens per request")
    g.add_argument("--ttft-slo", type=positive_seconds, metavar="SEC", help="TTFT target of the best plan (default: the "
                   "layout's own TTFT)")
    g.add_argument("--tpot-slo", type=positive_seconds, metavar="SEC", help="TPOT target of the best plan (default: the "
                   "layout's own TPOT)")


def run(args) -> int:
    from autoshard.commands.common import cost_table_for, model_for
    from autoshard.hardware import load_hardware
    from autoshard.passes.serving.inference_cost import ServeLayout, estimate_serving
    from autoshard.passes.serving.serving import plan_serving

    stray = [f"--{n.replace('_', '-')}" for n in TRAINING_ONLY if getattr(args, n) not in (None, False)]
    if stray:
        raise InvalidConfigError(f"{', '.join(stray)}: training flags; a serving layout takes --tp --pp --ep "
                                 "--replicas --batch --prompt-len --output-len")
    missing = [f"--{n.replace('_', '-')}" for n in ("model", "batch", "prompt_len", "output_len")
               if getattr(args, n) is None]
    if missing:
        raise InvalidConfigError(f"price --inference needs {', '.join(missing)}")
    tp, pp, ep = args.tp or 1, args.pp or 1, args.ep or 1
    size = tp * pp * ep
    devices = args.devices or size * (args.replicas or 1)
    replicas = args.replicas or devices // size
    if devices % size or replicas * size != devices:
        raise InvalidConfigError(f"--tp {tp} x --pp {pp} x --ep {ep} x --replicas {replicas} = {replicas * size} "
                                 f"devices, not --devices {devices}")
    hw = load_hardware(args.hardware)
    spec, module = model_for(args.model)
    if ep > 1 and not spec.is_moe:
        raise InvalidConfigError(f"--ep {ep}: {spec.name} has no experts; use --ep 1")
    spec, table = cost_table_for(args.model, spinner=not args.json, spec=spec, module=module)
    layout = ServeLayout(tp=tp, pp=pp, ep=ep, replicas=replicas, batch=args.batch)
    est = estimate_serving(table, spec, hw, layout, prompt_len=args.prompt_len, output_len=args.output_len)
    out = {"model": spec.name, "hardware": hw.name, "devices": devices, "prompt_len": args.prompt_len,
           "output_len": args.output_len, "layout": est.to_json()}
    ttft, tpot = args.ttft_slo or est.ttft_s, args.tpot_slo or est.tpot_s
    try:
        choice = plan_serving(table, spec, hw, devices=devices, prompt_len=args.prompt_len,
                              output_len=args.output_len, ttft_slo_s=ttft, tpot_slo_s=tpot)
        best = choice.predicted()
        out["best"] = {"summary": choice.best.summary(), "predicted": best, "targets": {"ttft_s": ttft, "tpot_s": tpot},
                       "throughput_ratio": best["throughput_tokens_per_s"] / est.throughput_tokens_per_s}
    except InfeasiblePlanError as e:
        out["best"] = {"targets": {"ttft_s": ttft, "tpot_s": tpot}, "none": str(e)}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    lay = out["layout"]
    print(f"{spec.name} serving on {devices}x {hw.name}: prompt {args.prompt_len}, output {args.output_len} tokens")
    print(f"layout: {replicas} replica(s) of tp{tp} pp{pp}" + (f" ep{ep}" if ep > 1 else "") + f", batch {args.batch}")
    print(f"  TTFT {lay['ttft_s'] * 1e3:.1f} ms, TPOT {lay['tpot_s'] * 1e3:.2f} ms, "
          f"{lay['throughput_tokens_per_s']:.4g} output tokens/s, memory {memory_text(lay['memory_gb'])} of "
          f"{memory_text(hw.memory_gb)}: {'fits' if lay['fits'] else 'DOES NOT FIT'}")
    b = out["best"]
    targets = f"TTFT <= {ttft * 1e3:.1f} ms, TPOT <= {tpot * 1e3:.2f} ms"
    if "none" in b:
        print(f"best plan for {targets}: none ({b['none']})")
    else:
        print(f"best plan for {targets}: {b['summary']}: {b['predicted']['throughput_tokens_per_s']:.4g} tokens/s "
              f"({b['throughput_ratio']:.3g}x), TTFT {b['predicted']['ttft_s'] * 1e3:.1f} ms, TPOT "
              f"{b['predicted']['tpot_s'] * 1e3:.2f} ms")
    return 0
