"""The job of test_restart.py, run under `torchrun --max-restarts 1`: 5 AdamW steps of llama-tiny under
dp 2, a checkpoint after every step, resumed from the last one on a restart. On the first attempt
rank 1 dies right after step 2 (its checkpoint is complete). Rank 0 writes the final weights
(safetensors) to the second argument.

    torchrun --nproc-per-node 2 --max-restarts 1 tests/runtime/restart_job.py CKPT_DIR OUT.safetensors
"""

from __future__ import annotations

import functools
import os
import sys

import torch
from safetensors.torch import save_file

import autoshard
from autoshard.models.presets import build_model, get_spec
from tests.runtime.equivalence import ADAM, batches

STEPS, DIE_AFTER = 5, 2


def main(checkpoint: str, out: str) -> None:
    torch.set_num_threads(1)
    spec = get_spec("llama-tiny")
    data = batches(spec.vocab, global_batch=8, seq=16, steps=STEPS)
    dm = autoshard.parallelize(build_model(spec, seed=0), data[0][0], plan=dict(dp=2), global_batch=8,
                               optimizer=functools.partial(torch.optim.AdamW, **ADAM), timeout_s=60)
    rank, attempt = torch.distributed.get_rank(), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    start = dm.load_checkpoint(checkpoint, missing_ok=True)
    print(f"attempt {attempt} rank {rank} resumes at step {start}", flush=True)
    for step in range(start, STEPS):
        dm.train_step(*data[step])
        dm.save_checkpoint(checkpoint)
        if attempt == 0 and rank == 1 and step + 1 == DIE_AFTER:
            os._exit(1)  # a lost rank: no clean-up, no message
    state = dm.full_state_dict()
    if rank == 0:
        save_file({n: t.contiguous() for n, t in state.items()}, out)


if __name__ == "__main__":
    main(*sys.argv[1:3])
