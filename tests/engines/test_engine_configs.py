"""What `plan --emit` writes, checked by each engine's own classes: megatron-core's TransformerConfig and
DistributedDataParallelConfig (their __post_init__ validate the combination), accelerate's
ParallelismConfig and FSDP2 plugin (the emitted Python executed), torchtitan's ConfigManager (native
llama3 config where the model has Llama 3's sizes)."""

from __future__ import annotations

import pytest

from autoshard.engines import accelerate, megatron, torchtitan
from autoshard.engines.training_run import TrainingRun, default_strategies, price
from autoshard.hardware import load_hardware
from autoshard.ir import Mesh, Recompute, Schedule
from autoshard.models.presets import get_spec
from autoshard.passes.cost.compiled import compile_table
from autoshard.passes.capture.shapes import build_cost_table

# (preset, run): NVIDIA's 70B layout; uneven first / last stages with full recompute; MoE with ep and ZeRO-2
RUNS = [
    ("llama-70b", TrainingRun(mesh=Mesh(dp=2, pp=4, tp=4, cp=2), schedule=Schedule.INTERLEAVED_1F1B, virtual_stages=5,
                              sequence_parallel=(True,))),
    ("llama-13b", TrainingRun(mesh=Mesh(dp=2, pp=4, tp=2), recompute=(Recompute.FULL,), rank_layers=(8, 11, 11, 10))),
    ("mixtral-8x7b", TrainingRun(mesh=Mesh(dp=2, tp=2, ep=4), zero=2, recompute=(Recompute.SELECTIVE,))),
    # a MindSpeed-LLM run (never a plan): block recompute of 6 layers per stage and the reused fp32 copy
    ("llama-13b", TrainingRun(mesh=Mesh(dp=2, pp=4, tp=2), recompute_layers=6, reuse_fp32_param=True)),
]


def _megatron_configs(words: list[str]):
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    got, _ = megatron.read_flags(" ".join(words), {**megatron.LAYOUT_FLAGS, **megatron.MODEL_FLAGS},
                                 megatron.IGNORED_FLAGS, source="test")
    pp, layers = got["--pipeline-model-parallel-size"], got["--num-layers"]
    per_chunk = got.get("--num-layers-per-virtual-pipeline-stage")
    kw = dict(num_layers=layers, hidden_size=got["--hidden-size"], ffn_hidden_size=got["--ffn-hidden-size"],
              num_attention_heads=got["--num-attention-heads"], num_query_groups=got.get("--num-query-groups"),
              tensor_model_parallel_size=got["--tensor-model-parallel-size"], pipeline_model_parallel_size=pp,
              virtual_pipeline_model_parallel_size=layers // (pp * per_chunk) if per_chunk else None,
              context_parallel_size=got["--context-parallel-size"],
              expert_model_parallel_size=got["--expert-model-parallel-size"],
              sequence_parallel=bool(got.get("--sequence-parallel")),
              num_layers_in_first_pipeline_stage=got.get("--decoder-first-pipeline-num-layers"),
              num_layers_in_last_pipeline_stage=got.get("--decoder-last-pipeline-num-layers"),
              recompute_granularity=got.get("--recompute-granularity"), recompute_method=got.get("--recompute-method"),
              recompute_num_layers=got.get("--recompute-num-layers"), bf16=True, gated_linear_unit=True,
              pipeline_dtype=__import__("torch").bfloat16,  # what pretrain_gpt.py sets from --bf16
              normalization="RMSNorm", num_moe_experts=got.get("--num-experts"), moe_router_topk=got.get("--moe-router-topk", 2),
              moe_ffn_hidden_size=got.get("--moe-ffn-hidden-size"), add_bias_linear="--disable-bias-linear" not in words,
              expert_tensor_parallel_size=got.get("--expert-tensor-parallel-size"))
    config = TransformerConfig(**kw)
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=bool(got.get("--use-distributed-optimizer")) or
                                        bool(got.get("--use-megatron-fsdp")),
                                        use_megatron_fsdp=bool(got.get("--use-megatron-fsdp")),
                                        data_parallel_sharding_strategy=got.get("--data-parallel-sharding-strategy",
                                                                                "no_shard"))
    return config, ddp


@pytest.mark.parametrize("name, run", RUNS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(RUNS)])
def test_megatron_core_accepts_the_arguments(name, run):
    pytest.importorskip("megatron.core")
    spec = get_spec(name)
    words = megatron.arguments(spec, run, global_batch=64, seq_len=4096)
    config, ddp = _megatron_configs(words)
    m = run.mesh
    assert (config.tensor_model_parallel_size, config.pipeline_model_parallel_size, config.context_parallel_size,
            config.expert_model_parallel_size) == (m.tp, m.pp, m.cp, m.ep)
    assert (config.virtual_pipeline_model_parallel_size or 1) == run.virtual_stages
    assert config.sequence_parallel == run.sequence_parallel[0]
    if run.rank_layers:
        assert (config.num_layers_in_first_pipeline_stage, config.num_layers_in_last_pipeline_stage) == (
            run.rank_layers[0], run.rank_layers[-1])
    assert ddp.use_distributed_optimizer == (run.zero >= 1)
    if run.recompute_layers:
        assert (config.recompute_method, config.recompute_num_layers) == ("block", run.recompute_layers)
    parsed = megatron.parse(" ".join(words), spec=spec, devices=m.size)
    assert parsed.run == run


def test_accelerate_builds_the_emitted_settings():
    pytest.importorskip("accelerate")
    spec, hw = get_spec("llama-7b"), load_hardware("h100")
    ct = compile_table(build_cost_table(spec, kernels=hw.kernels), spec)
    run = default_strategies(spec, TrainingRun(mesh=Mesh(dp=4, pp=2, tp=2), zero=1))
    projected, notes = accelerate.project(ct, hw, spec, run, global_batch=64, seq_len=4096)
    assert projected.mesh == Mesh(dp=8, tp=2) and any("pipeline" in n for n in notes)
    code = accelerate.script(spec, projected, global_batch=64, seq_len=4096).split("# ---- under")[0]
    scope: dict = {}
    exec(code, scope)  # accelerate's own classes validate the sizes
    pc, plugin = scope["parallelism_config"], scope["fsdp_plugin"]
    shard = 8 if projected.zero >= 2 else 1
    assert (pc.dp_replicate_size, pc.dp_shard_size, pc.tp_size, pc.cp_size) == (8 // shard, shard, 2, 1)
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward == (projected.zero == 3)
    p = price(ct, hw, spec, projected, global_batch=64, seq_len=4096)
    assert p["step_time_s"] > 0


def test_torchtitan_names_its_own_llama3_config():
    pytest.importorskip("torchtitan")
    spec = get_spec("llama-70b")
    run = default_strategies(spec, TrainingRun(mesh=Mesh(dp=8, tp=8), zero=3, recompute=(Recompute.FULL,),
                                               sequence_parallel=(True,)))
    words = torchtitan.arguments(spec, run, global_batch=64, seq_len=8192)
    assert "--config llama3_70b" in words
    back, gb, sl = torchtitan.parse(words, spec=spec, devices=64)
    assert (back.mesh, back.zero, back.recompute, back.sequence_parallel, gb, sl) == (
        run.mesh, 3, (Recompute.FULL,), (True,), 64, 8192)
    from autoshard.errors import InvalidConfigError

    with pytest.raises(InvalidConfigError, match=r"Unrecognized options: --parallelism\.frob"):
        torchtitan.parse(words + ["--parallelism.frob 2"], spec=spec, devices=64)
    with pytest.raises(InvalidConfigError, match="not --devices 32"):
        torchtitan.parse(words, spec=spec, devices=32)
