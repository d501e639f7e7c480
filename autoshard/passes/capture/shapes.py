"""Shapes: symbolic per-node cost tables (FLOPs, bytes, activations saved) in batch `b` and sequence `s`.

Contract
--------
`build_cost_table(spec, *, training=True, dtype=None, model=None, kernels=None) -> CostTable`

The whole contract: docs/modules/capture.md (passes/capture/shapes.py).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from autoshard.cost_table import CostTable
from autoshard.errors import InvalidConfigError
from autoshard.ir import BlockKind
from autoshard.model_spec import ModelSpec
from autoshard.passes.capture import kernels as kernel_table
from autoshard.passes.capture import table_cache

if TYPE_CHECKING:
    import torch
    from torch import nn

BF16 = "torch.bfloat16"  # str(torch.bfloat16): the default trace dtype, named without importing torch


def build_cost_table(spec: ModelSpec, *, training: bool = True, dtype: torch.dtype | str | None = None,
                     model: nn.Module | None = None, kernels: Sequence[str] | None = None) -> CostTable:
    """The symbolic per-block cost table of one training step of `spec`; see docs/modules/capture.md."""
    names = kernel_table.KERNEL_NAMES if kernels is None else tuple(kernels)
    table = _build_for_layers(spec, training, BF16 if dtype is None else str(dtype), model,
                              kernel_table.kernel_for(spec, names))
    if model is not None:
        check_params(table, model)
    return table


def check_params(table: CostTable, model: nn.Module) -> None:
    """InvalidConfigError, naming each block's count, when the table's parameters (`CostTable.params`) are not
    the model's own (every parameter once, as HF's PreTrainedModel.num_parameters(): a tied weight once, no
    buffer): a block autoshard read wrong would price and plan a model it does not hold."""
    own = sum(p.numel() for p in model.parameters())
    if table.params != own:
        blocks = ", ".join(f"{b.name} {b.params:,}" + (f" x {b.count}" if b.count > 1 else "") for b in table.blocks)
        raise InvalidConfigError(
            f"{table.model}: the traced blocks hold {table.params:,} parameters ({blocks}), the model "
            f"{own:,}: autoshard does not read this model's layers right, so it does not price or plan it "
            "(the parameters outside those blocks would go uncounted); this model is not supported yet")


@functools.lru_cache(maxsize=64)
def _build_for_layers(spec: ModelSpec, training: bool, dtype: str, model: nn.Module | None,
                      kernels: tuple[str, ...]) -> CostTable:
    """The table of the 1-layer copy (shared by every layer count), with the layer count of `spec`."""
    one = _build_cached(replace(spec, layers=1), training, dtype, model, kernels)
    if one.mixed:  # a mixed stack's table counts the model's own layers of each kind
        if len(one.layer_kinds) != spec.layers:
            raise InvalidConfigError(f"{spec.name}: the model's layers are of several kinds "
                                     f"({len(one.layer_kinds)} layers); its layer count cannot be changed to "
                                     f"{spec.layers}: change num_hidden_layers (and the layer kinds) in its config")
        return one
    blocks = tuple(replace(blk, count=spec.layers) if blk.kind is BlockKind.LAYER else blk for blk in one.blocks)
    return replace(one, blocks=blocks)


@functools.lru_cache(maxsize=64)
def _build_cached(spec: ModelSpec, training: bool, dtype: str, model: nn.Module | None,
                  kernels: tuple[str, ...]) -> CostTable:
    build = functools.partial(trace_table, spec, training, dtype, model, kernels)  # a miss: trace (shapes_trace)
    if model is None:  # a spec: the package may ship its table (passes/capture/table_cache.py, "Shipped tables")
        return table_cache.cached_table(lambda: _cache_key(spec, training, dtype, model, kernels), build,
                                        shipped=shipped_table_key(spec, training, dtype, kernels))
    key = _cache_key(spec, training, dtype, model, kernels)
    return build() if key is None else table_cache.cached_table(key, build)


def _options(training: bool, dtype: torch.dtype | str, kernels: tuple[str, ...]) -> dict:
    return {"training": training, "dtype": str(dtype), "kernels": list(kernels)}


def shipped_table_key(spec: ModelSpec, training: bool, dtype: str, kernels: tuple[str, ...]) -> dict:
    """The key of the shipped table of `spec` (no model: a preset's spec) traced with these options."""
    return table_cache.shipped_key(spec, **_options(training, dtype, kernels))


def _cache_key(spec: ModelSpec, training: bool, dtype: torch.dtype | str, model: nn.Module | None,
               kernels: tuple[str, ...]) -> dict | None:
    """Everything the table of the 1-layer copy depends on (None: a model the cache cannot name)."""
    key = {**table_cache.spec_key(spec), **_options(training, dtype, kernels)}
    if model is None:
        return key
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_json_string"):
        return None
    cls = type(model)
    try:  # a class without a source file, or a config with values JSON cannot hold: not cached
        source = hashlib.sha256(Path(inspect.getsourcefile(cls) or "").read_bytes()).hexdigest()
        config_json = config.to_json_string(use_diff=False)
    except (OSError, TypeError, ValueError):
        return None
    return {**key, "class": f"{cls.__module__}.{cls.__qualname__}", "class_source": source, "config": config_json}


def trace_table(spec: ModelSpec, training: bool, dtype: torch.dtype | str, model: nn.Module | None,
           kernels: tuple[str, ...]) -> CostTable:
    """Trace the 1-layer copy at the sample shapes and interpolate (passes/capture/shapes_trace.py)."""
    from autoshard.passes.capture import shapes_trace

    return shapes_trace.build(spec, training, dtype, model, kernels)
