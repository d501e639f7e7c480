"""Time `autoshard inspect --model P --seq-len 4096 --json` for every preset, each in a fresh process.

Each preset runs twice against a fresh, empty cost-table cache: `cold` traces the model (the first run
on a machine), `warm` reads the stored table (every later run; see autoshard/passes/capture/table_cache.py).
Baselines measured in the same run, so the figures are ratios on whatever machine runs this:
* `startup`: a fresh process that only imports autoshard's CLI, torch and transformers (the floor of
  a cold run, which must import transformers to build the model);
* `full trace` (with --full-trace NAME): capture_model of the whole model NAME, every layer traced,
  which is what block deduplication avoids (inspect traces a 1-layer copy at 6 shapes instead).

    python bench/bench_inspect.py                      # all presets
    python bench/bench_inspect.py llama-70b --repeat 3 --full-trace llama-7b
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import os
import subprocess
import sys
import tempfile
import time

STARTUP = "import autoshard.cli, torch, transformers; from transformers import LlamaForCausalLM, Mamba2ForCausalLM"
FULL_TRACE = """
import sys, torch
from autoshard.models import build_model, get_spec
from autoshard.passes.capture.capture import capture_model
capture_model(build_model(get_spec(sys.argv[1]), device="meta", dtype=torch.bfloat16),
              (torch.zeros(1, 4096, dtype=torch.long),))
"""


def _cpu_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _timed(argv: list[str], cache: str = "off") -> tuple[float, float, str]:
    """(wall seconds, CPU seconds of the child, its stdout); CPU time is the steadier figure on a shared machine."""
    start, cpu = time.perf_counter(), _cpu_children()
    done = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "AUTOSHARD_CACHE_DIR": cache})
    elapsed, cpu = time.perf_counter() - start, _cpu_children() - cpu
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    return elapsed, cpu, done.stdout


def main() -> None:
    from autoshard.models import PRESETS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("presets", nargs="*", default=[p for p in PRESETS if not p.endswith("tiny")])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=1, help="runs per preset (the median is reported)")
    parser.add_argument("--full-trace", metavar="NAME", help="also time capturing all layers of NAME")
    args = parser.parse_args()

    starts = [_timed([sys.executable, "-c", STARTUP]) for _ in range(args.repeat)]
    startup = statistics.median(t for t, _, _ in starts)
    startup_cpu = statistics.median(c for _, c, _ in starts)
    print(f"startup (imports only): {startup:.2f} s wall, {startup_cpu:.2f} s CPU")
    print(f"{'preset':<12} {'cold s':>7} {'warm s':>7} {'cold CPU':>8} {'/startup':>8} {'params':>16} "
          f"{'TFLOP/token':>11} {'/model':>7}")
    for name in args.presets:
        argv = [sys.executable, "-m", "autoshard.cli", "inspect", "--model", name, "--seq-len", str(args.seq_len),
                "--json"]
        cold, warm = [], []
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory(prefix="autoshard-bench-") as cache:
                cold.append(_timed(argv, cache))
                warm.append(_timed(argv, cache))
        elapsed = statistics.median(t for t, _, _ in cold)
        cpu = statistics.median(c for _, c, _ in cold)
        data = json.loads(cold[-1][2])
        assert json.loads(warm[-1][2]) == data, f"{name}: the cached table gives other numbers"
        print(f"{name:<12} {elapsed:>7.2f} {statistics.median(t for t, _, _ in warm):>7.2f} {cpu:>8.2f} "
              f"{cpu / startup_cpu:>8.2f} {data['params']:>16,} {data['flops_per_token'] / 1e12:>11.4f} "
              f"{data['flops_per_token'] / data['model_flops_per_token']:>7.3f}")
    if args.full_trace:
        elapsed, cpu, _ = _timed([sys.executable, "-c", FULL_TRACE, args.full_trace])
        print(f"full trace of {args.full_trace} (all layers, seq {args.seq_len}): {elapsed:.2f} s wall, "
              f"{cpu:.2f} s CPU = {cpu / startup_cpu:.2f} x startup CPU")


if __name__ == "__main__":
    main()
