"""Measuring what a training step keeps alive, to check the cost model's memory against what runs.

Contract: `saved_activation_bytes(model, ids)` runs one forward + backward of `model` on `ids`
(labels = ids) and returns the bytes of the distinct non-parameter storages autograd saved in the
forward for the backward (what stays alive until backward; backward's own recomputation is
transient). The priced counterpart is `cost_table.CostTable.saved_bytes(batch, seq)`.
"""

from __future__ import annotations

import torch


def saved_activation_bytes(model: torch.nn.Module, ids: torch.Tensor) -> int:
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()} | {ids.untyped_storage().data_ptr()}
    storages: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, labels=ids).loss
    loss.backward()  # runs: the saved tensors were enough
    model.zero_grad(set_to_none=True)
    return sum(storages.values())
