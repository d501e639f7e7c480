"""A plain training loop under torch.compile with autoshard's backend (data x tensor parallel).

    torchrun --nproc-per-node 4 examples/compile_backend.py --plan dp=2,tp=2

Calling convention: every rank passes its own dp shard of the batch (tp peers pass the same
rows); the loss returned is the mean over dp, the same on every rank; the optimizer is a plain
one over model.parameters() (parameters stay whole; gradients arrive summed over the mesh).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import autoshard
from autoshard.models.presets import build_model, get_spec
from autoshard.runtime.mesh import coords_of


def main() -> None:
    parser = argparse.ArgumentParser(description="train a tiny HF LLaMA under torch.compile(backend=autoshard)")
    parser.add_argument("--plan", default="dp=1", help="dp and tp, e.g. dp=2,tp=2")
    parser.add_argument("--model", default="llama-tiny", help="preset name (default llama-tiny)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=32)
    args = parser.parse_args()
    plan = {k: int(v) for k, v in (item.split("=") for item in args.plan.split(","))}

    spec = get_spec(args.model)
    model = build_model(spec, seed=0)
    be = autoshard.backend(model, plan=plan, global_batch=args.global_batch)
    compiled = torch.compile(model, backend=be)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    mesh, rank = be.plan.mesh, dist.get_rank()
    rows = args.global_batch // mesh.dp
    first = coords_of(rank, mesh).dp * rows
    gen = torch.Generator().manual_seed(0)
    for step in range(args.steps):
        ids = torch.randint(0, spec.vocab, (args.global_batch, args.seq_len), generator=gen)
        local = ids[first:first + rows]  # this rank's dp shard
        optimizer.zero_grad()
        loss = compiled(local, labels=local).loss
        loss.backward()
        optimizer.step()
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f} (mesh {mesh})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
