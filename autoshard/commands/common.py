"""Argument types shared by the commands: one-line errors for bad numbers."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from autoshard.errors import InvalidConfigError
from autoshard.ir import POSITIVE_INT


def positive_int(text: str) -> int:
    """A count flag (--devices, --seq-len, ...): ir.POSITIVE_INT, the one rule of a plan's counts."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {POSITIVE_INT.phrase}, got {text!r}") from None
    if not POSITIVE_INT.ok(value):
        raise argparse.ArgumentTypeError(f"must be {POSITIVE_INT.phrase}, got {value}")
    return value


def positive_float(text: str, unit: str = "") -> float:
    """A positive finite number flag (--time-limit; with `unit`, e.g. "seconds", --ttft-slo and the like)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {unit or 'a positive number'}, got {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be {f'a positive number of {unit}' if unit else 'a positive finite number'}"
                                         f", got {text}")
    return value


def positive_seconds(text: str) -> float:
    """A time flag (--ttft-slo, --tpot-slo): a positive finite number of seconds."""
    return positive_float(text, "seconds")


def memory_text(gb: float) -> str:
    """Memory given in GB (1e9 bytes), printed in a unit that shows it: 49.6 GB, 782 MB, 3.5 kB, 0 B (a tiny
    model or device profile printed "0.0 GB")."""
    value = gb * 1e9
    if abs(value) >= 1e9:
        return f"{gb:.1f} GB"
    for factor, unit in ((1e6, "MB"), (1e3, "kB")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {unit}"
    return f"{value:.3g} B"


def seconds_text(s: float) -> str:
    """A time in seconds for a table cell: two decimals from 1 s, three significant digits below (0.00 hid
    a tiny model's step)."""
    return f"{s:.2f}" if abs(s) >= 1 else f"{s:.3g}"


def check_output_path(path: str, flag: str) -> None:
    """Refuse an output file whose directory does not exist, before any slow work is done."""
    parent = Path(path).expanduser().parent
    if not parent.is_dir():
        raise InvalidConfigError(f"{flag} {path}: directory {parent} does not exist; create it or write elsewhere")
    if Path(path).is_dir():
        raise InvalidConfigError(f"{flag} {path} is a directory; give a file name, e.g. {Path(path) / 'plan.json'}")


def check_plot_path(path: str, flag: str = "--plot") -> None:
    """A plot file: a PNG (`--plot` of sweep and plan --inference) where `check_output_path` can write,
    refused before any slow work (sweep refused another suffix only once it had priced every layout)."""
    if not str(path).lower().endswith(".png"):
        raise InvalidConfigError(f"{flag} writes a PNG; give a file name ending in .png, got {path!r}")
    check_output_path(path, flag)


def check_schedule_flags(schedule: str | None, virtual_stages: int) -> None:
    """--schedule and --virtual-stages that contradict each other (sweep, price): one line naming both."""
    if virtual_stages > 1 and schedule in ("1f1b", "gpipe"):
        raise InvalidConfigError(f"--schedule {schedule} runs one stage per rank, but --virtual-stages is "
                                 f"{virtual_stages}; use interleaved-1f1b or zero-bubble, or drop --virtual-stages")
    if schedule == "interleaved-1f1b" and virtual_stages == 1:
        raise InvalidConfigError("--schedule interleaved-1f1b needs --virtual-stages 2 or more")


def imbalance(text: str) -> float:
    """--moe-imbalance: the busiest expert's load over the mean, a number >= 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 1.0, got {text!r}") from None
    if not value >= 1.0:
        raise argparse.ArgumentTypeError(f"is the busiest expert's load over the mean, so >= 1.0; got {value}")
    return value


def check_moe_imbalance(spec, value: float) -> None:
    """--moe-imbalance prices a mixture of experts' busiest expert: given (not 1.0) for a dense model it
    would be ignored, so it is refused."""
    if value != 1.0 and not spec.is_moe:
        raise InvalidConfigError(f"--moe-imbalance {value:g}: {spec.name} has no experts (not a mixture-of-experts "
                                 "model), so nothing would use it; drop it")


def check_positions(spec, module, seq_len: int, where: str) -> None:
    """A training sequence past the model's positions (`presets.position_violation`, the rule of plan
    --inference and dm.generate; HF's rope scaling lifts the limit) is refused before any slow work."""
    from autoshard.models.presets import max_positions, position_violation

    why = position_violation(max_positions(spec, getattr(module, "config", None)), prompt=seq_len, where=where)
    if why:
        raise InvalidConfigError(why)


MOE_IMBALANCE_HELP = ("mixture of experts: the busiest expert's load over the mean, which paces each MoE layer's "
                      "expert GEMMs and all-to-alls under ep (default 1.0, even routing); memory is always "
                      "bounded at the worst case of dropless routing; refused for a dense model")


def status(message: str, *, enabled: bool = True):
    """A spinner on stderr while a slow step runs (silent when stderr is not a terminal)."""
    import contextlib
    import sys

    from rich.console import Console

    console = Console(file=sys.stderr)
    if not enabled or not console.is_terminal:
        return contextlib.nullcontext()
    return console.status(message)


def model_for(model: str):
    """Preset name or package.module:factory -> (ModelSpec, the factory's module on meta, or None for
    a preset: a preset is traced without building the whole model)."""
    from autoshard.models.presets import get_spec, resolve_model

    if ":" not in model:
        return get_spec(model), None
    return resolve_model(model, device="meta")


def cost_table_for(model: str, *, spinner: bool = True, spec=None, module=None, kernels=None):
    """Preset name or package.module:factory -> (ModelSpec, CostTable), built once per machine (not at
    all when the table is in the on-disk cache); `spec`/`module`: `model_for(model)` when the caller
    has it already. `spinner`: say so on stderr while it runs (a terminal only). `kernels`: the fused
    kernels of the target device (`DeviceProfile.kernels`; None: every kernel autoshard knows)."""
    from autoshard.passes.capture.shapes import build_cost_table

    if spec is None:
        spec, module = model_for(model)
    with status(f"capturing {model} and building its cost table (once per machine, then cached) ...",
                enabled=spinner):
        return spec, build_cost_table(spec, model=module, kernels=kernels)


def print_refusals(spec, *, file=None) -> None:
    """One line per axis the model's facts refuse (models/facts.py; the search skips them)."""
    for axis, why in spec.refused:
        print(f"{axis} not searched: {why}", file=file)
