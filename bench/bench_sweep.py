"""Benchmark: full `sweep` of llama-70b on 1024 H100s (global batch 1024, seq 4096), ZeRO-1, no recompute.

Two parts, in one run:
* the CLI command of issue 3, each in a fresh process against a fresh cost-table cache: `cold` traces
  the model (first run on a machine), `warm` reads the stored table (every later run); the floor is a
  process that only imports autoshard's CLI and torch (warm) or also transformers (cold);
* in-process: the cost-table build, the table compilation and the sweep itself, and the layouts priced.
Target: < 10 s for the command. Run: python bench/bench_sweep.py [--repeat N]
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from autoshard.hardware import load_hardware
from autoshard.ir import Recompute
from autoshard.models.presets import get_spec

COMMAND = ["sweep", "--model", "llama-70b", "--hardware", "h100", "--devices", "1024", "--global-batch", "1024",
           "--seq-len", "4096", "--zero", "1", "--recompute", "none", "--json"]


def _wall(argv: list[str], cache: str) -> float:
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "AUTOSHARD_CACHE_DIR": cache})
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    return time.perf_counter() - start


def command(repeat: int) -> None:
    floor_warm = [_wall([sys.executable, "-c", "import autoshard.cli, torch"], "off") for _ in range(repeat)]
    floor_cold = [_wall([sys.executable, "-c", "import autoshard.cli, torch; from transformers import "
                         "LlamaForCausalLM"], "off") for _ in range(repeat)]
    cold, warm = [], []
    for _ in range(repeat):
        with tempfile.TemporaryDirectory(prefix="autoshard-bench-") as cache:
            cold.append(_wall([sys.executable, "-m", "autoshard.cli", *COMMAND], cache))
            warm.append(_wall([sys.executable, "-m", "autoshard.cli", *COMMAND], cache))
    med = statistics.median
    print(f"autoshard {' '.join(COMMAND)}")
    print(f"  cold {med(cold):6.2f} s  (floor: imports incl. transformers {med(floor_cold):5.2f} s)")
    print(f"  warm {med(warm):6.2f} s  (floor: imports of autoshard + torch {med(floor_warm):5.2f} s)")


def in_process() -> None:
    from autoshard.commands.sweep import sweep
    from autoshard.passes.cost.compiled import compile_table
    from autoshard.passes.capture.shapes import build_cost_table

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
    print(f"in process, llama-70b on 1024x h100: {len(results)} layouts priced, {len(fits)} fit")
    print(f"  cost table {t1 - t0:6.2f} s (cache: {os.environ.get('AUTOSHARD_CACHE_DIR', 'default')})   "
          f"compile {t2 - t1:5.2f} s   sweep {t3 - t2:5.2f} s   total {t3 - t0:6.2f} s")
    print(f"  best: dp{m.dp} pp{m.pp} tp{m.tp} cp{m.cp}  step {best.step_time_s:.2f} s  MFU {100 * best.mfu:.1f}%  "
          f"peak {best.memory_gb:.1f} GB  fits {best.fits}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1, help="fresh-process runs of each kind (median reported)")
    args = parser.parse_args()
    command(args.repeat)
    os.environ["AUTOSHARD_CACHE_DIR"] = "off"  # the in-process figures are the traced build
    in_process()


if __name__ == "__main__":
    main()
