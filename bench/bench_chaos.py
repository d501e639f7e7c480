"""Time lost per kill: the chaos run of tests/runtime/test_chaos.py (100 AdamW steps of llama-tiny, dp 2
on 2 gloo ranks under `torchrun --max-restarts`, a checkpoint every 5 steps, ranks SIGKILLed after a step,
inside DCP's write, before the digests and between the renames) against the uninterrupted run of the
same job, one after the other (not side by side, as the test runs them). Reported: each run's wall time,
(chaos - plain) / kills, and how much of that is steps taken again (the steps since the last checkpoint,
priced at the plain run's mean step) versus restarting (torchrun's restart, the imports, parallelize,
load_checkpoint). The final weights are compared bit for bit, as in the test.

    python bench/bench_chaos.py [--seed 1] [--repeats 1]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.runtime.chaos_job import SAVE_EVERY, STEPS  # noqa: E402
from tests.runtime.test_chaos import finish_job, kill_schedule, start_job  # noqa: E402


def lost_steps(kills: list[dict]) -> int:
    """Steps taken twice: from the checkpoint each attempt resumes at to the step its kill came at."""
    lost = 0
    for kill in kills:
        saved = kill["step"] // SAVE_EVERY * SAVE_EVERY if kill["at"] == "step" else kill["step"] + 1 - SAVE_EVERY
        lost += kill["step"] + 1 - saved
    return lost


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1, help="kill schedule seed (test_chaos.kill_schedule)")
    ap.add_argument("--repeats", type=int, default=1, help="pairs of runs (medians reported)")
    args = ap.parse_args(argv)
    kills = kill_schedule(args.seed)
    plain_s, chaos_s = [], []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            plain, log, took = finish_job(start_job(Path(tmp), "plain", []), "plain")
            plain_s.append(took)
            chaos, log, took = finish_job(start_job(Path(tmp), "chaos", kills), "chaos")
            chaos_s.append(took)
            assert all(torch.equal(chaos[n], t) for n, t in plain.items()), "the chaos run's weights differ"
            assert len(re.findall(r"rank 0 resumes at step", log)) == len(kills) + 1
    plain_t, chaos_t = statistics.median(plain_s), statistics.median(chaos_s)
    per_kill = (chaos_t - plain_t) / len(kills)
    redo = lost_steps(kills)
    where = ", ".join(f"{k['at']}@{k['step']}/rank{k['rank']}" for k in kills)
    print(f"kills (seed {args.seed}): {where}")
    print(f"{STEPS} steps, a checkpoint every {SAVE_EVERY}: uninterrupted {plain_t:.1f} s, with {len(kills)} kills "
          f"{chaos_t:.1f} s (medians of {args.repeats}); final weights bit-identical")
    print(f"time lost per kill: {per_kill:.1f} s = {per_kill / plain_t:.2f} of the uninterrupted run; steps taken "
          f"again: {redo} in all ({redo / len(kills):.1f} per kill, ~{redo / len(kills) * plain_t / STEPS:.2f} s at "
          "the plain run's mean step, which includes its start-up: an upper bound), the rest is the restart")


if __name__ == "__main__":
    main()
