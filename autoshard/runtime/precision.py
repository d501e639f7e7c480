"""Mixed precision of the training step: `bf16-mixed` is Megatron-LM's layout (ZeRO-3: FSDP2's).

Contract: `autocast(precision, device)` is the context every forward of the runtime runs under
(the single-stage step, each pipeline chunk, the evaluation forward); `precision` is the plan's,
already resolved for the device (`Precision.resolve`). Under `Precision.BF16_MIXED` the state a
rank keeps is the one the cost model prices (passes/cost/precision.py; measured against
`passes/cost/state.state_bytes` by tests/runtime/test_state_bytes.py).

The whole contract: docs/modules/runtime.md (runtime/precision.py).
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
