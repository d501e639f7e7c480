"""Model fingerprints: a short hash of a model's structure and parameter shapes.

A plan is only valid for the model it was solved for. `fingerprint_module(model)` hashes the
module tree (each submodule's path and class) and every parameter's name, shape and dtype;
no weights are read, so a model on the meta device gives the same fingerprint as the same
model on CPU. The runtime compares it with `Plan.fingerprint` when it loads a plan.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a preset's fingerprint ships in the package: reading it needs no torch
    from torch import nn


def fingerprint_module(model: nn.Module) -> str:
    """16 hex digits identifying the module tree and the parameter shapes of `model`."""
    h = hashlib.sha256()
    for path, module in model.named_modules():
        h.update(f"m {path} {type(module).__name__}\n".encode())
    for name, p in model.named_parameters():
        h.update(f"p {name} {tuple(p.shape)} {p.dtype}\n".encode())
    return h.hexdigest()[:16]


def check_plan_matches(plan, *, fingerprint: str, devices: int, source: str = "the plan") -> None:
    """Refuse a plan made for another model or world size (PlanFileError naming both sides)."""
    from autoshard.errors import PlanFileError

    if not plan.fingerprint.strip():
        raise PlanFileError(f"{source} has a blank fingerprint, so nothing tells which model it was made for "
                            f"(it names {plan.model!r}); re-export it with `autoshard plan ... --out`, or pass "
                            "plan=dict(dp=..., tp=..., ...) to run a layout without a plan file")
    problems = []
    if plan.fingerprint != fingerprint:
        problems.append(f"it was made for another model ({plan.model}, fingerprint {plan.fingerprint}; this "
                        f"model's is {fingerprint})")
    if plan.devices != devices:
        problems.append(f"it was made for {plan.devices} devices, this run has {devices}")
    if problems:
        raise PlanFileError(f"{source} does not fit this run: {'; '.join(problems)}; make a new plan with "
                            "`autoshard plan` for this model and device count")
