"""Errors autoshard raises for bad input.

Every message says what was found, what was expected, and what to do. The CLI prints
`AutoshardError`s as one line and exits with code 2; anything else is a bug in autoshard.
"""

from __future__ import annotations


class AutoshardError(Exception):
    """Base of every user-facing error: bad input, not a bug."""


class UnknownNameError(AutoshardError, KeyError):
    """A preset, hardware profile or option value that autoshard does not know."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class InvalidConfigError(AutoshardError, ValueError):
    """A number that is out of range or a parallel layout that breaks a divisibility rule."""


class CaptureError(AutoshardError):
    """The model could not be traced; the message names the op or Python construct."""


class UnsupportedOpError(AutoshardError):
    """An op with no sharding rule where one is required."""


class InfeasiblePlanError(AutoshardError):
    """No configuration fits; the message names the binding constraint and by how much."""


class PlanFileError(InvalidConfigError):
    """A plan file that is malformed, from a newer schema, or for another model or world size."""


class CheckpointError(AutoshardError):
    """A checkpoint that is incomplete, damaged, or of another model or optimizer than the one loading it."""
