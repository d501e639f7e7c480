"""Compiled decoder layers: on CUDA the runtime runs the fused element-wise kernels the cost model prices.

Contract
--------
* `compile_backend(setting, spec, device_type) -> str | None`: the `torch.compile` backend the
  decoder layers run under, or None for eager. `setting` is `parallelize(compile=...)`: None
  ("auto") compiles with Inductor on CUDA for dense LLaMA-family models in training and runs eager
  elsewhere (a generation replica, `training=False`, too: decode reads weights, and a compiled
  layer would recompile as the cache grows);
  False: eager; True: Inductor; a string: that backend (the tests use "aot_eager" on the CPU).
* `compile_layers(model, backend) -> int`: `torch.compile` each decoder layer of the HF model in
  place (`nn.Module.compile`, regional compilation: one graph reused by every layer), after tensor
  and context parallelism and the recompute wrappers are installed and before ZeRO-3's FSDP2
  wraps the layers (torchtitan's order). Returns how many layers it compiled.

Why: the GPU device profiles price RMSNorm, RoPE and SwiGLU as fused kernels (passes/capture/kernels.py,
`kernels` in autoshard/hardware.py), as production runs execute them (Megatron-LM's fused kernels,
torchtitan's compiled blocks). Measured on an H200 (bench/bench_device.py, docs/cost_model.md,
"Measured on an H200"): eager HF llama-1b ran 1.5x (micro-batch 4) to 2.9x (micro-batch 1) slower
than predicted, with compiled layers 1.08-1.16x at micro-batch 4. Mamba-2 stays eager: Inductor
(torch 2.11) fails to generate code for the SSD's cumulative sums; MoE layers stay eager: their
routing is data-dependent.
"""

from __future__ import annotations

from torch import nn

from autoshard.errors import InvalidConfigError
from autoshard.model_spec import Mixer, ModelSpec


def compile_backend(setting: bool | str | None, spec: ModelSpec, device_type: str, *,
                    training: bool = True) -> str | None:
    if setting is None:
        dense_attention = spec.mixer is Mixer.ATTENTION and not spec.is_moe
        return "inductor" if training and device_type == "cuda" and dense_attention else None
    if setting is True:
        return "inductor"
    if setting is False:
        return None
    if isinstance(setting, str) and setting:
        from torch._dynamo.backends.registry import lookup_backend
        from torch._dynamo.exc import InvalidBackend

        try:
            lookup_backend(setting)
        except InvalidBackend:
            raise InvalidConfigError(f"compile={setting!r} is not a torch.compile backend; use True (Inductor), "
                                     "False, or one of torch._dynamo.list_backends() (e.g. 'inductor', "
                                     "'aot_eager')") from None
        return setting
    raise InvalidConfigError(f"compile must be None (auto: Inductor on CUDA for dense LLaMA models), True, False "
                             f"or the name of a torch.compile backend; got {setting!r}")


def compile_layers(model: nn.Module, backend: str) -> int:
    layers = getattr(model, model.base_model_prefix).layers  # HF's body, as runtime/zero3.py finds the blocks
    for layer in layers:
        layer.compile(backend=backend)
    return len(layers)
