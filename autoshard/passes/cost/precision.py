"""Training precision as the cost model prices it: bytes per value and the GEMM rate.

Contract: `precision_numbers(precision) -> PrecisionNumbers` for a plan's `precision` (ir.Precision);
`resolve_precision(precision, hw)` turns AUTO into the device's default (ir.Precision.resolve).
The numbers are what the runtime keeps (runtime/precision.py says the same from its side;
tests/runtime/test_state_bytes.py measures a rank's tensors against `state.state_bytes`).

The whole contract: docs/modules/cost.md (passes/cost/precision.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from autoshard.ir import Fp8Recipe, Precision


@dataclass(frozen=True, slots=True, kw_only=True)
class PrecisionNumbers:
    param_bytes: float  # weights as the forward reads them
    grad_bytes: float  # main gradients (accumulated and reduced)
    optim_bytes: float  # optimizer state per parameter (master copy if any, Adam m and v)
    master_bytes: float  # of `optim_bytes`, the fp32 master copy (0: the weights are the masters)
    act_bytes: float  # activations, on the wire and saved
    flops_scale: float  # GEMM / attention rate relative to the bf16 tensor-core peak
    traced_scale: float  # factor on the bytes of a bf16-traced cost table
    gather_bytes: float  # bytes per parameter ZeRO-3 (FSDP2) all-gathers and holds gathered
    cast_bytes: float = 0.0  # fp8: HBM bytes per operand element of a float8 GEMM's cast (amax + scale-and-cast)


    @property
    def sharded_weight_bytes(self) -> float:
        """Bytes per parameter of a ZeRO-3 (FSDP2) shard: the fp32 master, or the weight itself when
        the weights are the masters."""
        return self.master_bytes or self.param_bytes


_NUMBERS = {
    Precision.BF16_MIXED: PrecisionNumbers(param_bytes=2.0, grad_bytes=4.0, optim_bytes=12.0, master_bytes=4.0, act_bytes=2.0,
                                   flops_scale=1.0, traced_scale=1.0, gather_bytes=2.0),
    Precision.FP32: PrecisionNumbers(param_bytes=4.0, grad_bytes=4.0, optim_bytes=8.0, master_bytes=0.0, act_bytes=4.0,
                             flops_scale=0.5, traced_scale=2.0, gather_bytes=4.0),
}
_FP8 = {  # bf16-mixed's numbers with the float8 casts; tensorwise gathers float8 weights under ZeRO-3
    recipe: PrecisionNumbers(param_bytes=2.0, grad_bytes=4.0, optim_bytes=12.0, master_bytes=4.0, act_bytes=2.0,
                             flops_scale=1.0, traced_scale=1.0, cast_bytes=2.0 + 2.0 + 1.0,
                             gather_bytes=1.0 if recipe is Fp8Recipe.TENSORWISE else 2.0)
    for recipe in Fp8Recipe
}


def precision_numbers(precision: Precision | str, fp8_recipe: Fp8Recipe | None = None) -> PrecisionNumbers:
    """The numbers of a concrete precision (fp8: of its recipe, tensorwise when None); AUTO prices as
    bf16-mixed, the accelerator default (resolve it against the device first: `resolve_precision`)."""
    if precision is Precision.FP8 or precision == Precision.FP8.value:
        return _FP8[fp8_recipe or Fp8Recipe.TENSORWISE]
    numbers = _NUMBERS.get(precision)  # a concrete Precision: the planner asks ~10^5 times
    if numbers is None:
        precision = Precision(precision)
        numbers = _NUMBERS[Precision.BF16_MIXED if precision is Precision.AUTO else precision]
    return numbers


def resolve_precision(precision: Precision | str, hw) -> Precision:
    """AUTO on this device profile: fp32 on the cpu profile (gloo runs), bf16-mixed on accelerators."""
    return Precision(precision).resolve("cpu" if hw.name == "cpu" else "cuda")
