"""Fixed-batch serving runs against the inference cost model (issue 29 item 1).

  python bench/bench_serving.py                  the two given rows (the calibration) and the held-out
                                                 rows of bench/serving_heldout_rows.json, each with
                                                 predicted / measured time, the error and the decode
                                                 step's breakdown; the mean and median absolute error
                                                 per group, over the held-out rows and over all
  python bench/bench_serving.py --rows FILE      any rows file in that format

Then the all-reduce bound: the largest fixed cost of a low-latency collective (the profile's
`ll_base_latency`, which every decode all-reduce, input broadcast and logits gather pays) that keeps
the tp > 1 given row within 5%, found by bisection on that row alone, and every held-out tp > 1
row's error at it -- how far a dearer all-reduce alone could close those rows (printed, nothing set).

Each row is one replica of tp H100s serving a fixed batch (prompt P, O new tokens, end-of-sequence
ignored), priced by `estimate_serving`: the whole batch takes TTFT + (O - 1) TPOT.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

from autoshard.commands.common import cost_table_for
from autoshard.hardware import load_hardware
from autoshard.models.published import SERVING_CALIBRATION
from autoshard.passes.serving.inference_cost import ServeLayout, compile_inference_table, estimate_serving

HELDOUT = Path(__file__).with_name("serving_heldout_rows.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=str(HELDOUT))
    ap.add_argument("--hardware", default="h100")
    args = ap.parse_args()
    hw = load_hardware(args.hardware)
    rows = [dict(id=r.id, model=r.spec, tp=r.tp, batch=r.batch, prompt_len=r.prompt_len, output_len=r.output_len,
                 total_s=r.total_s, group="given") for r in SERVING_CALIBRATION]
    rows += json.loads(Path(args.rows).read_text())["rows"]
    tables, errors = {}, {}

    def error(r, profile):
        model = r["model"]
        key = model if isinstance(model, str) else model.name
        if key not in tables:
            spec, table = (cost_table_for(model, spinner=False) if isinstance(model, str)
                           else (model, cost_table_for(model.name, spinner=False, spec=model,
                                                       module=_module(model))[1]))
            tables[key] = (spec, compile_inference_table(table, spec))
        spec, it = tables[key]
        e = estimate_serving(it, spec, profile, ServeLayout(tp=r["tp"], batch=r["batch"]), prompt_len=r["prompt_len"],
                             output_len=r["output_len"])
        return e, (e.ttft_s + (r["output_len"] - 1) * e.tpot_s) / r["total_s"] - 1

    print(f"{'row':28} {'group':8} {'pred s':>8} {'meas s':>8} {'error':>7} | TTFT ms  TPOT ms | decode step ms: "
          "weights+GEMMs  kernel floors  tp all-reduce  input broadcast")
    for r in rows:
        e, err = error(r, hw)
        total = (1 + err) * r["total_s"]
        errors.setdefault(r["group"], []).append(abs(err))
        d = e.decode
        print(f"{r['id']:28} {r['group']:8} {total:8.3f} {r['total_s']:8.3f} {100 * err:+6.1f}% | {e.ttft_s * 1e3:7.1f} "
              f"{e.tpot_s * 1e3:7.2f} | {(d.compute + d.core) * 1e3:13.2f} {d.fixed * 1e3:14.2f} {d.tp_comm * 1e3:14.2f} "
              f"{d.step_inputs * 1e3:16.2f}")
    held_out = [e for group, errs in errors.items() if group != "given" for e in errs]
    every = [e for errs in errors.values() for e in errs]
    for name, errs in [*errors.items(), ("held out", held_out), ("all", every)]:
        print(f"absolute error, {name}: mean {100 * statistics.mean(errs):.1f}%, median "
              f"{100 * statistics.median(errs):.1f}% over {len(errs)} rows")
    _all_reduce_bound(rows, hw, error)


def _all_reduce_bound(rows, hw, error) -> None:
    """The largest `ll_base_latency` keeping the tp > 1 given row within +5% (bisection on that row), and the
    held-out tp > 1 rows' errors there."""
    given = next(r for r in rows if r["group"] == "given" and r["tp"] > 1)
    lo, hi = hw.ll_base_latency, 1e-3
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if error(given, dataclasses.replace(hw, ll_base_latency=mid))[1] <= 0.05 else (lo, mid)
    bound = dataclasses.replace(hw, ll_base_latency=lo)
    print(f"all-reduce bound: ll_base_latency up to {lo * 1e6:.1f} us (profile {hw.ll_base_latency * 1e6:.1f} us) keeps "
          f"{given['id']} within +5%; there (check only):")
    for r in rows:
        if r["tp"] > 1 and r["group"] != "given":
            e, err = error(r, bound)
            print(f"  {r['id']:28} {100 * err:+6.1f}%  (decode step's tp collectives {e.decode.tp_comm * 1e3:.2f} ms)")


def _module(spec):
    from transformers import LlamaForCausalLM
    import torch

    with torch.device("meta"):
        return LlamaForCausalLM(spec.hf_config())


if __name__ == "__main__":
    main()
