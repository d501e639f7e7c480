"""Single-process checks: plan validation, mesh coordinates, backend choice, shard tables."""

from __future__ import annotations

import pytest
import torch

import autoshard
from autoshard.errors import InvalidConfigError
from autoshard.ir import Mesh, Plan
from autoshard.models.presets import build_model, get_spec
from autoshard.rules.validity import check_plan
from autoshard.passes.rewrite import Replicate, Shard, shard_program
from autoshard.runtime.mesh import axis_ranks, backend_for, coords_of, rank_of
from autoshard.runtime.tensor_parallel import shard_tensor, unshard


def _plan(world, global_batch=8, micro_batch=1, **mesh):
    return Plan(model="t", fingerprint="", hardware="cpu", devices=world, global_batch=global_batch, seq_len=16,
                mesh=Mesh(**mesh), micro_batch=micro_batch)


def test_zero_levels_the_runtime_runs():
    import dataclasses

    spec = get_spec("llama-tiny")
    with pytest.raises(InvalidConfigError, match="ZeRO-2 with pp=2"):
        check_plan(dataclasses.replace(_plan(4, dp=2, pp=2), zero=2), spec, world_size=4)
    with pytest.raises(InvalidConfigError, match="ZeRO-3 with pp=2"):
        check_plan(dataclasses.replace(_plan(4, dp=2, pp=2), zero=3), spec, world_size=4)
    check_plan(dataclasses.replace(_plan(2, dp=2), zero=3), spec, world_size=2)
    check_plan(dataclasses.replace(_plan(2, dp=2), zero=2), spec, world_size=2)
    check_plan(dataclasses.replace(_plan(4, dp=2, pp=2), zero=1), spec, world_size=4)


@pytest.mark.parametrize("preset, world, kwargs, needle", [
    ("llama-tiny", 4, dict(dp=2), "multiplies to 2, but the world size is 4"),
    ("llama-tiny", 3, dict(tp=3), "tp (3) does not divide the number of heads of llama-tiny (4)"),  # before vocab
    ("mamba2-tiny", 16, dict(tp=16), "tp (16) does not divide the number of heads of mamba2-tiny (8)"),  # groups: any
    ("llama-tiny", 8, dict(pp=8), "pp (8) is larger than the number of blocks (layers) of llama-tiny (4)"),
    ("llama-tiny", 2, dict(dp=2, micro_batch=3), "global batch 8 is not divisible by dp (2) x micro_batch (3)"),
])
def test_bad_plans_name_the_numbers(preset, world, kwargs, needle):
    micro = kwargs.pop("micro_batch", 1)
    plan = _plan(Mesh(**kwargs).size, micro_batch=micro, **kwargs)
    with pytest.raises(InvalidConfigError) as err:
        check_plan(plan, get_spec(preset), world_size=world)
    assert needle in str(err.value)


def test_parallelize_rejects_before_any_collective():
    model = build_model(get_spec("llama-tiny"))
    ids = torch.zeros(8, 16, dtype=torch.long)
    with pytest.raises(InvalidConfigError, match="multiplies to 4, but the world size is 1"):
        autoshard.parallelize(model, ids, plan=dict(dp=2, tp=2))
    with pytest.raises(InvalidConfigError, match="unknown plan keys"):
        autoshard.parallelize(model, ids, plan=dict(dq=1))
    with pytest.raises(InvalidConfigError, match="sequence length 1: training predicts each next token"):
        autoshard.parallelize(model, ids[:, :1], plan=dict(dp=1))  # as plan and sweep refuse --seq-len 1
    for bad in (ids[:0], ids[:, :0], ids[None]):  # said 'global_batch ... got 0', 'seq_len ... 0', 'got Tensor'
        with pytest.raises(InvalidConfigError, match=r"example_inputs must be input_ids of shape \(batch, seq\), "
                                                     r"neither empty .* got a tensor of shape"):
            autoshard.parallelize(model, bad, plan=dict(dp=1))
    # a bf16 model under an fp32 plan (auto on a CPU): its .grad cannot hold the float32 main gradients (torch
    # raised at the first data-parallel step); named, with both ways out
    half = build_model(get_spec("llama-tiny"), dtype=torch.bfloat16)
    for plan in (dict(dp=1), dict(dp=1, precision="fp32")):
        with pytest.raises(InvalidConfigError, match=r"parameter model.embed_tokens.weight is bfloat16, but the plan's "
                                                     r"precision is fp32 .*precision='bf16-mixed'.*model.float\(\)"):
            autoshard.parallelize(half, ids, plan=plan)
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("kwargs, needle", [
    (dict(global_batch=0), "global_batch must be a positive integer (sequences per optimizer step), got 0"),
    (dict(global_batch=True), "global_batch must be a positive integer"),
    (dict(device="bogus"), "device 'bogus' is not a torch device"),
    (dict(compile="no_such_backend"), "compile='no_such_backend' is not a torch.compile backend"),
    (dict(optimizer=5), "optimizer must be a callable taking the parameters"),
    (dict(seed="x"), "seed must be an integer, got 'x'"),
    (dict(hardware="bogus"), "unknown hardware 'bogus'"),
    (dict(timeout_s="10"), "timeout_s must be a positive number of seconds (below 1e9), got '10'"),  # a TypeError
    (dict(timeout_s=float("inf")), "timeout_s must be a positive number of seconds"),  # timedelta's OverflowError
])
def test_parallelize_arguments_are_checked_before_any_process_group(kwargs, needle):
    from autoshard.errors import AutoshardError

    model = build_model(get_spec("llama-tiny"), device="meta")
    with pytest.raises(AutoshardError) as err:
        autoshard.parallelize(model, torch.zeros(8, 16, dtype=torch.long), plan=dict(dp=1), **kwargs)
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert not torch.distributed.is_initialized()


def test_mesh_rank_order_tp_innermost():
    mesh = Mesh(pp=2, dp=2, tp=2)
    assert coords_of(5, mesh).pp == 1 and coords_of(5, mesh).dp == 0 and coords_of(5, mesh).tp == 1
    assert all(rank_of(coords_of(r, mesh), mesh) == r for r in range(8))
    assert axis_ranks(mesh, "tp")[0] == [0, 1]
    assert axis_ranks(mesh, "pp")[0] == [0, 4]


def test_backend_follows_device():
    assert backend_for("cpu") == "gloo"
    assert backend_for(torch.device("cuda", 0)) == "nccl"
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        with pytest.raises(InvalidConfigError, match="torch_npu"):
            backend_for("npu:0")
    else:
        assert backend_for("npu") == "hccl"


def test_mamba_in_proj_slices_every_piece():
    spec = get_spec("mamba2-tiny")
    model = build_model(spec, device="meta")
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    tables = [shard_program(_plan(2, tp=2), spec, shapes, tp_rank=r) for r in range(2)]
    placement = tables[1].placement("backbone.layers.0.mixer.in_proj.weight")
    inner, gn, heads = 128, 32, 8
    assert placement == Shard(dim=0, index=1, parts=2, segments=(inner, inner, gn, gn, heads))
    assert tables[0].placement("backbone.norm_f.weight") == Replicate()
    full = torch.randn(sum(placement.segments), 3)
    slices = [shard_tensor(full, t.placement("backbone.layers.0.mixer.in_proj.weight")) for t in tables]
    assert slices[0].shape == (full.shape[0] // 2, 3)
    assert torch.equal(unshard(slices, placement), full)
    assert ("backbone.layers.0.mixer", "n_groups", 1) in tables[0].attrs


def test_tp_slices_follow_the_config_s_head_dim():
    """A LLaMA whose head_dim is not hidden / heads (HF allows it): q_proj has heads x head_dim rows. The
    sharding table once sliced hidden / heads per head and tp=2 died in HF's reshape (a bare RuntimeError)."""
    import dataclasses

    from transformers import AutoModelForCausalLM, LlamaConfig

    from autoshard.models.presets import spec_from_hf_config

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    spec = spec_from_hf_config(config, name="wide-heads")
    assert spec.attention_head_dim == 32 and spec.hf_config().head_dim == 32
    assert spec_from_hf_config(get_spec("llama-tiny").hf_config(), name="t").head_dim == 0  # the usual shape: as before
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    for rank in range(2):
        program = shard_program(_plan(2, tp=2), spec, shapes, tp_rank=rank)
        for name, rows in (("q_proj", 4 * 32), ("k_proj", 2 * 32), ("o_proj", 4 * 32)):
            full = torch.randn(shapes[f"model.layers.0.self_attn.{name}.weight"])
            part = shard_tensor(full, program.placement(f"model.layers.0.self_attn.{name}.weight"))
            dim = 1 if name == "o_proj" else 0
            assert part.shape[dim] == rows // 2, (name, part.shape)
    check_plan(dataclasses.replace(_plan(2, tp=2), sequence_parallel=True), spec, world_size=2)


def test_recompute_is_applied_per_stage():
    """The planner picks recompute per pipeline stage; the rewrite checkpoints each layer at its
    stage's level (the plan-wide `recompute` only when the plan names no stages)."""
    import dataclasses

    from autoshard.ir import Recompute, Stage

    spec = get_spec("llama-tiny")  # 4 layers
    shapes = {n: tuple(p.shape) for n, p in build_model(spec, device="meta").named_parameters()}
    stages = (Stage(first_layer=0, end_layer=1, embed=True, head=False, recompute=Recompute.FULL),
              Stage(first_layer=1, end_layer=3, embed=False, head=False, recompute=Recompute.SELECTIVE),
              Stage(first_layer=3, end_layer=4, embed=False, head=True, recompute=Recompute.NONE))
    plan = dataclasses.replace(_plan(3, pp=3), recompute=Recompute.FULL, stages=stages)
    assert shard_program(plan, spec, shapes, tp_rank=0).checkpoint == (
        "model.layers.0", "model.layers.1.self_attn", "model.layers.2.self_attn")
    whole = dataclasses.replace(_plan(1), recompute=Recompute.SELECTIVE)
    assert shard_program(whole, spec, shapes, tp_rank=0).checkpoint == tuple(
        f"model.layers.{i}.self_attn" for i in range(4))
