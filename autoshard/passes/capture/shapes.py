"""Shapes: symbolic per-node cost tables (FLOPs, bytes, activations saved) in batch `b` and sequence `s`.

Contract
--------
`build_cost_table(spec, *, training=True, dtype=None, model=None, kernels=None) -> CostTable`

* Input: a frozen `ModelSpec` (and, for a user model from `package.module:factory`, that model: its
  class and HF config are used). Nothing is allocated: the model is built on the meta device.
* Output: `autoshard.cost_table.CostTable` with three `BlockCost`s: EMBED (everything before the first
  repeated layer: token embedding, rotary tables, masks), one LAYER standing for `spec.layers`
  identical layers (`count`), and HEAD (final norm, LM head, loss, and backward nodes no layer owns).
  Each `NodeCost` holds SymPy expressions in `cost_table.B` (micro-batch) and `S` (sequence):
  `flops`, `bytes_read`, `bytes_written` and `saved_bytes` (bytes of this forward node's output
  that the backward graph reads, resolved through views, read off the joint graph).
* Block deduplication: a copy of the model with ONE layer is traced (capture.capture_model on fake
  tensors) and its layer is costed once; llama-70b (80 layers) costs what a 1-layer model costs.
  A model whose layers are of several kinds (passes/capture/layer_kinds.py) gets a LAYER block per kind,
  each traced from a one-layer copy of that kind, and `CostTable.layer_kinds` (docs/passes/shapes.md).
* Symbolic expressions by exact interpolation: the truncated model is traced at b in {2, 3} and
  three sequence lengths; every node's numbers are a polynomial of degree <= 1 in b and <= 2 in s
  (attention's s x s, Mamba-2's inter-chunk (s/l)^2), so six traces determine them exactly
  (rational arithmetic). `tests/passes/capture/test_shapes.py` re-traces at an unseen (b, s) and checks
  equality node by node. Fixed-shape traces are ~20x faster than torch's symbolic tracing here.
* Mamba-2 pads the sequence to a multiple of the chunk size l (HF `pad_tensor_by_size`): the
  samples are multiples of l, and one extra trace at s = 2l + l/2 decides, per node and field,
  whether the number follows s or the padded length l*ceiling(s/l); the latter is written as
  `l*ceiling(S/l)` in the expression.
* Counting conventions: matmul FLOPs are 2*m*n*k (torch.utils.flop_counter); attention counts the
  full s x s score and value matmuls (PaLM, arXiv 2204.02311 appendix B) and its backward is
  2x forward (flash-attention's recomputation of the scores is not model FLOPs); elementwise and
  reduction ops count one FLOP per element of their output (reductions, scatters: of their first
  operand); copies, casts, concats,
  padding and lookups count none. Views cost nothing. Bytes are what each op reads and writes
  (a broadcast or sliced operand is charged at most its storage size).
* Mixture of experts: `aten._grouped_mm` (HF's `grouped_mm` experts) multiplies each row of the
  (token, expert) pairs by its own expert only, so it counts 2*rows*k*n FLOPs (top-k experts per
  token, not all of them); its GEMM shape is (experts, rows / experts, n, k): the tokens each expert
  receives under uniform routing (the cost model scales the busiest expert by --moe-imbalance).
  The weight-gradient form ((k, rows) x (rows, n) -> (experts, k, n)) counts 2*k*rows*n alike.
* `training=False` traces the forward only (no loss, no backward; `saved_bytes` are 0).
* Kernel substitution (passes/capture/kernels): every region of the traced graph that a fused kernel of
  `kernels` replaces (default: all of `kernels.KERNEL_NAMES` that apply to the model family; a
  device profile lists its own, `DeviceProfile.kernels`) is measured as two nodes,
  `fused_<kernel>_<output>` (forward) and `..._backward`, priced by the kernel's cost rule; saved
  activations are read off the substituted graph (the kernel saves its inputs and its state).
The table is cached per (spec, options): the cost model and the solver may call this freely.
* `dtype`: the dtype the model is traced in (a `torch.dtype` or its name; None: `torch.bfloat16`).
* Imports: this module is the table's entry point and its caches (in process, `passes/capture/table_cache`'s
  on disk and the tables shipped in the package); the tracing and measuring live in
  `passes/capture/shapes_trace.py`, imported only when a table is built. Reading a shipped or cached table
  loads neither torch nor transformers (`autoshard plan` of a preset on a fresh machine,
  tests/test_cli_imports.py).
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
    """The symbolic per-block cost table of one training step of `spec`; see the module docstring."""
    names = kernel_table.KERNEL_NAMES if kernels is None else tuple(kernels)
    return _build_for_layers(spec, training, BF16 if dtype is None else str(dtype), model,
                             kernel_table.kernel_for(spec, names))


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
