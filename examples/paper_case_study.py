"""Reproduce the shape of the paper's LLaMA-7B table on 8x Ascend 910B (arXiv 2602.09109).

    python examples/paper_case_study.py --plot case_study.png

Sweeps every valid (DP, PP, TP, CP) layout with ZeRO-1 and no recomputation at global batch
1024, sequence 4096, micro-batch 1 (the paper's setup), prints the predicted table next to the
published measurements and how many pairs of configurations the prediction orders as measured,
and writes the MFU-vs-memory plot (the paper's Figure 8).
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

from autoshard.commands.sweep import sweep, write_plot
from autoshard.hardware import load_hardware
from autoshard.ir import Recompute
from autoshard.models.presets import get_spec
from autoshard.passes.capture.shapes import build_cost_table

DEFAULT_REFERENCE = Path(__file__).resolve().parents[1].parent / "shared" / "reference" / "ascend910b_llama7b.json"


def main() -> None:
    parser = argparse.ArgumentParser(description="the paper's LLaMA-7B case study, predicted by autoshard")
    parser.add_argument("--reference", type=Path, default=DEFAULT_REFERENCE,
                        help=f"published measurements (default {DEFAULT_REFERENCE})")
    parser.add_argument("--plot", default="paper_case_study.png", help="PNG to write (default %(default)s)")
    args = parser.parse_args()

    spec, hw = get_spec("llama-7b"), load_hardware("ascend-910b")
    results = sweep(spec, build_cost_table(spec), hw, devices=8, global_batch=1024, seq_len=4096,
                    micro_batch=1, zeros=(1,), recomputes=(Recompute.NONE,))
    write_plot(results, hw, args.plot, title="llama-7b on 8x ascend-910b, global batch 1024, seq 4096 (ZeRO-1)")
    best = next(e for e in results if e.fits)
    print(f"predicted best: {best.layout.mesh}  step {best.step_time_s:.1f} s  MFU {100 * best.mfu:.1f}%  "
          f"memory {best.mean_memory_gb:.1f} GB (avg) / {best.memory_gb:.1f} GB (peak); plot: {args.plot}")
    if not args.reference.is_file():
        print(f"(no reference file at {args.reference}; pass --reference to compare with the paper)")
        return
    rows = json.loads(args.reference.read_text())["rows"]
    by_mesh = {(e.layout.mesh.dp, e.layout.mesh.pp, e.layout.mesh.tp, e.layout.mesh.cp): e for e in results}
    print(f"\n{'dp pp tp cp':>12} {'step s pred':>12} {'meas':>7} {'mem GB pred':>12} {'meas':>6} {'MFU% pred':>10} {'meas':>6}")
    pairs = []
    for row in rows:
        e = by_mesh[(row["dp"], row["pp"], row["tp"], row["cp"])]
        pairs.append((e.step_time_s, row["step_s"]))
        print(f"{row['dp']:>3}{row['pp']:>3}{row['tp']:>3}{row['cp']:>3} {e.step_time_s:>12.1f} {row['step_s']:>7.1f} "
              f"{e.mean_memory_gb:>12.1f} {row['mem_gb']:>6.1f} {100 * e.mfu:>10.1f} {row['mfu']:>6.1f}")
    agree = sum((a[0] < b[0]) == (a[1] < b[1]) for a, b in itertools.combinations(pairs, 2))
    total = len(pairs) * (len(pairs) - 1) // 2
    print(f"\npairs ordered as measured: {agree}/{total}")


if __name__ == "__main__":
    main()
