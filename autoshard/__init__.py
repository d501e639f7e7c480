"""autoshard: an automatic parallelization compiler for PyTorch training.

Public names only; see DESIGN.md for the contract.
"""

from autoshard.errors import (
    AutoshardError,
    CaptureError,
    InfeasiblePlanError,
    InvalidConfigError,
    PlanFileError,
    UnsupportedOpError,
)
from autoshard.ir import Mesh, Plan, Recompute, Stage

__all__ = [
    "AutoshardError",
    "CaptureError",
    "InfeasiblePlanError",
    "InvalidConfigError",
    "Mesh",
    "Plan",
    "PlanFileError",
    "Recompute",
    "Stage",
    "UnsupportedOpError",
]
__version__ = "0.1.0"

from autoshard.api import parallelize  # noqa: E402
from autoshard.runtime.dist_model import DistributedModel  # noqa: E402

__all__ += ["DistributedModel", "parallelize"]
from autoshard.compile_backend import backend  # noqa: E402

__all__ += ["backend"]
