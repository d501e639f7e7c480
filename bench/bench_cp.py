"""Context parallelism on this machine: attention time per rank and communication volume per step.

1. Attention (LLaMA, GQA): forward + backward of causal attention over a long sequence. cp1 is
   torch SDPA (is_causal) on the whole sequence, as HF's sdpa path runs it. For cp2 and cp4 each
   rank's share (`local_causal_attention`: its two query chunks against the key prefixes they see)
   is timed on its own, one rank after the other in this process, so the ranks do not compete for
   this machine's cores; the figure is the slowest rank (the step waits for it) over cp1.
   The K/V all-gather is not in these times: its volume is part 2.
2. Communication per training step: `autoshard.parallelize(..., plan=dict(cp=N))` runs one
   train_step of the tiny LLaMA, Mamba-2, Mamba-1 and three hybrids (Jamba: Mamba-1, attention, MoE;
   Bamba: Mamba-2 and attention; LFM2: short convolutions and attention; Qwen3-Next: gated DeltaNet, attention,
   MoE; all bf16-mixed) on N gloo
   processes while every CP all-gather
   is counted (forward output bytes; backward reduce-scatter input bytes from a gradient hook).
   Per-device volume = (N-1)/N of each buffer (ring / pairwise). The prediction is
   `passes.cost.block_time(...).cp_comm_s` on a unit device profile (1 byte/s, ~0 latency), so
   its seconds read as bytes: the cost model's own CP terms, layers x micro-batches (a mixed stack:
   each layer kind's own terms x its layers).

Usage: python bench/bench_cp.py [--seq 4096] [--heads 16] [--kv-heads 4] [--step-seq 256]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tiny models of tests/models

# presets, and tiny HF models by factory (tests/models): Mamba-1, and hybrids of each state-passing mixer
STEP_MODELS = ("llama-tiny", "mamba2-tiny", "tests.models.mamba1_models:mamba_tiny", "jamba", "bamba", "lfm2",
               "qwen3_next")


def _time(fn, repeat: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def attention_times(seq: int, heads: int, kv_heads: int, head_dim: int, repeat: int) -> dict[int, list[float]]:
    from autoshard.runtime.cp_sequence import SeqLayout, gathered_order, sequence_positions
    from autoshard.runtime.cp_attention import local_causal_attention

    torch.manual_seed(0)
    q = torch.randn(1, heads, seq, head_dim)
    kv = torch.randn(1, kv_heads, seq, 2 * head_dim)  # K then V along the features (cp_attention.py)

    def full():
        q_ = q.clone().requires_grad_()
        k_, v_ = (t.clone().requires_grad_() for t in kv.split(head_dim, dim=-1))
        F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, enable_gqa=True).sum().backward()

    out = {1: [_time(full, repeat)]}
    for cp in (2, 4):
        out[cp] = []
        for rank in range(cp):
            idx = sequence_positions(seq, cp, rank, SeqLayout.BALANCED)
            q_local = q.index_select(2, idx)
            assert gathered_order(seq, cp, SeqLayout.BALANCED).numel() == seq

            def share(q_local=q_local, rank=rank, cp=cp):
                q_ = q_local.clone().requires_grad_()
                kv_ = kv.clone().requires_grad_()
                local_causal_attention(q_, kv_, rank=rank, cp=cp).sum().backward()

            out[cp].append(_time(share, repeat))
    return out


# -- communication volume -------------------------------------------------------------------

def _counting(counter: dict):
    import autoshard.runtime.cp_attention as attn
    import autoshard.runtime.cp_delta as delta
    import autoshard.runtime.cp_mamba as mamba
    from autoshard.runtime.cp_sequence import all_gather_autograd

    def gather(x, ctx, *, dim=0):
        out = all_gather_autograd(x, ctx, dim=dim)
        counter["fwd"] += out.numel() * out.element_size()
        if out.requires_grad:
            out.register_hook(lambda g: counter.__setitem__("bwd", counter["bwd"] + g.numel() * g.element_size()))
        return out

    # (cp_scan and cp_conv gather through cp_mamba's functions)
    attn.all_gather_autograd = mamba.all_gather_autograd = delta.all_gather_autograd = gather


def _model(name: str):
    """(vocab, a fresh model) of a preset, a factory, or a tiny hybrid of tests/models/hybrid_models.py."""
    from autoshard.models.presets import build_model, get_spec, resolve_model

    if ":" in name:
        model = resolve_model(name, device="cpu")[1]
    elif name in ("llama-tiny", "mamba2-tiny"):
        model = build_model(get_spec(name), seed=0)
    else:
        from tests.models import hybrid_models

        model = hybrid_models.build(name)
    return model.config.vocab_size, model


def _step_worker(rank: int, world: int, port: int, seq: int, batch: int, results: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.pop("WORLD_SIZE", None)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        import autoshard

        counter = {"fwd": 0, "bwd": 0}
        _counting(counter)
        lines = []
        for name in STEP_MODELS:
            torch.manual_seed(0)
            vocab, model = _model(name)
            ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
            dm = autoshard.parallelize(model, ids, plan=dict(cp=world, precision="bf16-mixed"), global_batch=batch)
            counter.update(fwd=0, bwd=0)
            start = time.perf_counter()
            dm.train_step(ids, ids)
            lines.append(f"{name} {counter['fwd']} {counter['bwd']} {time.perf_counter() - start:.3f}")
        if rank == 0:
            with open(results, "w") as f:
                f.write("\n".join(lines))
    finally:
        dist.destroy_process_group()


def measured_volume(world: int, seq: int, batch: int) -> dict[str, tuple[int, int, float]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out")
        mp.spawn(_step_worker, args=(world, port, seq, batch, path), nprocs=world, join=True)
        rows = [line.split() for line in open(path).read().splitlines()]
    return {r[0]: (int(r[1]), int(r[2]), float(r[3])) for r in rows}


def predicted_volume(name: str, cp: int, seq: int, batch: int) -> float:
    """Per-device bytes of CP collectives in one step, from the cost model's own CP terms."""
    from autoshard.hardware import load_hardware
    from autoshard.ir import BlockKind, Mesh
    from autoshard.commands.common import cost_table_for
    from autoshard.passes.cost.block import block_time
    from autoshard.passes.cost.compiled import compile_table
    from autoshard.passes.cost.layout import Layout

    spec, table = cost_table_for(name if name in STEP_MODELS[:3] else f"tests.models.hybrid_models:{name}_tiny",
                                 spinner=False)
    unit = dataclasses.replace(load_hardware("cpu"), intra_bandwidth=1.0, inter_bandwidth=1.0,
                               intra_latency=1e-30, inter_latency=1e-30)
    ct = compile_table(table, spec)
    layout = Layout(mesh=Mesh(cp=cp), micro_batch=batch, precision="bf16-mixed")
    kinds = ct.kinds or (ct,)  # a mixed stack: each kind's own terms, times its layers
    counts = [list(ct.layer_kinds).count(i) for i in range(len(kinds))] if ct.kinds else [spec.layers]
    return sum(block_time(view, unit, layout, BlockKind.LAYER, seq_len=seq).cp_comm_s * n
               for view, n in zip(kinds, counts))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096, help="sequence length of the attention timing")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--step-seq", type=int, default=256, help="sequence length of the train steps")
    parser.add_argument("--step-batch", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    print(f"attention fwd+bwd, seq {args.seq}, heads {args.heads}, kv heads {args.kv_heads}, head dim "
          f"{args.head_dim}, 1 thread, best of {args.repeat}")
    times = attention_times(args.seq, args.heads, args.kv_heads, args.head_dim, args.repeat)
    base = times[1][0]
    print(f"  cp1  {base * 1e3:9.1f} ms  (torch SDPA, is_causal)")
    for cp in (2, 4):
        per = times[cp]
        print(f"  cp{cp}  {max(per) * 1e3:9.1f} ms  slowest rank = {max(per) / base:.3f} x cp1 "
              f"(ideal {1 / cp:.3f}); ranks: " + " ".join(f"{t * 1e3:.1f}" for t in per))

    print(f"\nCP communication per train_step, bf16-mixed, batch {args.step_batch}, seq {args.step_seq} "
          "(per device: (N-1)/N of every gathered buffer, fwd all-gather + bwd reduce-scatter)")
    for cp in (2, 4):
        measured = measured_volume(cp, args.step_seq, args.step_batch)
        for name, (fwd, bwd, secs) in measured.items():
            per_device = (fwd + bwd) * (cp - 1) / cp
            predicted = predicted_volume(name, cp, args.step_seq, args.step_batch)
            print(f"  cp{cp} {name.rpartition(':')[2]:12s} buffers fwd {fwd:>9d} B  bwd {bwd:>9d} B  per device {per_device:>11.0f} B  "
                  f"cost model {predicted:>11.0f} B  ratio {per_device / predicted:.3f}  (step {secs:.2f} s)")


if __name__ == "__main__":
    sys.exit(main())
