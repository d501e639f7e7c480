"""Train a tiny HF Mixtral (mixture of experts) for a few steps under expert parallelism.

    torchrun --nproc-per-node 2 examples/train_mixtral.py --plan ep=2
    torchrun --nproc-per-node 4 examples/train_mixtral.py --plan dp=2,ep=2 --aux-loss
    torchrun --nproc-per-node 4 examples/train_mixtral.py --plan ep=2,tp=2 --model qwen2-moe-tiny

Each ep rank holds experts/ep of every MoE layer and its own rows of the batch (EP folds into
data parallelism, docs/expert_parallel.md); tokens reach their experts by all-to-all.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch

import autoshard
from autoshard.models.presets import build_model, get_spec

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_llama import parse_plan  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description="train a tiny MoE model with expert parallelism (gloo)")
    parser.add_argument("--model", default="mixtral-tiny", choices=("mixtral-tiny", "qwen2-moe-tiny"))
    parser.add_argument("--plan", default="ep=2", help="mesh and options, e.g. ep=2 or dp=2,ep=2,zero=1")
    parser.add_argument("--aux-loss", action="store_true",
                        help="add HF's router load-balancing loss (output_router_logits=True)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=32)
    args = parser.parse_args()
    spec = get_spec(args.model)
    model = build_model(spec, seed=0)
    model.config.output_router_logits = args.aux_loss
    torch.manual_seed(0)
    ids = torch.randint(0, spec.vocab, (args.global_batch, args.seq_len))
    dm = autoshard.parallelize(model, ids, plan=parse_plan(args.plan), global_batch=args.global_batch,
                               optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    rank = torch.distributed.get_rank()
    if rank == 0:
        mesh = dm.plan.mesh
        print(f"{args.model}: {spec.experts} experts, top-{spec.top_k}; mesh {mesh}: "
              f"{spec.experts // mesh.ep} experts per rank", flush=True)
    for step in range(args.steps):
        loss = dm.train_step(ids, ids)
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
