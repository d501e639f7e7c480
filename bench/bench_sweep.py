"""Benchmark: full `sweep` of llama-70b on 1024 H100s (global batch 1024, seq 4096), ZeRO-1, no recompute.

Reports the cost-table build (capture, shapes pass; cached after the first call), the table
compilation and the sweep itself, and the number of layouts priced. Target: < 10 s for the sweep.
Run: python bench/bench_sweep.py
"""

import time

from autoshard.hardware import load_hardware
from autoshard.ir import Recompute
from autoshard.models.presets import get_spec


def main() -> None:
    from autoshard.commands.sweep import sweep
    from autoshard.passes.cost import compile_table
    from autoshard.passes.shapes import build_cost_table

    spec, hw = get_spec("llama-70b"), load_hardware("h100")
    t0 = time.perf_counter()
    table = build_cost_table(spec)
    t1 = time.perf_counter()
    ct = compile_table(table, spec)
    t2 = time.perf_counter()
    results = sweep(spec, ct, hw, devices=1024, global_batch=1024, seq_len=4096, zeros=(1,),
                    recomputes=(Recompute.NONE,))
    t3 = time.perf_counter()
    fits = [e for e in results if e.fits]
    best = results[0]
    m = best.layout.mesh
    print(f"llama-70b on 1024x h100: {len(results)} layouts priced, {len(fits)} fit")
    print(f"  cost table build {t1 - t0:6.2f} s   compile {t2 - t1:5.2f} s   sweep {t3 - t2:5.2f} s   "
          f"sweep+compile {t3 - t1:5.2f} s   total {t3 - t0:6.2f} s")
    print(f"  best: dp{m.dp} pp{m.pp} tp{m.tp} cp{m.cp}  step {best.step_time_s:.2f} s  MFU {100 * best.mfu:.1f}%  "
          f"peak {best.memory_gb:.1f} GB  fits {best.fits}")


if __name__ == "__main__":
    main()
