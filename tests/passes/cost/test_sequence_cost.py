"""Pricing of sequence parallelism (passes/cost/sequence_cost.py): the activation memory it saves equals the
analytic amount for llama-tiny, its collectives move the volume of the all-reduces they replace, and
it composes with pp (sends of the shard), full recompute and the validator."""

import dataclasses

import pytest

from autoshard.errors import InvalidConfigError
from autoshard.hardware import load_hardware
from autoshard.ir import BlockKind, Mesh, Recompute
from autoshard.models.presets import get_spec
from autoshard.passes.cost.block import block_time
from autoshard.passes.cost.pipeline import p2p_time
from autoshard.rules import sharding, tp_collectives
from autoshard.passes.cost.collectives import Collective, best_time, volume
from autoshard.passes.cost.compiled import compile_table
from autoshard.passes.cost.cost import estimate
from autoshard.passes.cost.layout import Layout
from autoshard.commands.common import cost_table_for, model_for

# h100 numbers with no fused kernels: the saved tensors are the traced graph's (HF's RMSNorm unfused)
HW = dataclasses.replace(load_hardware("h100"), kernels=())


@pytest.fixture(scope="module")
def llama():
    spec, module = model_for("llama-tiny")
    return spec, compile_table(cost_table_for("llama-tiny", spinner=False, spec=spec, module=module)[1], spec)


def _estimate(ct, spec, *, sp, seq=64, **mesh):
    layout = Layout(mesh=Mesh(**mesh), precision="bf16-mixed", sequence_parallel=sp)
    return estimate(ct, spec, HW, layout, global_batch=8, seq_len=seq)


def test_memory_saved_is_the_norms_and_residual_over_tp(llama):
    """HF LlamaRMSNorm keeps, per token, its fp32 input (4h bytes), the fp32 rsqrt (4), the bf16
    normalised hidden (2h) and its bf16 output (2h, the input the next projections keep): 8h + 4
    bytes; two norms per layer and the final norm. Under SP each rank keeps 1/tp of them, so the
    peak activation memory of a single stage falls by (1 - 1/tp) * tokens * (2L + 1) * (8h + 4)."""
    spec, ct = llama
    tp, seq = 2, 64
    off, on = (_estimate(ct, spec, sp=sp, seq=seq, tp=tp) for sp in (False, True))
    analytic = (1 - 1 / tp) * seq * (2 * spec.layers + 1) * (8 * spec.hidden + 4)
    assert off.memory.activations - on.memory.activations == pytest.approx(analytic)
    assert off.memory.total - on.memory.total == pytest.approx(analytic)
    assert (on.memory.weights, on.memory.logits) == (off.memory.weights, off.memory.logits)


def test_collectives_move_the_all_reduce_volume(llama):
    """Per layer forward: an all-gather per region and a reduce-scatter per row-parallel linear, the
    ring volume of the all-reduces they replace; embedding: reduce-scatter instead of all-reduce."""
    spec, ct = llama
    tp, seq = 4, 64
    act = seq * spec.hidden * 2.0
    assert volume(Collective.ALL_GATHER, act, tp) + volume(Collective.REDUCE_SCATTER, act, tp) == \
        pytest.approx(volume(Collective.ALL_REDUCE, act, tp))
    lay = Layout(mesh=Mesh(tp=tp), precision="bf16-mixed", sequence_parallel=True)
    ag, rs = (best_time(HW, op, act, size=tp, stride=1) for op in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER))
    layer = block_time(ct, HW, lay, BlockKind.LAYER, seq_len=seq)
    embed = block_time(ct, HW, lay, BlockKind.EMBED, seq_len=seq)
    assert tp_collectives.row_parallel_count(spec, BlockKind.LAYER) == 2
    full = block_time(ct, HW, dataclasses.replace(lay, recompute=Recompute.FULL), BlockKind.LAYER, seq_len=seq)
    assert full.recompute_s == pytest.approx(full.fwd_s + 2 * ag + 2 * rs)  # the rerun forward gathers again
    assert embed.tp_comm_s == pytest.approx(rs + ag)  # forward reduce-scatter, backward all-gather
    assert layer.tp_comm_s >= 2 * (ag + rs) + 2 * ag  # forward, and the row outputs' gradients gathered


def test_time_about_equal_memory_lower_and_pipeline_sends_the_shard(llama):
    spec, ct = llama
    for mesh in (dict(tp=2), dict(dp=2, tp=2), dict(pp=2, tp=2), dict(tp=2, cp=2)):
        off, on = (_estimate(ct, spec, sp=sp, **mesh) for sp in (False, True))
        assert on.memory_gb < off.memory_gb, mesh
        assert on.step_time_s == pytest.approx(off.step_time_s, rel=0.25), mesh
    lay = Layout(mesh=Mesh(pp=2, tp=2), precision="bf16-mixed")
    assert p2p_time(ct, HW, dataclasses.replace(lay, sequence_parallel=True), seq_len=64) < \
        p2p_time(ct, HW, lay, seq_len=64)


def test_bad_sequence_parallel_layouts_are_refused(llama):
    spec, ct = llama
    with pytest.raises(InvalidConfigError, match="sequence_parallel needs tp > 1"):
        _estimate(ct, spec, sp=True, dp=2)
    with pytest.raises(InvalidConfigError, match="sequence length 66 is not divisible by tp=4"):
        _estimate(ct, spec, sp=True, seq=66, tp=4)
    with pytest.raises(InvalidConfigError, match="sequence_parallel must be true or false"):
        Layout(mesh=Mesh(tp=2), sequence_parallel="yes")


def test_a_moe_block_routes_the_shard_of_the_tokens():
    """Under SP each tp rank routes its own shard of the tokens (the MoE block's roles are `sequence` ones): its
    work and its ep all-to-alls are 1/tp of those without (every tp rank routing every token), its parameters'
    gradients (router, experts) summed over tp by the rewrite, as the norms' are."""
    from autoshard.ir import Plan
    from autoshard.passes.rewrite import shard_program

    spec, module = model_for("mixtral-tiny")
    ct = compile_table(cost_table_for("mixtral-tiny", spinner=False, spec=spec, module=module)[1], spec)
    moe = [r for r in sharding.table(spec) if r.path in sharding.moe_block_paths(spec)]
    assert len(moe) >= 3 and all(sharding.on_sequence_shard(spec, BlockKind.LAYER, r) for r in moe)
    lay = Layout(mesh=Mesh(tp=2, ep=2), precision="bf16-mixed")
    off, on = (block_time(ct, HW, dataclasses.replace(lay, sequence_parallel=sp), BlockKind.LAYER, seq_len=64)
               for sp in (False, True))
    assert on.ep_comm_s < off.ep_comm_s and on.fwd_s < off.fwd_s
    plan = Plan(model="mixtral-tiny", fingerprint="", hardware="cpu", mesh=Mesh(tp=2), global_batch=8, seq_len=64,
                micro_batch=8, devices=2, sequence_parallel=True)
    from autoshard.models.presets import build_model

    params = {n: tuple(p.shape) for n, p in build_model(spec).named_parameters()}
    summed = set(shard_program(plan, spec, params, tp_rank=0).sequence_grads)
    layer = "model.layers.0"
    assert {f"{layer}.mlp.gate.weight", f"{layer}.mlp.experts.gate_up_proj", f"{layer}.mlp.experts.down_proj",
            f"{layer}.input_layernorm.weight"} <= summed
    assert f"{layer}.self_attn.q_proj.weight" not in summed


def test_placements_name_the_sequence_parallel_norms(llama):
    spec, _ = llama
    on = dict(sharding.block_placements(spec, tp=2, sequence_parallel=True))
    off = dict(sharding.block_placements(spec, tp=2))
    assert on["layers.*.input_layernorm"] == on["model.norm"] == "sequence"
    assert off["layers.*.input_layernorm"] == "replicate" and on["layers.*.self_attn.q_proj"] == "colwise"
    mamba = dict(sharding.block_placements(get_spec("mamba2-tiny"), tp=2, sequence_parallel=True))
    assert mamba["layers.*.norm"] == mamba["backbone.norm_f"] == "sequence" and mamba["layers.*.mixer.norm"] == "colwise"


def test_a_replicated_embedding_enters_the_shard_for_free():
    """Gemma's scaled embedding is replicated under tp (no plain lookup): under SP the runtime cuts its output to
    this rank's shard (no collective) and gathers the gradient back, and the head tied to it gathers its input
    (its gradient cut for free), with no vocab-parallel cross-entropy; a vocab-parallel one reduce-scatters."""
    from tests.runtime.families import DENSE

    source = DENSE["gemma2"]
    spec = source.spec
    assert not spec.embedding_plain and not sharding.vocab_parallel(spec, BlockKind.EMBED)
    ct = compile_table(cost_table_for("gemma2", spinner=False, spec=spec, module=source.build())[1], spec)
    tp, seq = 2, 64
    act = seq * spec.hidden * 2.0
    ag = best_time(HW, Collective.ALL_GATHER, act, size=tp, stride=1)
    lay = Layout(mesh=Mesh(tp=tp), precision="bf16-mixed", sequence_parallel=True)
    assert block_time(ct, HW, lay, BlockKind.EMBED, seq_len=seq).tp_comm_s == pytest.approx(ag)
    assert block_time(ct, HW, lay, BlockKind.HEAD, seq_len=seq).tp_comm_s == pytest.approx(ag)
