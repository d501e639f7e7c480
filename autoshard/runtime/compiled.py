"""Compiled decoder layers: on CUDA the runtime runs the fused element-wise kernels the cost model prices.

The whole contract: docs/modules/runtime.md (runtime/compiled.py).
"""

from __future__ import annotations

from torch import nn

from autoshard.errors import InvalidConfigError
from autoshard.model_spec import ModelSpec
from autoshard.rules.kernels import compiles_layers


def compile_backend(setting: bool | str | None, spec: ModelSpec, device_type: str, *,
                    training: bool = True) -> str | None:
    if setting is None:  # the one rule the cost model prices fused kernels by (rules/kernels.py)
        return "inductor" if training and device_type == "cuda" and compiles_layers(spec) else None
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
    from autoshard.models.facts import layer_list

    found = layer_list(model)  # by structure (GPT-2's and CodeGen's transformer.h too), as runtime/zero3.py
    layers = found[1] if found is not None else ()
    for layer in layers:
        layer.compile(backend=backend)
    return len(layers)
