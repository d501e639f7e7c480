"""Train every causal-LM class that plans on two gloo ranks: does each axis match one process, or refuse by name?

`bench/bench_families.py` checks what a user's `inspect` and `plan` give; this runs what `parallelize` gives. For
every model type the families sweep marks `ok` (or `--types`), a fresh process spawns two gloo ranks that build
`exaggerated(tiny_config(model_type))` with dropout off and, for each plan of dp2, tp2, pp2 (2 micro-batches), cp2,
dp2 with ZeRO-3 (FSDP2), tp2 with sequence parallelism and, for a mixture of experts, ep2, run `tests/runtime/equivalence.check_plan` (two AdamW
steps: the loss, every gradient, the weights and the logits against one process). Each (class, plan) is one of:
* `ok`: exact against one process;
* `refused`: parallelize raised an autoshard error (its one line is the reason);
* `WRONG`: it ran and differs from one process (the assertion's first line): a silent wrong answer (where the loss
  agreed but the weights or the second step's gradients differ, the plan is run again with SGD steps: exact there,
  it is `ok`, the AdamW line kept as its reason: Adam's normalised step turns a gradient's last-bit noise into a full
  step, and a model as sensitive as Gemma-4 turns those weights into gradients 1e-4 apart);
* `crash`: another exception (a bare traceback), or the class's process died or ran past `--timeout`.

The table (model type -> plan -> status and reason) goes to `bench/runtime_sweep.json`; `--types` re-measures
some classes and keeps the others' rows. Printed: the counts per status and every WRONG / crash row.

    python bench/bench_runtime_sweep.py                    # every class the families sweep plans (about an hour)
    python bench/bench_runtime_sweep.py --types qwen3,afmoe
    python bench/bench_runtime_sweep.py --world 4 --types qwen3,gemma2   # two axes at once on four ranks
    python bench/bench_runtime_sweep.py --plans dp2zero3                 # one plan over every class, merged
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import subprocess
import sys
import time

OUT = pathlib.Path(__file__).with_name("runtime_sweep.json")
FAMILIES = pathlib.Path(__file__).with_name("families_sweep.json")
ROOT = pathlib.Path(__file__).resolve().parent.parent
PLANS = {"dp2": dict(dp=2), "tp2": dict(tp=2), "pp2": dict(pp=2, micro_batch=2), "cp2": dict(cp=2),
         "dp2zero3": dict(dp=2, zero=3),  # FSDP2, a unit per block found by structure
         "tp2sp": dict(sequence_parallel=True, tp=2)}  # the layer's own norms on a sequence shard
EP = {"ep2": dict(ep=2)}
# --world 4: two axes at once (their groups, the stages' tp, the cp chunks' tp shards, FSDP2 on tp slices)
PLANS4 = {"dp2tp2": dict(dp=2, tp=2), "tp2pp2": dict(tp=2, pp=2, micro_batch=2), "tp2cp2": dict(tp=2, cp=2),
          "pp2cp2": dict(pp=2, cp=2, micro_batch=2), "dp2tp2zero3": dict(dp=2, tp=2, zero=3)}
EP4 = {"ep2tp2": dict(ep=2, tp=2), "ep2pp2": dict(ep=2, pp=2, micro_batch=2)}
OUT4 = pathlib.Path(__file__).with_name("runtime_sweep_world4.json")
STATUSES = ("ok", "refused", "WRONG", "crash")


def _one_line(text: str, limit: int = 300) -> str:
    line = next((x.strip() for x in str(text).splitlines() if x.strip()), "")
    return line[:limit]


def _no_dropout(config):
    """`config` (and its sub-configs) with every dropout probability 0: one process and the ranks draw different
    masks, so a model that drops out is compared without it."""
    for name, value in list(vars(config).items()):
        if isinstance(value, float) and ("dropout" in name or "pdrop" in name):
            setattr(config, name, 0.0)
        elif hasattr(value, "to_dict") and hasattr(value, "model_type"):  # a nested config (a text config)
            _no_dropout(value)
    return config


def _rank(rank: int, world: int, model_type: str, only: tuple[str, ...] = ()) -> None:
    """Every plan of the class on this rank; rank 0 prints one JSON line per plan as it ends."""
    from autoshard.errors import AutoshardError
    from autoshard.models.facts import config_value
    from autoshard.models.tiny import exaggerated, tiny_config
    from tests.runtime.equivalence import Tiny, check_plan

    config = _no_dropout(exaggerated(tiny_config(model_type)))
    moe = config_value(config.get_text_config(decoder=True), "experts")
    plans = {**PLANS, **(EP if moe else {})} if world == 2 else {**PLANS4, **(EP4 if moe else {})}
    for name, plan in plans.items():
        if only and name not in only:
            continue
        try:
            check_plan(Tiny(f"{model_type}-tiny", config), plan, logits=True)
            status, reason = "ok", ""
        except AutoshardError as e:
            status, reason = "refused", f"{type(e).__name__}: {_one_line(e)}"
        except AssertionError as e:
            status, reason = "WRONG", _one_line(e)
            if " loss" not in reason:  # AdamW's first step amplifies float32 noise into the second step's weights
                try:  # and, for a sensitive model (Gemma-4's scale-1 attention), its gradients (equivalence.ADAM)
                    check_plan(Tiny(f"{model_type}-tiny", config), plan, logits=True, sgd=True)
                    status, reason = "ok", f"SGD steps exact; AdamW's: {reason}"
                except AssertionError:
                    pass
        except Exception as e:  # noqa: BLE001 (a bare exception is what this sweep reports)
            status, reason = "crash", f"{type(e).__name__}: {_one_line(e)}"
        if rank == 0:
            print(json.dumps({"plan": name, "status": status, "reason": reason}), flush=True)


def _child(model_type: str, world: int, only: tuple[str, ...]) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    sys.path.insert(0, str(ROOT))
    from tests.runtime.dist_harness import run_ranks

    run_ranks(world, _rank, model_type, only)


def measure(model_type: str, *, timeout: float, world: int = 2, only: tuple[str, ...] = ()) -> dict:
    """One class in a fresh process: {plan: {"status", "reason"}, "seconds": s} (`only`: those plans)."""
    argv = [sys.executable, str(pathlib.Path(__file__).resolve()), "--child", model_type, "--world", str(world),
            *(["--plans", ",".join(only)] if only else [])]
    start = time.perf_counter()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        out, why = done.stdout, None if done.returncode == 0 else f"process died (exit {done.returncode})"
        err = done.stderr
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        why, err = f"timeout after {timeout:g} s", ""
    rows = {}
    for line in out.splitlines():
        if line.startswith("{\"plan\""):
            row = json.loads(line)
            rows[row.pop("plan")] = row
    if why is not None:  # the first plan that did not report ends the class
        lines = [x for x in err.splitlines() if "Error" in x or "error" in x]
        rows["unfinished"] = {"status": "crash", "reason": f"{why} after {', '.join(rows) or 'no plan'}"
                                                           + (f": {lines[-1][:200]}" if lines else "")}
    return {**rows, "seconds": round(time.perf_counter() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", help="comma-separated model types (default: those bench/families_sweep.json plans)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per class, every plan (default 600)")
    parser.add_argument("--world", type=int, choices=(2, 4), default=2,
                        help="2: each axis alone (default); 4: two axes at once, to bench/runtime_sweep_world4.json")
    parser.add_argument("--plans", help="comma-separated plan names (e.g. dp2zero3): only those, merged into the table")
    parser.add_argument("--out", type=pathlib.Path, help="the table (default: by --world)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    only = tuple(args.plans.split(",")) if args.plans else ()
    if args.child:
        return _child(args.child, args.world, only)
    args.out = args.out or (OUT if args.world == 2 else OUT4)
    families = json.loads(FAMILIES.read_text())
    types = args.types.split(",") if args.types else sorted(t for t, row in families.items() if row["status"] == "ok")
    table = json.loads(args.out.read_text()) if (args.types or only) and args.out.exists() else {}
    for n, model_type in enumerate(types, 1):
        row = measure(model_type, timeout=args.timeout, world=args.world, only=only)
        table[model_type] = {**table.get(model_type, {}), **row} if only else row
        row = table[model_type]
        cells = "  ".join(f"{p} {r['status']}" for p, r in row.items() if p != "seconds")
        print(f"[{n}/{len(types)}] {model_type:<24} {row['seconds']:>6.1f} s  {cells}", flush=True)
        args.out.write_text(json.dumps(dict(sorted(table.items())), indent=1) + "\n")
    counts = collections.Counter(r["status"] for row in table.values() for p, r in row.items() if p != "seconds")
    print(f"\n{len(table)} classes, {sum(counts.values())} (class, plan) rows: "
          + ", ".join(f"{s} {counts[s]}" for s in STATUSES))
    for status in ("WRONG", "crash"):
        for model_type, row in sorted(table.items()):
            for plan, r in row.items():
                if plan != "seconds" and r["status"] == status:
                    print(f"  {status:<6} {model_type} {plan}: {r['reason']}")


if __name__ == "__main__":
    main()
