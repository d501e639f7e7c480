"""Chaos: a 100-step run on 2 gloo ranks under `torchrun --max-restarts 4`, ranks SIGKILLed at random steps
four times (once after a step, and during three saves: inside DCP's write, before the digests, between the
renames), ends with the weights of the uninterrupted run, bit for bit (fp32). The kill schedule is drawn
from a seed (printed on failure; AUTOSHARD_CHAOS_SEED replays one). tests/runtime/chaos_job.py is the job;
The uninterrupted run goes first, in the first attempt's processes (one start-up fewer: start-up is most
of the test's time). bench/bench_chaos.py reports the time lost per kill.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.runtime.chaos_job import SAVE_EVERY, STEPS

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("step", "write", "digest", "publish")


def kill_schedule(seed: int) -> list[dict]:
    """One kill per attempt, at increasing steps (so each attempt gets past the previous kill), in a random
    order of the four kinds; a save kill falls on a step that saves, `publish` on rank 0 (it renames)."""
    rng = random.Random(seed)
    kinds = rng.sample(KINDS, len(KINDS))
    span = (STEPS - 10) // len(kinds)
    kills = []
    for attempt, kind in enumerate(kinds):
        step = 5 + attempt * span + rng.randrange(span - SAVE_EVERY)
        if kind != "step":
            step += SAVE_EVERY - 1 - step % SAVE_EVERY  # the next step after which the job saves
        kills.append(dict(attempt=attempt, rank=0 if kind == "publish" else rng.randrange(2), step=step, at=kind))
    return kills


def start_job(tmp: Path, name: str, kills: list[dict], *, plain: Path | None = None
              ) -> tuple[subprocess.Popen, Path, float]:
    """chaos_job.py started under torchrun with `kills` (`plain`: the uninterrupted run's weights written there
    first, by the same processes): (the process, its output file, its start time)."""
    out = tmp / f"{name}.safetensors"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", str(len(kills)), "--monitor-interval", "0.2", str(ROOT / "tests/runtime/chaos_job.py"),
           str(tmp / f"{name}-ckpt"), str(out), json.dumps(kills), *([str(plain)] if plain else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    log = open(tmp / f"{name}.log", "w")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True), out, \
        time.perf_counter()


def finish_job(job: tuple[subprocess.Popen, Path, float], what: str) -> tuple[dict, str, float]:
    """(final weights, the log, wall seconds) of a `start_job` once it ends."""
    proc, out, start = job
    code = proc.wait(timeout=600)
    took = time.perf_counter() - start
    log = (out.parent / out.name.replace(".safetensors", ".log")).read_text()
    assert code == 0, f"{what}:\n{log[-6000:]}"
    return load_file(out), log, took


@pytest.mark.slow
def test_killed_ranks_end_with_the_weights_of_the_uninterrupted_run(tmp_path):
    seed = int(os.environ.get("AUTOSHARD_CHAOS_SEED", random.randrange(10**6)))
    kills = kill_schedule(seed)
    what = f"seed {seed}, kills {kills}"
    chaos, log, _ = finish_job(start_job(tmp_path, "chaos", kills, plain=tmp_path / "plain.safetensors"), what)
    plain = load_file(tmp_path / "plain.safetensors")  # the uninterrupted run, first in the same processes
    for kill in kills:  # every kill happened, and the next attempt resumed from the last complete checkpoint
        # a kill after a step comes before that step's save; one during a save loses that save (the
        # previous checkpoint, at `publish` moved aside to .old, is the one loaded)
        saved = kill["step"] // SAVE_EVERY * SAVE_EVERY if kill["at"] == "step" else kill["step"] + 1 - SAVE_EVERY
        assert f"attempt {kill['attempt'] + 1} rank 0 resumes at step {saved}" in log, f"{what}\n{log[-4000:]}"
    assert chaos.keys() == plain.keys()
    for name, tensor in plain.items():
        assert tensor.dtype == torch.float32 and torch.equal(chaos[name], tensor), f"{what}: {name} differs"
