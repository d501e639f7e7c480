"""Pipeline schedules as the cost model prices them: bubble, micro-batches in flight, p2p traffic.

Contract (p stages, m micro-batches, v virtual stages (model chunks) per pipeline rank):

  bubble_fraction(schedule, v, microbatches=, pp=) -> Fraction f    makespan = m * max_i t_i + f * (sum_i t_i - max_i t_i)
  in_flight(schedule, stage, pp, m, v) -> float  micro-batches whose activations a stage holds at its peak
  p2p_factor(schedule, v) -> int                 stage-boundary crossings per micro-batch, relative to 1F1B
  check_chunks(schedule, v, pp=, microbatches=, layers=)  what the torch schedules accept (beyond ir.check_schedule)

With equal stages t the makespan is (m + f (p - 1)) t, the bubble fraction f(p-1)/(m + f(p-1)).

The whole contract: docs/modules/rules.md (rules/schedules.py).
"""

from __future__ import annotations

from fractions import Fraction

from autoshard.errors import InvalidConfigError
from autoshard.ir import Mesh, Schedule


def rows_per_microbatch(mesh: Mesh, micro_batch: int) -> int:
    """Sequences one micro-batch takes over all replicas: the batch splits over dp x ep (the ep ranks take
    their own rows, as runtime/dist_model.py slices them), each replica's rows into micro-batches."""
    return mesh.dp * mesh.ep * micro_batch


def microbatches_per_step(global_batch: int, mesh: Mesh, micro_batch: int) -> int:
    """Micro-batches each pipeline runs per step (`rows_per_microbatch`): the one count of them, read by
    the validity rules, the cost model, the planner and the engines' translations."""
    return global_batch // rows_per_microbatch(mesh, micro_batch)


def bubble_fraction(schedule: Schedule | str, virtual_stages: int = 1, *, microbatches: int | None = None,
                    pp: int | None = None) -> Fraction:
    """f of the contract. Given `microbatches` < `pp`, 1: the interleaved and zero-bubble bubbles
    assume a full pipeline (m >= p, Narayanan et al. 2021 sec. 2.2.2); with fewer micro-batches the
    path of one micro-batch through every chunk bounds the step (f = 1 exactly at m = 1)."""
    schedule = Schedule(schedule)
    if microbatches is not None and pp is not None and microbatches < pp:
        return Fraction(1)
    if schedule is Schedule.INTERLEAVED_1F1B:
        return Fraction(1, virtual_stages)
    if schedule is Schedule.ZERO_BUBBLE:
        return Fraction(1, 3 * virtual_stages)
    return Fraction(1)


def in_flight(schedule: Schedule | str, stage: int, pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    schedule = Schedule(schedule)
    if schedule is Schedule.GPIPE:
        return float(microbatches)
    base = float(min(pp - stage, microbatches))
    if schedule is Schedule.INTERLEAVED_1F1B:
        return base * (1 + (pp - 1) / (pp * virtual_stages))
    return base


def p2p_factor(schedule: Schedule | str, virtual_stages: int = 1) -> int:
    return virtual_stages if Schedule(schedule) in (Schedule.INTERLEAVED_1F1B, Schedule.ZERO_BUBBLE) else 1


def check_chunks(schedule: Schedule | str, virtual_stages: int, *, pp: int, microbatches: int, layers: int) -> None:
    """Beyond ir.check_schedule (the plan's own rule), what runtime/pipeline.py's torch schedules
    accept with `microbatches` micro-batches per step on each pipeline: every model chunk holds a
    layer; 1F1B and zero-bubble need at least pp micro-batches (GPipe runs fewer: with m < pp it
    has 1F1B's bubble and memory); the multi-chunk schedules other than ZB-V split the
    micro-batches into rounds of max(1, m // pp) (torch's ScheduleInterleaved1F1B /
    ScheduleInterleavedZeroBubble rule). InvalidConfigError saying the fix. The one plan validator
    (rules/validity.check_plan) and the planner both call it."""
    schedule = Schedule(schedule)
    if pp * virtual_stages > layers:
        raise InvalidConfigError(f"pp x virtual_stages ({pp} x {virtual_stages}) exceeds the {layers} layers; "
                                 "lower virtual_stages or pp")
    if pp == 1:
        return
    if schedule in (Schedule.ONE_F_ONE_B, Schedule.ZERO_BUBBLE) and microbatches < pp:
        raise InvalidConfigError(f"{schedule.value} needs at least as many micro-batches ({microbatches}) as "
                                 f"stages ({pp}); use a smaller micro_batch, a larger global batch, or "
                                 "schedule='gpipe'")
    multi = schedule is Schedule.INTERLEAVED_1F1B or (schedule is Schedule.ZERO_BUBBLE and virtual_stages != 2)
    rounds = max(1, microbatches // pp)
    if multi and microbatches % rounds:
        raise InvalidConfigError(f"{schedule.value} with pp {pp} runs the {microbatches} micro-batches in rounds of "
                                 f"{rounds} (torch's rule: a multiple of max(1, micro-batches // pp)); pick a "
                                 "global batch / micro_batch that gives a multiple of pp micro-batches")
