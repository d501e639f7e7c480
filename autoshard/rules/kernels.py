"""Fused kernels: which of a device's fused kernels a training run of autoshard's runtime really runs.

One rule for the runtime's default (runtime/compiled.py `compile_backend`: Inductor compiles the decoder layers
on CUDA) and the cost model's fused-region pricing (passes/cost/block.py), so a model is never priced with a
fusion the runtime does not run. The contract: docs/modules/rules.md (rules/kernels.py).
"""

from __future__ import annotations

from autoshard.model_spec import Mixer, ModelSpec

# the element-wise fusions a compiled layer runs (Inductor fuses HF's RMSNorm, SwiGLU and RoPE ops); the other
# kernels of a profile (flash attention through sdpa, mamba_ssm's SSD) run whether or not the layers are compiled
COMPILED_KERNELS = ("rmsnorm", "swiglu", "rope")


def compiles_layers(spec: ModelSpec) -> bool:
    """Whether the runtime compiles the decoder layers of `spec`'s model by default (compile=None) when it trains
    on CUDA: attention models without routed experts (a Mamba-2 stack and an MoE's routing run eagerly: their scans
    and dispatch are not compiled yet)."""
    return spec.mixer is Mixer.ATTENTION and not spec.is_moe


def runs_fused(kernel: str, device_kernels: tuple[str, ...], layers_compiled: bool) -> bool:
    """Whether a training run fuses `kernel` (hardware.KERNEL_NAMES) on a device listing `device_kernels`: the
    device runs it, and a compiled-layer fusion (`COMPILED_KERNELS`) only where the layers are compiled."""
    return kernel in device_kernels and (layers_compiled or kernel not in COMPILED_KERNELS)
