"""Benchmark: how long `sweep` / `plan` take to refuse a device count no layout fits (issue 16).

The layouts are built from the device count's prime factors and pruned axis by axis
(rules/validity.py); before, the divisor search was linear in the count (1e7 devices: 20 s,
1e9: no answer). In-process `autoshard.cli.main` for llama-7b, global batch 8, seq 4096 (the
model needs no trace: the answer comes before the cost table), each count `--repeat` times;
printed: the median in ms and the ratio to 1000 devices (also refused) in the same run. Target: < 1 s each.

    python bench/bench_devices.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import time

from autoshard.cli import main

COUNTS = (1000, 10**9, 2**60, 10**19, 1000000007 * 998244353, 720720**2)


def _seconds(command: str, devices: int) -> float:
    argv = [command, "--model", "llama-7b", "--hardware", "h100", "--devices", str(devices), "--global-batch", "8",
            "--seq-len", "4096"]
    start = time.perf_counter()
    with contextlib.redirect_stderr(io.StringIO()) as err, contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    elapsed = time.perf_counter() - start
    if code != 2 or "no valid" not in err.getvalue():
        raise SystemExit(f"{' '.join(argv)}: expected the one-line refusal, got exit {code}: {err.getvalue()!r}")
    return elapsed


def run(repeat: int) -> None:
    for command in ("sweep", "plan"):
        _seconds(command, 1000)  # imports (OR-Tools for plan) out of the timing
        medians = {n: statistics.median(_seconds(command, n) for _ in range(repeat)) for n in COUNTS}
        for n, s in medians.items():
            print(f"{command:5} --devices {n:<22} {1e3 * s:8.1f} ms  x{s / medians[1000]:.2f} of 1000 devices")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per device count (default 5)")
    run(parser.parse_args().repeat)
