"""Entry points; the only module that reads options and the environment.

`parallelize(model, example_inputs, plan=..., global_batch=..., optimizer=...)` turns an
unmodified HF `LlamaForCausalLM` / `Mamba2ForCausalLM` into this rank's `DistributedModel`.

The whole contract: docs/modules/package.md (api.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from autoshard import errors
from autoshard.errors import AutoshardError, InvalidConfigError
from autoshard.fingerprint import check_plan_matches, fingerprint_module
from autoshard.inference_plan import InferencePlan, read_plan_file
from autoshard.ir import AXES, INTEGER, PLAN_FIELD, POSITIVE_INT, Mesh, Plan, Precision
from autoshard.models.presets import max_positions, position_violation, spec_from_hf_config
from autoshard.rules.validity import MIN_SEQ_LEN, backend_violation, check_plan
from autoshard.passes.rewrite import Replicate, shard_program
from autoshard.runtime.shard_graph import shard_graph
from autoshard.runtime.agreement import PLAN_FIELDS, agree, plan_facts
from autoshard.runtime.compiled import compile_backend, compile_layers
from autoshard.runtime.context_parallel import setup_context_parallel
from autoshard.runtime.dist_model import DistributedModel, RankSetup
from autoshard.runtime.expert_parallel import apply_expert_parallel, expert_tp_names
from autoshard.runtime.mesh import DEFAULT_TIMEOUT_S, backend_for, build_groups, check_timeout, init_default_group
from autoshard.runtime.ssd import install_ssd_mixers, install_unfused_scans
from autoshard.runtime.tensor_parallel import apply_tensor_parallel

log = logging.getLogger("autoshard")

PLAN_HINT = "give every rank the same plan, model and settings of autoshard.parallelize"
PLAN_KEYS = (*AXES, *(name for name, f in PLAN_FIELD.items() if f.key))  # the mesh and the plan keys of ir.PLAN_FIELDS


def parallelize(model: nn.Module, example_inputs: Any, *,
                plan: Plan | InferencePlan | Mapping | str | Path | None = None,
                global_batch: int | None = None,
                optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
                hardware: str = "auto", device: str | torch.device | None = None, seed: int = 0,
                schedule: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                compile: bool | str | None = None) -> DistributedModel:
    """This rank's `DistributedModel` for `model` under `plan` (docs/modules/package.md).

    example_inputs: input_ids (b, s), a tuple starting with them, or a dict with "input_ids";
    its sequence length is the plan's, its batch the default global batch.
    optimizer: params -> torch.optim.Optimizer (e.g. functools.partial(torch.optim.AdamW, lr=1e-3)).
    seed: initialisation seed for a model built on the meta device (the same on every rank).
    timeout_s: the longest any collective may wait (a hung peer ends the job after that; a dead one at once).
    schedule: the pipeline schedule, overriding the plan's (the plan key `schedule` says the same).
    compile: the decoder layers under torch.compile (runtime/compiled.py): None (auto) compiles them with
    Inductor on CUDA for dense LLaMA models, the fused kernels the GPU cost model prices; False runs eager;
    True or a backend name compiles them anywhere.
    plan may be an `InferencePlan` (or its file, `autoshard plan --inference --out`): this world is one
    replica of its served pool, checked by the generation rules (any batch; `dm.generate` and
    evaluation, no `train_step`; docs/inference.md).
    """
    config = getattr(model, "config", None)
    if config is None:
        raise InvalidConfigError(f"{type(model).__name__} has no HF .config; parallelize takes a HF "
                                 "...ForCausalLM (any decoder: its config and module tree are read)")
    spec = spec_from_hf_config(config, name=getattr(config, "name_or_path", "") or config.model_type, model=model)
    ids = _input_ids(example_inputs)
    _check_arguments(global_batch=global_batch, optimizer=optimizer, seed=seed, hardware=hardware, timeout_s=timeout_s)
    optimizer = _checked_optimizer(optimizer)
    device = _device(model, device, hardware)
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    fingerprint = fingerprint_module(model)
    # a plan file is read once, here; what is wrong with it is raised inside resolve(), on every rank alike
    requested, unreadable = plan, None
    if isinstance(plan, (str, Path)):
        try:
            requested = read_plan_file(plan)
        except AutoshardError as e:
            unreadable = e
    serving = isinstance(requested, InferencePlan)  # one generation replica: generate's own rules
    if plan is None:  # rank 0 solves, every rank runs what it broadcasts
        init_default_group(backend=backend_for(device), env=dict(os.environ), device=device, timeout_s=timeout_s)
        # first, that every rank asked for it: a rank given a plan meets this, not the solver's broadcast
        agree("plan", PLAN_FIELDS, plan_facts(None, fingerprint=fingerprint, settings={}, solved=True), error=None,
              device=device, hint=PLAN_HINT)
        solved = _solve_on_rank0(model, spec, world=world, seq_len=ids.shape[1],
                                 global_batch=global_batch or ids.shape[0], hardware=_hardware_name(hardware, device),
                                 device=device)
        given = lambda: solved  # noqa: E731
    else:
        def given() -> Plan:
            if unreadable is not None:
                raise unreadable
            if serving:
                from autoshard.rules.sharding import runnable_strategies

                strategies = runnable_strategies(spec, requested.pools[-1].tp) or ()  # what the planner priced
                return requested.replica_training_plan(world=world, seq_len=ids.shape[1], fingerprint=fingerprint,
                                                       strategies=strategies)
            out = _resolve_plan(requested, spec=spec, seq_len=ids.shape[1],
                                global_batch=global_batch or ids.shape[0], hardware=hardware)
            if not isinstance(requested, Mapping):  # a Plan or a file: made for this model and world size?
                source = f"plan file {plan}" if isinstance(plan, (str, Path)) else "the plan"
                check_plan_matches(out, fingerprint=fingerprint, devices=world, source=source)
            return out

    def resolve() -> Plan:
        out = given()
        if schedule is not None:
            out = dataclasses.replace(out, schedule=schedule)
        if not serving:  # generation asks for no router logits; it holds its prompts to the positions itself
            _check_router_aux(model, out)
            _check_positions(model, spec, out.seq_len)
        if out.precision is Precision.FP8:  # torchao installed, float8 GEMMs on this device: before any collective
            from autoshard.runtime.fp8 import check_fp8_device, torchao_float8

            torchao_float8()
            check_fp8_device(device)
        return out

    layers_backend = compile_backend(compile, spec, device.type, training=not serving)
    settings = dict(seed=seed, device_type=device.type, optimizer=optimizer is not None, compile=layers_backend)
    plan, groups, program = _rank_program(model, spec, resolve, world=world, device=device,
                                          fingerprint=fingerprint, settings=settings, solved=plan is None,
                                          timeout_s=timeout_s, generate=serving)
    full_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    install_ssd_mixers(model)  # the SSD as the cost model prices it (passes/capture/kernels.py, runtime/ssd.py)
    install_unfused_scans(model)  # Mamba-1's linears as modules, which tp and fp8 wrap (runtime/ssd.py)
    # CP first: its Mamba-2 mixers replace the mixer's forward, which TP's wrappers (checkpoint, the
    # sequence-parallel gather) then wrap
    cp = setup_context_parallel(model, plan.mesh, groups)  # None when cp == 1
    apply_tensor_parallel(model, program, groups.tp if plan.mesh.tp > 1 else None, seed=seed)
    model.to(device)
    experts, expert_tp = frozenset(), ()
    # serving replicas (an inference plan) split every expert's GEMMs over tp too, as serving engines do
    split_tp = serving and spec.is_moe and plan.mesh.tp > 1
    if plan.mesh.ep > 1 or split_tp:  # this rank's experts; tokens dispatched by all-to-all (runtime/expert_parallel.py)
        experts = apply_expert_parallel(model, spec, groups.ep, ep=plan.mesh.ep, ep_rank=groups.coords.ep,
                                        **(dict(tp_group=groups.tp, tp=plan.mesh.tp, tp_rank=groups.coords.tp)
                                           if split_tp else {}))
        if split_tp:
            expert_tp = expert_tp_names(model, spec, tp=plan.mesh.tp, tp_rank=groups.coords.tp)
    precision = plan.precision.resolve(device.type)
    if precision is Precision.FP8:  # torchao's Float8Linear on the tp slices' projections (runtime/fp8.py)
        from autoshard.runtime.fp8 import apply_float8

        apply_float8(model, spec, plan.fp8_recipe, device=device, fsdp_float8_all_gather=plan.zero == 3)
    if layers_backend is not None:  # fused element-wise kernels, as the GPU cost model prices; before FSDP2
        compile_layers(model, layers_backend)
    if plan.zero == 3:  # FSDP2 over dp (x cp), on the tp slices; ep > 1: dense over dp x ep (x cp), experts over dp (x cp)
        from autoshard.runtime.expert_parallel import experts_modules
        from autoshard.runtime.zero3 import apply_zero3

        grad_group = cp.grad_group if cp is not None else groups.dp
        ep = plan.mesh.ep > 1
        apply_zero3(model, groups.replicas if ep else grad_group, device=device, offload=plan.offload_optimizer,
                    bf16=precision.mixed, expert_group=grad_group,
                    experts=tuple(path for path, _ in experts_modules(model, spec)) if ep else ())
    runner = None
    if plan.mesh.pp > 1:
        from autoshard.runtime.pipeline import PipelineOptions, PipelineRunner
        from autoshard.ir import even_stages

        stages = plan.stages or even_stages(spec.layers, plan.chunks)
        runner = PipelineRunner(model, spec, stages, pp_group=groups.pp, device=device,
                                options=PipelineOptions(schedule=plan.schedule, micro_batch=plan.micro_batch,
                                                        virtual_stages=plan.virtual_stages,
                                                        precision=precision,
                                                        sequence_shards=tuple(plan.mesh.tp if on else 1 for on
                                                                              in plan.stage_sequence_parallel)),
                                tp_group=groups.tp if plan.mesh.tp > 1 and program.vocab_head else None, cp=cp,
                                sequence_group=groups.tp if plan.mesh.tp > 1 else None)
    setup = RankSetup(model=model, spec=spec, plan=plan, groups=groups, program=program, pipeline=runner, cp=cp,
                      expert_names=experts, expert_tp=expert_tp, fingerprint=fingerprint, full_shapes=full_shapes,
                      generate_only=serving)
    return DistributedModel(setup, optimizer=optimizer)


def _check_positions(model: nn.Module, spec, seq_len: int) -> None:
    """A training sequence past the model's positions (HF's rope scaling honoured): the one position rule
    (`presets.position_violation`) of plan, sweep, train_step, plan --inference and dm.generate."""
    why = position_violation(max_positions(spec, model.config), prompt=seq_len, where="parallelize")
    if why:
        raise InvalidConfigError(why)


def _check_router_aux(model: nn.Module, plan: Plan) -> None:
    """The router auxiliary loss sums statistics over all layers before it multiplies them (HF), so a
    pipeline stage cannot compute its part alone: refused under pp > 1, on every rank alike."""
    if plan.mesh.pp > 1 and getattr(model.config, "output_router_logits", False):
        raise InvalidConfigError(f"output_router_logits=True (the router auxiliary loss) with pp={plan.mesh.pp}: the "
                                 "loss multiplies statistics summed over every layer, which no single pipeline stage "
                                 "holds; use pp=1, or set model.config.output_router_logits = False")


def _rank_program(model: nn.Module, spec, resolve: Callable[[], Plan], *, world: int, device: torch.device,
                  fingerprint: str, settings: Mapping[str, Any], solved: bool = False,
                  timeout_s: float = DEFAULT_TIMEOUT_S, generate: bool = False):
    """The plan `resolve()` gives, checked on this rank with no communication; then every rank compares
    its plan (or the error its checks raised) with the others' in one small all-gather, so a rank given
    another plan or a bad one ends every rank with the same error instead of a hang
    (runtime/agreement.py); then this rank's groups and shard table: (plan, groups, program).
    `generate`: a generation replica's plan, checked by generate's rules (rules/validity.check_plan)."""
    try:
        plan, error = resolve(), None
        check_plan(plan, spec, world_size=world, generate=generate)
        if not generate:
            _check_weights_dtype(plan, model, device)
    except AutoshardError as e:
        if world == 1 and not dist.is_initialized():
            raise  # nobody to tell: no process group is made just to report it
        plan, error = None, e
    try:
        init_default_group(backend=backend_for(device), env=dict(os.environ), device=device, timeout_s=timeout_s)
    except AutoshardError:
        if error is not None:
            raise error from None  # no process group to share it through: the plan's own error comes first
        raise
    facts = None if error is not None else plan_facts(plan, fingerprint=fingerprint, settings=settings,
                                                      solved=solved)
    agree("plan", PLAN_FIELDS, facts, error=error, device=device, hint=PLAN_HINT)
    groups = build_groups(plan.mesh, device=device, backend=backend_for(device), timeout_s=timeout_s)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    return plan, groups, shard_program(plan, spec, shapes, tp_rank=groups.coords.tp)


def _check_weights_dtype(plan: Plan, model: nn.Module, device: torch.device) -> None:
    """A plan training in fp32 (`precision` fp32, or auto on a CPU) takes float32 weights: its gradients are float32
    (the data-parallel buckets' main gradients), which a bf16 parameter's `.grad` cannot hold (torch raised at the
    first step). Raised on every rank alike, naming the first other parameter and both ways out."""
    if plan.precision.resolve(device.type).mixed:
        return
    low = next(((n, p.dtype) for n, p in model.named_parameters()
                if p.is_floating_point() and p.dtype != torch.float32), None)
    if low is not None:
        how = f"auto on {device.type}" if plan.precision is Precision.AUTO else "fp32"
        raise InvalidConfigError(
            f"the model's parameter {low[0]} is {str(low[1]).removeprefix('torch.')}, but the plan's precision is fp32 "
            f"({how}), which trains float32 weights; pass precision='bf16-mixed' (bf16 compute, fp32 master "
            "weights and gradients) or an fp32 model (model.float())")


def _check_arguments(*, global_batch, optimizer, seed, hardware, timeout_s) -> None:
    """parallelize's own arguments, on every rank alike before any process group (a world of one raises
    here; a wrong one would otherwise be ignored, e.g. global_batch=0 taken as 'not given')."""
    if global_batch is not None and not POSITIVE_INT.ok(global_batch):
        raise InvalidConfigError(f"global_batch must be a positive integer (sequences per optimizer step), got "
                                 f"{global_batch!r}; or leave it out to use the example batch's size")
    if optimizer is not None and not callable(optimizer):
        raise InvalidConfigError(f"optimizer must be a callable taking the parameters and returning a "
                                 f"torch.optim.Optimizer (e.g. functools.partial(torch.optim.AdamW, lr=1e-3)), got "
                                 f"{type(optimizer).__name__}")
    INTEGER.check("seed", seed)
    check_timeout(timeout_s)
    if hardware != "auto":
        from autoshard.hardware import load_hardware

        load_hardware(hardware)  # an unknown name or a bad profile file: its own one-line error


def _checked_optimizer(factory):
    """`factory`, refusing what does not build a torch.optim.Optimizer (the runtime steps and checkpoints it)."""
    if factory is None:
        return None

    def build(params):
        optimizer = factory(params)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidConfigError(f"the optimizer factory returned {type(optimizer).__name__}, expected a "
                                     "torch.optim.Optimizer (e.g. functools.partial(torch.optim.AdamW, lr=1e-3))")
        return optimizer

    return build


def _input_ids(example_inputs: Any) -> Tensor:
    if isinstance(example_inputs, Mapping):
        example_inputs = example_inputs.get("input_ids")
    elif isinstance(example_inputs, (tuple, list)) and example_inputs:
        example_inputs = example_inputs[0]
    if not isinstance(example_inputs, Tensor) or example_inputs.dim() != 2 or 0 in example_inputs.shape:
        got = (f"a tensor of shape {tuple(example_inputs.shape)}" if isinstance(example_inputs, Tensor)
               else type(example_inputs).__name__)
        raise InvalidConfigError("example_inputs must be input_ids of shape (batch, seq), neither empty (a tensor, a "
                                 f"tuple starting with it, or a dict with 'input_ids'), got {got}")
    return example_inputs


def _device(model: nn.Module, device: str | torch.device | None, hardware: str) -> torch.device:
    if device is not None:
        if str(device) == "npu":
            return _npu()
        try:
            return torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise InvalidConfigError(f"device {device!r} is not a torch device ({e}); give e.g. 'cpu', 'cuda:0' "
                                     "or 'npu', or leave it out to use the model's own") from None
    if hardware.startswith("ascend"):
        return _npu()
    first = next(model.parameters(), None)
    if first is not None and first.device.type not in ("meta", "cpu"):
        return first.device
    if hardware in ("auto", "cpu") and first is not None and first.device.type == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available() and hardware != "cpu":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _npu() -> torch.device:
    backend_for("npu")  # imports torch_npu or raises a clear error
    return torch.device("npu", int(os.environ.get("LOCAL_RANK", "0")))


def _hardware_name(hardware: str, device: torch.device) -> str:
    """The device profile for `hardware="auto"`: read off the device this rank runs on."""
    if hardware != "auto":
        return hardware
    if device.type == "npu":
        return "ascend-910b"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).upper()
        for marker, profile in (("H200", "h200"), ("H100", "h100"), ("A100", "a100-80g")):
            if marker in name:
                return profile
        log.warning("no device profile for %r; planning with the h100 profile (pass hardware=<profile or "
                    "profile.json> to choose)", name)
        return "h100"
    return "cpu"


def _solve_on_rank0(model: nn.Module, spec, *, world: int, seq_len: int, global_batch: int, hardware: str,
                    device: torch.device) -> Plan:
    """Rank 0 captures `model`'s class and config and solves; the plan (or the error, e.g. the construct
    that stopped the trace) reaches every rank as JSON bytes, never pickle."""
    if dist.get_rank() == 0:
        from autoshard.passes.capture.shapes import build_cost_table
        from autoshard.passes.solve.planner import solve

        try:
            from autoshard.hardware import load_hardware

            _check_positions(model, spec, seq_len)
            table = build_cost_table(spec, model=model, kernels=load_hardware(hardware).kernels)
            plan = solve(spec, hardware, devices=world, global_batch=global_batch, seq_len=seq_len, table=table,
                         fingerprint=fingerprint_module(model))
            payload = {"plan": plan.to_json()}
        except AutoshardError as e:
            payload = {"error": str(e), "kind": type(e).__name__}
        data = json.dumps(payload).encode()
    else:
        data = b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    if dist.get_rank() == 0:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, src=0)
    payload = json.loads(bytes(buf.cpu().tolist()).decode())
    if "error" in payload:
        error = getattr(errors, payload["kind"], AutoshardError)
        raise error(payload["error"])
    plan = Plan.from_json(payload["plan"], source="the plan solved on rank 0")
    if dist.get_rank() == 0:
        _announce(plan)
    return plan


def _announce(plan: Plan) -> None:
    if not log.handlers and not logging.getLogger().handlers:
        log.addHandler(logging.StreamHandler())
        log.setLevel(logging.INFO)
    predicted = plan.predicted
    log.info("autoshard: %s on %d x %s: mesh %s, micro-batch %d, ZeRO-%d, recompute %s, precision %s, schedule %s "
             "x%d; predicted %.4g s/step, %.3g GB/device, MFU %.1f%%", plan.model, plan.devices, plan.hardware,
             plan.mesh, plan.micro_batch, plan.zero, plan.recompute.value, plan.precision.value, plan.schedule.value,
             plan.virtual_stages, predicted.get("step_time_s", float("nan")),
             predicted.get("memory_gb", float("nan")), 100 * predicted.get("mfu", float("nan")))


def _resolve_plan(plan: Any, *, spec, seq_len: int, global_batch: int, hardware: str) -> Plan:
    """The Plan of `plan`: itself, or a dict of PLAN_KEYS (a key given as None takes its default), each value
    checked by its field's own rule (ir.PLAN_FIELDS) and named as a plan key. A file is read by the caller
    (`read_plan_file`), once."""
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, InferencePlan):
        raise InvalidConfigError("an inference plan runs under autoshard.parallelize (dm.generate), not under the "
                                 "torch.compile backend; give the backend a training plan, or a dict such as "
                                 "dict(dp=2, tp=2)")
    if not isinstance(plan, Mapping):
        raise InvalidConfigError(f"plan must be a dict, a Plan or a path to a plan file, got {type(plan).__name__}")
    unknown = sorted(set(plan) - set(PLAN_KEYS))
    if unknown:
        raise InvalidConfigError(f"unknown plan keys {unknown}; known keys: {', '.join(PLAN_KEYS)}")
    given = {key: value for key, value in plan.items() if value is not None}
    for key, value in given.items():
        if key not in AXES:  # a mesh axis: Mesh's own check
            PLAN_FIELD[key].parse(value, f"plan key {key!r}")
    mesh = Mesh(**{axis: given.pop(axis, 1) for axis in AXES})
    # devices: the mesh's own size; check_plan (the one validator) compares it with the world size
    return Plan(model=spec.name, fingerprint="", hardware=hardware, devices=mesh.size, global_batch=global_batch,
                seq_len=seq_len, mesh=mesh, **given)


# -- torch.compile backend -------------------------------------------------------------------

def backend(model: nn.Module, *, plan: Plan | Mapping | str | Path | None = None, global_batch: int | None = None,
            device: str | torch.device = "cpu") -> Callable:
    """A torch.compile backend running `model`'s graph as this rank's part of `plan` (dp x tp).

    plan=None runs plain data parallelism over the whole world (dp = world size). Collective:
    every rank calls it (it creates the process groups). `global_batch` only feeds the plan's
    divisibility checks (default: dp).
    """
    config = getattr(model, "config", None)
    if config is None:
        raise InvalidConfigError(f"{type(model).__name__} has no HF .config; autoshard.backend takes a HF "
                                 "...ForCausalLM (any decoder: its config and module tree are read)")
    spec = spec_from_hf_config(config, name=getattr(config, "name_or_path", "") or config.model_type, model=model)
    device = torch.device(device)
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    requested = {"dp": world} if plan is None else plan

    def resolve() -> Plan:
        # the backend takes any sequence (no cp, no sequence parallelism): MIN_SEQ_LEN stands for it
        given = _resolve_plan(read_plan_file(requested) if isinstance(requested, (str, Path)) else requested,
                              spec=spec, seq_len=MIN_SEQ_LEN,
                              global_batch=global_batch or world, hardware="auto")
        why = backend_violation(spec, given)  # what the backend adds to the plan rules (check_plan, below)
        if why:
            raise InvalidConfigError(why)
        return given

    plan, groups, program = _rank_program(model, spec, resolve, world=world, device=device,
                                          fingerprint=fingerprint_module(model), settings={"device_type": device.type})
    # embedding and LM head stay whole under the backend (the loss is HF's own, on full logits)
    vocab = {program.vocab_embed and f"{program.vocab_embed}.weight", program.vocab_head and f"{program.vocab_head}.weight"}
    program = _replace_placements(program, {name: Replicate() for name in vocab if name})
    names = {id(p): name for name, p in model.named_parameters()}

    def compile_fn(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        param_names = {node.name: names.get(id(value)) for node, value in zip(placeholders, example_inputs)}
        return shard_graph(gm, param_names, program, groups).forward

    compile_fn.plan = plan
    compile_fn.groups = groups
    return compile_fn


def _replace_placements(program, overrides: Mapping[str, Any]):
    placements = tuple((name, overrides.get(name, placement)) for name, placement in program.placements)
    return dataclasses.replace(program, placements=placements)
