"""What the cost model prices and what it answers: the `Layout` of one training step and the
breakdowns of its `Estimate` (time per block, memory, time per part of the step).

Part of the cost model: passes/cost/cost.py composes these into `estimate`.
"""

from __future__ import annotations


from dataclasses import dataclass, replace
from typing import Any


from autoshard.errors import InvalidConfigError
from autoshard.ir import (BOOLEAN, NON_NEGATIVE_INT, PLAN_FIELD, Fp8Recipe, Mesh, Precision, Recompute, Schedule, Stage, check_fields,
                          fp8_recipe_of, offload_violation)
from autoshard.passes.cost.precision import PrecisionNumbers, precision_numbers
from autoshard.rules.schedules import microbatches_per_step


OPTIM_TRAFFIC = 30.0  # HBM bytes per parameter of an Adam step: grad r, master/m/v r+w, bf16 w


# The plan's fields a layout holds as they are (ir.PLAN_FIELDS: their checks, the enums read into members).
LAYOUT_FIELDS = tuple(PLAN_FIELD[name] for name in ("micro_batch", "zero", "offload_optimizer", "recompute", "precision",
                                                    "schedule", "virtual_stages"))


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    """One parallel layout: the mesh plus the memory options, the Plan's fields of the same names (LAYOUT_FIELDS;
    `sequence_parallel` and `strategies` one option each, what differs per stage being `stage_choices`)."""

    mesh: Mesh
    micro_batch: int = 1
    zero: int = 0
    recompute: Recompute = Recompute.NONE
    precision: Precision = Precision.AUTO  # passes/cost/precision.py; estimate resolves AUTO per device (`resolved`)
    fp8_recipe: Fp8Recipe | None = None  # precision fp8 only (tensorwise when None): torchao's recipe
    schedule: Schedule = Schedule.ONE_F_ONE_B  # pipeline schedule, priced by rules/schedules.py
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved-1f1b, zero-bubble V)
    offload_optimizer: bool = False  # ZeRO-3 shards and optimizer state in host memory (passes/cost/state.py)
    sequence_parallel: bool = False  # norms / residual on a tp shard of the sequence (passes/cost/sequence_cost.py)
    # intra-op choices as (choice, option) pairs that differ from the table's default (Plan.strategies,
    # rules/sharding.py CHOICES): what the sharding table splits, hence every TP divisor and collective
    strategies: tuple[tuple[str, str], ...] = ()
    moe_imbalance: float = 1.0  # mixture of experts: the busiest expert's load over the mean (passes/cost/moe_cost.py)
    # layer choices each pipeline stage makes on its own (the planner's tables, passes/solve/solve_model.py
    # `stage_variants`): "sequence_parallel" (on or off per stage; where they differ every stage boundary
    # carries the whole sequence, `sequence_boundary_time`) and "groups" (Mamba-2 split or whole per stage);
    # the layout's own sequence_parallel / groups are then off / split, the first of each stage's variants.
    # What estimate() prices of such a layout is that first variant on every stage
    stage_choices: tuple[str, ...] = ()
    # What a device's training stack runs beyond a plan's keys (hardware.StackRecipe; cost.as_stack_runs sets
    # them): autoshard's runtime runs neither, so the planner never does. Block recompute: the first
    # `recompute_layers` layers of each model chunk (each stage at virtual_stages 1; cost.block_segments) keep only
    # their input (Recompute.FULL), the others the stage's level
    recompute_layers: int = 0
    reuse_fp32_param: bool = False  # the fp32 master is the bf16 weight plus a 2-byte residual (state.state_bytes)

    def __post_init__(self) -> None:
        check_fields(self, LAYOUT_FIELDS)  # (the planner builds ~10^5 layouts: members pass as they are)
        BOOLEAN.check("sequence_parallel", self.sequence_parallel)
        BOOLEAN.check("reuse_fp32_param", self.reuse_fp32_param)
        NON_NEGATIVE_INT.check("recompute_layers", self.recompute_layers)
        if self.reuse_fp32_param and (self.zero == 3 or self.offload_optimizer):
            raise InvalidConfigError(f"reuse_fp32_param with zero {self.zero}"
                                     f"{' and offload' if self.offload_optimizer else ''}: the reused fp32 copy is "
                                     "MindSpeed's for the bf16 weights of ZeRO 0-2 (it refuses ZeRO-3); use zero <= 2 "
                                     "without offload, or drop reuse_fp32_param")
        if not isinstance(self.moe_imbalance, (int, float)) or not self.moe_imbalance >= 1.0:
            raise InvalidConfigError(f"moe_imbalance is the busiest expert's load over the mean, so a number, at least 1.0; "
                                     f"got {self.moe_imbalance!r}")
        if self.fp8_recipe is not None or self.precision is Precision.FP8:
            object.__setattr__(self, "fp8_recipe", fp8_recipe_of(self.precision, self.fp8_recipe))
        why = offload_violation(self.offload_optimizer, self.zero)
        if why:
            raise InvalidConfigError(why)
        if self.stage_choices and not set(self.stage_choices) <= {"sequence_parallel", "groups"} or self.stage_choices and (
                self.sequence_parallel and "sequence_parallel" in self.stage_choices) or (
                "groups" in self.stage_choices and "groups" in dict(self.strategies)):
            raise InvalidConfigError(f"stage_choices {self.stage_choices!r}: per-stage sequence_parallel / groups, "
                                     "with the layout's own off / split")

    @property
    def numbers(self) -> PrecisionNumbers:
        """Bytes per value and GEMM rate of this layout's precision."""
        return precision_numbers(self.precision, self.fp8_recipe)

    @property
    def numerics(self) -> tuple:
        """What of the layout its precision numbers depend on (memo keys): the precision and the fp8 recipe."""
        return self.precision, self.fp8_recipe

    def microbatches(self, global_batch: int) -> int:
        """Micro-batches per step (rules/schedules.microbatches_per_step)."""
        return microbatches_per_step(global_batch, self.mesh, self.micro_batch)

    def priced_twin(self) -> Layout:
        """The layout the cost model prices exactly as this one with the first fp8 recipe (`Fp8Recipe` order) that
        does: the recipes' numbers differ only in the bytes ZeRO-3 gathers (`PrecisionNumbers.gather_bytes`, read
        under ZeRO-3 alone), so below ZeRO-3 every fp8 layout prices as its tensorwise twin; else itself."""
        if self.precision is not Precision.FP8 or self.zero == 3:
            return self
        first = next(iter(Fp8Recipe))
        if self.fp8_recipe is first or replace(self.numbers, gather_bytes=0.0) != replace(
                precision_numbers(Precision.FP8, first), gather_bytes=0.0):
            return self
        return replace(self, fp8_recipe=first)


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockTime:
    """Seconds for one instance of a block and one micro-batch on one device."""

    fwd_s: float
    bwd_s: float
    recompute_s: float
    tp_comm_s: float
    cp_comm_s: float
    ep_comm_s: float = 0.0  # MoE dispatch / combine all-to-alls (passes/cost/moe_cost.py)

    @property
    def compute_s(self) -> float:
        return self.fwd_s + self.bwd_s

    @property
    def comm_s(self) -> float:
        """TP, CP and EP collectives on the critical path."""
        return self.tp_comm_s + self.cp_comm_s + self.ep_comm_s

    @property
    def total_s(self) -> float:
        return self.fwd_s + self.bwd_s + self.recompute_s + self.comm_s


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryBreakdown:
    """Bytes on one device."""

    weights: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    logits: float = 0.0
    buffers: float = 0.0

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.logits + self.buffers

    def as_gb(self) -> dict[str, float]:
        names = ("weights", "grads", "optimizer", "activations", "logits", "buffers")
        return {n: getattr(self, n) / 1e9 for n in names}


@dataclass(frozen=True, slots=True, kw_only=True)
class TimeBreakdown:
    """Seconds of one step on the critical path; the parts add up to the step time."""

    compute: float = 0.0
    recompute: float = 0.0
    tp_comm: float = 0.0
    cp_comm: float = 0.0
    ep_comm: float = 0.0  # MoE dispatch / combine all-to-alls
    p2p: float = 0.0
    pp_bubble: float = 0.0
    dp_comm_exposed: float = 0.0
    optimizer: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {n: getattr(self, n) for n in ("compute", "recompute", "tp_comm", "cp_comm", "ep_comm", "p2p",
                                              "pp_bubble", "dp_comm_exposed", "optimizer")}


@dataclass(frozen=True, slots=True, kw_only=True)
class Estimate:
    """The predicted cost of one training step of one layout."""

    layout: Layout
    step_time_s: float
    tokens_per_s: float
    mfu: float  # fraction, paper convention
    memory_gb: float  # peak over devices (what `fits` is judged on)
    mean_memory_gb: float  # average over devices (how the paper's table reports memory)
    memory: MemoryBreakdown  # of the device with the peak
    fits: bool
    time: TimeBreakdown
    microbatches: int
    stages: tuple[Stage, ...]
    stage_times_s: tuple[float, ...]  # per micro-batch, fwd + bwd, per stage
    stage_memory_gb: tuple[float, ...] = ()  # peak bytes / 1e9 of each stage's devices
    # sequence parallelism per pipeline stage when the stages differ (a `sweep` row, commands/sweep.py); empty:
    # the layout's own on every stage
    stage_sequence_parallel: tuple[bool, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """One sweep row. `memory_gb` is the device average (the convention of published tables,
        e.g. arXiv 2602.09109's), `peak_memory_gb` the busiest device (first pipeline stage)."""
        mesh, lay = self.layout.mesh, self.layout
        return {
            **mesh.as_dict(), "zero": lay.zero, "offload": lay.offload_optimizer, "recompute": lay.recompute.value, "micro_batch": lay.micro_batch,
            "precision": lay.precision.value, **({"fp8_recipe": lay.fp8_recipe.value} if lay.fp8_recipe else {}),
            "schedule": lay.schedule.value, "virtual_stages": lay.virtual_stages,
            "sequence_parallel": list(self.stage_sequence_parallel) or lay.sequence_parallel,
            "strategies": dict(lay.strategies),  # the intra-op choices (plan key strategies)
            "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
            # the paper's tables report memory averaged over the devices; `fits` judges the peak
            "memory_gb": self.mean_memory_gb, "peak_memory_gb": self.memory_gb,
            "mfu": self.mfu, "fits": self.fits, "microbatches": self.microbatches,
            "memory_breakdown_gb": self.memory.as_gb(), "time_breakdown_s": self.time.as_dict(),
        }
