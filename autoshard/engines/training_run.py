"""One training layout as an engine states it, priced by the planner's own numbers.

The whole contract: docs/modules/engines.md (engines/training_run.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from autoshard.errors import InvalidConfigError
from autoshard.ir import Fp8Recipe, Mesh, Plan, Precision, Recompute, Schedule, even_stages, stage_rank


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingRun:
    mesh: Mesh
    micro_batch: int = 1
    zero: int = 1
    offload: bool = False
    schedule: Schedule = Schedule.ONE_F_ONE_B
    virtual_stages: int = 1
    recompute: tuple[Recompute, ...] = (Recompute.NONE,)  # per pipeline rank, or one for all
    sequence_parallel: tuple[bool, ...] = (False,)  # per pipeline rank, or one for all
    rank_layers: tuple[int, ...] = ()  # layers per pipeline rank; empty: ir.even_stages
    strategies: tuple[tuple[str, str], ...] = ()  # intra-op choices (plan key strategies); () the table's default
    groups: tuple[str, ...] = ()  # Mamba-2 groups "split" / "whole" per rank where they differ
    precision: Precision = Precision.AUTO  # AUTO: the device's default (bf16-mixed on accelerators)
    fp8_recipe: Fp8Recipe | None = None  # precision fp8 only
    # what a Megatron / MindSpeed command line may state and a plan cannot (Layout's fields of the same names): the
    # first `recompute_layers` layers of each model chunk (each stage at v = 1) recomputed whole (block recompute,
    # Megatron's --recompute-num-layers: per virtual stage), the reused fp32 copy
    recompute_layers: int = 0
    reuse_fp32_param: bool = False

    def __post_init__(self) -> None:
        pp = self.mesh.pp
        if self.recompute_layers and (self.per_stage_recompute or self.recompute[0] is not Recompute.NONE):
            raise InvalidConfigError(f"block recompute of {self.recompute_layers} layers per stage with recompute "
                                     f"{'/'.join(r.value for r in self.recompute)}: Megatron's block method keeps the "
                                     "other layers whole (recompute none); give one or the other")
        for name in ("recompute", "sequence_parallel"):
            if len(getattr(self, name)) not in (1, pp):
                raise InvalidConfigError(f"{name}: one value or one per pipeline rank ({pp}), got {getattr(self, name)}")
        if self.rank_layers and len(self.rank_layers) != pp:
            raise InvalidConfigError(f"{len(self.rank_layers)} stage layer counts for pp={pp}")

    def rank_value(self, name: str, rank: int):
        values = getattr(self, name)
        return values[rank] if len(values) > 1 else values[0]

    @property
    def per_stage_recompute(self) -> bool:
        return len(set(self.recompute)) > 1

    @property
    def per_stage_sequence_parallel(self) -> bool:
        return len(set(self.sequence_parallel)) > 1

    def layers(self, num_layers: int) -> tuple[int, ...]:
        """Layers per pipeline rank."""
        if self.rank_layers:
            if sum(self.rank_layers) != num_layers:
                raise InvalidConfigError(f"the stages hold {sum(self.rank_layers)} layers but the model has {num_layers}")
            return self.rank_layers
        return tuple(st.layers for st in even_stages(num_layers, self.mesh.pp))

    def layout(self, *, moe_imbalance: float = 1.0):
        """The cost model's Layout: the per-rank choices as `stage_choices` where the ranks differ."""
        from autoshard.passes.cost.layout import Layout

        sp_differ = self.per_stage_sequence_parallel
        groups_differ = len(set(self.groups)) > 1
        strategies = tuple(sorted(self.strategies + ((("groups", self.groups[0]),)
                                                     if self.groups and not groups_differ and self.groups[0] != "split" else ())))
        return Layout(mesh=self.mesh, micro_batch=self.micro_batch, zero=self.zero, offload_optimizer=self.offload,
                      recompute=max(self.recompute, key=list(Recompute).index), schedule=self.schedule,
                      virtual_stages=self.virtual_stages,
                      sequence_parallel=False if sp_differ else self.sequence_parallel[0], strategies=strategies,
                      stage_choices=(("sequence_parallel",) if sp_differ else ()) + (("groups",) if groups_differ else ()),
                      moe_imbalance=moe_imbalance, precision=self.precision, fp8_recipe=self.fp8_recipe,
                      recompute_layers=self.recompute_layers, reuse_fp32_param=self.reuse_fp32_param)

    def assignment(self, num_layers: int, layout):
        """The planner's stage assignment of this run under `layout` (`self.layout()`)."""
        from autoshard.passes.solve.solve_model import Assignment, stage_variants

        pp = self.mesh.pp
        variants = stage_variants(layout)
        picks = []
        for r in range(pp):
            sp, groups = self.rank_value("sequence_parallel", r), self.groups[r] if self.groups else "split"
            picks.append(next(i for i, v in enumerate(variants)
                              if ("sequence_parallel" not in layout.stage_choices or v.sequence_parallel == sp)
                              and ("groups" not in layout.stage_choices
                                   or dict(v.strategies).get("groups", "split") == groups)))
        return Assignment(layers=self.layers(num_layers), recompute=tuple(self.rank_value("recompute", r) for r in range(pp)),
                          variant=tuple(picks) if layout.stage_choices else ())

    def describe(self) -> str:
        """One line: dp2 pp4 tp4 cp2 ep1, interleaved-1f1b x5, sp on, zero 1, recompute none, micro-batch 1."""
        m = self.mesh
        sched = self.schedule.value + (f" x{self.virtual_stages}" if self.virtual_stages > 1 else "")
        sp = "/".join("on" if x else "off" for x in self.sequence_parallel)
        rec = "/".join(r.value for r in self.recompute)
        if self.recompute_layers:
            rec = f"block ({self.recompute_layers} layers per {'model chunk' if self.virtual_stages > 1 else 'stage'})"
        rec += " + reused fp32 copy" if self.reuse_fp32_param else ""
        split = f", stages {'/'.join(map(str, self.rank_layers))} layers" if self.rank_layers else ""
        fp8 = f", fp8 {self.fp8_recipe.value if self.fp8_recipe else 'tensorwise'}" if self.precision is Precision.FP8 else ""
        return (f"dp{m.dp} pp{m.pp} tp{m.tp} cp{m.cp} ep{m.ep}, {sched}, sp {sp}, zero {self.zero}{fp8}"
                f"{' + offload' if self.offload else ''}, recompute {rec}, micro-batch {self.micro_batch}{split}")


def run_of_plan(plan: Plan) -> TrainingRun:
    """The run a plan describes (its stages are model chunks; a rank's chunks share its choices)."""
    pp, v = plan.mesh.pp, plan.virtual_stages
    chunks = pp * v
    ranks = [stage_rank(i, pp=pp, virtual_stages=v, schedule=plan.schedule) for i in range(chunks)]
    layers, recompute, sp, groups = [0] * pp, [plan.recompute] * pp, [False] * pp, ["split"] * pp
    chunk_sp = plan.stage_sequence_parallel
    for i, r in enumerate(ranks):
        sp[r] = chunk_sp[i]
        groups[r] = dict(plan.stage_strategies(i)).get("groups", "split")
        if plan.stages:
            layers[r] += plan.stages[i].layers
            recompute[r] = plan.stages[i].recompute
    shared = tuple((k, o) for k, o in plan.strategies if not isinstance(o, tuple) and k != "groups")
    return TrainingRun(mesh=plan.mesh, micro_batch=plan.micro_batch, zero=plan.zero, offload=plan.offload_optimizer,
                       schedule=plan.schedule, virtual_stages=v, recompute=_collapse(recompute),
                       sequence_parallel=_collapse(sp), rank_layers=tuple(layers) if plan.stages else (),
                       strategies=shared, groups=tuple(groups) if len(set(groups)) > 1 or groups[0] != "split" else (),
                       precision=plan.precision, fp8_recipe=plan.fp8_recipe)


def _collapse(values: list) -> tuple:
    return (values[0],) if len(set(values)) == 1 else tuple(values)


def default_strategies(spec, run: TrainingRun) -> TrainingRun:
    """A hand-given run with the intra-op choices `sweep` prices its mesh with (the table's default where
    it runs: a vocabulary tp does not divide replicates the embedding and head)."""
    from autoshard.rules.sharding import runnable_strategies

    sp = any(run.sequence_parallel)
    st = runnable_strategies(spec, run.mesh.tp, sequence_parallel=sp)
    if st is None:
        raise InvalidConfigError(f"tp={run.mesh.tp}{' with sequence parallelism' if sp else ''} has no sharding of "
                                 f"{spec.name} that runs; pick a tp that divides the heads and vocabulary")
    return replace(run, strategies=tuple(st))


def price(ct, hw, spec, run: TrainingRun, *, global_batch: int, seq_len: int, moe_imbalance: float = 1.0) -> dict:
    """The figures of `run` (the keys of a plan's `predicted`), from `planner.predict`."""
    from autoshard.passes.cost.cost import _check, resolved
    from autoshard.passes.solve.planner import predict

    layout = resolved(run.layout(moe_imbalance=moe_imbalance), hw)
    _check(spec, replace(layout, stage_choices=()), global_batch, seq_len)  # the validator's one-line reasons
    a = run.assignment(spec.layers, layout)
    return predict(ct, hw, spec, layout, a, global_batch=global_batch, seq_len=seq_len)


def uniform(ct, hw, spec, run: TrainingRun, *, global_batch: int, seq_len: int, moe_imbalance: float = 1.0,
            recompute: bool = True, sequence_parallel: bool = True) -> tuple[TrainingRun, dict]:
    """`run` with one recompute level (`recompute`) and / or one sequence-parallel choice
    (`sequence_parallel`) on every rank: of the levels and choices the run uses on some rank, the
    fastest combination that fits (else the one with the least memory). Returns (run, its price)."""
    recs = sorted(set(run.recompute), key=list(Recompute).index) if recompute and run.per_stage_recompute else [None]
    sps = sorted(set(run.sequence_parallel)) if sequence_parallel and run.per_stage_sequence_parallel else [None]
    options = []
    for r in recs:
        for sp in sps:
            cand = replace(run, recompute=(r,) if r is not None else run.recompute,
                           sequence_parallel=(sp,) if sp is not None else run.sequence_parallel)
            options.append((cand, price(ct, hw, spec, cand, global_batch=global_batch, seq_len=seq_len,
                                        moe_imbalance=moe_imbalance)))
    fitting = [o for o in options if o[1]["fits"]]
    if fitting:
        return min(fitting, key=lambda o: o[1]["step_time_s"])
    return min(options, key=lambda o: o[1]["memory_gb"])


def compare(priced: dict, best: dict, *, terms: int = 3) -> str:
    """'1.23x faster: pp bubble -1.2 s, tp comm -0.4 s, ...' (the best plan against the priced layout)."""
    diffs = {k: best["time_breakdown_s"].get(k, 0.0) - v for k, v in priced["time_breakdown_s"].items()}
    top = sorted((k for k in diffs if abs(diffs[k]) > 1e-9), key=lambda k: -abs(diffs[k]))[:terms]
    ratio = priced["step_time_s"] / best["step_time_s"]
    if abs(ratio - 1) < 1e-9:
        return "the same step time: this layout is the best plan's"
    why = ", ".join(f"{k.replace('_', ' ')} {diffs[k]:+.3g} s" for k in top) or "the same time terms"
    return f"{ratio:.3g}x {'faster' if ratio >= 1 else 'slower'} ({why} per step)"
