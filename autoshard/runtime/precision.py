"""Mixed precision of the training step: `bf16-mixed` is Megatron-LM's layout (ZeRO-3: FSDP2's).

Contract: `autocast(precision, device)` is the context every forward of the runtime runs under
(the single-stage step, each pipeline chunk, the evaluation forward); `precision` is the plan's,
already resolved for the device (`Precision.resolve`). Under `Precision.BF16_MIXED` the state a
rank keeps is the one the cost model prices (passes/cost/precision.py; measured against
`passes/cost/state.state_bytes` by tests/runtime/test_state_bytes.py):

* ZeRO 0, 1, 2 (runtime/dist_model.py, runtime/data_parallel.py; Megatron-LM's DDP `main_grad`
  and distributed optimizer): the model's parameters are bf16 (2 B/param; buffers such as RoPE's
  inv_freq stay as HF keeps them). Each parameter has an fp32 main gradient: a hook after each
  micro-batch's backward adds `.grad` into it in fp32 and drops `.grad` (4 B/param, views of one
  flat buffer per gradient bucket; under ZeRO-2 only the reduced fp32 slices are kept, 4 B / dp).
  The data-parallel all-reduce / ZeRO reduce-scatter move the fp32 main gradients. The
  optimizer steps fp32 master weights held by `ShardedOptimizer`: this rank's slice of every
  bucket under ZeRO-1/2, every bucket whole under ZeRO 0; with Adam 4 + 8 B per parameter,
  sharded over dp x cp under ZeRO-1/2. After the step the masters are cast to bf16 and
  all-gathered (bf16) into the parameters. Checkpoints and `full_state_dict` read the masters.
* ZeRO-3 (runtime/zero3.py, torchtitan's layout): FSDP2 keeps the parameters as fp32 shards (the
  masters), their fp32 gradient shards and Adam's fp32 state, (4 + 4 + 8) B / dp; its
  `MixedPrecisionPolicy` all-gathers each block in bf16 and reduce-scatters gradients in fp32.
* Forward: GEMMs read bf16 weights and produce bf16 activations, so the residual stream,
  tensor-parallel collectives and pipeline sends are bf16; autocast keeps the ops it lists as fp32
  in fp32 (softmax, ...), HF upcasts its norms' variance itself, and the loss runs on
  `logits.float()` (runtime/loss.py). Backward follows the recorded dtypes (bf16 `.grad`, summed
  in fp32 from there on).

Activations saved for backward are bf16 where a GEMM produced them. Memory per parameter
(ZeRO 0): 2 + 4 + 12 = 18 B, as the ZeRO paper's mixed-precision accounting (arXiv 1910.02054
sec. 3.1, K = 12). Torch AMP's alternative (autocast over fp32 parameters) keeps fp32 weights
and gradients plus the bf16 weight copies autocast caches: ~4 B/param more than this.

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
