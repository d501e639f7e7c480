"""Argument types shared by the commands: one-line errors for bad numbers."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def status(message: str, *, enabled: bool = True):
    """A spinner on stderr while a slow step runs (silent when stderr is not a terminal)."""
    import contextlib
    import sys

    from rich.console import Console

    console = Console(file=sys.stderr)
    if not enabled or not console.is_terminal:
        return contextlib.nullcontext()
    return console.status(message)


def cost_table_for(model: str, *, spinner: bool = True):
    """Preset name or package.module:factory -> (ModelSpec, CostTable). A preset is traced without
    building the whole model (and not at all when its table is in the on-disk cache). `spinner`:
    say so on stderr while it runs (a terminal only)."""
    from autoshard.models.presets import get_spec, resolve_model
    from autoshard.passes.shapes import build_cost_table

    with status(f"capturing {model} and building its cost table (once per machine, then cached) ...",
                enabled=spinner):
        if ":" not in model:
            spec = get_spec(model)
            return spec, build_cost_table(spec)
        spec, module = resolve_model(model, device="meta")
        return spec, build_cost_table(spec, model=module)
