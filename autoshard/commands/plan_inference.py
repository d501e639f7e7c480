"""`autoshard plan --inference`: the highest-throughput serving configuration under TTFT and TPOT targets.

`run(args)` prices every layout with `passes/serving/serving.py`, writes an `InferencePlan` (`--out`),
prints it (`--json` or a summary, `render`, which `autoshard show` also uses) and, with `--plot`,
draws throughput against the TPOT target (0.4x to 4x the one given, the other targets fixed).
Unmeetable targets raise `InfeasiblePlanError` (exit 2, one line: best TTFT / TPOT and what binds).
"""

from __future__ import annotations

import json
import time

from autoshard.commands.common import memory_text, positive_float, positive_int, positive_seconds
from autoshard.errors import InfeasiblePlanError, InvalidConfigError

PLOT_POINTS = 10


def add_arguments(p) -> None:
    g = p.add_argument_group("inference (with --inference)")
    g.add_argument("--inference", action="store_true",
                   help="plan serving instead of training: tp x pp (x ep for MoE) per replica, replicas, concurrent batch "
                   "(and prefill/decode disaggregation) for the most output tokens/s under --ttft-slo / --tpot-slo")
    g.add_argument("--prompt-len", type=positive_int, metavar="P", help="prompt tokens per request")
    g.add_argument("--output-len", type=positive_int, metavar="O", help="generated tokens per request")
    g.add_argument("--ttft-slo", type=positive_seconds, metavar="SEC", help="time-to-first-token target, seconds")
    g.add_argument("--tpot-slo", type=positive_seconds, metavar="SEC", help="time-per-output-token target, seconds")
    g.add_argument("--no-disaggregation", action="store_true",
                   help="only colocated configurations (prefill and decode on the same devices)")
    g.add_argument("--plot", metavar="PNG", help="plot throughput against the TPOT target (0.4x to 4x --tpot-slo)")
    g.add_argument("--request-rate", type=_rate, metavar="REQ_PER_S",
                   help="also price continuous batching (as vLLM / SGLang run it: new prompts' prefills interleaved "
                   "with the running decodes) under Poisson arrivals at this many requests/s over all devices: TTFT "
                   "and TPOT p50 / p99 of every colocated layout against --ttft-slo / --tpot-slo (met at p99), and "
                   "the most requests/s each sustains under them; the static-batch plan is kept")


def _rate(text: str) -> float:
    return positive_float(text, "requests per second")


def run(args) -> int:
    from autoshard.commands.common import check_output_path, check_plot_path, cost_table_for, model_for
    from autoshard.hardware import load_hardware
    from autoshard.models.presets import max_positions, position_violation

    missing = [f"--{n.replace('_', '-')}" for n in ("prompt_len", "output_len", "ttft_slo", "tpot_slo")
               if getattr(args, n) is None]
    if missing:
        raise InvalidConfigError(f"--inference needs {', '.join(missing)} (e.g. --prompt-len 2048 --output-len 256 "
                                 "--ttft-slo 1 --tpot-slo 0.05)")
    if args.out:
        check_output_path(args.out, "--out")
    if args.plot:
        check_plot_path(args.plot)
    hw = load_hardware(args.hardware)
    spec, module = model_for(args.model)
    why = position_violation(max_positions(spec, getattr(module, "config", None)), prompt=args.prompt_len,
                             new=args.output_len, where="--prompt-len + --output-len")  # dm.generate's rule
    if why:
        raise InvalidConfigError(why)
    spec, table = cost_table_for(args.model, spinner=not args.json, spec=spec, module=module)
    plan = make_plan(spec, table, hw, args, module=module)
    if getattr(args, "emit", None):
        from autoshard.commands.emit import write
        from autoshard.engines.serving import script

        return write(args, script(args.emit, plan, model_path=args.model_path or f"./{spec.name}"))
    if args.out:
        plan.save(args.out)
    rows = _plot(spec, table, hw, args, module) if args.plot else []
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
    else:
        render(plan)
        for target, best, colocated in rows:
            print(f"  TPOT target {target * 1e3:6.1f} ms: {best:10.4g} tokens/s (any mode), "
                  f"{colocated:10.4g} tokens/s (colocated only)")
        for what, path in (("plan", args.out), ("plot", args.plot)):
            if path:
                print(f"{what} written to {path}")
    return 0


def make_plan(spec, table, hw, args, *, tpot_slo: float | None = None, module=None):
    """The `InferencePlan` for `args` (`module`: a factory's model, for its fingerprint; None for a preset)."""
    from autoshard.fingerprint import fingerprint_module
    from autoshard.passes.capture.shipped import fingerprint_spec
    from autoshard.inference_plan import InferencePlan, Pool
    from autoshard.passes.serving.serving import plan_serving

    t0 = time.perf_counter()
    choice = plan_serving(table, spec, hw, devices=args.devices, prompt_len=args.prompt_len,
                          output_len=args.output_len, ttft_slo_s=args.ttft_slo,
                          tpot_slo_s=tpot_slo or args.tpot_slo, disaggregation=not args.no_disaggregation)
    pools = tuple(Pool(role=role, **{k: getattr(e.layout, k) for k in ("tp", "pp", "ep", "replicas", "batch")})
                  for role, e in choice.best.pools)
    runner = choice.runner_up
    solver = {"layouts_priced": choice.layouts_priced, "solve_time_s": time.perf_counter() - t0,
              "runner_up": None if runner is None else {
                  "mode": runner.mode, "shape": runner.shape, "ttft_s": runner.ttft_s, "tpot_s": runner.tpot_s,
                  "throughput_tokens_per_s": runner.throughput_tokens_per_s, "why": choice.why_runner_up_lost}}
    predicted = choice.predicted()
    if getattr(args, "request_rate", None):  # continuous batching at that rate, beside the static-batch plan
        from autoshard.passes.serving.continuous_batching import plan_continuous

        continuous = plan_continuous(table, spec, hw, devices=args.devices, request_rate=args.request_rate,
                                     prompt_len=args.prompt_len, output_len=args.output_len,
                                     ttft_slo_s=args.ttft_slo, tpot_slo_s=tpot_slo or args.tpot_slo)
        predicted["continuous_batching"] = continuous.to_json(args.ttft_slo, tpot_slo or args.tpot_slo)
    return InferencePlan(model=spec.name, fingerprint=fingerprint_spec(spec) if module is None else fingerprint_module(module),
                         hardware=hw.name, devices=args.devices, prompt_len=args.prompt_len,
                         output_len=args.output_len, ttft_slo_s=args.ttft_slo, tpot_slo_s=tpot_slo or args.tpot_slo,
                         pools=pools, predicted=predicted, solver=solver)


def render(plan) -> None:
    from rich.console import Console

    con = Console(soft_wrap=True)
    pred, solver = dict(plan.predicted), dict(plan.solver)
    con.print(f"[bold]{plan.model}[/] serving on {plan.devices} x {plan.hardware}: prompt {plan.prompt_len}, "
              f"output {plan.output_len} tokens, targets TTFT {plan.ttft_slo_s * 1e3:.0f} ms, "
              f"TPOT {plan.tpot_slo_s * 1e3:.1f} ms  (fingerprint {plan.fingerprint or '-'})")
    mode = "disaggregated prefill / decode pools" if plan.disaggregated else "colocated (prefill and decode share devices)"
    con.print(f"mode: {mode}")
    for p in plan.pools:
        ep = f" x ep{p.ep}" if p.ep > 1 else ""
        con.print(f"  {p.role:>7} pool: {p.replicas} replica(s) of tp{p.tp} x pp{p.pp}{ep} ({p.devices} devices), "
                  f"batch {p.batch} sequences per replica")
    if pred:
        con.print(f"predicted: TTFT {pred['ttft_s'] * 1e3:.1f} ms, TPOT {pred['tpot_s'] * 1e3:.2f} ms, "
                  f"{pred['throughput_tokens_per_s']:.4g} output tokens/s, {memory_text(pred['memory_gb'])} on the "
                  f"busiest device; batch limited by {pred.get('batch_limited_by', '-')}")
        parts = pred.get("memory_breakdown_gb", {})
        con.print("  memory: " + ", ".join(f"{k} {memory_text(v)}" for k, v in parts.items()))
        for title, key in (("prefill", "prefill_breakdown_s"), ("decode step", "decode_breakdown_s")):
            con.print(f"  {title}: " + ", ".join(f"{k} {v * 1e3:.3g} ms" for k, v in pred.get(key, {}).items() if v))
        if "kv_transfer_s" in pred:
            con.print(f"  KV / state transfer prefill -> decode: {pred['kv_transfer_s'] * 1e3:.2f} ms (in TTFT)")
    if solver.get("runner_up"):
        con.print(f"runner-up: {solver['runner_up']['why']}")
    if "continuous_batching" in pred:
        _render_continuous(con, pred["continuous_batching"], plan)
    pool = plan.pools[-1]
    con.print(f"priced {solver.get('layouts_priced', '?')} (layout, batch) points in "
              f"{solver.get('solve_time_s', 0):.1f} s; each {'decode-pool ' if plan.disaggregated else ''}replica "
              f"(tp x pp x ep = {pool.tp * pool.pp * pool.ep} ranks) runs autoshard.parallelize(model, ids, "
              "plan=<this plan file>), then dm.generate (any batch)")
    if plan.disaggregated:
        con.print("note: autoshard's runtime runs each pool's generate; the KV hand-off between pools is priced, "
                  "not run (deploy the disaggregated plan on a serving engine)")
    for note in solver.get("notes", ()):
        con.print(f"note: {note}")


def _render_continuous(con, data: dict, plan) -> None:
    """The continuous-batching figures of `plan --inference --request-rate` (passes/serving/continuous_batching.py)."""
    def shape(row):
        ep = f" ep{row['ep']}" if row["ep"] > 1 else ""
        return f"{row['replicas']} x (tp{row['tp']} pp{row['pp']}{ep})"

    con.print(f"continuous batching at {data['request_rate']:g} requests/s (Poisson; prefills interleaved with the "
              f"running decodes), p99 against the targets:")
    for row in data["layouts"][:5]:
        if row["stable"]:
            status = "meets" if row["meets_slos"] else "misses"
            con.print(f"  {shape(row):>20}: TTFT p50 {row['ttft_p50_s'] * 1e3:.0f} / p99 {row['ttft_p99_s'] * 1e3:.0f} ms, "
                      f"TPOT p50 {row['tpot_p50_s'] * 1e3:.1f} / p99 {row['tpot_p99_s'] * 1e3:.1f} ms, "
                      f"{row['running_sequences']:.0f} sequences running (memory holds {row['max_sequences']}), "
                      f"{row['throughput_tokens_per_s']:.4g} tokens/s: {status} the targets; "
                      f"sustains {row['max_request_rate']:.3g} requests/s under them")
        else:
            con.print(f"  {shape(row):>20}: not sustainable at this rate ({row['limit']}); sustains "
                      f"{row['max_request_rate']:.3g} requests/s under the targets")
    best = data["best"]
    if not best["meets_slos"]:
        con.print(f"  no layout meets both p99 targets at {data['request_rate']:g} requests/s; the most any sustains is "
                  f"{max(r['max_request_rate'] for r in data['layouts']):.3g} requests/s ({shape(best)})")


def _plot(spec, table, hw, args, module) -> list[tuple[float, float, float]]:
    """Draw throughput against the TPOT target; the (target, any mode, colocated only) rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    targets = [args.tpot_slo * 0.4 * 10 ** (i / (PLOT_POINTS - 1)) for i in range(PLOT_POINTS)]
    series = {"best (any mode)": [], "colocated only": []}
    for target in targets:
        for name, disagg in (("best (any mode)", True), ("colocated only", False)):
            args_mode = _Args(args, no_disaggregation=not disagg)
            try:
                series[name].append(make_plan(spec, table, hw, args_mode, tpot_slo=target, module=module)
                                    .predicted["throughput_tokens_per_s"])
            except InfeasiblePlanError:
                series[name].append(float("nan"))
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, values in series.items():
        ax.plot([t * 1e3 for t in targets], values, marker="o", label=name)
    ax.axvline(args.tpot_slo * 1e3, color="grey", linestyle=":", label="--tpot-slo")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xticks([round(t * 1e3) for t in targets[::3]])
    ax.set_xlabel("TPOT target (ms)")
    ax.set_ylabel("output tokens / s (all devices)")
    ax.set_title(f"{spec.name} on {args.devices} x {hw.name}, P={args.prompt_len} O={args.output_len}, "
                 f"TTFT <= {args.ttft_slo:g} s", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    plt.close(fig)
    return list(zip(targets, *series.values()))


class _Args:
    """`args` with some attributes replaced."""

    def __init__(self, args, **override) -> None:
        self._args, self._override = args, override

    def __getattr__(self, name):
        return self._override[name] if name in self._override else getattr(self._args, name)
