"""torchtitan 0.3 command line of a training run, and a run read back through torchtitan's own parser.

The whole contract: docs/modules/engines.md (engines/torchtitan.py).
"""

from __future__ import annotations

import contextlib
import io
import math
import re
import shlex
from dataclasses import replace

from autoshard.engines.training_run import TrainingRun, default_strategies, price, uniform
from autoshard.errors import InvalidConfigError
from autoshard.ir import Mesh, Precision, Recompute, Schedule, stage_rank
from autoshard.model_spec import Mixer, ModelSpec

# torchtitan's own Llama 3 sizes (torchtitan/models/llama3/__init__.py): (layers, dim, ffn, heads, kv, vocab)
LLAMA3_CONFIGS = {(32, 4096, 14336, 32, 8, 128256): "llama3_8b", (80, 8192, 28672, 64, 8, 128256): "llama3_70b",
                  (126, 16384, 53248, 128, 8, 128256): "llama3_405b"}
SCHEDULES = {"1F1B": (Schedule.ONE_F_ONE_B, False), "GPipe": (Schedule.GPIPE, False),
             "Interleaved1F1B": (Schedule.INTERLEAVED_1F1B, True), "InterleavedZeroBubble": (Schedule.ZERO_BUBBLE, True),
             "ZBVZeroBubble": (Schedule.ZERO_BUBBLE, True)}
AC = {Recompute.NONE: "none", Recompute.SELECTIVE: "selective", Recompute.FULL: "full"}
LAUNCH = "torchrun --nproc-per-node {per_node} --nnodes {nodes} -m torchtitan.train"


def _schedule_name(run: TrainingRun) -> str | None:
    v = run.virtual_stages
    return {Schedule.ONE_F_ONE_B: "1F1B", Schedule.GPIPE: "GPipe", Schedule.INTERLEAVED_1F1B: "Interleaved1F1B",
            Schedule.ZERO_BUBBLE: None if v == 1 else "ZBVZeroBubble" if v == 2 else "InterleavedZeroBubble"}[run.schedule]


def chunk_layers(layers: int, chunks: int, first_less: int, last_less: int) -> tuple[int, ...] | None:
    """torchtitan's split (`generate_llm_fqn_per_model_part`): layers + first_less + last_less units over
    the chunks, the first chunks one longer, the first / last chunk `first_less` / `last_less` fewer."""
    units = layers + first_less + last_less
    per, extra = divmod(units, chunks)
    out = [per + (i < extra) for i in range(chunks)]
    out[0] -= first_less
    out[-1] -= last_less
    if min(out) < 0 or (chunks > 1 and min(out[1:-1] or [1]) < 1) or sum(out) != layers:
        return None
    return tuple(out)


def rank_totals(chunks: tuple[int, ...], pp: int, v: int, schedule: Schedule) -> tuple[int, ...]:
    out = [0] * pp
    for i, n in enumerate(chunks):
        out[stage_rank(i, pp=pp, virtual_stages=v, schedule=schedule)] += n
    return tuple(out)


def _splits(layers: int, pp: int, v: int, schedule: Schedule):
    """Every (first_less, last_less) torchtitan takes, with the rank totals it gives."""
    for a in range(0, layers // (pp * v) + 2):
        for b in range(0, layers // (pp * v) + 2):
            chunks = chunk_layers(layers, pp * v, a, b)
            if chunks is not None and (v == 1 or _layers_per_stage(layers, a, b, pp * v)):
                yield (a, b), rank_totals(chunks, pp, v, schedule)


def project(ct, hw, spec, run: TrainingRun, *, global_batch: int, seq_len: int,
            moe_imbalance: float = 1.0) -> tuple[TrainingRun, list[str]]:
    """The run torchtitan expresses, and what it could not express of `run` (one note each)."""
    if spec.mixer is Mixer.SSD:
        raise InvalidConfigError(f"torchtitan 0.3 has no Mamba-2 model ({spec.name}); emit megatron or accelerate")
    notes = []
    if run.per_stage_recompute or run.per_stage_sequence_parallel:
        notes.append("per-stage recompute / sequence parallelism: torchtitan sets one value for every stage")
        run, _ = uniform(ct, hw, spec, run, global_batch=global_batch, seq_len=seq_len, moe_imbalance=moe_imbalance)
    if run.precision is Precision.FP8:
        notes.append("fp8: torchtitan 0.3 turns float8 on by a model converter in a config function, not from the "
                     "command line; priced as bf16 mixed precision")
        run = replace(run, precision=Precision.AUTO, fp8_recipe=None)
    if run.zero == 1 or (run.zero >= 1 and run.mesh.pp > 1):
        if run.mesh.pp == 1:
            notes.append("ZeRO-1: torchtitan shards with FSDP; priced as ZeRO-2 (FSDP without resharding after forward)")
            run = replace(run, zero=2)
        else:
            notes.append(f"ZeRO-{run.zero} with pp > 1: torchtitan shards with FSDP there, which autoshard prices "
                         "only with pp = 1; emitted as DDP replication (ZeRO-0)")
            run = replace(run, zero=0)
    if _schedule_name(run) is None:
        notes.append("zero-bubble with one chunk per rank: torchtitan's zero-bubble schedules need 2+; 1F1B instead")
        run = replace(run, schedule=Schedule.ONE_F_ONE_B)
    pp, v = run.mesh.pp, run.virtual_stages
    if v > 1 and not any(True for _ in _splits(spec.layers, pp, v, run.schedule)):
        notes.append(f"{v} virtual stages: no pipeline_parallel_layers_per_stage splits {spec.layers} layers into "
                     f"pp x v = {pp * v} stages; 1F1B instead")
        run = replace(run, schedule=Schedule.ONE_F_ONE_B, virtual_stages=1, rank_layers=())
        v = 1
    if pp > 1:
        want = run.layers(spec.layers)
        splits = dict((totals, ab) for ab, totals in _splits(spec.layers, pp, v, run.schedule))
        if want not in splits:
            notes.append(f"stages of {'/'.join(map(str, want))} layers: torchtitan splits by first / last stage "
                         "less layers")
            options = [replace(run, rank_layers=t) for t in splits]
            run = min(options, key=lambda r: _cost(ct, hw, spec, r, global_batch, seq_len, moe_imbalance))
    wanted = default_strategies(spec, run)
    if wanted.strategies != run.strategies:
        notes.append(f"intra-op choices {dict(run.strategies) or 'default'}: torchtitan's plan for the model instead")
        run = wanted
    return run, notes


def _cost(ct, hw, spec, run, global_batch, seq_len, moe_imbalance) -> tuple:
    try:
        p = price(ct, hw, spec, run, global_batch=global_batch, seq_len=seq_len, moe_imbalance=moe_imbalance)
    except InvalidConfigError:
        return (True, math.inf)
    return (not p["fits"], p["step_time_s"])


def model_arguments(spec: ModelSpec, hf_config_dir: str) -> list[str]:
    key = (spec.layers, spec.hidden, spec.ffn, spec.heads, spec.kv_heads, spec.vocab)
    if key in LLAMA3_CONFIGS and not spec.is_moe and not spec.tied:
        return ["--module llama3", f"--config {LLAMA3_CONFIGS[key]}"]
    return ["--module transformers_modeling_backend", "--config transformers_modeling_backend_full",
            f"--hf_model {shlex.quote(hf_config_dir)}"]


def arguments(spec: ModelSpec, run: TrainingRun, *, global_batch: int, seq_len: int,
              hf_config_dir: str = "./hf-config") -> list[str]:
    """torchtitan.train arguments of `run` (already `project`ed)."""
    m, pp, v = run.mesh, run.mesh.pp, run.virtual_stages
    dp = m.dp * m.ep
    shard = dp if run.zero >= 2 else 1
    out = model_arguments(spec, hf_config_dir) + [
        f"--parallelism.data_parallel_replicate_degree {dp // shard}", f"--parallelism.data_parallel_shard_degree {shard}",
        f"--parallelism.tensor_parallel_degree {m.tp}", f"--parallelism.context_parallel_degree {m.cp}",
        f"--parallelism.expert_parallel_degree {m.ep}", f"--parallelism.pipeline_parallel_degree {pp}"]
    if run.zero >= 2:
        out.append(f"--parallelism.fsdp_reshard_after_forward {'never' if run.zero == 2 else 'always'}")
    out.append("--parallelism.enable_sequence_parallel" if run.sequence_parallel[0] else
               "--parallelism.no-enable-sequence-parallel")
    local = global_batch // dp
    if pp > 1:
        want = run.layers(spec.layers)
        (a, b) = next(ab for ab, totals in _splits(spec.layers, pp, v, run.schedule) if totals == want)
        out += [f"--parallelism.pipeline_parallel_schedule {_schedule_name(run)}",
                f"--parallelism.pipeline_parallel_first_stage_less_layers {a}",
                f"--parallelism.pipeline_parallel_last_stage_less_layers {b}",
                f"--parallelism.pipeline_parallel_microbatch_size {run.micro_batch}", "--training.disable_cuda_graphs"]
        if v > 1:
            out.append(f"--parallelism.pipeline_parallel_layers_per_stage {_layers_per_stage(spec.layers, a, b, pp * v)}")
    else:
        local = run.micro_batch  # torchtitan accumulates gradients over global / (local x dp) steps
    out += [f"--training.local_batch_size {local}", f"--training.global_batch_size {global_batch}",
            f"--training.seq_len {seq_len}", "--training.mixed_precision_param bfloat16",
            "--training.mixed_precision_reduce float32"]
    if run.offload:
        out.append("--training.enable_cpu_offload")
    return out + [f"activation-checkpoint:{AC[run.recompute[0]]}"]


def _layers_per_stage(layers: int, a: int, b: int, chunks: int) -> int | None:
    """The layers_per_stage whose ceil((layers + a + b) / n) is `chunks` (torchtitan's rule), if one is."""
    units = layers + a + b
    return next((n for n in range(1, units + 1) if math.ceil(units / n) == chunks), None)


def parse(words: list[str] | str, *, spec: ModelSpec | None, devices: int, source: str = "--from-torchtitan"):
    """(run, global batch, seq len) of a torchtitan.train command line, read by torchtitan itself."""
    config = _parse_with_torchtitan(words, source)
    par, tr = config.parallelism, config.training
    tp, pp, cp, ep = (par.tensor_parallel_degree, par.pipeline_parallel_degree, par.context_parallel_degree,
                      par.expert_parallel_degree)
    replicate, shard = par.data_parallel_replicate_degree, par.data_parallel_shard_degree
    rest = tp * pp * cp * replicate
    if devices % rest:
        raise InvalidConfigError(f"{source}: replicate x tp x pp x cp = {rest} does not divide --devices {devices}")
    if shard == -1:
        shard = devices // rest
    if replicate * shard * tp * pp * cp != devices:
        raise InvalidConfigError(f"{source}: data_parallel_replicate x shard x tp x pp x cp = "
                                 f"{replicate * shard * tp * pp * cp}, not --devices {devices}")
    if replicate > 1 and shard > 1:
        raise InvalidConfigError(f"{source}: HSDP (data_parallel_replicate_degree {replicate} x shard {shard}) is not "
                                 "priced by autoshard; give one of them")
    dp = replicate * shard
    if dp % ep:
        raise InvalidConfigError(f"{source}: expert_parallel_degree {ep} does not divide the data-parallel ranks {dp}")
    zero = 0 if shard == 1 else 2 if par.fsdp_reshard_after_forward == "never" else 3
    schedule, multi = SCHEDULES.get(par.pipeline_parallel_schedule, (None, None))
    if schedule is None:
        raise InvalidConfigError(f"{source}: --parallelism.pipeline_parallel_schedule {par.pipeline_parallel_schedule}: "
                                 f"autoshard prices {', '.join(SCHEDULES)}")
    layers = spec.layers
    v, split = 1, ()
    if pp > 1:
        a, b = par.pipeline_parallel_first_stage_less_layers, par.pipeline_parallel_last_stage_less_layers
        lps = par.pipeline_parallel_layers_per_stage
        chunks = math.ceil((layers + a + b) / lps) if lps else pp * (2 if multi else 1)
        v = chunks // pp
        if multi and v == 1 and par.pipeline_parallel_schedule != "ZBVZeroBubble":
            raise InvalidConfigError(f"{source}: {par.pipeline_parallel_schedule} needs 2+ stages per rank")
        got = chunk_layers(layers, chunks, a, b)
        if got is None:
            raise InvalidConfigError(f"{source}: first / last stage less layers {a} / {b} leave a stage empty")
        split = rank_totals(got, pp, v, schedule)
    else:
        schedule = Schedule.ONE_F_ONE_B
    ac = type(config.activation_checkpoint).__qualname__.split(".")[0] if config.activation_checkpoint else "none"
    recompute = {"none": Recompute.NONE, "NoneType": Recompute.NONE, "FullAC": Recompute.FULL,
                 "SelectiveAC": Recompute.SELECTIVE}.get(ac)
    if recompute is None:
        raise InvalidConfigError(f"{source}: activation checkpointing {ac}: autoshard prices none, selective and full")
    micro = par.pipeline_parallel_microbatch_size if pp > 1 else tr.local_batch_size
    global_batch = tr.global_batch_size if tr.global_batch_size > 0 else tr.local_batch_size * dp
    run = TrainingRun(mesh=Mesh(dp=dp // ep, pp=pp, tp=tp, cp=cp, ep=ep), micro_batch=micro, zero=zero,
                      offload=bool(tr.enable_cpu_offload), schedule=schedule, virtual_stages=v,
                      recompute=(recompute,), sequence_parallel=(bool(par.enable_sequence_parallel and tp > 1),),
                      rank_layers=split)
    return run, global_batch, tr.seq_len


def _parse_with_torchtitan(words, source: str):
    try:
        from torchtitan.config import ConfigManager
    except ImportError:
        raise InvalidConfigError(f"{source} reads the command line with torchtitan's own parser: pip install "
                                 "torchtitan==0.3.0 triton") from None
    words = shlex.split(words if isinstance(words, str) else " ".join(words))  # arguments() gives "--flag value" items
    while words and not words[0].startswith("--"):  # torchrun ... -m torchtitan.train
        words.pop(0)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return ConfigManager().parse_args(words)
    except SystemExit:
        lines = [ln.strip(" │╭╮╰╯─") for ln in err.getvalue().splitlines()]
        noise = re.compile(r"^([WIE]\d{4} |Failed to load|.*[Ww]arning)|helptext|Parsing error")  # import-time chatter
        kept = [ln for ln in lines if ln.strip("-") and not noise.search(ln) and "has no effect" not in ln]
        said = next((ln for ln in kept if ln.startswith("Unrecognized options:")), "; ".join(kept)[:400])
        raise InvalidConfigError(f"{source}: torchtitan refused the arguments: {said}") from None
    except (ValueError, ImportError, TypeError) as e:
        raise InvalidConfigError(f"{source}: torchtitan refused the arguments: {e}") from None


def launch(hw, devices: int) -> str:
    per_node = min(devices, hw.devices_per_node)
    return LAUNCH.format(per_node=per_node, nodes=max(1, devices // per_node))
