"""Megatron-LM / MindSpeed-LLM arguments of a training run, and a run read back from them.

The whole contract: docs/modules/engines.md (engines/megatron.py).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, replace

from autoshard.engines.training_run import TrainingRun, default_strategies, price, uniform
from autoshard.errors import InvalidConfigError
from autoshard.ir import Fp8Recipe, Mesh, Precision, Recompute, Schedule
from autoshard.model_spec import Mixer, ModelSpec
from autoshard.rules.schedules import microbatches_per_step

# flags read into the run: name -> kind ("int", "str", "flag")
LAYOUT_FLAGS = {
    "--tensor-model-parallel-size": "int", "--pipeline-model-parallel-size": "int", "--context-parallel-size": "int",
    "--expert-model-parallel-size": "int", "--num-layers-per-virtual-pipeline-stage": "int",
    "--num-virtual-stages-per-pipeline-rank": "int", "--sequence-parallel": "flag", "--micro-batch-size": "int",
    "--global-batch-size": "int", "--seq-length": "int", "--recompute-granularity": "str", "--recompute-method": "str",
    "--recompute-num-layers": "int", "--use-distributed-optimizer": "flag", "--use-megatron-fsdp": "flag",
    "--use-custom-fsdp": "flag", "--data-parallel-sharding-strategy": "str", "--optimizer-cpu-offload": "flag",
    "--decoder-first-pipeline-num-layers": "int", "--decoder-last-pipeline-num-layers": "int",
    "--account-for-embedding-in-pipeline-split": "flag", "--account-for-loss-in-pipeline-split": "flag",
    "--bf16": "flag", "--fp16": "flag", "--expert-tensor-parallel-size": "int", "--fp8-format": "str",
    "--fp8-recipe": "str", "--reuse-fp32-param": "flag",
}
MODEL_FLAGS = {
    "--num-layers": "int", "--hidden-size": "int", "--ffn-hidden-size": "int", "--num-attention-heads": "int",
    "--num-query-groups": "int", "--group-query-attention": "flag", "--vocab-size": "int", "--kv-channels": "int",
    "--num-experts": "int", "--moe-router-topk": "int", "--moe-ffn-hidden-size": "int",
    "--moe-shared-expert-intermediate-size": "int", "--untie-embeddings-and-output-weights": "flag",
    "--mamba-state-dim": "int", "--mamba-head-dim": "int", "--mamba-num-groups": "int",
    "--hybrid-override-pattern": "str",
}
# flags that change nothing autoshard prices (optimizer, data, logging, kernels, model details the
# cost model reads from the model itself): accepted and listed as ignored
IGNORED_FLAGS = (
    "--swiglu", "--normalization", "--position-embedding-type", "--disable-bias-linear", "--max-position-embeddings",
    "--tokenizer-type", "--tokenizer-model", "--vocab-file", "--merge-file", "--lr", "--min-lr", "--train-iters",
    "--train-samples", "--data-path", "--mock-data", "--split", "--save", "--load", "--save-interval", "--log-interval",
    "--eval-iters", "--eval-interval", "--exit-interval", "--tensorboard-dir", "--overlap-grad-reduce",
    "--overlap-param-gather", "--tp-comm-overlap", "--cp-comm-type", "--use-flash-attn", "--transformer-impl",
    "--attention-backend", "--make-vocab-size-divisible-by", "--seed", "--weight-decay", "--clip-grad",
    "--adam-beta1", "--adam-beta2", "--adam-eps", "--init-method-std", "--lr-decay-style", "--lr-warmup-iters",
    "--lr-warmup-fraction", "--lr-decay-iters", "--attention-dropout", "--hidden-dropout", "--rotary-base",
    "--norm-epsilon", "--distributed-backend", "--manual-gc", "--moe-token-dispatcher-type", "--moe-grouped-gemm",
    "--moe-aux-loss-coeff", "--moe-router-load-balancing-type", "--use-mcore-models", "--ckpt-format",
    "--no-masked-softmax-fusion", "--use-rotary-position-embeddings", "--no-position-embedding",
    "--distributed-timeout-minutes", "--log-throughput", "--spec", "--use-fused-rmsnorm", "--use-fused-swiglu",
    "--use-fused-rotary-pos-emb", "--use-flash-attn", "--no-gradient-accumulation-fusion", "--recompute-modules",
)
SHARDING_STRATEGY = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}
LAUNCH = "torchrun --nproc-per-node {per_node} --nnodes {nodes} pretrain_gpt.py"


def project(ct, hw, spec, run: TrainingRun, *, global_batch: int, seq_len: int,
            moe_imbalance: float = 1.0) -> tuple[TrainingRun, list[str]]:
    """The run Megatron expresses, and what it could not express of `run` (one note each)."""
    notes = []
    pp, v, layers = run.mesh.pp, run.virtual_stages, spec.layers
    if run.groups and set(run.groups) != {"split"}:
        notes.append("Mamba-2 groups kept whole on some stages: Megatron's Mamba layers always split the groups "
                     "over tp")
        run = replace(run, groups=())
    if run.per_stage_recompute or run.per_stage_sequence_parallel:
        what = [w for w, on in (("recompute", run.per_stage_recompute),
                                ("sequence parallelism", run.per_stage_sequence_parallel)) if on]
        notes.append(f"per-stage {' and '.join(what)}: Megatron sets one value for every stage")
        run, _ = uniform(ct, hw, spec, run, global_batch=global_batch, seq_len=seq_len, moe_imbalance=moe_imbalance)
    if run.schedule is Schedule.ZERO_BUBBLE:
        notes.append(f"zero-bubble schedule: Megatron-LM runs 1F1B{' interleaved' if v > 1 else ''}")
        run = replace(run, schedule=Schedule.INTERLEAVED_1F1B if v > 1 else Schedule.ONE_F_ONE_B)
    rank_layers = run.layers(layers)
    accounted = _accounted(layers, pp, v)
    if v > 1 and rank_layers != accounted and (layers % (pp * v) or len(set(rank_layers)) > 1):
        notes.append(f"stages of {'/'.join(map(str, rank_layers))} layers over {v} virtual stages: Megatron gives "
                     "every model chunk the same layers (the embedding and loss may count as one each)")
        if layers % (pp * v) == 0:
            run = replace(run, rank_layers=())
        elif accounted:
            run = replace(run, rank_layers=accounted)
        else:
            notes.append(f"{layers} layers do not split into pp x v = {pp * v} equal model chunks: 1F1B instead")
            run = replace(run, schedule=Schedule.ONE_F_ONE_B, virtual_stages=1)
    if run.virtual_stages == 1 and pp > 1 and not _megatron_split(rank_layers, layers):
        notes.append(f"stages of {'/'.join(map(str, rank_layers))} layers: Megatron sets the first and last stage "
                     "and splits the rest evenly")
        run = min((replace(run, rank_layers=split) for split in _first_last_splits(rank_layers, layers, pp)),
                  key=lambda r: _cost(ct, hw, spec, r, global_batch, seq_len, moe_imbalance))
    wanted = default_strategies(spec, run)
    if wanted.strategies != run.strategies:
        notes.append(f"intra-op choices {dict(run.strategies) or 'default'}: Megatron shards the embedding and head "
                     "over tp (vocabulary padded to a multiple of tp)")
        run = wanted
    if run.precision is Precision.FP8 and run.fp8_recipe is Fp8Recipe.ROWWISE:
        notes.append("fp8 rowwise scaling: Megatron's --fp8-recipe has tensorwise (per-tensor current scaling) and "
                     "others autoshard does not price")
        run = replace(run, fp8_recipe=Fp8Recipe.TENSORWISE)
    if run.schedule is Schedule.GPIPE:
        notes.append("GPipe schedule: Megatron runs 1F1B (with fewer micro-batches than stages, GPipe's bubble)")
        m = microbatches_per_step(global_batch, run.mesh, run.micro_batch)
        run = replace(run, schedule=Schedule.GPIPE if m < pp else Schedule.ONE_F_ONE_B)
    return run, notes


def _accounted(layers: int, pp: int, v: int) -> tuple[int, ...] | None:
    """Layers per rank when the embedding and the loss each count as a layer of the even split
    (--account-for-embedding/loss-in-pipeline-split), where that splits into equal chunks."""
    units = layers + 2
    if pp == 1 or units % (pp * v):
        return None
    out = [units // pp] * pp
    out[0] -= 1
    out[-1] -= 1
    return tuple(out)


def _megatron_split(rank_layers, layers: int) -> bool:
    """Whether Megatron states this split: a first / last stage (or its even default) and the rest even."""
    return len(rank_layers) <= 2 or len(set(rank_layers[1:-1])) == 1


def _first_last_splits(rank_layers, layers: int, pp: int) -> list[tuple[int, ...]]:
    """Splits Megatron states (first, middle x (pp - 2), last) near `rank_layers`."""
    out = []
    for middle in range(max(1, layers // pp - 2), layers // pp + 3):
        rest = layers - middle * (pp - 2)
        for first in {rest // 2, rest - rest // 2, min(rest, rank_layers[0])}:
            if rest >= 0 and 0 <= first <= rest:
                out.append((first, *([middle] * (pp - 2)), rest - first))
    return out or [()]


def _cost(ct, hw, spec, run, global_batch, seq_len, moe_imbalance) -> tuple:
    try:
        p = price(ct, hw, spec, run, global_batch=global_batch, seq_len=seq_len, moe_imbalance=moe_imbalance)
    except InvalidConfigError:
        return (True, float("inf"))
    return (not p["fits"], p["step_time_s"])


def arguments(spec: ModelSpec, run: TrainingRun, *, global_batch: int, seq_len: int) -> list[str]:
    """Megatron-LM arguments of `run` (already `project`ed)."""
    m, pp, v = run.mesh, run.mesh.pp, run.virtual_stages
    out = [f"--tensor-model-parallel-size {m.tp}", f"--pipeline-model-parallel-size {pp}",
           f"--context-parallel-size {m.cp}", f"--expert-model-parallel-size {m.ep}"]
    accounted = pp > 1 and v > 1 and bool(run.rank_layers) and run.rank_layers == _accounted(spec.layers, pp, v)
    if accounted:
        out += [f"--num-virtual-stages-per-pipeline-rank {v}", "--account-for-embedding-in-pipeline-split",
                "--account-for-loss-in-pipeline-split"]
    elif v > 1:
        out.append(f"--num-layers-per-virtual-pipeline-stage {spec.layers // (pp * v)}")
    if run.sequence_parallel[0]:
        out.append("--sequence-parallel")
    if not accounted and pp > 1 and v == 1 and (spec.layers % pp or len(set(run.layers(spec.layers))) > 1):
        split = run.layers(spec.layers)
        out += [f"--decoder-first-pipeline-num-layers {split[0]}", f"--decoder-last-pipeline-num-layers {split[-1]}"]
    out += [f"--micro-batch-size {run.micro_batch}", f"--global-batch-size {global_batch}", f"--seq-length {seq_len}"]
    level = run.recompute[0]
    if run.recompute_layers and level is not Recompute.FULL:
        out += ["--recompute-granularity full", "--recompute-method block",
                f"--recompute-num-layers {run.recompute_layers}"]
    elif level is Recompute.FULL:
        out += ["--recompute-granularity full", "--recompute-method uniform", "--recompute-num-layers 1"]
    elif level is Recompute.SELECTIVE:
        out.append("--recompute-granularity selective")
    if run.zero == 1:
        out.append("--use-distributed-optimizer")
    elif run.zero >= 2:
        strategy = next(k for k, z in SHARDING_STRATEGY.items() if z == run.zero)
        out += ["--use-megatron-fsdp", f"--data-parallel-sharding-strategy {strategy}"]
    if run.offload:
        out.append("--optimizer-cpu-offload")
    if run.reuse_fp32_param:  # MindSpeed's flag (a run read from a MindSpeed command line; plans have none)
        out.append("--reuse-fp32-param")
    out.append("--bf16")
    if run.precision is Precision.FP8:  # the attention / MLP GEMMs in float8, per-tensor current scaling
        out += ["--fp8-format hybrid", "--fp8-recipe tensorwise"]
    return out + model_arguments(spec)


def _even(layers: int, pp: int) -> tuple[int, ...]:
    from autoshard.ir import even_stages

    return tuple(st.layers for st in even_stages(layers, pp))


# a layer part as Megatron's hybrid model names its layer (megatron/core/ssm/mamba_hybrid_layer_allocation.py's
# symbols): Mamba-2 mixer, attention, MLP, mixture of experts
HYBRID_SYMBOLS = {"ssd": "M", "attention": "*", "mlp": "-", "moe": "E"}
_BESIDE_LAYERS = ("embed", "final_norm", "lm_head", "norm")


def hybrid_pattern(spec: ModelSpec) -> str:
    """Megatron's `--hybrid-override-pattern` of a model read by its layer parts (`ModelSpec.parts`: Nemotron-H's
    Mamba-2, MoE, attention and MLP layers, one symbol each); InvalidConfigError naming the first layer that is no
    one of those (Bamba's mixer beside an MLP, Falcon-H1's two mixers, DeepSeek's latent attention): its layers
    would be another model in Megatron's terms."""
    out = []
    for i in range(spec.layers):
        held = [p for p in spec.parts if p.kind not in _BESIDE_LAYERS and (not p.layers or i in p.layers)]
        if len(held) != 1 or held[0].kind not in HYBRID_SYMBOLS:
            blocks = " + ".join(f"{p.kind} ({p.path})" for p in held) or "no mixer"
            symbols = ", ".join(f"{s} {k}" for k, s in HYBRID_SYMBOLS.items())
            raise InvalidConfigError(
                f"{spec.name}: layer {i} holds {blocks}; Megatron's hybrid model (--hybrid-override-pattern) has one "
                f"Mamba-2 mixer, attention, MLP or MoE block per layer ({symbols}), so its arguments would describe "
                "another model; emit torchtitan (its Hugging Face backend) or accelerate")
        out.append(HYBRID_SYMBOLS[held[0].kind])
    return "".join(out)


def _hybrid_arguments(spec: ModelSpec) -> list[str]:
    """The sizes of a model read by its layer parts, in Megatron's hybrid model's names (one part per layer)."""
    pattern = hybrid_pattern(spec)
    sizes = {p.kind: dict(p.sizes) for p in spec.parts}
    for kind in sizes:
        each = {p.sizes for p in spec.parts if p.kind == kind}
        if len(each) > 1:  # Megatron's arguments give one size of each block to every layer holding it
            raise InvalidConfigError(
                f"{spec.name}: its {kind} layers differ in sizes ({' vs '.join(map(str, sorted(each)))}); Megatron's "
                "hybrid model gives every layer of a block the same sizes, so its arguments would describe another "
                "model; emit torchtitan (its Hugging Face backend) or accelerate")
    out = [f"--hybrid-override-pattern {pattern}"]
    if "ssd" in sizes:
        ssd = sizes["ssd"]
        out += [f"--mamba-state-dim {ssd['state']}", f"--mamba-head-dim {ssd['head_dim']}",
                f"--mamba-num-groups {ssd['groups']}"]
    if "attention" in sizes:
        att = sizes["attention"]
        out.append(f"--num-attention-heads {att['heads']}")
        if att["kv_heads"] != att["heads"]:
            out += ["--group-query-attention", f"--num-query-groups {att['kv_heads']}"]
        if att["q"] != spec.hidden:
            out.append(f"--kv-channels {att['q'] // att['heads']}")
    if "mlp" in sizes:
        out.append(f"--ffn-hidden-size {sizes['mlp']['ffn']}")
    return out + _experts_and_head(spec, moe="moe" in sizes) + ["--tokenizer-type NullTokenizer",
                                                                 "--normalization RMSNorm"]


def _experts_and_head(spec: ModelSpec, *, moe: bool) -> list[str]:
    """The routed (and shared) experts' flags where the model has them, whole on every tp rank as autoshard runs
    and prices them (passes/cost/moe_cost.py); the untied LM head's."""
    out = []
    if moe:
        out += [f"--num-experts {spec.experts}", f"--moe-router-topk {spec.top_k}", f"--moe-ffn-hidden-size {spec.ffn}",
                "--expert-tensor-parallel-size 1"]
        if spec.shared_ffn:
            out.append(f"--moe-shared-expert-intermediate-size {spec.shared_ffn}")
    return out + ([] if spec.tied else ["--untie-embeddings-and-output-weights"])


def model_arguments(spec: ModelSpec) -> list[str]:
    """The model's sizes in Megatron's names (GPT / LLaMA-style decoder, MoE, Mamba; a model read by its layer
    parts as Megatron's hybrid model, `hybrid_pattern`)."""
    out = [f"--num-layers {spec.layers}", f"--hidden-size {spec.hidden}", f"--vocab-size {spec.vocab}"]
    if spec.parts:
        return out + _hybrid_arguments(spec)
    if spec.mixer is Mixer.SSD:
        return out + [f"--mamba-state-dim {spec.state}", f"--mamba-head-dim {spec.head_dim}",
                      f"--mamba-num-groups {spec.groups}", f"--hybrid-override-pattern {'M' * spec.layers}",
                      "--tokenizer-type NullTokenizer", "--normalization RMSNorm"]
    out += [f"--ffn-hidden-size {spec.ffn}", f"--num-attention-heads {spec.heads}"]
    if spec.kv_heads != spec.heads:
        out += ["--group-query-attention", f"--num-query-groups {spec.kv_heads}"]
    if spec.head_dim:
        out.append(f"--kv-channels {spec.head_dim}")
    return out + _experts_and_head(spec, moe=spec.is_moe) + [
        "--swiglu", "--normalization RMSNorm", "--position-embedding-type rope", "--disable-bias-linear",
        "--tokenizer-type NullTokenizer"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Parsed:
    run: TrainingRun
    global_batch: int | None
    seq_len: int | None
    model: dict  # the model-size flags given, by flag
    ignored: tuple[str, ...]  # flags read and not priced


def read_flags(text: str, known: dict, ignored: tuple[str, ...], *, source: str) -> tuple[dict, list[str]]:
    """Flags of a command line by name -> value (True for a bare flag); a flag in neither `known` nor
    `ignored` is an error naming it. Leading words before the first flag (torchrun, the script) are skipped."""
    try:
        words = shlex.split(text)
    except ValueError as e:
        raise InvalidConfigError(f"{source}: cannot split the arguments ({e})") from None
    while words and not words[0].startswith("--"):
        words.pop(0)
    values, skipped, i = {}, [], 0
    while i < len(words):
        word = words[i]
        name, eq, inline = word.partition("=")
        if not name.startswith("--"):
            raise InvalidConfigError(f"{source}: {word!r} is not a flag (values follow their flag)")
        kind = known.get(name)
        if kind is None and name not in ignored:
            raise InvalidConfigError(f"{source}: {name} is not a flag autoshard knows; drop it, or price the layout "
                                     "with autoshard price --dp/--tp/--pp/... flags")
        takes = kind in ("int", "str") or (kind is None and (eq or (i + 1 < len(words) and not words[i + 1].startswith("--"))))
        if takes and not eq:
            if i + 1 >= len(words):
                raise InvalidConfigError(f"{source}: {name} needs a value")
            inline, i = words[i + 1], i + 1
        if kind is None:
            skipped.append(name)
        elif kind == "int":
            try:
                values[name] = int(inline)
            except ValueError:
                raise InvalidConfigError(f"{source}: {name} takes an integer, got {inline!r}") from None
            if values[name] < 0:
                raise InvalidConfigError(f"{source}: {name} must not be negative, got {inline}")
        else:
            values[name] = inline if kind == "str" else True
        i += 1
    return values, skipped


def parse(text: str, *, spec: ModelSpec | None, devices: int, source: str = "--from-megatron") -> Parsed:
    """The run a Megatron-LM command line states on `devices` devices (docs/modules/engines.md)."""
    got, skipped = read_flags(text, {**LAYOUT_FLAGS, **MODEL_FLAGS}, IGNORED_FLAGS, source=source)
    tp, pp = got.get("--tensor-model-parallel-size", 1), got.get("--pipeline-model-parallel-size", 1)
    cp, ep = got.get("--context-parallel-size", 1), got.get("--expert-model-parallel-size", 1)
    for flag, value in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                        ("--context-parallel-size", cp), ("--expert-model-parallel-size", ep)):
        if value < 1:
            raise InvalidConfigError(f"{source}: {flag} must be at least 1, got {value}")
    if devices % (tp * pp * cp):
        raise InvalidConfigError(f"{source}: tp x pp x cp = {tp} x {pp} x {cp} = {tp * pp * cp} does not divide "
                                 f"--devices {devices}; Megatron's data-parallel size is devices / (tp x pp x cp)")
    dp_megatron = devices // (tp * pp * cp)
    if dp_megatron % ep:
        raise InvalidConfigError(f"{source}: --expert-model-parallel-size {ep} does not divide the data-parallel "
                                 f"size {dp_megatron} (devices / (tp x pp x cp)); Megatron carves ep out of it")
    model = {k: v for k, v in got.items() if k in MODEL_FLAGS}
    layers = model.get("--num-layers", spec.layers if spec else None)
    if layers is None:
        raise InvalidConfigError(f"{source}: give --num-layers (and the model's sizes) or --model")
    v = _virtual(got, layers, pp, source)
    run = TrainingRun(mesh=Mesh(dp=dp_megatron // ep, pp=pp, tp=tp, cp=cp, ep=ep),
                      micro_batch=got.get("--micro-batch-size", 1), zero=_zero(got, source),
                      offload="--optimizer-cpu-offload" in got,
                      schedule=Schedule.INTERLEAVED_1F1B if v > 1 else Schedule.ONE_F_ONE_B, virtual_stages=v,
                      recompute=(_recompute(got, source),), sequence_parallel=(bool(got.get("--sequence-parallel")),),
                      rank_layers=_rank_layers(got, layers, pp, v, source), recompute_layers=_block_layers(got),
                      reuse_fp32_param=bool(got.get("--reuse-fp32-param")))
    if run.reuse_fp32_param and run.zero == 3:
        raise InvalidConfigError(f"{source}: --reuse-fp32-param with --use-megatron-fsdp optim_grads_params: MindSpeed "
                                 "reuses the fp32 copy under ZeRO 0-2 only (it refuses ZeRO-3); drop one")
    if got.get("--expert-tensor-parallel-size", 1) != 1 and tp > 1:
        raise InvalidConfigError(f"{source}: --expert-tensor-parallel-size {got['--expert-tensor-parallel-size']}: "
                                 "autoshard prices each expert whole on every tp rank (--expert-tensor-parallel-size 1)")
    precision, recipe = _precision(got, source)
    run = replace(run, precision=precision, fp8_recipe=recipe)
    if got.get("--fp16"):
        raise InvalidConfigError(f"{source}: --fp16: autoshard prices bf16 mixed precision (--bf16); use --bf16")
    return Parsed(run=run, global_batch=got.get("--global-batch-size"), seq_len=got.get("--seq-length"), model=model,
                  ignored=tuple(skipped))


def _precision(got: dict, source: str):
    """(precision, fp8 recipe): bf16 mixed, or fp8 with per-tensor current scaling (--fp8-recipe tensorwise)."""
    if "--fp8-format" not in got:
        if "--fp8-recipe" in got:
            raise InvalidConfigError(f"{source}: --fp8-recipe needs --fp8-format")
        return Precision.AUTO, None
    if got["--fp8-format"] not in ("hybrid", "e4m3"):
        raise InvalidConfigError(f"{source}: --fp8-format {got['--fp8-format']!r}: expected hybrid or e4m3")
    recipe = got.get("--fp8-recipe", "delayed")
    if recipe != "tensorwise":
        raise InvalidConfigError(f"{source}: --fp8-recipe {recipe}{' (Megatron default)' if '--fp8-recipe' not in got else ''}: "
                                 "autoshard prices per-tensor current scaling; give --fp8-recipe tensorwise")
    return Precision.FP8, Fp8Recipe.TENSORWISE


def _virtual(got: dict, layers: int, pp: int, source: str) -> int:
    per_chunk = got.get("--num-layers-per-virtual-pipeline-stage")
    layers += bool(got.get("--account-for-embedding-in-pipeline-split")) + bool(got.get("--account-for-loss-in-pipeline-split"))
    per_rank = got.get("--num-virtual-stages-per-pipeline-rank")
    if per_chunk and per_rank:
        raise InvalidConfigError(f"{source}: give --num-layers-per-virtual-pipeline-stage or "
                                 "--num-virtual-stages-per-pipeline-rank, not both")
    if per_rank:
        return per_rank
    if not per_chunk:
        return 1
    if per_chunk < 1 or layers % (pp * per_chunk):
        raise InvalidConfigError(f"{source}: --num-layers-per-virtual-pipeline-stage {per_chunk} x pp {pp} does not "
                                 f"divide the {layers} layers (the embedding / loss counted where accounted for); pick a count that divides {layers // pp if layers % pp == 0 else layers} "
                                 "(layers per pipeline rank)")
    return layers // (pp * per_chunk)


def _zero(got: dict, source: str) -> int:
    if got.get("--use-megatron-fsdp") or got.get("--use-custom-fsdp"):
        strategy = got.get("--data-parallel-sharding-strategy", "optim_grads_params")
        if strategy not in SHARDING_STRATEGY:
            raise InvalidConfigError(f"{source}: --data-parallel-sharding-strategy {strategy!r}: expected one of "
                                     f"{', '.join(SHARDING_STRATEGY)}")
        return SHARDING_STRATEGY[strategy]
    if "--data-parallel-sharding-strategy" in got:
        raise InvalidConfigError(f"{source}: --data-parallel-sharding-strategy needs --use-megatron-fsdp")
    return 1 if got.get("--use-distributed-optimizer") else 0


def _recompute(got: dict, source: str) -> Recompute:
    granularity = got.get("--recompute-granularity")
    method, count = got.get("--recompute-method"), got.get("--recompute-num-layers")
    if granularity is None:
        if method or count:
            raise InvalidConfigError(f"{source}: --recompute-method / --recompute-num-layers need "
                                     "--recompute-granularity full")
        return Recompute.NONE
    if granularity == "selective":
        return Recompute.SELECTIVE
    if granularity != "full":
        raise InvalidConfigError(f"{source}: --recompute-granularity {granularity!r}: expected full or selective")
    if method == "block":  # the first `count` layers of each model chunk recomputed whole, the rest kept (_block_layers)
        if not count or count < 1:
            raise InvalidConfigError(f"{source}: --recompute-method block needs --recompute-num-layers N (N >= 1: the "
                                     "layers of each model chunk recomputed)")
        return Recompute.NONE
    if (method or "uniform") != "uniform" or (count or 1) != 1:
        raise InvalidConfigError(f"{source}: --recompute-method {method} --recompute-num-layers {count}: autoshard "
                                 "prices full recompute of every layer (--recompute-method uniform "
                                 "--recompute-num-layers 1) or of the first N layers of each model chunk (--recompute-method "
                                 "block --recompute-num-layers N); use those, or --recompute-granularity selective")
    return Recompute.FULL


def _block_layers(got: dict) -> int:
    """Layers of each model chunk (pipeline stage at v = 1) Megatron's block recompute reruns whole (0: none), as
    cost.block_segments prices them; _recompute checks the flags."""
    return got["--recompute-num-layers"] if got.get("--recompute-method") == "block" else 0


def _rank_layers(got: dict, layers: int, pp: int, v: int, source: str) -> tuple[int, ...]:
    first, last = got.get("--decoder-first-pipeline-num-layers"), got.get("--decoder-last-pipeline-num-layers")
    embed, loss = got.get("--account-for-embedding-in-pipeline-split"), got.get("--account-for-loss-in-pipeline-split")
    if (first is not None or last is not None) and (embed or loss):
        raise InvalidConfigError(f"{source}: --decoder-first/last-pipeline-num-layers and --account-for-*-in-pipeline-"
                                 "split set the split two ways; give one")
    if embed or loss:  # the embedding / loss count as one layer each in the even split (NeMo's 405B recipe)
        units = layers + bool(embed) + bool(loss)
        if units % (pp * v):
            raise InvalidConfigError(f"{source}: {layers} layers + embedding / loss = {units} do not split into "
                                     f"pp x v = {pp * v} equal model chunks")
        out = [units // pp] * pp
        out[0] -= bool(embed)
        out[-1] -= bool(loss)
        return tuple(out) if pp > 1 else ()
    if first is None and last is None:
        return ()
    if pp == 1:
        raise InvalidConfigError(f"{source}: --decoder-first/last-pipeline-num-layers need "
                                 "--pipeline-model-parallel-size > 1")
    if v > 1:
        raise InvalidConfigError(f"{source}: uneven first / last stages with a virtual pipeline: autoshard prices "
                                 "those only with one model chunk per rank")
    if pp == 2:
        first = first if first is not None else layers - last
        last = layers - first
    rest = layers - (first or 0) - (last or 0)
    middle_ranks = pp - (first is not None) - (last is not None)
    if rest < 0 or (middle_ranks and rest % middle_ranks) or (not middle_ranks and rest):
        raise InvalidConfigError(f"{source}: first {first} / last {last} stage layers leave {rest} layers for "
                                 f"{middle_ranks} other stages of {layers}; they must split evenly")
    middle = rest // middle_ranks if middle_ranks else 0
    out = [middle] * pp
    if first is not None:
        out[0] = first
    if last is not None:
        out[-1] = last
    return tuple(out)


def spec_of(model: dict, *, name: str = "megatron-model", source: str = "--from-megatron") -> ModelSpec:
    """A LLaMA-style spec from the model-size flags (for `price` without --model)."""
    need = ("--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--vocab-size")
    missing = [f for f in need if f not in model]
    if missing:
        raise InvalidConfigError(f"{source}: without --model the model's sizes are needed: give {', '.join(missing)}")
    heads = model["--num-attention-heads"]
    return ModelSpec(name=name, mixer=Mixer.ATTENTION, vocab=model["--vocab-size"], hidden=model["--hidden-size"],
                     ffn=model["--ffn-hidden-size"], layers=model["--num-layers"], heads=heads,
                     kv_heads=model.get("--num-query-groups", heads),
                     tied="--untie-embeddings-and-output-weights" not in model, head_dim=model.get("--kv-channels", 0))


def check_model(spec: ModelSpec, model: dict, *, source: str) -> None:
    """The model sizes a command line gives must be the model's own."""
    facts = {"--num-layers": spec.layers, "--hidden-size": spec.hidden, "--vocab-size": spec.vocab}
    if "--hybrid-override-pattern" in model and (spec.parts or spec.mixer is Mixer.SSD):
        facts["--hybrid-override-pattern"] = hybrid_pattern(spec) if spec.parts else "M" * spec.layers
    if spec.mixer is Mixer.ATTENTION and not spec.parts:  # a model read by its parts: the pattern says which is which
        facts.update({"--ffn-hidden-size": spec.ffn, "--num-attention-heads": spec.heads,
                      "--num-query-groups": spec.kv_heads})
        if spec.is_moe:
            facts.update({"--num-experts": spec.experts, "--moe-router-topk": spec.top_k, "--moe-ffn-hidden-size": spec.ffn})
    for flag, value in model.items():
        if flag in facts and value != facts[flag]:
            raise InvalidConfigError(f"{source}: {flag} {value} but {spec.name} has {facts[flag]}; the command line "
                                     "is for another model: fix the flag or --model")


def launch(hw, devices: int) -> str:
    per_node = min(devices, hw.devices_per_node)
    return LAUNCH.format(per_node=per_node, nodes=max(1, devices // per_node))


def price_parsed(ct, hw, spec, parsed: Parsed, *, global_batch: int, seq_len: int, moe_imbalance: float = 1.0) -> dict:
    return price(ct, hw, spec, default_strategies(spec, parsed.run), global_batch=global_batch, seq_len=seq_len,
                 moe_imbalance=moe_imbalance)
