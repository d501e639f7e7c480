"""Distributed runs on gloo equal one process: loss of two AdamW steps, every gradient, the weights
(bf16-mixed plans: loss and gradients to bf16 precision; fp8 plans: to float8 precision against the
single-process torchao FP8 run; see tests/runtime/equivalence.py).

Each world size is spawned once and runs all its configurations (start-up costs seconds).
"""

from __future__ import annotations

import dataclasses

import pytest

from autoshard.models.presets import get_spec

from tests.runtime.dist_harness import run_ranks
from tests.runtime.equivalence import check_plan
from tests.runtime.families import MULTI_QUERY

# mamba2-tiny with one group (as mamba2-1b): tp does not divide the groups, so B/C are kept whole
ONE_GROUP = dataclasses.replace(get_spec("mamba2-tiny"), name="mamba2-tiny-1group", groups=1)
# a vocabulary tp does not divide (a user config's 32001, here 257): tp runs with embedding and head replicated
ODD_VOCAB = dataclasses.replace(get_spec("llama-tiny"), name="llama-tiny-vocab257", vocab=257)
WORLD2 = (
    ("llama-tiny", dict(dp=2), True),
    ("llama-tiny", dict(tp=2), True),
    ("mamba2-tiny", dict(dp=2, micro_batch=2), False),
    ("mamba2-tiny", dict(tp=2), True),
    ("llama-tiny", dict(pp=2, micro_batch=2), True),
    ("mamba2-tiny", dict(pp=2, micro_batch=2), False),
    ("llama-tiny", dict(dp=2, zero=2, micro_batch=2), False),  # 2 micro-batches: one reduce-scatter each
    # two model chunks per pipeline rank: interleaved 1F1B (loop placement) and zero-bubble (ZB-V placement)
    ("llama-tiny", dict(pp=2, micro_batch=2, schedule="interleaved-1f1b", virtual_stages=2), True),
    ("mamba2-tiny", dict(pp=2, micro_batch=2, schedule="interleaved-1f1b", virtual_stages=2), False),
    ("llama-tiny", dict(pp=2, micro_batch=2, schedule="zero-bubble", virtual_stages=2), False),
    ("mamba2-tiny", dict(pp=2, micro_batch=2, schedule="zero-bubble", virtual_stages=2), True),
    # zero-bubble with one chunk per rank (ZB-H1); interleaved with selective recompute (the planner searches both)
    ("llama-tiny", dict(pp=2, micro_batch=2, schedule="zero-bubble", virtual_stages=1), False),
    ("llama-tiny", dict(pp=2, schedule="interleaved-1f1b", virtual_stages=2, recompute="selective"), False),
    # bf16-mixed (fp32 masters and gradients) against the single-process bf16-mixed run, every parallel form
    *((preset, dict(plan, precision="bf16-mixed"), False) for preset, plan in (
        ("llama-tiny", dict(dp=2, zero=1)), ("llama-tiny", dict(tp=2)), ("llama-tiny", dict(pp=2, micro_batch=2)),
        ("llama-tiny", dict(cp=2)), ("mamba2-tiny", dict(dp=2, zero=2, micro_batch=2)), ("mamba2-tiny", dict(tp=2)),
        ("mamba2-tiny", dict(pp=2, micro_batch=2)), ("mamba2-tiny", dict(cp=2)),
        ("llama-tiny", dict(dp=2)), ("llama-tiny", dict(dp=2, zero=3)),  # ZeRO 0: whole-bucket masters; FSDP2
        ("llama-tiny", dict(pp=2, micro_batch=2, schedule="zero-bubble", virtual_stages=2)))),  # weight pass
    (ONE_GROUP, dict(tp=2), True),  # heads split, the one group whole on both ranks
    ("mamba2-tiny", dict(dp=2, zero=3, micro_batch=2), True),  # FSDP2; logits through the root forward
    ("llama-tiny", dict(dp=2, zero=3, offload_optimizer=True), False),  # FSDP2's CPUOffloadPolicy
    # intra-op choices (rules/sharding.py CHOICES): replicated embedding / LM head + plain loss on full logits
    ("llama-tiny", dict(tp=2, strategies={"embedding": "replicate", "head": "replicate"}), True),
    ("mamba2-tiny", dict(tp=2, strategies={"head": "replicate"}), False),
    (ODD_VOCAB, dict(tp=2, strategies={"embedding": "replicate", "head": "replicate"}), True),
    # sequence parallelism: norms and residual on half the sequence (check_plan asserts the shard)
    ("llama-tiny", dict(tp=2, sequence_parallel=True), True),
    ("mamba2-tiny", dict(tp=2, sequence_parallel=True, recompute="selective"), True),
    ("llama-tiny", dict(tp=2, sequence_parallel=True, precision="bf16-mixed"), False),
    # fp8 (torchao's Float8Linear on the projections, runtime/fp8.py) against the single-process FP8 run to float8
    # precision (equivalence.FP8_NOISE): both recipes, the row-parallel float8 linears, FSDP2's float8 all-gather
    *((preset, dict(plan, precision="fp8"), False) for preset, plan in (
        ("llama-tiny", dict(dp=2, zero=1)), ("llama-tiny", dict(tp=2)),
        ("llama-tiny", dict(tp=2, sequence_parallel=True, fp8_recipe="rowwise")),
        ("llama-tiny", dict(pp=2, micro_batch=2)), ("llama-tiny", dict(cp=2, fp8_recipe="rowwise")),
        ("llama-tiny", dict(dp=2, zero=3)), ("mamba2-tiny", dict(tp=2)),
        ("mamba2-tiny", dict(dp=2, zero=2, micro_batch=2, fp8_recipe="rowwise")))),
)
# decoder layers under torch.compile (runtime/compiled.py; on CUDA Inductor, here aot_eager): Dynamo
# traces through the tp / sequence-parallel collectives, the recompute wrappers and FSDP2's hooks
COMPILED = (
    ("llama-tiny", dict(tp=2, sequence_parallel=True, recompute="selective")),
    ("llama-tiny", dict(dp=2, zero=3)),
    ("llama-tiny", dict(pp=2, micro_batch=2)),
)
WORLD4 = (
    ("llama-tiny", dict(dp=2, tp=2, micro_batch=2), True),
    ("mamba2-tiny", dict(dp=2, tp=2), False),
    ("llama-tiny", dict(dp=4, zero=1), False),
    ("llama-tiny", dict(dp=2, tp=2, recompute="full"), False),
    ("mamba2-tiny", dict(dp=2, tp=2, recompute="full", zero=1), False),
    ("llama-tiny", dict(tp=4), False),  # 2 KV heads, tp 4: each rank keeps one KV head
    (MULTI_QUERY["gemma2_mq"], dict(tp=4), True),  # one KV head for one query head per rank (repeat_kv once)
    (MULTI_QUERY["llama_mq"], dict(dp=2, tp=2, zero=3), False),  # the whole k / v gradients summed on FSDP2's shard
    ("llama-tiny", dict(dp=2, pp=2, micro_batch=2), False),
    ("mamba2-tiny", dict(pp=2, tp=2, micro_batch=2), True),
    ("mamba2-tiny", dict(dp=2, tp=2, zero=2), False),
    ("llama-tiny", dict(dp=2, cp=2, zero=2, micro_batch=2), False),  # shards over dp x cp
    ("llama-tiny", dict(pp=2, tp=2, micro_batch=2, schedule="interleaved-1f1b", virtual_stages=2), True),
    ("mamba2-tiny", dict(pp=2, tp=2, micro_batch=2, schedule="interleaved-1f1b", virtual_stages=2), False),
    # the schedules the planner searches, with dp, ZeRO-1, recompute and cp
    ("llama-tiny", dict(dp=2, pp=2, zero=1, schedule="interleaved-1f1b", virtual_stages=2), False),
    ("mamba2-tiny", dict(dp=2, pp=2, zero=1, schedule="zero-bubble", virtual_stages=2, recompute="full"), False),
    ("llama-tiny", dict(pp=2, cp=2, schedule="zero-bubble", virtual_stages=1), False),
    ("mamba2-tiny", dict(tp=4), False),  # 2 groups at tp 4: groups whole, the norm synced
    (ONE_GROUP, dict(dp=2, tp=2), False),
    (ONE_GROUP, dict(dp=2, tp=2, zero=3), False),  # the whole B/C rows' gradients summed over tp on FSDP2's shard
    ("llama-tiny", dict(dp=4, zero=3), False),  # ZeRO-3: FSDP2 over dp
    ("llama-tiny", dict(dp=2, tp=2, zero=3, micro_batch=2), False),  # FSDP2 on the tp slices
    ("mamba2-tiny", dict(dp=4, zero=3), False),
    ("llama-tiny", dict(dp=2, tp=2, micro_batch=2, strategies={"head": "replicate"}), False),
    ("llama-tiny", dict(pp=2, tp=2, micro_batch=2, strategies={"embedding": "replicate"}), True),
    # Mamba-2's 2 groups kept whole at tp 2 (tp divides them): SGD steps, see WHOLE_GROUPS
    # sequence parallelism with dp, pp (the stages exchange the sequence shard), cp (SP splits each cp
    # rank's chunk), recompute
    ("llama-tiny", dict(dp=2, tp=2, sequence_parallel=True, recompute="selective"), False),
    ("mamba2-tiny", dict(dp=2, tp=2, sequence_parallel=True, zero=1), False),
    ("llama-tiny", dict(pp=2, tp=2, micro_batch=2, sequence_parallel=True, recompute="full"), True),
    ("mamba2-tiny", dict(pp=2, tp=2, micro_batch=2, sequence_parallel=True), False),
    ("llama-tiny", dict(cp=2, tp=2, sequence_parallel=True), True),
    ("mamba2-tiny", dict(cp=2, tp=2, sequence_parallel=True), False),
    ("llama-tiny", dict(dp=2, tp=2, sequence_parallel=True, zero=3), False),  # FSDP2 on the tp slices
    # per-stage choices: stage 0 sequence-parallel, stage 1 not (the boundary carries the whole sequence)
    ("llama-tiny", dict(pp=2, tp=2, micro_batch=2, sequence_parallel=[True, False]), True),
    ("llama-tiny", dict(dp=2, tp=2, zero=3, micro_batch=2, precision="fp8"), False),  # float8 gather of tp slices
)
# groups kept whole where tp divides them (the plan's "groups": "whole"), stepped with SGD: the gradients agree
# with one process to 3e-6 of their norm, as the split groups' do, but in_proj / embedding elements whose
# gradient is ~1e-6 (Adam's eps) take an AdamW step that differs by 1-2% of lr (equivalence.optimizer_factory)
WHOLE_GROUPS = (("mamba2-tiny", dict(dp=2, tp=2, strategies={"groups": "whole"}), True),
                # per stage: groups split on stage 0, whole on stage 1; sequence parallelism on stage 1 only
                ("mamba2-tiny", dict(pp=2, tp=2, micro_batch=2, strategies={"groups": ["split", "whole"]},
                                     sequence_parallel=[False, True]), True))
WORLD8 = (
    ("llama-tiny", dict(dp=2, pp=2, tp=2, micro_batch=2), True),
)


def _dynamic_rope(model) -> None:
    """HF's dynamic RoPE trained past 8 positions: its frequencies follow the largest position a forward
    sees, which a cp rank alone does not hold (runtime/cp_attention.py `_rotary_over_whole_sequence`)."""
    import copy

    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = copy.deepcopy(model.config)
    config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": config.rope_parameters["rope_theta"]}
    config.max_position_embeddings = 8
    model.model.rotary_emb = LlamaRotaryEmbedding(config)


def _sliding_window(model) -> None:
    """A 4-token sliding window (Mixtral's config.sliding_window; Qwen2-MoE: layer 0 sliding, the others
    full, as its max_window_layers gives): the CP attention and the pipeline stages' masks keep it."""
    model.config.sliding_window = 4
    if model.config.model_type == "qwen2_moe":
        model.config.layer_types = ["sliding_attention"] + ["full_attention"] * (model.config.num_hidden_layers - 1)
        model.model.layers[0].self_attn.sliding_window = 4


def _run_all(rank: int, world: int, configs) -> None:
    if world == 2:
        from tests.runtime.families import check_families

        check_families()  # Qwen3, Mistral, Gemma-2/3, Phi-3, OLMo2, Granite, Qwen3-MoE, GPT-OSS (issue 24)
        from tests.runtime.hybrids import check_hybrids

        check_hybrids()  # Bamba, Nemotron-H, Falcon-H1, DeepSeek-V3, Jamba (issue 25)
        _check_shard_saved()
        for preset, plan in COMPILED:
            check_plan(preset, plan, compile="aot_eager")
        check_plan("llama-tiny", dict(cp=2), prepare=_dynamic_rope, logits=True)  # 25% of the logits were off
        for preset, plan in (("mixtral-tiny", dict(cp=2)), ("qwen2-moe-tiny", dict(cp=2)),
                             ("qwen2-moe-tiny", dict(pp=2, micro_batch=2))):  # the window was dropped: wrong loss
            check_plan(preset, plan, prepare=_sliding_window, logits=True)
    for preset, plan, logits in configs:
        check_plan(preset, plan, logits=logits)
    if world == 2:
        _check_nothing_held()
    if world == 4:
        for preset, plan, logits in WHOLE_GROUPS:
            check_plan(preset, plan, logits=logits, sgd=True)
        from tests.runtime.families import CLASSIC, DENSE
        from tests.runtime.hybrids import HYBRIDS

        # sequence parallelism through stages that run HF's own forward (positions, masks and placeholder of the
        # whole sequence, the shard swapped in at the stage's first layer): Gemma-2's scaled embedding and
        # softcaps, DeepSeek-V3's latent attention and its dense and MoE layers, per stage too
        check_plan(DENSE["gemma2"], dict(pp=2, tp=2, micro_batch=2, sequence_parallel=True), logits=True)
        check_plan(HYBRIDS["deepseek_v3"], dict(pp=2, tp=2, micro_batch=2, sequence_parallel=[False, True]), logits=True)
        # GPT-2's transposed linears (HF's Conv1D) split by the layout proposed on its graph, through the stages of
        # its own forward (learned positions), under sequence parallelism (its positions cut to the shard)
        check_plan(CLASSIC["gpt2"], dict(pp=2, tp=2, micro_batch=2, sequence_parallel=True), logits=True)


def _check_nothing_held() -> None:
    """After the hundreds of plans this world ran: the process groups of the same ranks were made once
    (runtime/mesh.py `process_group`; gloo's threads of a new set per plan slowed this run ~15x), and a dropped
    DistributedModel is freed whole (its gradient hooks hold it weakly: runtime/data_parallel.py `_weak_hook`)."""
    import gc
    import os
    import weakref

    import torch
    from torch.distributed import distributed_c10d

    import autoshard
    from autoshard.models.presets import build_model

    ids = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(0))
    made = []
    for _ in range(2):
        dm = autoshard.parallelize(build_model(get_spec("llama-tiny"), seed=0), ids, plan=dict(dp=2), global_batch=8)
        dm.train_step(ids, ids)
        made.append((weakref.ref(dm.model), dm._groups))
        del dm
        gc.collect()
    assert [model() for model, _ in made] == [None, None], "a dropped DistributedModel's model is still held"
    assert made[0][1].dp is made[1][1].dp, "a second parallelize made new process groups for the same ranks"
    # the world, the single-rank groups of each rank and the pair, per (backend, timeout) they were asked with
    held = len(distributed_c10d._world.pg_map)
    assert held <= 8, f"{held} process groups held after this world's plans"
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 0
    assert threads <= 64, f"{threads} threads in this rank after this world's plans"


def _check_shard_saved() -> None:
    """Sequence parallelism keeps a region's gathered input as this rank's shard for backward and
    gathers it again there (runtime/tensor_parallel.py `_ShardSaved`): the linear saves no full copy,
    and its gradients equal those of the plain gathered run."""
    import torch
    import torch.distributed as dist

    from autoshard.runtime.comm import gather_from_sequence
    from autoshard.runtime.tensor_parallel import _ShardSaved

    group = dist.group.WORLD
    torch.manual_seed(0)  # the same weight on both ranks, each its own shard of the sequence
    weight = torch.randn(6, 8, requires_grad=True)
    local = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(dist.get_rank()), requires_grad=True)
    grads = []
    for keep_shard in (False, True):
        full = gather_from_sequence(local, group)
        saver, packed = _ShardSaved(full, local, group), []
        saver.pack_hook = lambda t, pack=saver.pack_hook: packed.append(pack(t)) or packed[-1]  # noqa: B023
        if keep_shard:
            with saver:
                out = torch.nn.functional.linear(full, weight)
            assert any(isinstance(p, tuple) for p in packed), "the gathered input was saved whole"
            assert saver.full is None  # gathered again only when backward needs it
        else:
            out = torch.nn.functional.linear(full, weight)
        (out * torch.arange(out.numel()).view_as(out)).sum().backward()
        grads.append((weight.grad.clone(), local.grad.clone()))
        weight.grad = local.grad = None
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)


@pytest.mark.parametrize("world, configs", [(2, WORLD2), (4, WORLD4), (8, WORLD8)], ids=["ws2", "ws4", "ws8"])
def test_matches_single_process(world, configs):
    run_ranks(world, _run_all, configs)
