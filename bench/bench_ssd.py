"""Memory-efficient chunked SSD (runtime/ssd.py) against HF's PyTorch fallback, on this machine's CPU.

One training step (forward + backward, HF loss) of a Mamba-2 model, both ways, in the same run:

* time: median of `--repeat` steps (after one warm-up), ours over HF's;
* saved activations: bytes of the distinct non-parameter storages autograd keeps from forward to
  backward (`torch.autograd.graph.saved_tensors_hooks`), ours over HF's, next to what the cost
  model prices for each (`build_cost_table` with and without the `ssd_chunk_scan` kernel);
* peak: the largest sum of live saved storages plus the step's transient tensors is not
  observable on CPU without an allocator hook, so the saved bytes stand for the activation peak
  (the backward's transient recomputation is one layer's chunk-local tensors at a time).

Usage: python bench/bench_ssd.py [--hidden 512] [--layers 4] [--seq 1024] [--batch 2] [--repeat 3]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

from autoshard.model_spec import Mixer, ModelSpec
from autoshard.models.presets import build_model
from autoshard.passes.capture.shapes import build_cost_table
from autoshard.runtime.ssd import install_ssd_mixers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.runtime.measure import saved_activation_bytes  # noqa: E402


def step_time(model, ids, repeat: int) -> float:
    times = []
    for i in range(repeat + 1):
        t0 = time.perf_counter()
        model(ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def priced(spec, seq, batch, kernels) -> float:
    return build_cost_table(spec, dtype=torch.float32, kernels=kernels).saved_bytes(batch, seq)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    spec = ModelSpec(name="mamba2-bench", mixer=Mixer.SSD, vocab=4096, hidden=args.hidden, layers=args.layers,
                     tied=True, state=64, expand=2, head_dim=64, heads=2 * args.hidden // 64, groups=1, conv=4,
                     chunk=128)
    hf = build_model(spec, seed=0)
    ours = copy.deepcopy(hf)
    install_ssd_mixers(ours)
    ids = torch.randint(0, spec.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    t_hf, t_ours = step_time(hf, ids, args.repeat), step_time(ours, ids, args.repeat)
    m_hf, m_ours = saved_activation_bytes(hf, ids), saved_activation_bytes(ours, ids)
    p_hf, p_ours = priced(spec, args.seq, args.batch, ()), priced(spec, args.seq, args.batch, None)
    print(f"{spec.name}: hidden {spec.hidden}, {spec.layers} layers, {spec.heads} heads x {spec.head_dim}, "
          f"state {spec.state}, chunk {spec.chunk}, batch {args.batch} x seq {args.seq}, fp32, "
          f"{torch.get_num_threads()} threads")
    print(f"{'':22}{'HF fallback':>14}{'runtime/ssd.py':>16}{'ratio':>8}")
    print(f"{'step time (s)':22}{t_hf:>14.3f}{t_ours:>16.3f}{t_ours / t_hf:>8.2f}")
    print(f"{'saved, measured (MiB)':22}{m_hf / 2**20:>14.1f}{m_ours / 2**20:>16.1f}{m_ours / m_hf:>8.2f}")
    print(f"{'saved, priced (MiB)':22}{p_hf / 2**20:>14.1f}{p_ours / 2**20:>16.1f}{p_ours / p_hf:>8.2f}")


if __name__ == "__main__":
    main()
