"""Plan validity: every rule a plan must pass, as one table of named rules, and every valid mesh.

`check_plan(plan, spec, world_size=, generate=)` walks `RULES` in order and raises the first broken
rule's message as `InvalidConfigError`; `plan_violation` asks the same table about a layout the planner
or `sweep` considers (no world, schedule or stage split yet), `axis_violation` one mesh axis alone (the
search prunes axis by axis), `generate_violation` a generation replica, `backend_violation` what the
torch.compile backend adds (`BACKEND_RULES`). The runtime, the planner, `sweep`, `show` and the cost
model all ask here, so the planner never emits a plan the runtime refuses. Each rule, and why it
holds, is in docs/validation.md; a new rule is one entry of `RULES` and one case in
tests/rules/test_rule_table.py.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from autoshard.errors import InvalidConfigError
from autoshard.ir import Mesh, Plan, Precision, Schedule, check_stages, is_positive_int
from autoshard.model_spec import Mixer, ModelSpec
from autoshard.rules.schedules import check_chunks, microbatches_per_step, rows_per_microbatch
from autoshard.rules.sharding import choice_violation, tp_violation


def prime_factors(n: int) -> dict[int, int]:
    """{prime: exponent} of n >= 1: trial division by small primes, then Pollard's rho with a
    Miller-Rabin test, so any device count factors in milliseconds (a linear scan of 1e9 does not)."""
    out: dict[int, int] = {}
    for p in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37):
        while n % p == 0:
            out[p] = out.get(p, 0) + 1
            n //= p
    stack = [n] if n > 1 else []
    while stack:
        m = stack.pop()
        if _is_prime(m):
            out[m] = out.get(m, 0) + 1
        else:
            d = _pollard_rho(m)
            stack += [d, m // d]
    return dict(sorted(out.items()))


def _is_prime(n: int) -> bool:
    """Miller-Rabin; deterministic below 3.3e24 with these bases (Sorenson and Webster 2015)."""
    if n < 2:
        return False
    bases = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    if n in bases:
        return True
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in bases:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _pollard_rho(n: int) -> int:
    """A non-trivial factor of the odd composite n (no factor below 41)."""
    c = 1
    while True:
        x = y = 2
        d = 1
        while d == 1:
            x = (x * x + c) % n
            y = (y * y + c) % n
            y = (y * y + c) % n
            d = math.gcd(abs(x - y), n)
        if d != n:
            return d
        c += 1


def divisors(n: int) -> tuple[int, ...]:
    """The divisors of n, ascending (from its prime factors)."""
    out = [1]
    for p, e in prime_factors(n).items():
        out = [d * p ** k for d in out for k in range(e + 1)]
    return tuple(sorted(out))


def _meshes(devices: int, allowed: Callable[[str, int], bool] = lambda axis, size: True) -> Iterator[Mesh]:
    """Meshes with product `devices`, dp descending then pp, tp, cp, whose every axis size passes
    `allowed` (pruned axis by axis, so a huge device count costs what its few valid sizes cost)."""
    if not is_positive_int(devices):
        raise InvalidConfigError(f"devices must be a positive integer, got {devices!r}")
    divs = divisors(devices)
    ok = {axis: [d for d in divs if allowed(axis, d)] for axis in ("dp", "pp", "tp", "cp", "ep")}
    ep_ok = set(ok["ep"])
    for dp in reversed(ok["dp"]):
        for pp in (d for d in ok["pp"] if (devices // dp) % d == 0):
            for tp in (d for d in ok["tp"] if (devices // dp // pp) % d == 0):
                for cp in (d for d in ok["cp"] if (devices // dp // pp // tp) % d == 0):
                    ep = devices // dp // pp // tp // cp
                    if ep in ep_ok:
                        yield Mesh(dp=dp, pp=pp, tp=tp, cp=cp, ep=ep)


def factorizations(devices: int) -> tuple[Mesh, ...]:
    """Every (dp, pp, tp, cp, ep) with product `devices`, dp descending then pp, tp, cp."""
    return tuple(_meshes(devices))


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanQuestion:
    """What the rules are asked about: a model, a mesh and the plan's other choices. `strategies` None:
    whether SOME intra-op choices pass (the search's question); `chunks` None: pp. `world_size`,
    `schedule` and `stages` are None for a layout the planner or `sweep` considers (the rules of a whole
    plan then pass); `stages` () is an even split. `generate`: a generation replica's question (its batch
    and sequence are those `generate_violation` asks with)."""

    spec: ModelSpec
    mesh: Mesh
    global_batch: int
    seq_len: int
    micro_batch: int = 1
    zero: int = 0
    zeros: tuple[int, ...] = ()
    sequence_parallel: bool | tuple[bool, ...] = False
    strategies: tuple | None = ()
    chunks: int | None = None
    world_size: int | None = None
    schedule: Schedule | str | None = None
    virtual_stages: int = 1
    stages: tuple | None = None
    generate: bool = False

    @property
    def model_chunks(self) -> int:
        return self.mesh.pp if self.chunks is None else self.chunks


@dataclass(frozen=True, slots=True, kw_only=True)
class Rule:
    """One named rule: `checks` says what it requires, `violation(question)` gives its message (what was
    found, what to do) when the question breaks it, else None (a `PlanQuestion` for `RULES`, a
    `BackendQuestion` for `BACKEND_RULES`). `axis`: the one mesh axis it reads (the
    search prunes by it); `modes`: "train", "generate" or both."""

    name: str
    checks: str
    violation: Callable[[Any], str | None]
    axis: str | None = None
    modes: frozenset[str] = frozenset({"train", "generate"})


def refusal(spec: ModelSpec, axis: str) -> str | None:
    """Why `spec`'s facts refuse `axis` ("tp", "pp", "cp", "ep", "sequence_parallel"; "inference": generation and
    serving plans), or None."""
    for name, why in spec.refused:
        if name == axis:
            return f"{axis} is refused for {spec.name}: {why}"
    return None


def sequence_split_violation(seq: int, cp: int, *, balanced: bool, min_local: int = 1, model: str = "") -> str | None:
    """Why `seq` tokens cannot be split over `cp` ranks, or None: the balanced causal layout (LLaMA)
    cuts 2*cp chunks, the contiguous one (Mamba-2) cp slices of at least `min_local` tokens
    (conv_kernel - 1, the conv halo). The plan rule "cp-splits-sequence" and the runtime's check of
    each batch it splits (runtime/context_parallel.check_seq_len) both ask here."""
    if cp == 1:
        return None
    parts, what = (2 * cp, "2*cp") if balanced else (cp, "cp")
    where = f"cp={cp}, {model}" if model else f"cp={cp}"
    if seq % parts:
        return (f"sequence length {seq} is not divisible by {what} = {parts} ({where}); pad the "
                f"sequence to a multiple of {parts} or pick a smaller cp")
    if seq // cp < min_local:
        return (f"sequence length {seq} over cp={cp} leaves {seq // cp} tokens per rank, fewer than "
                f"conv_kernel-1 = {min_local} (a causal conv's halo: Mamba-2's, LFM2's); use a smaller cp")
    return None


def ep_violation(spec: ModelSpec, ep: int) -> str | None:
    """Expert parallelism needs experts, and ep must divide them (each rank holds experts/ep)."""
    if ep == 1:
        return None
    if not spec.is_moe:
        return f"ep={ep}: {spec.name} has no experts (not a mixture-of-experts model); use ep=1"
    if spec.experts % ep:
        return (f"ep ({ep}) does not divide the {spec.experts} experts of {spec.name}; use an ep that divides "
                f"{spec.experts}")
    return None


def excluded_eps(spec: ModelSpec, devices: int, meshes) -> tuple[tuple[int, str], ...]:
    """(ep, why) for every ep > 1 that divides `devices` but appears in none of `meshes` (the valid
    ones): the model has no experts, ep does not divide them, or every mesh with it broke a rule."""
    present = {m.ep for m in meshes}
    out = []
    for ep in divisors(devices)[1:]:
        if ep not in present:
            out.append((ep, ep_violation(spec, ep) or (
                f"no mesh with ep={ep} passes the other rules (dp x ep x micro-batch must divide the global "
                "batch; tp, pp and cp as usual)")))
    return tuple(out)


MIN_SEQ_LEN = 2  # a next-token loss predicts token i + 1 from tokens 0..i: one token leaves nothing to predict


def sizes_violation(*, global_batch, seq_len, micro_batch=1) -> str | None:
    """Why a training step's sizes cannot be (rules "sizes-positive", "sequence-predicts"), or None.
    `valid_meshes` and the command line (`seq_len` type) ask here too."""
    q = PlanQuestion(spec=None, mesh=Mesh(), global_batch=global_batch, seq_len=seq_len, micro_batch=micro_batch)
    return _sizes_positive(q) or _sequence_predicts(q)


def sequence_parallel_violation(spec: ModelSpec, mesh: Mesh, seq_len: int) -> str | None:
    """Why sequence parallelism cannot go with `mesh` and `seq_len`, or None: it splits each cp rank's
    seq_len / cp tokens over the tp ranks (attention, MoE and Mamba-2 models whose facts allow it)."""
    why = refusal(spec, "sequence_parallel")
    if why:
        return why
    if mesh.tp == 1:
        return ("sequence_parallel needs tp > 1 (it splits the sequence over the tensor-parallel ranks outside "
                "their sharded regions); set tp > 1 or sequence_parallel to false")
    local = seq_len // mesh.cp
    if local % mesh.tp:
        where = f"sequence length {seq_len}" + (f" over cp={mesh.cp} leaves {local} tokens per rank, which is"
                                                if mesh.cp > 1 else " is")
        return (f"sequence_parallel: {where} not divisible by tp={mesh.tp}; pad the sequence to a multiple of "
                f"tp x cp = {mesh.tp * mesh.cp}, pick a tp that divides {local}, or set sequence_parallel to false")
    return None


def zero_violation(mesh: Mesh, zero: int) -> str | None:
    """Why ZeRO level `zero` cannot go with `mesh`, or None (rule "zero-without-pipeline")."""
    if zero >= 2 and mesh.pp > 1:
        return (f"ZeRO-{zero} with pp={mesh.pp}: gradients are reduce-scattered after every micro-batch, which "
                "a pipeline schedule does not allow; use ZeRO-1 with pp > 1")
    return None


# -- the rules, one function each, in the order of RULES ----------------------------------------------

def _world_size(q: PlanQuestion) -> str | None:
    mesh, world = q.mesh, q.world_size
    if world is not None and mesh.size != world:
        return (f"the plan's mesh {mesh.as_dict()} multiplies to {mesh.size}, but the world size "
                f"is {world}; choose dp*pp*tp*cp*ep = {world}")
    return None


def _one_replica(q: PlanQuestion) -> str | None:
    if q.mesh.dp != 1 or q.mesh.cp != 1:
        return (f"generate runs one model replica: the plan has dp={q.mesh.dp}, cp={q.mesh.cp}; use a plan with "
                "dp = cp = 1 (tp, pp and ep as you like) and start one such world per replica")
    return None


def _sizes_positive(q: PlanQuestion) -> str | None:
    for name, value in (("global batch", q.global_batch), ("sequence length", q.seq_len),
                        ("micro_batch", q.micro_batch)):
        if not is_positive_int(value):
            return f"{name} must be a positive integer, got {value!r}"
    return None


def _sequence_predicts(q: PlanQuestion) -> str | None:
    if q.seq_len < MIN_SEQ_LEN:
        return (f"sequence length {q.seq_len}: training predicts each next token, so a sequence needs at least "
                f"{MIN_SEQ_LEN} tokens; give a sequence length >= {MIN_SEQ_LEN}")
    return None


def _refused(axis: str) -> Callable[[PlanQuestion], str | None]:
    return lambda q: refusal(q.spec, axis) if getattr(q.mesh, axis) > 1 else None


def _pp_layers(q: PlanQuestion) -> str | None:
    pp, spec = q.mesh.pp, q.spec
    if pp > spec.layers:
        return (f"pp ({pp}) is larger than the number of blocks (layers) of {spec.name} ({spec.layers}); "
                f"use pp <= {spec.layers}")
    return None


def _dp_batch(q: PlanQuestion) -> str | None:
    per_step = q.mesh.dp * q.micro_batch
    if q.global_batch % per_step:
        return (f"global batch {q.global_batch} is not divisible by dp ({q.mesh.dp}) x micro_batch "
                f"({q.micro_batch}) = {per_step}; pick a global batch that is a multiple of {per_step}")
    return None


def _cp_split(q: PlanQuestion) -> str | None:
    spec = q.spec
    if not spec.cp_contiguous:  # 2*cp chunks (balanced causal layout, runtime/context_parallel.py)
        return sequence_split_violation(q.seq_len, q.mesh.cp, balanced=True, model=spec.name)
    return sequence_split_violation(q.seq_len, q.mesh.cp, balanced=False, min_local=spec.cp_halo, model=spec.name)


def _ep_batch(q: PlanQuestion) -> str | None:
    mesh = q.mesh
    per_step = rows_per_microbatch(mesh, q.micro_batch)
    if mesh.ep > 1 and q.global_batch % per_step:  # the ep peers take their own rows too
        return (f"global batch {q.global_batch} is not divisible by dp ({mesh.dp}) x ep ({mesh.ep}) x micro_batch "
                f"({q.micro_batch}) = {per_step}; pick a global batch that is a multiple of {per_step}")
    return None


def _sequence_parallel(q: PlanQuestion) -> str | None:
    sp = q.sequence_parallel
    some = any(sp) if isinstance(sp, tuple) else sp
    return sequence_parallel_violation(q.spec, q.mesh, q.seq_len) if some else None


def _choices(q: PlanQuestion) -> str | None:
    strategies = () if q.strategies is None else q.strategies
    per_stage = isinstance(q.sequence_parallel, tuple) or any(isinstance(v, tuple) for _, v in strategies)
    if not (strategies or per_stage):
        return None
    return choice_violation(q.spec, q.mesh.tp, strategies, sequence_parallel=q.sequence_parallel,
                            chunks=q.model_chunks)


def _zero_runtime(q: PlanQuestion) -> str | None:
    if q.zero not in (q.zeros or RUNTIME_ZERO):
        return (f"zero={q.zero} (parameter sharding) is not supported by the runtime yet; use zero="
                f"{max(RUNTIME_ZERO)} (gradients and optimizer state sharded over dp) or lower")
    return None


def _raised(check: Callable[[], object]) -> str | None:
    """The message of the InvalidConfigError `check` raises (the rules shared with ir and schedules), or None."""
    try:
        check()
    except InvalidConfigError as e:
        return str(e)
    return None


def _schedule(q: PlanQuestion) -> str | None:
    mesh = q.mesh
    if q.schedule is None or mesh.pp == 1:
        return None
    return _raised(lambda: check_chunks(q.schedule, q.virtual_stages, pp=mesh.pp, layers=q.model_chunks,
                                        microbatches=microbatches_per_step(q.global_batch, mesh, q.micro_batch)))


def _stage_split(q: PlanQuestion) -> str | None:
    spec = q.spec
    if q.stages is None:
        return None
    if q.stages:
        return _raised(lambda: check_stages(q.stages, num_layers=spec.layers, pp=q.model_chunks))
    if q.model_chunks > spec.layers:
        return (f"pp ({q.mesh.pp}) x virtual_stages ({q.virtual_stages}) = {q.model_chunks} model "
                f"chunks, more than the {spec.layers} blocks of {spec.name} an even split can give "
                "one each; use fewer virtual_stages or give the plan's stages (empty first / last "
                "chunks allowed)")
    return None


GENERATE = frozenset({"generate"})
TRAIN = frozenset({"train"})

RULES: tuple[Rule, ...] = (
    Rule(name="world-size", checks="the mesh multiplies to the world size it runs on", violation=_world_size),
    Rule(name="one-replica", checks="generation runs one model replica: dp = cp = 1", violation=_one_replica,
         modes=GENERATE),
    Rule(name="serving-refused", checks="generation only where the model's facts allow it",
         violation=lambda q: refusal(q.spec, "inference"), modes=GENERATE),
    Rule(name="sizes-positive", checks="global batch, sequence length and micro-batch are positive integers",
         violation=_sizes_positive),
    Rule(name="sequence-predicts", checks=f"a training sequence holds at least {MIN_SEQ_LEN} tokens",
         violation=_sequence_predicts),
    Rule(name="ep-refused", checks="ep > 1 only where the model's facts allow it", violation=_refused("ep"), axis="ep"),
    Rule(name="ep-divides-experts", checks="ep > 1 needs experts, and ep divides them",
         violation=lambda q: ep_violation(q.spec, q.mesh.ep), axis="ep"),
    Rule(name="tp-refused", checks="tp > 1 only where the model's facts allow it", violation=_refused("tp"), axis="tp"),
    Rule(name="tp-divides", checks="tp divides every count the sharding table splits (heads, widths, vocabulary)",
         violation=lambda q: tp_violation(q.spec, q.mesh.tp, q.strategies), axis="tp"),
    Rule(name="pp-refused", checks="pp > 1 only where the model's facts allow it", violation=_refused("pp"), axis="pp"),
    Rule(name="pp-layers", checks="pp is at most the number of layers", violation=_pp_layers, axis="pp"),
    Rule(name="dp-refused", checks="dp > 1 only where the model's facts allow it", violation=_refused("dp"), axis="dp"),
    Rule(name="dp-divides-batch", checks="dp x micro_batch divides the global batch", violation=_dp_batch, axis="dp"),
    Rule(name="cp-refused", checks="cp > 1 only where the model's facts allow it", violation=_refused("cp"), axis="cp"),
    Rule(name="cp-splits-sequence", checks="cp splits the sequence: 2*cp chunks (attention), cp slices of at least "
         "conv_kernel - 1 tokens (Mamba-2)", violation=_cp_split, axis="cp"),
    Rule(name="ep-divides-batch", checks="dp x ep x micro_batch divides the global batch (the ep ranks take rows)",
         violation=_ep_batch),
    Rule(name="zero-without-pipeline", checks="ZeRO-2 and -3 need pp = 1",
         violation=lambda q: zero_violation(q.mesh, q.zero)),
    Rule(name="sequence-parallel", checks="sequence parallelism needs tp > 1, a model that runs it, and tp "
         "dividing each cp rank's tokens", violation=_sequence_parallel),
    Rule(name="intra-op-choices", checks="the plan's intra-op choices are ones the sharding table offers at its tp",
         violation=_choices),
    Rule(name="zero-runtime", checks="the ZeRO level is one the runtime runs", violation=_zero_runtime),
    Rule(name="schedule-microbatches", checks="the pipeline schedule accepts the step's micro-batches",
         violation=_schedule, modes=TRAIN),
    Rule(name="stage-split", checks="the stages cover the layers in order, one model chunk each",
         violation=_stage_split),
)


def broken_rule(q: PlanQuestion) -> tuple[Rule, str] | None:
    """The first rule of `RULES` (in its order) that `q` breaks, with its message, or None."""
    mode = "generate" if q.generate else "train"
    for rule in RULES:
        if mode in rule.modes:
            why = rule.violation(q)
            if why:
                return rule, why
    return None


def axis_violation(spec: ModelSpec, axis: str, size: int, *, global_batch: int, seq_len: int,
                   micro_batch: int = 1, strategies=None) -> str | None:
    """The first rule of one mesh axis that `size` on `axis` alone breaks, or None (the search's prune).
    `strategies`: the plan's intra-op choices (tp's rule depends on them: `sharding.tp_violation`);
    None: whether some choices pass."""
    q = PlanQuestion(spec=spec, mesh=Mesh(**{axis: size}), global_batch=global_batch, seq_len=seq_len,
                     micro_batch=micro_batch, strategies=strategies)
    for rule in RULES:
        if rule.axis == axis:
            why = rule.violation(q)
            if why:
                return why
    return None


def plan_violation(spec: ModelSpec, mesh: Mesh, *, global_batch: int, seq_len: int, micro_batch: int = 1,
                   zero: int = 0, zeros: tuple[int, ...] = (), sequence_parallel: bool | tuple[bool, ...] = False,
                   strategies=(), chunks: int | None = None) -> str | None:
    """The first rule this layout breaks for `spec` (a layout of the search or `sweep`: no world, schedule
    or stage split yet), worded for the user, or None. `zeros`: the ZeRO levels allowed (default
    `RUNTIME_ZERO`; the cost model prices 0-3); `strategies`: as `PlanQuestion`; `sequence_parallel` and
    the layer choices of `strategies` may list one value per model chunk (`chunks`, default pp)."""
    found = broken_rule(PlanQuestion(spec=spec, mesh=mesh, global_batch=global_batch, seq_len=seq_len,
                                     micro_batch=micro_batch, zero=zero, zeros=zeros,
                                     sequence_parallel=sequence_parallel, strategies=strategies, chunks=chunks))
    return found and found[1]


def _generation(spec: ModelSpec, mesh: Mesh, **fields) -> PlanQuestion:
    """A generation replica's question: generation does not split the batch over ep (every ep rank holds
    the same sequences), so the batch rules are asked with a batch of ep, and MIN_SEQ_LEN stands for any
    prompt (cp = 1 there); no micro-batches, ZeRO or sequence parallelism (decode runs those layers whole)."""
    return PlanQuestion(spec=spec, mesh=mesh, global_batch=mesh.ep, seq_len=MIN_SEQ_LEN, generate=True, **fields)


def plan_question(plan: Plan, spec: ModelSpec, *, world_size: int | None = None,
                  generate: bool = False) -> PlanQuestion:
    """What `check_plan` asks the rules about `plan`."""
    whole = dict(world_size=world_size, strategies=plan.strategies, chunks=plan.chunks,
                 virtual_stages=plan.virtual_stages, stages=plan.stages)
    if generate:
        return _generation(spec, plan.mesh, **whole)
    return PlanQuestion(spec=spec, mesh=plan.mesh, global_batch=plan.global_batch, seq_len=plan.seq_len,
                        micro_batch=plan.micro_batch, zero=plan.zero, sequence_parallel=plan.sequence_parallel,
                        schedule=plan.schedule, **whole)


def check_plan(plan: Plan, spec: ModelSpec, *, world_size: int | None = None, generate: bool = False) -> None:
    """InvalidConfigError with the first rule of `RULES` that `plan` breaks for `spec` (on `world_size`
    ranks, when given). No communication: every rank raises the same error before any collective.
    `generate`: the plan of a generation replica (`parallelize` of an inference plan), asked by the
    generation rules instead of the training batch and schedule ones."""
    found = broken_rule(plan_question(plan, spec, world_size=world_size, generate=generate))
    if found:
        raise InvalidConfigError(found[1])


def generate_violation(spec: ModelSpec, mesh: Mesh, *, strategies=(), chunks: int | None = None) -> str | None:
    """Why `DistributedModel.generate` (runtime/generate.py) cannot run one replica of `mesh`, or None:
    one replica (dp = cp = 1), any tp, pp and ep the plan rules allow, any sequence parallelism (decode
    runs those layers on the whole sequence). The runtime's `generate` and the inference planner
    (passes/serving/serving.py) both ask here; `strategies` and `chunks`: those of the plan generating,
    the default layout for the inference planner's replicas."""
    found = broken_rule(_generation(spec, mesh, strategies=strategies, chunks=chunks))
    return found and found[1]


# -- what the torch.compile backend adds (autoshard.backend, runtime/shard_graph.py) ------------------
# It rewrites the graph Dynamo traced: the weights sliced over tp with an all-reduce after each
# row-parallel matmul, the batch split over dp. Its rules are asked about (plan, spec).
BackendQuestion = tuple[Plan, ModelSpec]


def _backend_axes(q: BackendQuestion) -> str | None:
    plan, _ = q
    mesh = plan.mesh
    for axis in ("pp", "cp", "ep"):
        if getattr(mesh, axis) > 1:
            per_stage = " (and with it per-stage choices)" if axis == "pp" and plan.per_stage else ""
            return (f"{axis}={getattr(mesh, axis)}{per_stage} is not supported by the torch.compile backend (it "
                    "shards data and tensors only); use autoshard.parallelize for pipeline, context and expert "
                    "parallelism")
    return None


def _backend_sequence_parallel(q: BackendQuestion) -> str | None:
    plan, _ = q
    if plan.sequence_parallel:
        return ("sequence_parallel is not supported by the torch.compile backend: it slices the traced graph's "
                "weights over tp and all-reduces their partial sums (runtime/shard_graph.py), keeping the norms "
                "and residual stream whole; use autoshard.parallelize, which runs sequence parallelism, or "
                "sequence_parallel false here (the same numbers, more activation memory per device)")
    return None


def _backend_zero(q: BackendQuestion) -> str | None:
    plan, _ = q
    if plan.zero:
        return (f"zero={plan.zero}: the torch.compile backend keeps optimizer state whole; use zero=0 here or "
                "autoshard.parallelize for ZeRO-1/2/3")
    return None


def _backend_fp8(q: BackendQuestion) -> str | None:
    plan, _ = q
    if plan.precision is Precision.FP8:
        return ("precision 'fp8' is not supported by the torch.compile backend (it slices the traced graph's weights "
                "and keeps its matmuls); use autoshard.parallelize, which runs torchao's float8 training")
    return None


def _backend_tp(q: BackendQuestion) -> str | None:
    plan, spec = q
    if plan.mesh.tp > 1 and spec.mixer is not Mixer.ATTENTION:
        return (f"tp={plan.mesh.tp} for {spec.name}: Dynamo bakes the Mamba-2 mixer's head counts into the "
                "graph, so the backend cannot shard it; use autoshard.parallelize for Mamba-2 tensor parallelism, "
                "or tp=1 here")
    return None


BACKEND_RULES: tuple[Rule, ...] = (
    Rule(name="backend-dp-tp-only", checks="the backend runs dp x tp only: pp = cp = ep = 1",
         violation=_backend_axes),
    Rule(name="backend-no-sequence-parallel", checks="the backend keeps norms and residual whole",
         violation=_backend_sequence_parallel),
    Rule(name="backend-zero-0", checks="the backend keeps optimizer state whole: ZeRO-0",
         violation=_backend_zero),
    Rule(name="backend-no-fp8", checks="the backend keeps the traced matmuls: no fp8", violation=_backend_fp8),
    Rule(name="backend-tp-attention", checks="the backend shards attention models over tp (Dynamo bakes Mamba-2 "
         "head counts)", violation=_backend_tp),
)


def backend_violation(spec: ModelSpec, plan: Plan) -> str | None:
    """Why the torch.compile backend (`autoshard.backend`, runtime/shard_graph.py) cannot run `plan`, or
    None: the first of `BACKEND_RULES` it breaks. `parallelize` runs all of these; `backend` asks here
    before `check_plan`."""
    for rule in BACKEND_RULES:
        why = rule.violation((plan, spec))
        if why:
            return why
    return None


RUNTIME_ZERO = (0, 1, 2, 3)  # the ZeRO levels the runtime runs (3: FSDP2, runtime/zero3.py)
# the (pipeline schedule, virtual stages) pairs runtime/pipeline.py runs that the planner chooses
# among: 1F1B; interleaved 1F1B with 2 or 4 model chunks per rank (ScheduleInterleaved1F1B);
# zero-bubble with one chunk per rank (ScheduleInterleavedZeroBubble) or two in a V
# (ScheduleZBVZeroBubble). GPipe runs too but never beats 1F1B (the same bubble, every micro-batch
# in flight), so it is not searched; a plan may still ask for it.
RUNTIME_SCHEDULES = (("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 4), ("zero-bubble", 1),
                     ("zero-bubble", 2))
# the sequence_parallel values the planner searches (True only with tp > 1 where
# `sequence_parallel_violation` passes): runtime/tensor_parallel.py runs both
RUNTIME_SEQUENCE_PARALLEL = (False, True)



def valid_meshes(spec: ModelSpec, devices: int, *, global_batch: int, seq_len: int,
                 micro_batch: int = 1) -> tuple[Mesh, ...]:
    """Every valid mesh; raises InvalidConfigError naming each candidate's broken rule if none."""
    why = sizes_violation(global_batch=global_batch, seq_len=seq_len, micro_batch=micro_batch)
    if why:
        raise InvalidConfigError(why)
    if global_batch % micro_batch:
        raise InvalidConfigError(f"micro-batch {micro_batch} does not divide the global batch {global_batch}; "
                                 "no dp x micro-batch can divide it: pick a micro-batch that divides it")
    rules = dict(global_batch=global_batch, seq_len=seq_len, micro_batch=micro_batch, strategies=None)  # some choices
    good = tuple(m for m in _meshes(devices, lambda axis, size: axis_violation(spec, axis, size, **rules) is None)
                 if plan_violation(spec, m, **rules) is None)  # the rules of two axes (dp x ep x micro-batch)
    if good:
        return good
    dense = (m for m in _meshes(devices) if m.ep == 1 or spec.is_moe)  # lazily: a huge device count has very many
    shown = [f"({m.dp},{m.pp},{m.tp},{m.cp},{m.ep}): {plan_violation(spec, m, **rules)}"
             for m in itertools.islice(dense, 12)]
    more = _dense_count(devices) - len(shown)
    raise InvalidConfigError(
        f"no valid (dp,pp,tp,cp,ep) factorisation of {devices} devices for {spec.name} "
        f"(global batch {global_batch}, seq {seq_len}, micro-batch {micro_batch}); "
        + ("" if spec.is_moe else "ep>1 ruled out everywhere (no experts); ") + "; ".join(shown) + (f"; ... and {more} more" if more else "")
        + ". Change the device count, global batch or sequence length"
    )


def _dense_count(devices: int) -> int:
    """How many (dp, pp, tp, cp) multiply to `devices`: per prime p^e, C(e + 3, 3) ways to spread it."""
    return math.prod(math.comb(e + 3, 3) for e in prime_factors(devices).values())


@functools.lru_cache(maxsize=16)
def mesh_micro_batches(spec: ModelSpec, devices: int, *, global_batch: int, seq_len: int,
                       micro_batches: tuple[int, ...] = (1, 2, 4, 8)) -> tuple[tuple[Mesh, int], ...]:
    """Every (valid mesh, micro-batch) pair the planner searches: for each mesh of
    `factorizations` and each micro-batch in `micro_batches`, the pair when `plan_violation`
    finds no broken rule (so dp x ep x micro-batch divides the global batch; ep > 1 only for a
    mixture of experts whose experts it divides).
    Empty when no pair is valid (the caller words the error). Memoised: the planner asks once per precision
    and again on a re-plan of the same shape."""
    rules = dict(global_batch=global_batch, seq_len=seq_len, strategies=None)  # some intra-op choices pass
    out = []
    for mesh in _meshes(devices, lambda axis, size: axis_violation(spec, axis, size, **rules) is None):
        for mb in micro_batches:
            if plan_violation(spec, mesh, **rules, micro_batch=mb) is None:
                out.append((mesh, mb))
    return tuple(out)
