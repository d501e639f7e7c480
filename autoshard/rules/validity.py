"""Plan validation and layouts: the one set of rules a plan must pass, and every valid mesh.

Contract
  `plan_violation(spec, mesh, *, global_batch, seq_len, micro_batch=1, zero=0, sequence_parallel=False)` gives the first
  rule a plan breaks (None if it runs), `check_plan(plan, spec, world_size=)` raises it (and a bad
  stage split, `ir.check_stages`) as `InvalidConfigError`. These are THE rules: the runtime
  (`parallelize`, `backend`), the planner (`solve` searches only layouts that pass), `sweep`,
  `show` and the cost model all call them, so the planner never emits a plan the runtime refuses
  (tests/rules/test_plan_validity.py).
  `generate_violation(spec, mesh)`: the rules `DistributedModel.generate` adds (one replica:
  dp = cp = 1); the inference planner searches only layouts that pass it, and `check_plan(...,
  generate=True)` (`parallelize` of an inference plan) checks by it instead of the training batch
  and schedule rules.
  `backend_violation(spec, plan)`: what the torch.compile backend (`autoshard.backend`) runs on top
  (dp x tp only, ZeRO-0, no sequence parallelism, tp for LLaMA); `backend` asks here first. The
  planner plans for `parallelize`, not for the backend.
  `valid_meshes(spec, devices, *, global_batch, seq_len, micro_batch=1) -> tuple[Mesh, ...]`
  lists every mesh with dp*pp*tp*cp*ep == devices that passes them, in a fixed order (dp
  descending, then pp, tp, cp); if none passes it raises `InvalidConfigError` saying which rule
  ruled each candidate out.

Every mesh rule below concerns one axis (`axis_violation`), so the search prunes axis by axis: the
sizes each axis may take are the device count's divisors (from its prime factors, Pollard's rho:
milliseconds for any count) that pass that axis's rules, and only their products are built. A
billion devices cost what their few valid sizes cost, not a scan of every divisor product. A
rule that ties two axes together belongs in `plan_violation`, after the per-axis ones.

Rules (the runtime's, see DESIGN.md):
  ep    1 for a dense model; for a mixture of experts (Mixtral, Qwen2-MoE) ep divides the experts
        (`ep_violation`); the ep ranks also split the batch (EP folds into DP), so dp x ep x
        micro_batch divides the global batch (a rule of two axes: checked in `plan_violation`).
  tp    splits every count the family's sharding table splits (`sharding.tp_violation`): LLaMA's
        heads, MLP width and vocabulary, and its KV heads or a multiple of them (each KV head
        then kept by tp / kv_heads ranks); Mamba-2's heads, groups and vocabulary. The vocabulary
        only where the plan keeps the embedding or head vocab-parallel: with both replicated
        (strategies) any tp may go with any vocabulary, so the tp axis alone passes a tp that
        only the vocabulary rules out, and the plan's strategies are checked against it.
  pp    at most the number of layers (every stage holds at least one layer).
  dp    dp x micro_batch divides the global batch.
  cp    LLaMA: 2*cp divides the sequence (load-balanced causal split, chunks i and 2cp-1-i).
        Mamba-2: cp divides the sequence, and each rank keeps at least conv_kernel - 1 tokens.
  SP    `sequence_parallel` (Megatron's sequence parallelism) needs tp > 1, and tp divides each cp
        rank's seq_len / cp tokens (`sequence_parallel_violation`); dense LLaMA and Mamba-2 only.
        It may list one bool per model chunk (pp x virtual_stages of them); those rules then hold
        when any chunk is on.
  strategies  the plan's intra-op choices are ones the family's table offers at its tp
        (`sharding.choice_violation`: vocab-parallel or replicated embedding / head, Mamba-2 groups
        split or whole where tp divides them; a tied model's embedding and head alike; a replicated
        embedding / head not on a sequence-parallel first / last chunk). A layer choice ("groups")
        may list one option per model chunk.
  ZeRO  0-3; levels 2 and 3 need pp = 1 (`zero_violation`): they reduce gradients after every
        micro-batch, which a pipeline schedule's accumulation does not allow (DeepSpeed's rule too).
        The runtime runs every level (`RUNTIME_ZERO`, what the planner searches): 1-2 in
        runtime/data_parallel.py, 3 through FSDP2 (runtime/zero3.py). Under ep every level runs per
        group: the dense weights over dp x ep x cp, the experts over dp x cp (ZeRO-1/2: GradSyncs in
        runtime/dist_model.py; ZeRO-3: an FSDP2 unit per experts module over dp x cp, torchtitan's way).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator

from autoshard.errors import InvalidConfigError
from autoshard.ir import Mesh, Plan, Precision, check_stages, is_positive_int
from autoshard.model_spec import Mixer, ModelSpec
from autoshard.rules.schedules import check_chunks
from autoshard.rules.sharding import choice_violation, sequence_violation, tp_violation


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


def axis_violation(spec: ModelSpec, axis: str, size: int, *, global_batch: int, seq_len: int,
                   micro_batch: int = 1, strategies=None) -> str | None:
    """The rule of the module docstring that `size` on mesh axis `axis` alone breaks, or None.
    `strategies`: the plan's intra-op choices (tp's rule depends on them: `sharding.tp_violation`);
    None: whether some choices pass (the search's prune). An axis the model's facts refuse
    (`ModelSpec.refused`, models/facts.py) is refused by name at any size above 1."""
    if size > 1:
        why = refusal(spec, axis)
        if why:
            return why
    if axis == "ep":
        return ep_violation(spec, size)
    if axis == "tp":
        return tp_violation(spec, size, strategies)
    if axis == "pp":
        if size > spec.layers:
            return (f"pp ({size}) is larger than the number of blocks (layers) of {spec.name} ({spec.layers}); "
                    f"use pp <= {spec.layers}")
        return None
    if axis == "dp":
        per_step = size * micro_batch
        if global_batch % per_step:
            return (f"global batch {global_batch} is not divisible by dp ({size}) x micro_batch ({micro_batch}) = "
                    f"{per_step}; pick a global batch that is a multiple of {per_step}")
        return None
    return _cp_violation(spec, size, seq_len)


def refusal(spec: ModelSpec, axis: str) -> str | None:
    """Why `spec`'s facts refuse `axis` ("tp", "pp", "cp", "ep", "sequence_parallel"), or None."""
    for name, why in spec.refused:
        if name == axis:
            return f"{axis} is refused for {spec.name}: {why}"
    return None


def _cp_violation(spec: ModelSpec, cp: int, seq: int) -> str | None:
    """Attention splits the sequence in 2*cp chunks (balanced causal layout), the SSD scan in cp contiguous
    slices of at least conv_kernel-1 tokens (runtime/context_parallel.py)."""
    if spec.mixer is Mixer.ATTENTION:
        return sequence_split_violation(seq, cp, balanced=True, model=spec.name)
    return sequence_split_violation(seq, cp, balanced=False, min_local=spec.conv - 1, model=spec.name)


def sequence_split_violation(seq: int, cp: int, *, balanced: bool, min_local: int = 1, model: str = "") -> str | None:
    """Why `seq` tokens cannot be split over `cp` ranks, or None: the balanced causal layout (LLaMA)
    cuts 2*cp chunks, the contiguous one (Mamba-2) cp slices of at least `min_local` tokens
    (conv_kernel - 1, the conv halo). The plan rule above and the runtime's check of each batch it
    splits (runtime/context_parallel.check_seq_len) both ask here."""
    if cp == 1:
        return None
    parts, what = (2 * cp, "2*cp") if balanced else (cp, "cp")
    where = f"cp={cp}, {model}" if model else f"cp={cp}"
    if seq % parts:
        return (f"sequence length {seq} is not divisible by {what} = {parts} ({where}); pad the "
                f"sequence to a multiple of {parts} or pick a smaller cp")
    if seq // cp < min_local:
        return (f"sequence length {seq} over cp={cp} leaves {seq // cp} tokens per rank, fewer than "
                f"conv_kernel-1 = {min_local} (Mamba-2 conv halo); use a smaller cp")
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


_RULE_ORDER = ("ep", "tp", "pp", "dp", "cp")  # the order plan_violation reports broken rules in


def plan_violation(spec: ModelSpec, mesh: Mesh, *, global_batch: int, seq_len: int, micro_batch: int = 1,
                   zero: int = 0, zeros: tuple[int, ...] = (), sequence_parallel: bool | tuple[bool, ...] = False,
                   strategies=(), chunks: int | None = None) -> str | None:
    """The first rule (module docstring) that this plan breaks for `spec`, worded for the user
    (what was found, what to do), or None. `zeros`: the ZeRO levels allowed (default
    `RUNTIME_ZERO`; the cost model prices 0-3); `strategies`: the plan's intra-op choices
    (`sharding.choice_violation`: each a choice the table offers at this tp; () the table's default
    layout), None for "some choices" (the search's question: a tp that only the vocabulary rules out
    passes, as the replicated embedding and head run it); `sequence_parallel` and the layer choices of
    `strategies` may list one value per model chunk (`chunks`, default pp)."""
    why = sizes_violation(global_batch=global_batch, seq_len=seq_len, micro_batch=micro_batch)
    if why:
        return why
    for axis in _RULE_ORDER:
        why = axis_violation(spec, axis, getattr(mesh, axis), global_batch=global_batch, seq_len=seq_len,
                             micro_batch=micro_batch, strategies=strategies)
        if why:
            return why
    per_step = mesh.dp * mesh.ep * micro_batch
    if mesh.ep > 1 and global_batch % per_step:  # the ep peers take their own rows too
        return (f"global batch {global_batch} is not divisible by dp ({mesh.dp}) x ep ({mesh.ep}) x micro_batch "
                f"({micro_batch}) = {per_step}; pick a global batch that is a multiple of {per_step}")
    chunks = mesh.pp if chunks is None else chunks
    strategies = () if strategies is None else strategies
    some = any(sequence_parallel) if isinstance(sequence_parallel, tuple) else sequence_parallel
    per_stage = isinstance(sequence_parallel, tuple) or any(isinstance(v, tuple) for _, v in strategies)
    why = (zero_violation(mesh, zero) or (sequence_parallel_violation(spec, mesh, seq_len) if some else None)
           or (choice_violation(spec, mesh.tp, strategies, sequence_parallel=sequence_parallel, chunks=chunks)
               if strategies or per_stage else None))
    if why:
        return why
    if zero not in (zeros or RUNTIME_ZERO):
        return (f"zero={zero} (parameter sharding) is not supported by the runtime yet; use zero="
                f"{max(RUNTIME_ZERO)} (gradients and optimizer state sharded over dp) or lower")
    return None


MIN_SEQ_LEN = 2  # a next-token loss predicts token i + 1 from tokens 0..i: one token leaves nothing to predict


def sizes_violation(*, global_batch, seq_len, micro_batch=1) -> str | None:
    """Why a training step's sizes cannot be (not positive integers; fewer than `MIN_SEQ_LEN` tokens a
    sequence), or None. `plan_violation`, `valid_meshes` and the command line (`seq_len` type) ask here."""
    for name, value in (("global batch", global_batch), ("sequence length", seq_len), ("micro_batch", micro_batch)):
        if not is_positive_int(value):
            return f"{name} must be a positive integer, got {value!r}"
    if seq_len < MIN_SEQ_LEN:
        return (f"sequence length {seq_len}: training predicts each next token, so a sequence needs at least "
                f"{MIN_SEQ_LEN} tokens; give a sequence length >= {MIN_SEQ_LEN}")
    return None


def check_plan(plan: Plan, spec: ModelSpec, *, world_size: int | None = None, generate: bool = False) -> None:
    """InvalidConfigError if `plan` cannot run `spec` (on `world_size` ranks, when given). No
    communication: every rank raises the same error before any collective. `sweep`, `plan`,
    `show` and `parallelize` all check plans here. `generate`: the plan of a generation replica
    (`parallelize` of an inference plan): `generate_violation`'s rules instead of the training
    batch and schedule rules (generation runs no micro-batches: any batch, any pipeline)."""
    mesh = plan.mesh
    if world_size is not None and mesh.size != world_size:
        raise InvalidConfigError(f"the plan's mesh {mesh.as_dict()} multiplies to {mesh.size}, but the world size "
                                 f"is {world_size}; choose dp*pp*tp*cp*ep = {world_size}")
    if generate:
        why = generate_violation(spec, mesh, strategies=plan.strategies, chunks=plan.chunks)
    else:
        why = plan_violation(spec, mesh, global_batch=plan.global_batch, seq_len=plan.seq_len,
                             micro_batch=plan.micro_batch, zero=plan.zero, sequence_parallel=plan.sequence_parallel,
                             strategies=plan.strategies, chunks=plan.chunks)
    if why:
        raise InvalidConfigError(why)
    if mesh.pp > 1 and not generate:  # the schedule's micro-batch rules (torch's pipelining schedules); chunks vs layers below
        check_chunks(plan.schedule, plan.virtual_stages, pp=mesh.pp, layers=plan.chunks,
                     microbatches=plan.global_batch // (mesh.dp * mesh.ep * plan.micro_batch))
    if plan.stages:
        check_stages(plan.stages, num_layers=spec.layers, pp=plan.chunks)
    elif plan.chunks > spec.layers:
        raise InvalidConfigError(f"pp ({mesh.pp}) x virtual_stages ({plan.virtual_stages}) = {plan.chunks} model "
                                 f"chunks, more than the {spec.layers} blocks of {spec.name} an even split can give "
                                 "one each; use fewer virtual_stages or give the plan's stages (empty first / last "
                                 "chunks allowed)")


def generate_violation(spec: ModelSpec, mesh: Mesh, *, strategies=(), chunks: int | None = None) -> str | None:
    """Why `DistributedModel.generate` (runtime/generate.py) cannot run one replica of `mesh`, or None.
    Generation runs one model replica: dp = cp = 1 (serve more replicas by starting one such world
    each; the prompt's context parallelism is not run in decode), with any tp, pp and ep the plan
    rules allow (virtual stages and Mamba-2 groups kept whole included; ep > 1 for MoE models: every
    ep rank holds the same sequences and slices the experts, runtime/expert_parallel.py), and any
    sequence parallelism, uniform or per stage: a decode step's one token cannot be split over tp, so
    generation runs those layers on the whole sequence (runtime/tensor_parallel.py
    `sequence_parallel_off`; the same weights, all-reduce for reduce-scatter + all-gather).
    The runtime's `generate` and the inference planner (passes/serving/serving.py) both ask here; `strategies` and
    `chunks`: those of the plan generating (a replicated embedding and head generate too, with a vocabulary
    tp does not divide), the default layout for the inference planner's replicas."""
    if mesh.dp != 1 or mesh.cp != 1:
        return (f"generate runs one model replica: the plan has dp={mesh.dp}, cp={mesh.cp}; use a plan with "
                "dp = cp = 1 (tp, pp and ep as you like) and start one such world per replica")
    # generation does not split the batch over ep (every ep rank holds the same sequences): the
    # training rule that ep divides the batch is met by asking with a batch of ep
    # and the sequence rules (cp = 1 here) hold for any prompt: MIN_SEQ_LEN stands for its length;
    return plan_violation(spec, mesh, global_batch=mesh.ep, seq_len=MIN_SEQ_LEN, strategies=strategies, chunks=chunks)


def backend_violation(spec: ModelSpec, plan: Plan) -> str | None:
    """Why the torch.compile backend (`autoshard.backend`, runtime/shard_graph.py) cannot run `plan`,
    or None. It rewrites the graph Dynamo traced: the weights sliced over tp with an all-reduce after
    each row-parallel matmul, the batch split over dp. So dp x tp only (no pipeline, context or expert
    parallelism, hence no per-stage choices), ZeRO-0, tp for LLaMA (Dynamo bakes the Mamba-2 mixer's
    head counts into the graph), and no sequence parallelism: the graph's norms and residual stream
    stay whole (a plan with it off computes the same numbers, with more activation memory).
    `parallelize` runs all of these."""
    mesh = plan.mesh
    for axis in ("pp", "cp", "ep"):
        if getattr(mesh, axis) > 1:
            per_stage = " (and with it per-stage choices)" if axis == "pp" and plan.per_stage else ""
            return (f"{axis}={getattr(mesh, axis)}{per_stage} is not supported by the torch.compile backend (it "
                    "shards data and tensors only); use autoshard.parallelize for pipeline, context and expert "
                    "parallelism")
    if plan.sequence_parallel:
        return ("sequence_parallel is not supported by the torch.compile backend: it slices the traced graph's "
                "weights over tp and all-reduces their partial sums (runtime/shard_graph.py), keeping the norms "
                "and residual stream whole; use autoshard.parallelize, which runs sequence parallelism, or "
                "sequence_parallel false here (the same numbers, more activation memory per device)")
    if plan.zero:
        return (f"zero={plan.zero}: the torch.compile backend keeps optimizer state whole; use zero=0 here or "
                "autoshard.parallelize for ZeRO-1/2/3")
    if plan.precision is Precision.FP8:
        return ("precision 'fp8' is not supported by the torch.compile backend (it slices the traced graph's weights "
                "and keeps its matmuls); use autoshard.parallelize, which runs torchao's float8 training")
    if mesh.tp > 1 and spec.mixer is not Mixer.ATTENTION:
        return (f"tp={mesh.tp} for {spec.name}: Dynamo bakes the Mamba-2 mixer's head counts into the "
                "graph, so the backend cannot shard it; use autoshard.parallelize for Mamba-2 tensor parallelism, "
                "or tp=1 here")
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


def sequence_parallel_violation(spec: ModelSpec, mesh: Mesh, seq_len: int) -> str | None:
    """Why sequence parallelism cannot go with `mesh` and `seq_len` (module docstring), or None: it
    splits each cp rank's seq_len / cp tokens over the tp ranks (dense LLaMA and Mamba-2 models)."""
    why = sequence_violation(spec) or refusal(spec, "sequence_parallel")
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
    """Why ZeRO level `zero` cannot go with `mesh` (see the module docstring), or None."""
    if zero >= 2 and mesh.pp > 1:
        return (f"ZeRO-{zero} with pp={mesh.pp}: gradients are reduce-scattered after every micro-batch, which "
                "a pipeline schedule does not allow; use ZeRO-1 with pp > 1")
    return None


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


def mesh_micro_batches(spec: ModelSpec, devices: int, *, global_batch: int, seq_len: int,
                       micro_batches: tuple[int, ...] = (1, 2, 4, 8)) -> tuple[tuple[Mesh, int], ...]:
    """Every (valid mesh, micro-batch) pair the planner searches: for each mesh of
    `factorizations` and each micro-batch in `micro_batches`, the pair when `plan_violation`
    finds no broken rule (so dp x ep x micro-batch divides the global batch; ep > 1 only for a
    mixture of experts whose experts it divides).
    Empty when no pair is valid (the caller words the error)."""
    rules = dict(global_batch=global_batch, seq_len=seq_len, strategies=None)  # some intra-op choices pass
    out = []
    for mesh in _meshes(devices, lambda axis, size: axis_violation(spec, axis, size, **rules) is None):
        for mb in micro_batches:
            if plan_violation(spec, mesh, **rules, micro_batch=mb) is None:
                out.append((mesh, mb))
    return tuple(out)
