"""autoshard: an automatic parallelization compiler for PyTorch training.

Public names only; see DESIGN.md for the contract. `parallelize`, `backend` and `DistributedModel`
are loaded on first use (module `__getattr__`): they need torch, and `autoshard plan` of a preset
whose cost table ships in the package needs neither torch nor transformers
(tests/test_cli_imports.py).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from autoshard.errors import (
    AutoshardError,
    CaptureError,
    CheckpointError,
    InfeasiblePlanError,
    InvalidConfigError,
    PlanFileError,
    UnsupportedOpError,
)
from autoshard.ir import Mesh, Plan, Recompute, Stage

if TYPE_CHECKING:
    from autoshard.api import backend, parallelize
    from autoshard.runtime.dist_model import DistributedModel

_LAZY = {"backend": "autoshard.api", "parallelize": "autoshard.api", "DistributedModel": "autoshard.runtime.dist_model"}

__all__ = [
    "AutoshardError",
    "CaptureError",
    "CheckpointError",
    "DistributedModel",
    "InfeasiblePlanError",
    "InvalidConfigError",
    "Mesh",
    "Plan",
    "PlanFileError",
    "Recompute",
    "Stage",
    "UnsupportedOpError",
    "backend",
    "parallelize",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # once: later lookups do not come back here
        return value
    raise AttributeError(f"module 'autoshard' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
