"""Fused-region pricing: the fused kernels a device runs instead of the traced ops.

Contract
--------
The CPU trace holds HF's unfused RMSNorm, RoPE and SwiGLU; a production GPU run fuses each into ONE kernel.
The regions are found on the graph (passes/capture/fused_patterns.py, every layer kind) and kept on the
table's nodes (`NodeCost.region`). For the kernels a profile fuses (`DeviceProfile.kernels`) this module
gives the fused op's cost rule, applied by passes/cost/compiled.py (region_kinds) and passes/cost/block.py
(fused_scales) at pricing time.

The whole contract: docs/modules/cost.md (passes/cost/fused_regions.py)."""

from __future__ import annotations

import math

import numpy as np

from autoshard.ir import OpKind
from autoshard.model_spec import ModelSpec
from autoshard.passes.capture.fused_patterns import RMSNORM, ROPE, SWIGLU

FLASH_TILE = 128  # key/query block of FlashAttention-2/3 for head dim 128 (flash-attn kernel traits)

def region_kinds(nodes) -> tuple[np.ndarray, tuple[str, ...], tuple[tuple[float, ...], ...]]:
    """Region id per node (-1: none), and the kernel and sizes per token of each region: the regions the graph's
    patterns found (`NodeCost.region`, passes/capture/fused_patterns.py), over their vector nodes (the ops a
    fused kernel replaces; their GEMMs and views are priced as themselves)."""
    keys: dict[str, int] = {}
    kernels: list[str] = []
    sizes: list[tuple[float, ...]] = []
    ids = np.full(len(nodes), -1, dtype=np.int32)
    for i, n in enumerate(nodes):
        tag = n.region
        if tag is None or n.kind is not OpKind.VECTOR:
            continue
        if tag.key not in keys:
            keys[tag.key] = len(keys)
            kernels.append(tag.kernel)
            sizes.append(tuple(tag.size))
        ids[i] = keys[tag.key]
    return ids, tuple(kernels), tuple(sizes)


def _fused_per_token(kernel: str, size: tuple[float, ...], a: float) -> tuple[float, float, float] | None:
    """(forward bytes, backward bytes, saved bytes) per token of one fused region, from its sizes per token as
    the graph shows them (passes/capture/fused_patterns.py; docs/modules/cost.md); None: no rule (the region
    is priced as traced)."""
    if kernel == RMSNORM:  # rows of `width`: read x, write y (+ the fp32 rstd per row); backward dy, x -> dx
        rows, width = size
        return rows * (2 * a * width + 4), rows * 6 * a * width, rows * (2 * a * width + 4)
    if kernel == ROPE:  # q and k rotated in place; saved: q, k, v for the flash kernel
        q, k, v = size
        return 2 * a * (q + k), 2 * a * (q + k), a * (q + k + v)
    if kernel == SWIGLU:  # read gate and up, write the product; backward reads dy, gate, up, writes both grads
        (f,) = size
        return 3 * a * f, 5 * a * f, a * f
    return None


def fused_scales(region: np.ndarray, kernels: tuple[str, ...], sizes: tuple[tuple[float, ...], ...], fwd: np.ndarray,
                 nbytes: np.ndarray, saved: np.ndarray, *, fused, tokens: float, act_bytes: float
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Per-node factors on traced bytes and saved bytes that make each region of a kernel the
    device fuses (`fused(kernel)` true) cost what the fused kernel moves and saves. `tokens` is
    b * s of the traced numbers (before any TP / CP division); `act_bytes` the activation width."""
    byte_scale, saved_scale = np.ones(len(region)), np.ones(len(region))
    for rid, (kernel, size) in enumerate(zip(kernels, sizes)):
        per_token = _fused_per_token(kernel, size, act_bytes) if fused(kernel) else None
        if per_token is None:
            continue
        f_bytes, b_bytes, f_saved = (tokens * x for x in per_token)
        sel = region == rid
        for phase, target in ((fwd, f_bytes), (~fwd, b_bytes)):
            m = sel & phase
            total = float(nbytes[m].sum())
            if total > 0:
                byte_scale[m] = target / total
        m = sel & fwd
        total = float(saved[m].sum())
        if total > 0:
            saved_scale[m] = f_saved / total
    return byte_scale, saved_scale


def causal_tile_fraction(seq_len: int) -> float:
    """Share of the s x s tiles a causal flash kernel visits: n(n+1)/2 of n^2 tiles of FLASH_TILE."""
    n = max(1, math.ceil(seq_len / FLASH_TILE))
    return (n + 1) / (2 * n)


def window_tile_fraction(seq_len: int, window: int) -> float:
    """Share of the s x s tiles a causal flash kernel with a sliding window of `window` tokens visits
    (flash-attn's window_size=(window - 1, 0)): query tile row i visits the tiles of its last `window`
    keys, min(i + 1, ceil(window / FLASH_TILE) + 1) of them (the band's partial tile at each end)."""
    n = max(1, math.ceil(seq_len / FLASH_TILE))
    band = math.ceil(window / FLASH_TILE) + 1
    return sum(min(i + 1, band) for i in range(n)) / (n * n)


def attention_tile_fraction(spec: ModelSpec, seq_len: int) -> float:
    """The causal kernel's tile share, the mean over the layers: a windowed layer's band
    (`window_tile_fraction`, `spec.window_layers` of them), the causal triangle in the others."""
    causal = causal_tile_fraction(seq_len)
    if not (spec.sliding_window and spec.window_layers):
        return causal
    windowed = min(causal, window_tile_fraction(seq_len, spec.sliding_window))
    return ((spec.layers - spec.window_layers) * causal + spec.window_layers * windowed) / spec.layers


def flash_attention_flops(traced_flops: np.ndarray, fwd: np.ndarray, *, share: float) -> np.ndarray:
    """FLOPs the flash kernel runs for the traced attention nodes (full-square forward 4 s^2 h d,
    backward 2x): the `share` of the tiles it visits (`attention_tile_fraction`: the causal triangle, a
    sliding window's band), backward 2.5x forward (scores recomputed)."""
    return traced_flops * share * np.where(fwd, 1.0, 2.5 / 2.0)


def wgrad_overlap_groups(paths, colwise_wgrad) -> dict[str, np.ndarray]:
    """For Megatron's async TP all-reduce of the input gradient (it overlaps the weight-gradient
    GEMMs of the same column-parallel linears, Megatron-LM `LinearWithGradAccumulationAndAsync
    Communication`): per parent module (self_attn, mlp, mixer), the mask of the weight-gradient
    GEMMs of its column-parallel linears (`colwise_wgrad`, from the sharding table)."""
    groups: dict[str, list[int]] = {}
    for i, (path, w) in enumerate(zip(paths, colwise_wgrad)):
        if w and "." in path:
            groups.setdefault(path.rsplit(".", 1)[0], []).append(i)
    out = {}
    for key, idx in groups.items():
        mask = np.zeros(len(paths), dtype=bool)
        mask[idx] = True
        out[key] = mask
    return out
