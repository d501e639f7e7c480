"""autoshard: an automatic parallelization compiler for PyTorch training.

Public names only; see DESIGN.md for the contract.
"""

from autoshard.api import backend, parallelize
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
from autoshard.runtime.dist_model import DistributedModel

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
