"""FP8 training (plan precision "fp8"): torchao's float8 training on the layers' projections.

Contract: `apply_float8(model, spec, recipe, device=..., fsdp_float8_all_gather=...)` swaps, in place,
the linears of `rules/sharding.py float8_modules(spec)` (every layer's attention, MLP and Mamba-2
mixer projections, the shared expert's; not the embedding, the LM head, norms, routers, the
routed experts' grouped weights or the SSD scan) for torchao's `Float8Linear`, configured by the
recipe as torchao names it (`Float8LinearConfig.from_recipe_name`: "tensorwise" or "rowwise").
It runs on this rank's tensor-parallel slices (after runtime/tensor_parallel.py) and before FSDP2.

The whole contract: docs/modules/runtime.md (runtime/fp8.py).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from autoshard.errors import InvalidConfigError
from autoshard.ir import Fp8Recipe
from autoshard.model_spec import ModelSpec
from autoshard.runtime.tensor_parallel import RowParallelLinear

TORCHAO_HINT = "pip install 'autoshard[fp8]' (or pip install torchao>=0.18)"
_ALIGN = 16  # torch._scaled_mm on CUDA: both dims of each operand multiples of 16


def torchao_float8():
    """torchao's float8 module, or an InvalidConfigError naming the install."""
    try:
        import torchao.float8 as float8
    except ImportError as e:
        raise InvalidConfigError(f"precision 'fp8' runs torchao's float8 training, which is not installed "
                                 f"({e}); {TORCHAO_HINT}") from None
    return float8


def check_fp8_device(device: torch.device) -> None:
    """Refuse a device that cannot run float8 GEMMs (CPU runs them, slowly: the tests)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise InvalidConfigError(f"precision 'fp8' needs FP8 tensor cores (compute capability 8.9+: H100, H200, "
                                 f"L40S); {torch.cuda.get_device_name(device)} is {major}.{minor}; use "
                                 "precision 'bf16-mixed'")
    if device.type not in ("cuda", "cpu"):
        raise InvalidConfigError(f"precision 'fp8' runs torchao's float8 training on CUDA (and CPU for checks); "
                                 f"device {device.type!r} has none; use precision 'bf16-mixed'")


def _row_parallel_class(float8) -> type:
    """torchao's `Float8Linear` with `RowParallelLinear`'s collective after the GEMM and the bias after that."""

    class Float8RowParallelLinear(float8.float8_linear.Float8Linear):
        tp_group = None
        sequence_parallel: bool = False

        def forward(self, x: Tensor) -> Tensor:
            if torch.is_autocast_enabled("cuda"):  # as Float8Linear.forward: the input in autocast's dtype
                x = x.to(torch.get_autocast_dtype("cuda"))
            y = float8.float8_linear.matmul_with_hp_or_float8_args.apply(x, self.weight.t(), self.linear_mm_config,
                                                                         self.config)
            return RowParallelLinear.reduce_and_add_bias(self, y)

    return Float8RowParallelLinear


def apply_float8(model: nn.Module, spec: ModelSpec, recipe: Fp8Recipe, *, device: torch.device,
                 fsdp_float8_all_gather: bool = False) -> tuple[str, ...]:
    """Swap the float8 modules of `model` for torchao's Float8Linear (docs/modules/runtime.md); the paths swapped."""
    from autoshard.rules.sharding import float8_modules

    float8 = torchao_float8()
    check_fp8_device(device)
    config = float8.Float8LinearConfig.from_recipe_name(recipe.value)
    if fsdp_float8_all_gather and recipe is Fp8Recipe.TENSORWISE:
        import dataclasses

        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    wanted = set(float8_modules(spec))
    any_shape = device.type != "cuda"  # CPU's float8 GEMM takes any shape

    def keep(module: nn.Module, path: str) -> bool:
        if path not in wanted or module.weight.is_meta:
            return False
        return any_shape or (module.in_features % _ALIGN == 0 and module.out_features % _ALIGN == 0)

    rows = {path: (m.tp_group, m.sequence_parallel) for path, m in model.named_modules()
            if isinstance(m, RowParallelLinear) and path in wanted}
    float8.convert_to_float8_training(model, module_filter_fn=keep, config=config)
    row_class = _row_parallel_class(float8)
    swapped = []
    for path, module in model.named_modules():
        if not isinstance(module, float8.float8_linear.Float8Linear):
            continue
        swapped.append(path)
        if path in rows:
            module.__class__ = row_class
            module.tp_group, module.sequence_parallel = rows[path]
    return tuple(swapped)
