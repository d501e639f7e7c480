"""pp2: autoshard's PipelineRunner against torch.distributed.pipelining used by hand, same split.

Both sides run the same HF model (same weights), the same even split over 2 gloo ranks, the
same schedule and micro-batches, forward + backward of one batch per step (no optimizer). The
hand-written baseline is what a user writes from the torch docs: a stage module that calls the
embedding / decoder layers / norm / head, `PipelineStage`, the schedule, and a mean
cross-entropy per micro-batch (torch's default `scale_grads=True`). Steps of the two sides
alternate so machine load hits both alike; the figure is the ratio of medians (ours / hand),
measured in this run. Aim: <= 1.0x (ours adds the global-token loss, the tied-grad check and
the loss broadcast).

    python bench/bench_pipeline.py --model llama-tiny --layers 8 --steps 10
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from autoshard.model_spec import Mixer
from autoshard.models.presets import build_model, get_spec
from autoshard.runtime.pipeline import PipelineOptions, PipelineRunner, Schedule
from autoshard.ir import even_stages


class HandStage(nn.Module):
    """A hand-written stage: the HF model's own modules, called as its forward calls them."""

    def __init__(self, model, mixer, first: int, end: int, is_first: bool, is_last: bool):
        super().__init__()
        self.mixer, self.is_first, self.is_last = mixer, is_first, is_last
        body = model.model if mixer is Mixer.ATTENTION else model.backbone
        self.embed = (body.embed_tokens if mixer is Mixer.ATTENTION else body.embeddings) if is_first else None
        self.layers = nn.ModuleList(list(body.layers)[first:end])
        self.norm = (body.norm if mixer is Mixer.ATTENTION else body.norm_f) if is_last else None
        self.lm_head = model.lm_head if is_last else None
        self.rotary = body.rotary_emb if mixer is Mixer.ATTENTION else None

    def forward(self, x):
        h = self.embed(x) if self.is_first else x
        if self.mixer is Mixer.ATTENTION:
            pos = torch.arange(h.shape[1])[None]
            pe = self.rotary(h, position_ids=pos)
            for layer in self.layers:
                h = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe)
        else:
            for layer in self.layers:
                h = layer(h)
        return self.lm_head(self.norm(h)).float() if self.is_last else h


def _mean_ce(logits, labels):
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _worker(rank, world, init_file, args, results):
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    spec = replace(get_spec(args.model), layers=args.layers)
    stages = even_stages(spec.layers, world)
    schedule = Schedule(args.schedule)
    ours_model, hand_model = build_model(spec), build_model(spec)
    runner = PipelineRunner(ours_model, spec, stages, pp_group=dist.group.WORLD, device="cpu",
                            options=PipelineOptions(schedule=schedule, micro_batch=args.micro_batch))
    st = stages[rank]
    hand = HandStage(hand_model, spec.mixer, st.first_layer, st.end_layer, st.embed, st.head)
    cls = ScheduleGPipe if schedule is Schedule.GPIPE else Schedule1F1B
    hand_sched = cls(PipelineStage(hand, rank, world, torch.device("cpu")), args.batch // args.micro_batch,
                     loss_fn=_mean_ce)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, spec.vocab, (args.batch, args.seq), generator=gen)

    def ours():
        runner.module.zero_grad(set_to_none=True)
        runner.step(ids, ids, num_tokens=ids[:, 1:].numel())

    def theirs():
        hand.zero_grad(set_to_none=True)
        hand_sched.step(*((ids,) if st.embed else ()), target=ids if st.head else None)

    for _ in range(args.warmup):
        ours(), theirs()
    times = {"ours": [], "hand": []}
    for _ in range(args.steps):
        times["ours"].append(_timed(ours))
        times["hand"].append(_timed(theirs))
    if rank == 0:
        results.update({k: statistics.median(v) for k, v in times.items()})
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama-tiny", help="preset (llama-* or mamba2-*)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--schedule", default="1f1b", choices=[s.value for s in Schedule])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(2, os.path.join(tmp, "init"), args, results), nprocs=2, join=True)
        ours, hand = results["ours"], results["hand"]
    print(f"{args.model} layers={args.layers} batch={args.batch} seq={args.seq} micro_batch={args.micro_batch} "
          f"schedule={args.schedule}, pp2 on gloo, median of {args.steps} steps")
    print(f"  torch.distributed.pipelining by hand: {hand * 1e3:8.1f} ms/step")
    print(f"  autoshard PipelineRunner:             {ours * 1e3:8.1f} ms/step")
    print(f"  ratio ours / hand:                    {ours / hand:8.3f}")


if __name__ == "__main__":
    main()
