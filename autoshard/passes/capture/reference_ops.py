"""The real backward of an op substituted at capture (passes/capture/selective_scan.py, gated_delta_rule.py), from
its reference forward: `reference_grads(forward, inputs, dout)`, the gradient of each input by torch.func's vjp."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def reference_grads(forward: Callable[..., Tensor], inputs: tuple[Tensor | None, ...], dout: Tensor) -> list[Tensor]:
    """The gradient of `forward(*inputs)` against `dout` for each input, in its dtype (an empty tensor where an
    input is None): the real backward kernel of a substituted op, from its reference forward."""
    present = [i for i, t in enumerate(inputs) if t is not None]

    def given(*tensors):
        full = list(inputs)
        for i, t in zip(present, tensors):
            full[i] = t
        return forward(*full)

    _, vjp = torch.func.vjp(given, *(inputs[i] for i in present))
    grads = dict(zip(present, vjp(dout.float())))
    empty = inputs[present[0]].new_empty(0)
    return [grads[i].to(t.dtype) if t is not None else empty for i, t in enumerate(inputs)]
