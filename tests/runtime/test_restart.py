"""Restart under torchrun: a job whose rank dies resumes from its last checkpoint and ends with the
weights of an uninterrupted run (tests/runtime/restart_job.py). A peer that hangs ends the step after
the collective timeout, with an error naming it (torchrun's agent kills the survivors of a rank that
*dies* before they can say anything; its own summary names the rank)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.testing import assert_close

import autoshard
from autoshard.models.presets import build_model, get_spec
from autoshard.runtime.mesh import PeerLostError
from tests.runtime.dist_harness import run_ranks
from tests.runtime.equivalence import TOL, batches, reference

ROOT = Path(__file__).resolve().parents[2]


def test_a_lost_rank_restarts_from_the_last_checkpoint(tmp_path):
    out = tmp_path / "final.safetensors"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
           "--monitor-interval", "0.5", str(ROOT / "tests/runtime/restart_job.py"), str(tmp_path / "ckpt"), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-6000:]
    assert "attempt 1 rank 0 resumes at step 2" in log and "attempt 1 rank 1 resumes at step 2" in log, log[-6000:]
    spec = get_spec("llama-tiny")
    ref, _, _ = reference(spec, batches(spec.vocab, global_batch=8, seq=16, steps=5))
    final = load_file(out)
    for name, param in ref.named_parameters():
        assert_close(final[name], param.detach(), **TOL, msg=lambda m: f"{name}: {m}")


def _hang(rank, world, flag):
    spec = get_spec("llama-tiny")
    ids = batches(spec.vocab, global_batch=4, seq=8, steps=1)[0][0]
    from datetime import timedelta

    dm = autoshard.parallelize(build_model(spec, seed=0), ids, plan=dict(dp=2), global_batch=4, timeout_s=120)
    # the step's first collective (the batch check) runs on the harness's default group (30 min): bound it
    # to 2 s, as parallelize(timeout_s=) bounds the groups it makes (120 s here: start-up is slow on 2 cores)
    torch.distributed.distributed_c10d._set_pg_timeout(timedelta(seconds=2), None)
    if rank == 1:  # hangs: never joins the step's collectives, until rank 0 has given up
        while not os.path.exists(flag):
            time.sleep(0.2)
        os._exit(0)
    with pytest.raises(PeerLostError, match=r"rank 0: a collective failed: .*; rank 1 did not answer within"):
        dm.train_step(ids, ids)
    open(flag, "w").close()


def test_a_hung_peer_ends_the_step_naming_it(tmp_path):
    run_ranks(2, _hang, str(tmp_path / "gave_up"))
