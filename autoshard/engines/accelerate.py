"""accelerate (1.x) settings of a training run: `ParallelismConfig` + the FSDP2 plugin, and its launch line.

Contract
--------
* `project(ct, hw, spec, run, *, global_batch, seq_len) -> (run, notes)`: the run accelerate expresses:
  no pipeline or expert parallelism (their ranks become data-parallel ones), no sequence parallelism,
  data parallelism as DDP (ZeRO-0) or FSDP2 (ZeRO-3, or ZeRO-2 with reshard_after_forward=False), full
  activation checkpointing or none; of the runs it expresses, the fastest that fits (else the smallest),
  with a note per setting of `run` it could not keep.
* `script(spec, run, *, global_batch, seq_len) -> str`: Python that builds the `ParallelismConfig`,
  the `FullyShardedDataParallelPlugin` and the `Accelerator` (the lines up to the Accelerator run
  anywhere: the tests execute them with accelerate's own classes).
"""

from __future__ import annotations

import math
from dataclasses import replace

from autoshard.engines.training_run import TrainingRun, default_strategies, price
from autoshard.errors import InvalidConfigError
from autoshard.ir import Mesh, Precision, Recompute, Schedule

LAUNCH = "accelerate launch --num_processes {devices} --num_machines {nodes} train.py"


def project(ct, hw, spec, run: TrainingRun, *, global_batch: int, seq_len: int,
            moe_imbalance: float = 1.0) -> tuple[TrainingRun, list[str]]:
    m = run.mesh
    notes = []
    if m.pp > 1:
        notes.append(f"pipeline parallelism (pp={m.pp}): accelerate has none; its ranks become data-parallel")
    if m.ep > 1:
        notes.append(f"expert parallelism (ep={m.ep}): accelerate has none; its ranks become data-parallel")
    if any(run.sequence_parallel):
        notes.append("sequence parallelism: accelerate's tensor parallelism (HF tp_plan) has none")
    if Recompute.SELECTIVE in run.recompute or run.per_stage_recompute:
        notes.append("selective or per-stage recompute: accelerate's FSDP2 plugin checkpoints every layer or none")
    if run.zero == 1:
        notes.append("ZeRO-1: accelerate's FSDP2 shards gradients too (ZeRO-2: reshard_after_forward=False)")
    mesh = Mesh(dp=m.dp * m.pp * m.ep, pp=1, tp=m.tp, cp=m.cp, ep=1)
    base = TrainingRun(mesh=mesh, micro_batch=run.micro_batch, offload=False, precision=run.precision,
                       fp8_recipe=run.fp8_recipe)
    zeros = [run.zero] if run.zero in (0, 2, 3) and not notes else [0, 2, 3]
    options = []
    for zero in zeros:
        for level in (Recompute.NONE, Recompute.FULL):
            cand = default_strategies(spec, replace(base, zero=zero, recompute=(level,), offload=run.offload and zero == 3))
            try:
                p = price(ct, hw, spec, cand, global_batch=global_batch, seq_len=seq_len, moe_imbalance=moe_imbalance)
            except InvalidConfigError:
                continue
            options.append((not p["fits"], p["step_time_s"] if p["fits"] else p["memory_gb"], cand))
    if not options:
        raise InvalidConfigError(f"accelerate: no data / tensor / context parallel layout of {mesh.size} devices runs "
                                 f"{spec.name} at tp={m.tp}, cp={m.cp}")
    chosen = min(options, key=lambda o: o[:2])[2]
    if not notes and (chosen.zero, chosen.recompute) != (run.zero, run.recompute[:1]):
        notes.append(f"ZeRO-{run.zero} with recompute {run.recompute[0].value}: accelerate runs ZeRO-{chosen.zero}, "
                     f"recompute {chosen.recompute[0].value}")
    return chosen, notes


def script(spec, run: TrainingRun, *, global_batch: int, seq_len: int) -> str:
    m = run.mesh
    if m.pp > 1 or m.ep > 1 or run.schedule is not Schedule.ONE_F_ONE_B:
        raise InvalidConfigError("accelerate expresses no pipeline / expert parallelism: project the run first")
    shard = m.dp if run.zero >= 2 else 1
    accumulation = max(1, global_batch // (m.dp * run.micro_batch))
    fp8 = run.precision is Precision.FP8
    recipe = run.fp8_recipe.value if run.fp8_recipe else "tensorwise"
    lines = ["import torch",
             "from accelerate import Accelerator, ParallelismConfig",
             "from accelerate.utils import FullyShardedDataParallelPlugin",
             "from torch.distributed.fsdp import MixedPrecisionPolicy",
             *(["from accelerate.utils import AORecipeKwargs", "from torchao.float8 import Float8LinearConfig"] if fp8 else []),
             "",
             f"# {spec.name}: per-device batch {run.micro_batch} x {accumulation} accumulation steps x dp {m.dp} = "
             f"{global_batch} sequences of {seq_len} tokens",
             f"parallelism_config = ParallelismConfig(dp_replicate_size={m.dp // shard}, dp_shard_size={shard}, "
             f"tp_size={m.tp}, cp_size={m.cp})",
             "fsdp_plugin = FullyShardedDataParallelPlugin(",
             "    fsdp_version=2,",
             f"    reshard_after_forward={run.zero == 3},  # True: ZeRO-3, False: ZeRO-2",
             f"    activation_checkpointing={run.recompute[0] is Recompute.FULL},",
             f"    cpu_offload={run.offload},",
             "    mixed_precision_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),",
             ")",
             *([f"fp8_kwargs = AORecipeKwargs(config=Float8LinearConfig.from_recipe_name({recipe!r}))"] if fp8 else []),
             "# ---- under `accelerate launch` (the lines above construct anywhere)",
             f"accelerator = Accelerator(parallelism_config=parallelism_config, "
             f"{'fsdp_plugin=fsdp_plugin, ' if shard > 1 else ''}gradient_accumulation_steps={accumulation}, "
             + ("mixed_precision=\"fp8\", kwargs_handlers=[fp8_kwargs])" if fp8 else "mixed_precision=\"bf16\")")]
    if m.tp > 1:
        lines.append("# build the model with its tensor-parallel plan: AutoModelForCausalLM.from_config(config, "
                     "tp_plan=\"auto\", device_mesh=accelerator.torch_device_mesh)")
    return "\n".join(lines) + "\n"


def launch(hw, devices: int) -> str:
    return LAUNCH.format(devices=devices, nodes=max(1, math.ceil(devices / hw.devices_per_node)))
