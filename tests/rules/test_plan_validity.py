"""Property test (issue 13): every plan the planner can emit passes the runtime's check, and the
sharding table it derives from slices the real HF parameters evenly.

Random model shapes (user-built HF configs read through `spec_from_hf_config`, as `parallelize`
reads them), device counts 1..64, global batches and sequence lengths. A sample of small plans
runs on gloo and trains like one process (tests/runtime/equivalence.py)."""

from __future__ import annotations

import random

import pytest
import torch

from autoshard.ir import Mesh, Plan
from autoshard.model_spec import ModelSpec
from autoshard.models.presets import build_model, get_spec, spec_from_hf_config
from autoshard.rules.validity import check_plan, plan_violation
from autoshard.passes.rewrite import Shard, shard_program
from autoshard.passes.solve.planner import candidate_layouts


def _size(rng: random.Random) -> int:
    """Mostly round sizes (so tp > 1 often fits), sometimes odd ones."""
    return rng.choice((4, 8, 12, 16)) * rng.randint(1, 8) + rng.choice((0, 0, 0, 1, 3))


def random_spec(rng: random.Random) -> ModelSpec:
    """A small LLaMA or Mamba-2 built the way a user would: an HF config, read back as a spec."""
    if rng.random() < 0.6:
        from transformers import LlamaConfig

        heads = rng.choice((1, 2, 3, 4, 6, 8, 12))
        kv = rng.choice([d for d in range(1, heads + 1) if heads % d == 0])
        head_dim = rng.choice((2, 4))
        config = LlamaConfig(vocab_size=_size(rng), hidden_size=heads * head_dim,
                             intermediate_size=_size(rng), num_hidden_layers=rng.randint(1, 6),
                             num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim)
        return spec_from_hf_config(config, name="user-llama")
    from transformers import Mamba2Config

    heads = rng.choice((2, 4, 6, 8))
    head_dim = rng.choice((2, 4))
    config = Mamba2Config(vocab_size=_size(rng), hidden_size=heads * head_dim // 2,
                          num_hidden_layers=rng.randint(1, 6), state_size=rng.choice((2, 4)), expand=2,
                          head_dim=head_dim, num_heads=heads,
                          n_groups=rng.choice([d for d in range(1, heads + 1) if heads % d == 0]),
                          conv_kernel=rng.choice((2, 4)), chunk_size=8)
    return spec_from_hf_config(config, name="user-mamba2")


def _plan(spec: ModelSpec, layout, *, devices: int, global_batch: int, seq_len: int, variant=()) -> Plan:
    """The plan of `layout`; with per-stage choices (`Layout.stage_choices`), each pipeline rank at its
    entry of `variant` (indices into `solve_model.stage_variants`), as the planner writes it."""
    from autoshard.passes.solve.planner import chunk_strategies
    from autoshard.passes.solve.solve_model import Assignment

    a = Assignment(layers=(0,) * layout.mesh.pp, recompute=(), variant=tuple(variant))
    sp, strategies = chunk_strategies(a, layout)
    return Plan(model=spec.name, fingerprint="", hardware="cpu", devices=devices, global_batch=global_batch,
                seq_len=seq_len, mesh=layout.mesh, micro_batch=layout.micro_batch, zero=layout.zero,
                offload_optimizer=layout.offload_optimizer, schedule=layout.schedule, virtual_stages=layout.virtual_stages,
                sequence_parallel=sp, strategies=strategies)


def _variants(rng: random.Random, layout) -> list:
    """Per-stage variant tuples to check for `layout`: none without per-stage choices; else every stage
    at the first variant, and three random mixes (the planner may pick any one per stage)."""
    from autoshard.passes.solve.solve_model import stage_variants

    count = len(stage_variants(layout))
    if count == 1:
        return [()]
    return [(0,) * layout.mesh.pp] + [tuple(rng.randrange(count) for _ in range(layout.mesh.pp)) for _ in range(3)]


def _valid_mix(spec, layout, variant) -> bool:
    """Whether the planner can emit this mix: a replicated embedding / head only with its stage not
    sequence-parallel (the tables give such a stage no memory to fit in, `solve_model.mesh_problem`)."""
    from autoshard.passes.solve.solve_model import stage_variants

    from autoshard.ir import stage_rank

    if not variant:
        return True
    variants = stage_variants(layout)
    chosen = dict(layout.strategies)
    pp, v = layout.mesh.pp, layout.virtual_stages
    first, last = (stage_rank(c, pp=pp, virtual_stages=v, schedule=layout.schedule) for c in (0, pp * v - 1))
    return not ((chosen.get("embedding") == "replicate" and variants[variant[first]].sequence_parallel) or
                (chosen.get("head") == "replicate" and variants[variant[last]].sequence_parallel))


def _slices_evenly(spec: ModelSpec, plan: Plan, shapes: dict) -> None:
    """Every Shard of every tp rank cuts the real parameter's pieces into equal parts."""
    for rank in range(plan.mesh.tp):
        for name, placement in shard_program(plan, spec, shapes, tp_rank=rank).placements:
            if isinstance(placement, Shard):
                assert sum(placement.segments) == shapes[name][placement.dim], (spec, plan.mesh, name)
                assert all(s % placement.parts == 0 for s in placement.segments), (spec, plan.mesh, name)


def test_every_candidate_layout_passes_the_runtime_check():
    rng, mix = random.Random(13), random.Random(1)  # (the mixes draw from their own generator)
    seen_tp = seen_mixed = 0
    for _ in range(25):
        spec = random_spec(rng)
        shapes = {n: tuple(p.shape) for n, p in build_model(spec, device="meta").named_parameters()}
        devices = rng.randint(1, 64) if rng.random() < 0.4 else rng.choice((2, 4, 6, 8, 12, 16, 32, 64))
        global_batch, seq_len = rng.choice((1, 2, 3, 12, 64, 256)), rng.choice((8, 12, 64, 100, 2048))
        layouts = candidate_layouts(spec, devices=devices, global_batch=global_batch, seq_len=seq_len)
        for tp in {lay.mesh.tp for lay in layouts}:
            lay = next(lay for lay in layouts if lay.mesh.tp == tp)
            _slices_evenly(spec, _plan(spec, lay, devices=devices, global_batch=global_batch, seq_len=seq_len),
                           shapes)
            seen_tp += tp > 1
        for lay in layouts:
            for variant in _variants(mix, lay):
                plan = _plan(spec, lay, devices=devices, global_batch=global_batch, seq_len=seq_len, variant=variant)
                if _valid_mix(spec, lay, variant):
                    check_plan(plan, spec, world_size=devices)
                    seen_mixed += plan.per_stage
                    if plan.per_stage and seen_mixed % 50 == 1:  # a sample: each stage's slices even too
                        _slices_evenly(spec, plan, shapes)
    assert seen_tp >= 4  # the sample reaches tensor parallelism (5 (spec, tp > 1) pairs with this seed)
    assert seen_mixed >= 10  # and per-stage mixes of sequence parallelism / groups


def test_llama13b_on_5_devices_never_gets_tp5():
    """tp 5 divides llama-13b's 40 heads but not its MLP width 13824 (the plan the runtime refused)."""
    spec = get_spec("llama-13b")
    layouts = candidate_layouts(spec, devices=5, global_batch=1, seq_len=2048)
    assert layouts and all(lay.mesh.tp == 1 for lay in layouts)
    assert "MLP width" in plan_violation(spec, Mesh(tp=5), global_batch=1, seq_len=2048)


def test_solved_plans_pass_the_runtime_check():
    """The whole planner (traced cost table, search) on random user-built models."""
    from autoshard.passes.capture.shapes import build_cost_table
    from autoshard.passes.solve.planner import solve

    rng = random.Random(7)
    for _ in range(2):
        spec = random_spec(rng)
        devices = rng.choice((2, 4, 6, 8))
        table = build_cost_table(spec, model=build_model(spec, device="meta"))
        plan = solve(spec, "cpu", devices=devices, global_batch=devices * 2, seq_len=16, table=table,
                     fingerprint="x")
        check_plan(plan, spec, world_size=devices)


def gloo_sample(world: int, count: int, seed: int) -> list:
    """`count` (spec, plan dict) pairs that the planner may emit on `world` ranks, tp > 1 first."""
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        spec = random_spec(rng)
        layouts = [lay for lay in candidate_layouts(spec, devices=world, global_batch=8, seq_len=16)
                   if lay.mesh.tp > 1]
        if layouts:
            lay = rng.choice(layouts)
            plan = dict(lay.mesh.as_dict(), micro_batch=lay.micro_batch, zero=lay.zero,
                        sequence_parallel=lay.sequence_parallel, strategies=dict(lay.strategies))
            out.append((spec, plan))
    return out


def _train(rank: int, world: int, sample) -> None:
    from tests.runtime.equivalence import check_plan as equal_to_one_process

    for spec, plan in sample:
        equal_to_one_process(spec, plan)


def test_sample_trains_like_one_process():
    from tests.runtime.dist_harness import run_ranks

    torch.manual_seed(0)
    run_ranks(2, _train, gloo_sample(2, 2, seed=3))


def test_plan_placements_say_what_the_runtime_shards():
    """The plan's placements and the runtime's slices come from one table: llama-tiny at tp 4 keeps
    each of its 2 KV heads on 2 ranks, and the plan says so (it used to say "replicate")."""
    from autoshard.rules.sharding import block_placements

    spec = get_spec("llama-tiny")
    shapes = {n: tuple(p.shape) for n, p in build_model(spec, device="meta").named_parameters()}
    plan = Plan(model=spec.name, fingerprint="", hardware="cpu", devices=4, global_batch=8, seq_len=16,
                mesh=Mesh(tp=4))
    program = shard_program(plan, spec, shapes, tp_rank=3)
    k = program.placement("model.layers.0.self_attn.k_proj.weight")
    assert isinstance(k, Shard) and (k.parts, k.index) == (2, 1)
    named = dict(block_placements(spec, tp=4))
    assert named["layers.*.self_attn.k_proj"] == "colwise (2 parts)"
    assert named["layers.*.self_attn.q_proj"] == "colwise" and named["layers.*.mlp.down_proj"] == "rowwise"
    assert named["layers.*.input_layernorm"] == "replicate" and named["loss"] == "vocab"
    for role, strategy in named.items():  # every sharded role names a module the runtime slices
        if role.startswith("layers.*.") and strategy.startswith(("colwise", "rowwise")):
            name = f"model.layers.0.{role[len('layers.*.'):]}.weight"
            assert isinstance(program.placement(name), Shard), role
    assert block_placements(spec, tp=1) == (("all", "replicate"),)


def test_a_vocabulary_tp_does_not_divide_runs_with_embedding_and_head_replicated():
    """A user config's vocab of 32001: tp 2 is refused with the vocab-parallel embedding or head (the
    message names both ways out), allowed with both replicated, and the planner's tp layouts are
    exactly those (sequence parallelism, which needs them vocab-parallel, only on middle stages)."""
    import dataclasses

    spec = dataclasses.replace(get_spec("llama-tiny"), name="user-llama-32001", vocab=32001)
    both = (("embedding", "replicate"), ("head", "replicate"))
    for strategies in ((), both[:1], both[1:]):
        why = plan_violation(spec, Mesh(tp=2), global_batch=8, seq_len=16, strategies=strategies)
        assert "vocabulary size of user-llama-32001 (32001)" in why and '"head": "replicate"' in why
    assert plan_violation(spec, Mesh(tp=2), global_batch=8, seq_len=16, strategies=both) is None
    plan = Plan(model=spec.name, fingerprint="", hardware="cpu", devices=2, global_batch=8, seq_len=16,
                mesh=Mesh(tp=2), strategies=dict(both))
    check_plan(plan, spec, world_size=2)
    shapes = {n: tuple(p.shape) for n, p in build_model(spec, device="meta").named_parameters()}
    program = shard_program(plan, spec, shapes, tp_rank=1)
    assert not program.vocab_head and not isinstance(program.placement("lm_head.weight"), Shard)
    with pytest.raises(Exception, match="vocabulary"):
        check_plan(dataclasses.replace(plan, strategies=()), spec, world_size=2)
    layouts = candidate_layouts(spec, devices=4, global_batch=8, seq_len=16)
    tp = [lay for lay in layouts if lay.mesh.tp > 1]
    assert {lay.mesh.tp for lay in tp} == {2, 4}
    assert all(lay.strategies == both and not lay.sequence_parallel for lay in tp)
    # a tied model (one weight for both) takes the same replicated option
    tied = dataclasses.replace(spec, tied=True)
    assert all(dict(lay.strategies) == dict(both) for lay in candidate_layouts(tied, devices=2, global_batch=8,
                                                                                seq_len=16) if lay.mesh.tp > 1)
