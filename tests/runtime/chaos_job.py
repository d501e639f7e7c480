"""The job of test_chaos.py and bench/bench_chaos.py, run under `torchrun --max-restarts K`: STEPS AdamW steps
of llama-tiny under dp 2, a checkpoint every SAVE_EVERY steps, resumed from the last one on every restart.

`kills` (JSON) lists, per attempt, the rank that SIGKILLs itself and where: `step` (right after a
train_step), `write` (inside DCP's save, once this rank's shard is written), `digest` (the save's
files are complete, before their digests), `publish` (rank 0, between the two renames: the previous
checkpoint moved aside, the new one not yet in place). `[]` is the uninterrupted run. Rank 0 writes the
final weights (safetensors) to OUT. With PLAIN, the first attempt first runs the uninterrupted job in
the same processes (its own model and checkpoint directory, the RNG state put back after it) and writes
its final weights there: one start-up fewer than a second torchrun.

    torchrun --standalone --nproc-per-node 2 --max-restarts K tests/runtime/chaos_job.py CKPT OUT KILLS_JSON [PLAIN]
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys

import torch
from safetensors.torch import save_file

import autoshard
from autoshard.models.presets import build_model, get_spec
from autoshard.runtime import checkpoint
from tests.runtime.equivalence import ADAM

STEPS, SAVE_EVERY, BATCH, SEQ = 100, 5, 4, 16


def batch(step: int, vocab: int):
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
    return ids, ids.clone()


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)  # no clean-up, no message, as the OOM killer or a lost node


def arm(kill: dict, rank: int) -> None:
    """Make this rank die at `kill`'s point of the save after step kill["step"] (see the module docstring)."""
    if kill["at"] == "write":
        from torch.distributed.checkpoint.filesystem import _FileSystemWriter

        real = _FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            real(self, plan, planner).wait()
            die()

        _FileSystemWriter.write_data = write_then_die
    elif kill["at"] == "digest":
        checkpoint._digest_files = lambda *args, **kwargs: die()
    elif kill["at"] == "publish":
        def move_aside_then_die(tmp, final, old):
            if final.exists():
                final.rename(old)
            die()

        checkpoint._publish = move_aside_then_die


def train(ckpt: str, out: str, *, kill: dict | None, attempt: int) -> None:
    """The job: resume from `ckpt`, train to STEPS saving every SAVE_EVERY steps, final weights to `out`."""
    spec = get_spec("llama-tiny")
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else int(os.environ["RANK"])
    dm = autoshard.parallelize(build_model(spec, seed=0), batch(0, spec.vocab)[0], plan=dict(dp=2), global_batch=BATCH,
                               optimizer=functools.partial(torch.optim.AdamW, **ADAM), timeout_s=60)
    start = dm.load_checkpoint(ckpt, missing_ok=True)
    print(f"attempt {attempt} rank {rank} resumes at step {start}", flush=True)
    for step in range(start, STEPS):
        dm.train_step(*batch(step, spec.vocab))
        if kill is not None and kill["step"] == step:
            if kill["at"] == "step":
                die()
            arm(kill, rank)
        if (step + 1) % SAVE_EVERY == 0:
            dm.save_checkpoint(ckpt)
    state = dm.full_state_dict()
    if rank == 0:
        save_file({n: t.contiguous() for n, t in state.items()}, out)


def main(ckpt: str, out: str, kills_json: str, plain: str | None = None) -> None:
    torch.set_num_threads(1)
    rank, attempt = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    kill = next((k for k in json.loads(kills_json) if k["attempt"] == attempt and k["rank"] == rank), None)
    if plain is not None and attempt == 0:
        rng = torch.get_rng_state()
        train(f"{ckpt}-plain", plain, kill=None, attempt=-1)
        torch.set_rng_state(rng)
    train(ckpt, out, kill=kill, attempt=attempt)


if __name__ == "__main__":
    main(*sys.argv[1:5])
