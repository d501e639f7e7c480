"""Mamba-2's SSD scan on a CUDA device: mamba_ssm's fused kernel against autoshard's torch scan.

What `runtime/ssd.py` `ssd_scan` runs on CUDA where mamba_ssm is installed is its Triton
`mamba_chunk_scan_combined`; elsewhere, and in this script as the reference, the torch Function
`_SSDScan`. Two checks, one JSON:

* agreement: the output and every input gradient of both, in float32, on a length that is not a
  multiple of the chunk, with the even grouping (head i reads group i // (h / g)) and with an uneven
  one (what tensor parallelism leaves when it keeps the groups whole: B, C gathered per head);
  printed as the largest error relative to the largest reference value;
* speed: forward + backward of one Mamba-2 layer's scan at a preset's shapes, CUDA events, the
  kernel with bf16 inputs (what autocast hands it) and the torch scan, and the kernel's FLOP rate
  by `passes/capture/kernels.py` `ssd_cost` (what the cost model prices).

Usage (on a CUDA machine with mamba_ssm): python bench/bench_ssd_kernel.py [--model mamba2-1b]
    [--batch 1,4] [--seq 2048] [--out ssd_kernel.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from autoshard.models.presets import get_spec  # noqa: E402
from autoshard.passes.capture.kernels import ssd_cost  # noqa: E402
from autoshard.runtime.ssd import _SSDScan, _mamba_ssm_scan  # noqa: E402


def _inputs(b, L, h, p, g, n, dtype, device, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*shape, scale=1.0, dtype=dtype):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype).requires_grad_()

    return dict(x=rand(b, L, h, p), dt=rand(b, L, h, scale=0.5), A=(-torch.rand(h, generator=gen) - 0.5).to(device)
                .requires_grad_(), B=rand(b, L, g, n, scale=0.5), C=rand(b, L, g, n, scale=0.5),
                D=rand(h, dtype=torch.float32), dt_bias=rand(h, scale=0.5, dtype=torch.float32))  # fp32 parameters


def _torch_scan(t, chunk, head_group):
    return _SSDScan.apply(t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"], t["dt_bias"], head_group, chunk,
                          (0.0, float("inf")), False)


def _kernel_scan(kernel, t, chunk, head_group):
    B, C = t["B"], t["C"]
    if head_group is not None:
        B, C = B.index_select(2, head_group), C.index_select(2, head_group)
    return kernel(t["x"], t["dt"], t["A"], B, C, chunk, D=t["D"], dt_bias=t["dt_bias"], dt_softplus=True,
                  dt_limit=(0.0, float("inf")))


def agreement(kernel, device) -> list[dict]:
    b, L, h, p, g, n, chunk = 2, 300, 8, 16, 2, 16, 64
    rows = []
    even = torch.arange(h, device=device) // (h // g)
    uneven = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1], device=device)  # tp kept the groups whole: offset heads
    for name, group, for_kernel in (("even groups", even, None), ("uneven groups (per head)", uneven, uneven)):
        ref_in, ker_in = _inputs(b, L, h, p, g, n, torch.float32, device), _inputs(b, L, h, p, g, n, torch.float32,
                                                                                   device)
        dy = torch.randn(b, L, h, p, generator=torch.Generator().manual_seed(1)).to(device)
        ref = _torch_scan(ref_in, chunk, group)
        ker = _kernel_scan(kernel, ker_in, chunk, for_kernel)
        (ref * dy).sum().backward()
        (ker * dy).sum().backward()
        errors = {"y": _rel(ker, ref)}
        errors.update({k: _rel(ker_in[k].grad, ref_in[k].grad) for k in ref_in})
        rows.append(dict(case=name, rel_error=errors, worst=max(errors.values())))
        print(f"{name:26s} worst relative error {rows[-1]['worst']:.2e}  " +
              " ".join(f"{k}={v:.1e}" for k, v in errors.items()), flush=True)
    return rows


def _rel(a, b) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _time(fn, repeat=10, warmup=3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeat


def speed(kernel, spec, batches, seq, device) -> list[dict]:
    h, p, g, n, chunk = spec.heads, spec.head_dim, spec.groups, spec.state, spec.chunk
    rows = []
    for b in batches:
        cost = ssd_cost(spec, b, seq)
        flops = cost.fwd_flops + cost.bwd_flops
        row = dict(batch=b, seq=seq, heads=h, head_dim=p, groups=g, state=n, chunk=chunk, priced_flops=flops)
        for name, dtype, run in (("kernel_bf16", torch.bfloat16, lambda t: _kernel_scan(kernel, t, chunk, None)),
                                 ("torch_fp32", torch.float32,
                                  lambda t: _torch_scan(t, chunk, torch.arange(h, device=device) // (h // g)))):
            t = _inputs(b, seq, h, p, g, n, dtype, device)
            dy = torch.randn(b, seq, h, p, device=device, dtype=dtype)

            def step(t=t, dy=dy, run=run):
                y = run(t)
                y.backward(dy)
                for v in t.values():
                    v.grad = None
            try:
                row[f"{name}_s"] = _time(step)
            except torch.OutOfMemoryError as e:
                row[f"{name}_s"] = None
                row[f"{name}_error"] = str(e).splitlines()[0]
        if row.get("kernel_bf16_s"):
            row["kernel_tflops"] = flops / row["kernel_bf16_s"] / 1e12
            if row.get("torch_fp32_s"):
                row["torch_over_kernel"] = row["torch_fp32_s"] / row["kernel_bf16_s"]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="mamba2-1b", help="a Mamba-2 preset whose layer shapes are timed")
    ap.add_argument("--batch", default="1,4", help="comma-separated batch sizes (default %(default)s)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--out", default="ssd_kernel.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_ssd_kernel.py needs a CUDA device")
    kernel = _mamba_ssm_scan()
    if kernel is None:
        sys.exit("mamba_ssm is not importable here (pip install mamba-ssm): nothing to compare")
    device = torch.device("cuda:0")
    result = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, model=args.model)
    result["agreement"] = agreement(kernel, device)
    result["speed"] = speed(kernel, get_spec(args.model), [int(b) for b in args.batch.split(",")], args.seq, device)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
