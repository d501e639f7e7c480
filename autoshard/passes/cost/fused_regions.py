"""Fused-region pricing: the fused kernels a device runs instead of the traced LLaMA ops.

Contract
--------
The captured graph is what the CPU trace sees: HF's unfused RMSNorm (fp32 upcast, pow, mean, rsqrt,
two casts), RoPE as mul/neg/cat/add, SwiGLU as silu and mul, and SDPA as one flash-attention op.
A production GPU run (Megatron-Core / Transformer Engine, torchtitan) runs each of these as ONE
kernel. A device profile lists the kernels it fuses (`DeviceProfile.kernels`, names in
`hardware.KERNEL_NAMES`); for those this module gives the cost rule of the fused op, applied by
passes/cost/compiled.py (region_kinds) and passes/cost/block.py (fused_scales) at pricing time.

The whole contract: docs/modules/cost.md (passes/cost/fused_regions.py).
"""

from __future__ import annotations

import math

import numpy as np

from autoshard.model_spec import Mixer, ModelSpec

FLASH_TILE = 128  # key/query block of FlashAttention-2/3 for head dim 128 (flash-attn kernel traits)

RMSNORM, ROPE, SWIGLU = "rmsnorm", "rope", "swiglu"


def region_of(path: str, is_vector: bool, spec: ModelSpec) -> tuple[str, str] | None:
    """(kernel, region key) of a traced vector node that a fused kernel replaces, or None."""
    if not is_vector or spec.mixer is not Mixer.ATTENTION:
        return None
    parts = path.split(".") if path else []
    if not parts:
        return None
    if "norm" in parts[-1]:
        return RMSNORM, path
    if path == spec.attention_path or path.endswith(f".{spec.attention_path}"):  # the attention-interface module
        return ROPE, path
    if parts[-1] == "mlp" or (len(parts) > 1 and parts[-2] == "mlp" and parts[-1] == "act_fn"):
        return SWIGLU, ".".join(parts[:-1]) if parts[-1] == "act_fn" else path
    return None


def region_kinds(paths, vector, spec: ModelSpec) -> tuple[np.ndarray, tuple[str, ...]]:
    """Region id per node (-1: none) and the kernel of each region."""
    keys: dict[tuple[str, str], int] = {}
    ids = np.full(len(paths), -1, dtype=np.int32)
    for i, (path, vec) in enumerate(zip(paths, vector)):
        r = region_of(path, bool(vec), spec)
        if r is not None:
            ids[i] = keys.setdefault(r, len(keys))
    return ids, tuple(k for k, _ in sorted(keys, key=lambda k: keys[k]))


def _fused_per_token(kernel: str, spec: ModelSpec, a: float) -> tuple[float, float, float]:
    """(forward bytes, backward bytes, saved bytes) per token of one fused region (docs/modules/cost.md)."""
    h = spec.hidden
    h_q = spec.heads * spec.attention_head_dim if spec.heads else h  # = h unless the config sets head_dim
    h_kv = spec.kv_heads * spec.attention_head_dim if spec.heads else h
    if kernel == RMSNORM:
        return 2 * a * h + 4, 6 * a * h, 2 * a * h + 4
    if kernel == ROPE:
        return 2 * a * (h_q + h_kv), 2 * a * (h_q + h_kv), a * (h_q + 2 * h_kv)
    return 3 * a * spec.ffn, 5 * a * spec.ffn, a * spec.ffn  # SWIGLU


def fused_scales(region: np.ndarray, kernels: tuple[str, ...], fwd: np.ndarray, nbytes: np.ndarray,
                 saved: np.ndarray, *, spec: ModelSpec, fused, tokens: float, act_bytes: float
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Per-node factors on traced bytes and saved bytes that make each region of a kernel the
    device fuses (`fused(kernel)` true) cost what the fused kernel moves and saves. `tokens` is
    b * s of the traced numbers (before any TP / CP division); `act_bytes` the activation width."""
    byte_scale, saved_scale = np.ones(len(region)), np.ones(len(region))
    for rid, kernel in enumerate(kernels):
        if not fused(kernel):
            continue
        f_bytes, b_bytes, f_saved = (tokens * x for x in _fused_per_token(kernel, spec, act_bytes))
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
