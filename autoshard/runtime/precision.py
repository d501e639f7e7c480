"""Mixed precision of the training step: `bf16-mixed` is torch.autocast over fp32 parameters.

Contract: `autocast(precision, device)` is the context every forward of the runtime runs under
(the single-stage step, each pipeline chunk, the evaluation forward); `precision` is the plan's,
already resolved for the device (`Precision.resolve`). Under `Precision.BF16_MIXED`:

* the parameters stay fp32 (they are the master weights); autocast casts each weight to bf16
  where a matmul-class op reads it (linear, matmul, bmm, conv1d: torch's autocast op lists),
  so GEMMs run and their outputs (activations) are bf16; ops autocast keeps in fp32 (softmax,
  norms' variance, the loss) and HF's own upcasts stay fp32; the residual stream of a LLaMA /
  Mamba-2 block is the sum of an fp32 input and a bf16 output, so it stays fp32 (as in any
  torch AMP run);
* backward follows the recorded dtypes: a weight's gradient is the fp32 gradient of the cast,
  so `.grad` is fp32, gradient accumulation over micro-batches is fp32, the data-parallel
  all-reduce / ZeRO reduce-scatter (runtime/data_parallel.py) move fp32 buckets, and the
  optimizer (or ZeRO's sharded optimizer) steps the fp32 parameters;
* tensor-parallel collectives in forward (the row-parallel all-reduce, the vocab-parallel
  cross-entropy runs on `logits.float()`) and pipeline sends carry whatever dtype the op
  produced (bf16 GEMM outputs), as Megatron's do.

This is Lightning's "bf16-mixed" (torch AMP). Megatron's alternative, bf16 parameters with fp32
main gradients and fp32 master copies in the optimizer, saves 2 bytes per parameter of weights
but changes the dtype every runtime piece sees (grad buckets, ZeRO shards, TP slices, pipeline
stages, the checks); autocast leaves all of them fp32 and so composes with DP, ZeRO-1/2, TP, PP
and CP unchanged. Memory it keeps: fp32 weights (4 B/param) + fp32 gradients (4 B) + the bf16
weight copies autocast caches for the forward and backward of a step (2 B per parameter of the
running model chunk) + optimizer state; activations saved for backward are bf16 where a GEMM
produced them.

`Precision.FP32` is a no-op context: bit-for-bit the fp32 step.
"""

from __future__ import annotations

import contextlib

import torch

from autoshard.ir import Precision


def autocast(precision: Precision, device: torch.device | str):
    """The context a forward runs under: bf16 autocast for bf16-mixed, nothing for fp32."""
    if precision is Precision.AUTO:
        raise ValueError("resolve the plan's precision for the device first (Precision.resolve)")
    if precision is Precision.FP32:
        return contextlib.nullcontext()
    kind = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    return torch.autocast(kind, dtype=torch.bfloat16)


class Autocast(torch.nn.Module):
    """`module` whose forward runs under `autocast(precision, device)` (a pipeline stage's module).

    It registers `module` as its only child, so its parameters are the module's, same objects."""

    def __init__(self, module: torch.nn.Module, precision: Precision, device: torch.device | str) -> None:
        super().__init__()
        self.module = module
        self.precision = precision
        self.device = device

    def forward(self, *args, **kwargs):
        with autocast(self.precision, self.device):
            return self.module(*args, **kwargs)
