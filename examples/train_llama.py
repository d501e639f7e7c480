"""Train a tiny HF LLaMA for a few steps under a hand-given plan.

    torchrun --nproc-per-node 4 examples/train_llama.py --plan dp=2,tp=2
    torchrun --nproc-per-node 2 examples/train_llama.py --plan auto
    torchrun --nproc-per-node 4 --max-restarts 3 examples/train_llama.py --plan dp=2,tp=2,zero=3 --checkpoint ckpt

With --checkpoint the run resumes from the checkpoint in that directory (under any plan or world size)
and saves one after every step, so a restarted job (torchrun --max-restarts) continues where it stopped.
"""

from __future__ import annotations

import argparse
import functools

import torch

import autoshard
from autoshard.models.presets import build_model, get_spec


def parse_plan(text: str) -> dict | None:
    """"dp=2,tp=2,recompute=full" -> {"dp": 2, "tp": 2, "recompute": "full"}; "auto" -> None (solve)."""
    if text.strip() == "auto":
        return None
    plan = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        value = value.strip()
        plan[key.strip()] = int(value) if value.isdigit() else {"true": True, "false": False}.get(value.lower(), value)
    return plan


def main(preset: str = "llama-tiny") -> None:
    parser = argparse.ArgumentParser(description=f"train {preset} with autoshard on CPU (gloo)")
    parser.add_argument("--plan", default="dp=1", help="mesh and options, e.g. dp=2,tp=2,zero=1,recompute=full or "
                        "pp=2,schedule=zero-bubble,virtual_stages=2,precision=bf16-mixed or tp=2,sequence_parallel=true, or "
                        "auto: rank 0 "
                        "solves for the fastest plan on the cpu profile and broadcasts it")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--checkpoint", help="directory: resume from the checkpoint there, save one after every step")
    args = parser.parse_args()
    spec = get_spec(preset)
    torch.manual_seed(0)
    ids = torch.randint(0, spec.vocab, (args.global_batch, args.seq_len))
    dm = autoshard.parallelize(build_model(spec, seed=0), ids, plan=parse_plan(args.plan),
                               global_batch=args.global_batch,
                               optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    start = dm.load_checkpoint(args.checkpoint, missing_ok=True) if args.checkpoint else 0
    for step in range(start, args.steps):
        loss = dm.train_step(ids, ids)
        if args.checkpoint:
            dm.save_checkpoint(args.checkpoint)
        if torch.distributed.get_rank() == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
