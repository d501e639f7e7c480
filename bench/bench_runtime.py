"""Speed of autoshard's runtime against PyTorch's own parallelism (issue 5), as ratios.

Every comparison times one training step (forward, backward, AdamW step) of the same HF
`LlamaForCausalLM` on the same batch, run by a baseline and by autoshard, in the same processes:

    ws1  eager HF model                                  vs  parallelize(plan=dict())  (world of one)
    bf16 eager HF model under torch.autocast(bfloat16)   vs  parallelize(plan=dict(precision="bf16-mixed"))
         (world of one; torch AMP's recipe, fp32 weights, against autoshard's Megatron layout: bf16 weights,
         fp32 main gradients and masters, runtime/precision.py)
    dp2  torch.nn.parallel.DistributedDataParallel       vs  parallelize(plan=dict(dp=2))
    tp2  torch.distributed.tensor.parallel.parallelize_module (ColwiseParallel q/k/v/gate/up,
         RowwiseParallel o/down)                         vs  parallelize(plan=dict(tp=2))
    pp2  torch.distributed.pipelining by hand (PipelineStage of a hand-cut stage, Schedule1F1B)
                                                         vs  parallelize(plan=dict(pp=2))

Method: the machine is shared and noisy, so the two sides are built once and then run in
alternating order (A B, B A, A B, ...) for `--steps` repetitions after `--warmup`; the reported
ratio is median(autoshard) / median(baseline) (> 1: autoshard slower), with the quartiles of
the per-repetition paired ratios as a noise gauge. A step is timed on rank 0 between two
barriers, so it includes the slowest rank (`--clock cpu`: rank 0's CPU time instead). Each
rank uses one intra-op thread (`--threads`). Only ratios mean anything; the milliseconds are
this run's medians on this machine.

autoshard runs the baseline's micro-batches: the whole local batch at once (ws1, dp2, tp2), or
`--pp-micro` sequences per micro-batch on both sides (pp2). ws1 also times the literal
`plan=dict()`, whose default micro_batch is 1 sequence (B micro-batches of gradient
accumulation). ws1 runs in this process as a world of one; dp2, tp2 and pp2 share one spawned
world of 2 gloo ranks (start-up costs seconds). Both sides build the model from the same seed.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

import autoshard
from autoshard.models.presets import build_model, get_spec
from autoshard.ir import even_stages

COMPARISONS = ("ws1", "bf16", "dp2", "tp2", "pp2")
LOCAL = ("ws1", "bf16")  # run in this process as a world of one


@dataclass(frozen=True, slots=True, kw_only=True)
class Options:
    steps: int = 10
    warmup: int = 2
    hidden: int = 256
    ffn: int = 688
    layers: int = 4
    vocab: int = 256
    seq: int = 128
    batch: int = 8
    pp_micro: int = 2
    threads: int = 1
    clock: str = "wall"  # "wall": perf_counter between barriers; "cpu": rank 0's process CPU time
    device: str = "cpu"  # ws1 / bf16 only: "cuda" runs the world of one on the GPU
    lr: float = 1e-3


@dataclass(frozen=True, slots=True, kw_only=True)
class Timing:
    """Per-repetition seconds of one baseline / candidate pair, measured interleaved."""

    name: str
    baseline: str
    candidate: str
    base_s: tuple[float, ...]
    cand_s: tuple[float, ...]

    @property
    def ratio(self) -> float:
        return statistics.median(self.cand_s) / statistics.median(self.base_s)

    def paired_quartiles(self) -> tuple[float, float, float]:
        """Quartiles of candidate / baseline over the repetitions (each pair ran back to back)."""
        pairs = sorted(c / b for b, c in zip(self.base_s, self.cand_s))
        if len(pairs) < 4:
            return pairs[0], statistics.median(pairs), pairs[-1]
        q = statistics.quantiles(pairs, n=4)
        return q[0], q[1], q[2]


# -- model, data, steps ------------------------------------------------------------------------
def _spec(opts: Options):
    return replace(get_spec("llama-tiny"), name="llama-bench", hidden=opts.hidden, ffn=opts.ffn,
                   layers=opts.layers, vocab=opts.vocab)


def _model(opts: Options) -> nn.Module:
    return build_model(_spec(opts), seed=0)


def _batch(opts: Options) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, opts.vocab, (opts.batch, opts.seq), generator=gen)  # (B, T)
    return ids, ids.clone()


def _adamw(opts: Options) -> Callable:
    return functools.partial(torch.optim.AdamW, lr=opts.lr)


def _eager_step(model: nn.Module, opt: torch.optim.Optimizer, ids: Tensor, labels: Tensor, *,
                bf16: bool = False) -> None:
    """The plain training step: HF loss, backward, optimizer step (every baseline but pp);
    bf16: the forward under torch.autocast(bfloat16) on the ids' device, as torch's AMP recipe runs it."""
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=bf16):
        loss = model(ids, labels=labels).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _autoshard(opts: Options, ids: Tensor, plan: dict, device: str = "cpu") -> Callable[[], None]:
    dm = autoshard.parallelize(_model(opts), ids, plan=plan, global_batch=opts.batch, optimizer=_adamw(opts),
                               device=device)
    labels = ids.clone()
    return lambda: dm.train_step(ids, labels)


# -- timing ------------------------------------------------------------------------------------
def _time_pair(base: Callable[[], None], cand: Callable[[], None], opts: Options) -> tuple[tuple, tuple]:
    """Run both `warmup` times, then `steps` alternating repetitions; seconds of each on rank 0."""
    for _ in range(opts.warmup):
        base()
        cand()
    clock = time.perf_counter if opts.clock == "wall" else time.process_time
    times: dict[int, list[float]] = {0: [], 1: []}
    for rep in range(opts.steps):
        order = (0, 1) if rep % 2 == 0 else (1, 0)
        for which in order:
            dist.barrier()
            start = clock()
            (base, cand)[which]()
            if opts.device == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            times[which].append(clock() - start)
    return tuple(times[0]), tuple(times[1])


# -- comparisons (each runs on every rank of its world) ----------------------------------------
def compare_ws1(rank: int, world: int, opts: Options) -> list[Timing]:
    ids, labels = _batch(opts)
    model = _model(opts)
    opt = _adamw(opts)(model.parameters())
    eager = functools.partial(_eager_step, model, opt, ids, labels)
    out = []
    for label, plan in (("plan=dict(micro_batch=B)", dict(micro_batch=opts.batch)), ("plan=dict()", {})):
        base, cand = _time_pair(eager, _autoshard(opts, ids, plan), opts)
        out.append(Timing(name="ws1", baseline="eager HF", candidate=label, base_s=base, cand_s=cand))
    return out


def compare_bf16(rank: int, world: int, opts: Options) -> list[Timing]:
    ids, labels = (t.to(opts.device) for t in _batch(opts))
    model = _model(opts).to(opts.device)
    eager = functools.partial(_eager_step, model, _adamw(opts)(model.parameters()), ids, labels, bf16=True)
    cand = _autoshard(opts, ids, dict(micro_batch=opts.batch, precision="bf16-mixed"), device=opts.device)
    base, cand = _time_pair(eager, cand, opts)
    return [Timing(name="bf16", baseline="eager HF under torch.autocast(bf16)",
                   candidate='plan=dict(micro_batch=B, precision="bf16-mixed")', base_s=base, cand_s=cand)]


def compare_dp2(rank: int, world: int, opts: Options) -> list[Timing]:
    ids, labels = _batch(opts)
    rows = slice(rank * opts.batch // world, (rank + 1) * opts.batch // world)
    ddp = DistributedDataParallel(_model(opts))
    opt = _adamw(opts)(ddp.parameters())
    base = functools.partial(_eager_step, ddp, opt, ids[rows], labels[rows])
    cand = _autoshard(opts, ids, dict(dp=world, micro_batch=opts.batch // world))
    b, c = _time_pair(base, cand, opts)
    return [Timing(name="dp2", baseline="DistributedDataParallel", candidate="plan=dict(dp=2)", base_s=b, cand_s=c)]


def compare_tp2(rank: int, world: int, opts: Options) -> list[Timing]:
    ids, labels = _batch(opts)
    model = _model(opts)
    layout = {}
    for i in range(opts.layers):
        layer = f"model.layers.{i}"
        layout.update({f"{layer}.self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")})
        layout.update({f"{layer}.mlp.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj")})
        layout.update({f"{layer}.self_attn.o_proj": RowwiseParallel(), f"{layer}.mlp.down_proj": RowwiseParallel()})
    parallelize_module(model, init_device_mesh("cpu", (world,)), layout)
    # DTensor and plain parameters cannot share one foreach kernel: one group each
    dtensors = [p for p in model.parameters() if isinstance(p, DTensor)]
    plain = [p for p in model.parameters() if not isinstance(p, DTensor)]
    opt = torch.optim.AdamW([dict(params=dtensors), dict(params=plain)], lr=opts.lr)
    base = functools.partial(_eager_step, model, opt, ids, labels)
    cand = _autoshard(opts, ids, dict(tp=world, micro_batch=opts.batch))
    b, c = _time_pair(base, cand, opts)
    return [Timing(name="tp2", baseline="parallelize_module Colwise/Rowwise", candidate="plan=dict(tp=2)",
                   base_s=b, cand_s=c)]


class HandStage(nn.Module):
    """LLaMA layers [first, end) of `model` (shared modules), with the embedding / norm and head
    when first / last: the stage a user of torch.distributed.pipelining writes by hand."""

    def __init__(self, model: nn.Module, first: int, end: int, *, embed: bool, head: bool):
        super().__init__()
        body = model.model
        self.embed = body.embed_tokens if embed else None
        self.layers = nn.ModuleList(list(body.layers)[first:end])
        self.rotary = body.rotary_emb
        self.norm = body.norm if head else None
        self.lm_head = model.lm_head if head else None

    def forward(self, x: Tensor) -> Tensor:
        hidden = self.embed(x) if self.embed is not None else x  # (b, s, h)
        positions = torch.arange(hidden.shape[1], device=hidden.device)[None]  # (1, s)
        rope = self.rotary(hidden, position_ids=positions)
        for layer in self.layers:  # attention_mask None: sdpa runs causal
            hidden = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=rope)
        return self.lm_head(self.norm(hidden)) if self.lm_head is not None else hidden  # (b, s, V)


def _shifted_ce(logits: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())


def compare_pp2(rank: int, world: int, opts: Options) -> list[Timing]:
    ids, labels = _batch(opts)
    split = even_stages(opts.layers, world)[rank]  # the split autoshard runs too
    model = _model(opts)
    module = HandStage(model, split.first_layer, split.end_layer, embed=split.embed, head=split.head)
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    schedule = Schedule1F1B(stage, opts.batch // opts.pp_micro, loss_fn=_shifted_ce)
    opt = _adamw(opts)(module.parameters())

    def base() -> None:
        if split.embed:
            schedule.step(ids)
        else:
            schedule.step(target=labels, losses=[])
        opt.step()
        opt.zero_grad(set_to_none=True)

    cand = _autoshard(opts, ids, dict(pp=world, micro_batch=opts.pp_micro))
    b, c = _time_pair(base, cand, opts)
    return [Timing(name="pp2", baseline="pipelining by hand (1F1B)", candidate="plan=dict(pp=2)",
                   base_s=b, cand_s=c)]


COMPARE = {"ws1": compare_ws1, "bf16": compare_bf16, "dp2": compare_dp2, "tp2": compare_tp2, "pp2": compare_pp2}


# -- processes ---------------------------------------------------------------------------------
def _worker(rank: int, world: int, store: str, which: tuple[str, ...], opts: Options, out: str) -> None:
    os.environ.pop("WORLD_SIZE", None)
    torch.set_num_threads(opts.threads)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        timings = [t for name in which for t in COMPARE[name](rank, world, opts)]
        if rank == 0:
            with open(out, "w") as f:
                json.dump([asdict(t) for t in timings], f)
    finally:
        dist.destroy_process_group()


def run_world(which: tuple[str, ...], world: int, opts: Options) -> list[Timing]:
    """Spawn `world` ranks once, run every comparison of `which` in them; rank 0's timings."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "timings.json")
        mp.spawn(_worker, args=(world, os.path.join(tmp, "store"), which, opts, out), nprocs=world, join=True)
        with open(out) as f:
            return [Timing(**{**t, "base_s": tuple(t["base_s"]), "cand_s": tuple(t["cand_s"])})
                    for t in json.load(f)]


def run_local(which: tuple[str, ...], opts: Options) -> list[Timing]:
    """ws1 / bf16 in this process, as a world of one (a plain `python` run of a training script)."""
    torch.set_num_threads(opts.threads)
    backend = "cpu:gloo,cuda:nccl" if opts.device == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        return [t for name in which for t in COMPARE[name](0, 1, opts)]
    finally:
        dist.destroy_process_group()


def format_table(timings: list[Timing]) -> str:
    head = ("bench", "baseline", "autoshard", "base ms", "auto ms", "ratio", "paired p25 / p50 / p75")
    rows = [head]
    for t in timings:
        q = t.paired_quartiles()
        rows.append((t.name, t.baseline, t.candidate, f"{1e3 * statistics.median(t.base_s):.1f}",
                     f"{1e3 * statistics.median(t.cand_s):.1f}", f"{t.ratio:.3f}", " / ".join(f"{x:.3f}" for x in q)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def parse_args(argv=None) -> tuple[tuple[str, ...], Options]:
    d = Options()
    p = argparse.ArgumentParser(
        description="Time autoshard's training step against PyTorch's own parallelism on the same LLaMA "
                    "model and batch (gloo, CPU) and print median-time ratios autoshard / baseline "
                    "(> 1: autoshard slower). Baseline and autoshard repetitions are interleaved.",
        epilog="ws1: eager HF vs plan=dict() (world of one; also plan=dict(micro_batch=B)); bf16: eager HF under "
               "torch.autocast(bfloat16) vs plan=dict(micro_batch=B, precision='bf16-mixed') (world of one); dp2: "
               "DistributedDataParallel vs dp=2; tp2: parallelize_module(ColwiseParallel/RowwiseParallel) "
               "vs tp=2; pp2: torch.distributed.pipelining by hand (Schedule1F1B) vs pp=2.")
    p.add_argument("--which", default=",".join(COMPARISONS),
                   help=f"comma-separated comparisons among {', '.join(COMPARISONS)} (default: all)")
    p.add_argument("--steps", type=int, default=d.steps, help="timed repetitions of each side (default %(default)s)")
    p.add_argument("--warmup", type=int, default=d.warmup,
                   help="untimed steps of each side first (default %(default)s)")
    p.add_argument("--hidden", type=int, default=d.hidden, help="model width (default %(default)s)")
    p.add_argument("--ffn", type=int, default=d.ffn, help="MLP width (default %(default)s)")
    p.add_argument("--layers", type=int, default=d.layers, help="decoder layers (default %(default)s)")
    p.add_argument("--vocab", type=int, default=d.vocab, help="vocabulary size (default %(default)s)")
    p.add_argument("--seq", type=int, default=d.seq, help="sequence length (default %(default)s)")
    p.add_argument("--batch", type=int, default=d.batch, help="global batch, sequences (default %(default)s)")
    p.add_argument("--pp-micro", type=int, default=d.pp_micro,
                   help="sequences per pipeline micro-batch, both sides of pp2 (default %(default)s)")
    p.add_argument("--threads", type=int, default=d.threads,
                   help="torch intra-op threads per rank (default %(default)s)")
    p.add_argument("--clock", choices=("wall", "cpu"), default=d.clock,
                   help="wall: elapsed time of a step between barriers, slowest rank included (default); cpu: "
                        "rank 0's process CPU time, steadier on a loaded machine but blind to waiting "
                        "(communication, pipeline bubbles), so meant for ws1")
    p.add_argument("--device", choices=("cpu", "cuda"), default=d.device,
                   help="device of the bf16 comparison (world of one; default %(default)s)")
    a = p.parse_args(argv)
    which = tuple(w.strip() for w in a.which.split(",") if w.strip())
    unknown = [w for w in which if w not in COMPARISONS]
    if unknown:
        p.error(f"unknown comparison(s) {unknown}; choose among {', '.join(COMPARISONS)}")
    if a.batch % 2 or a.batch % a.pp_micro:
        p.error(f"--batch ({a.batch}) must be even and divisible by --pp-micro ({a.pp_micro})")
    opts = Options(steps=a.steps, warmup=a.warmup, hidden=a.hidden, ffn=a.ffn, layers=a.layers, vocab=a.vocab,
                   seq=a.seq, batch=a.batch, pp_micro=a.pp_micro, threads=a.threads,
                   clock=a.clock, device=a.device)
    return which, opts


def main(argv=None) -> None:
    which, opts = parse_args(argv)
    print(f"llama: hidden {opts.hidden}, ffn {opts.ffn}, {opts.layers} layers, vocab {opts.vocab}, "
          f"seq {opts.seq}, batch {opts.batch}; {opts.warmup} warm-up + {opts.steps} timed steps each side, "
          f"{opts.threads} thread(s) per rank, {opts.clock} clock", flush=True)
    timings = []
    start = time.perf_counter()
    local = tuple(w for w in which if w in LOCAL)
    if local:
        timings.extend(run_local(local, opts))
        print(f"  {', '.join(local)} done after {time.perf_counter() - start:.0f} s", flush=True)
    spawned = tuple(w for w in which if w not in LOCAL)
    if spawned:  # one world of 2 runs every 2-rank comparison (start-up costs seconds)
        timings.extend(run_world(spawned, 2, opts))
        print(f"  {', '.join(spawned)} done after {time.perf_counter() - start:.0f} s", flush=True)
    print(format_table(timings))


if __name__ == "__main__":
    main()
