"""Cost model on a hand-built 5-node table whose numbers are checked by hand, and the layout rules."""

import dataclasses

import pytest
import sympy

from autoshard.errors import InvalidConfigError
from autoshard.hardware import load_hardware
from autoshard.cost_table import B, S, BlockCost, CostTable, NodeCost
from autoshard.ir import BlockKind, Mesh, OpKind, Recompute
from autoshard.models.presets import get_spec
from autoshard.passes.cost import cost
from autoshard.passes.cost.block import (block_activation_bytes, block_params, block_time, cp_attention_overwork,
                                         gemm_efficiency)
from autoshard.passes.cost.compiled import priced_nodes
from autoshard.passes.cost.layout import OPTIM_TRAFFIC
from autoshard.passes.cost.pipeline import logits_bytes, p2p_time, pipeline_time
from autoshard.passes.cost.state import (bucketed_time, dp_bucket_params, dp_exposed_time, offload_time, optimizer_time,
                                         state_bytes, zero2_time, zero3_time)
from autoshard.passes.cost.compiled import compile_table
from autoshard.passes.cost.cost import estimate
from autoshard.passes.cost.layout import Layout
from autoshard.rules.validity import factorizations, plan_violation, valid_meshes

SPEC = get_spec("llama-tiny")  # hidden 64, 4 heads, 2 KV heads, 4 layers, vocab 256
H = SPEC.hidden
# a device with round numbers and no shape penalty: GEMM time = flops / 1e12, vector = bytes / 1e11;
# no fused kernels (the toy table is not an HF graph: passes/cost/fused_regions.py has its own tests)
HW = dataclasses.replace(load_hardware("h100"), name="toy", peak_flops=1e12, gemm_efficiency=1.0,
                         gemm_half_dim=1e-9, hbm_bandwidth=1e11, vector_efficiency=1.0, memory_bytes=1e9,
                         kernels=())


def node(name, kind, phase, path, flops, nbytes, saved=0, gemm=None):
    return NodeCost(name=name, target="aten." + name, kind=kind, phase=phase, module_path=path, block=0,
                    flops=sympy.sympify(flops), bytes_read=sympy.sympify(nbytes), bytes_written=sympy.Integer(0),
                    saved_bytes=sympy.sympify(saved), gemm=None if gemm is None else tuple(map(sympy.sympify, gemm)))


def toy_table():
    t = B * S
    L = "model.layers.0."
    layer = (
        node("norm", OpKind.VECTOR, "fwd", L + "input_layernorm", 0, 4 * t * H, saved=2 * t * H),
        node("mm", OpKind.MATMUL, "fwd", L + "mlp.up_proj", 2 * t * H * 256, 0, saved=2 * t * 256,
             gemm=(1, t, 256, H)),
        node("mm_bwd", OpKind.MATMUL, "bwd", L + "mlp.up_proj", 4 * t * H * 256, 0, gemm=(1, t, H, 256)),
        node("norm_bwd", OpKind.VECTOR, "bwd", L + "input_layernorm", 0, 8 * t * H),
    )
    embed = (node("emb", OpKind.VECTOR, "fwd", "model.embed_tokens", 0, 2 * t * H),)
    head = (node("lm", OpKind.MATMUL, "fwd", "lm_head", 2 * t * H * 256, 0, saved=4 * t * 256, gemm=(1, t, 256, H)),)
    return CostTable(model="toy", blocks=(
        BlockCost(name="embed", kind=BlockKind.EMBED, count=1, params=256 * H, nodes=embed),
        BlockCost(name="layer", kind=BlockKind.LAYER, count=4, params=1000 + 2 * H, nodes=layer),
        BlockCost(name="head", kind=BlockKind.HEAD, count=1, params=256 * H + H, nodes=head),
    ))


CT = compile_table(toy_table(), SPEC)
SEQ, GB = 128, 16
T = SEQ  # tokens per micro-batch of 1


def lay(**kw):
    mb = kw.pop("micro_batch", 1)
    zero = kw.pop("zero", 0)
    rc = kw.pop("recompute", Recompute.NONE)
    offload = kw.pop("offload", False)
    return Layout(mesh=Mesh(**kw), micro_batch=mb, zero=zero, recompute=rc, offload_optimizer=offload)


def test_block_time_is_the_roofline_sum():
    bt = block_time(CT, HW, lay(), BlockKind.LAYER, seq_len=SEQ)
    assert bt.fwd_s == pytest.approx(4 * T * H / 1e11 + 2 * T * H * 256 / 1e12)
    assert bt.bwd_s == pytest.approx(8 * T * H / 1e11 + 4 * T * H * 256 / 1e12)
    assert bt.tp_comm_s == bt.cp_comm_s == bt.recompute_s == 0


def test_tp_splits_the_mlp_not_the_norm_and_adds_all_reduces():
    one = block_time(CT, HW, lay(), BlockKind.LAYER, seq_len=SEQ)
    two = block_time(CT, HW, lay(tp=2), BlockKind.LAYER, seq_len=SEQ)
    assert two.fwd_s == pytest.approx(4 * T * H / 1e11 + T * H * 256 / 1e12)  # norm whole, GEMM halved
    act = T * H * 2
    ar = min(2 * HW.intra_latency + act / HW.intra_bandwidth, 2 * HW.intra_latency + 2 * act / HW.intra_bandwidth)
    assert two.tp_comm_s == pytest.approx(4 * ar)  # LLaMA: 2 all-reduces forward, 2 backward
    assert one.total_s / 2 < two.total_s


def test_gemm_efficiency_falls_for_thin_shapes():
    hw = load_hardware("ascend-910b")
    import numpy as np
    big, thin = gemm_efficiency(hw, *(np.array([4096.0]),) * 3), gemm_efficiency(
        hw, np.array([4096.0]), np.array([128.0]), np.array([4096.0]))
    assert thin[0] < big[0] < hw.gemm_efficiency


def test_activation_memory_from_saved_bytes_and_recompute():
    act = block_activation_bytes(CT, lay(), BlockKind.LAYER, seq_len=SEQ)
    assert act == 2 * T * H + 2 * T * 256
    assert block_activation_bytes(CT, lay(tp=2), BlockKind.LAYER, seq_len=SEQ) == 2 * T * H + T * 256
    assert block_activation_bytes(CT, lay(cp=2), BlockKind.LAYER, seq_len=SEQ) > act / 2  # + gathered K/V
    full = lay(recompute=Recompute.FULL)
    assert block_activation_bytes(CT, full, BlockKind.LAYER, seq_len=SEQ) == T * H * 2
    bt = block_time(CT, HW, full, BlockKind.LAYER, seq_len=SEQ)
    assert bt.recompute_s == pytest.approx(bt.fwd_s)


def _collective(op, nbytes, size, stride):
    from autoshard.passes.cost.collectives import best_time
    return best_time(HW, op, nbytes, size=size, stride=stride)


@pytest.mark.parametrize("spec_name", ["llama-tiny", "mamba2-tiny"])
def test_recompute_reruns_the_forward_collectives_inside_the_checkpoint(spec_name):
    """Full recompute reruns the layer's forward TP all-reduces and CP all-gathers; selective
    reruns the attention module / mixer: one TP all-reduce (o_proj / out_proj) and every CP
    all-gather (runtime/cp_attention.py, runtime/cp_mamba.py)."""
    from autoshard.passes.cost.collectives import Collective
    spec = get_spec(spec_name)
    ct = compile_table(toy_table(), spec)
    b, tp, cp = 1, 2, 2
    ar = _collective(Collective.ALL_REDUCE, T // cp * spec.hidden * 2, tp, 1)
    if spec_name == "llama-tiny":
        hd = spec.hidden // spec.heads
        cp_f = _collective(Collective.ALL_GATHER, 2 * b * T * (spec.kv_heads / tp) * hd * 2, cp, tp)
        tp_f = 2 * ar
    else:
        state = b * spec.heads / tp * (spec.head_dim * spec.state + 1) * 4 * cp
        halo = b * (spec.conv - 1) * (spec.intermediate + 2 * spec.groups * spec.state) / tp * 2 * cp
        cp_f = sum(_collective(Collective.ALL_GATHER, n, cp, tp) for n in (state, halo))
        tp_f = ar
    base = block_time(ct, HW, lay(tp=tp, cp=cp), BlockKind.LAYER, seq_len=SEQ)
    full = block_time(ct, HW, lay(tp=tp, cp=cp, recompute=Recompute.FULL), BlockKind.LAYER, seq_len=SEQ)
    sel = block_time(ct, HW, lay(tp=tp, cp=cp, recompute=Recompute.SELECTIVE), BlockKind.LAYER, seq_len=SEQ)
    assert cp_f > 0 and base.recompute_s == 0
    assert full.recompute_s == pytest.approx(base.fwd_s + tp_f + cp_f)
    assert sel.recompute_s == pytest.approx(ar + cp_f)  # the toy layer has no attention core node
    assert full.cp_comm_s == sel.cp_comm_s == base.cp_comm_s > cp_f  # forward + backward, not changed


def test_cp_attention_does_2cp_plus_1_chunk_pairs():
    """runtime/cp_attention.py computes each rank's 2cp+1 chunk pairs in full (diagonal under a
    mask): (2cp+1)/(2cp) of the ideal 1/cp share of the s x s work; linear work splits exactly."""
    base = toy_table()
    L = "model.layers.0."
    hd = H // SPEC.heads
    scores = node("sdpa", OpKind.MATMUL, "fwd", L + "self_attn", 4 * B * SPEC.heads * S * S * hd, 0,
                  gemm=(B * SPEC.heads, S, S, hd))
    blocks = tuple(dataclasses.replace(b, nodes=b.nodes + (scores,)) if b.kind is BlockKind.LAYER else b
                   for b in base.blocks)
    ct = compile_table(dataclasses.replace(base, blocks=blocks), SPEC)
    linear = block_time(CT, HW, lay(), BlockKind.LAYER, seq_len=SEQ).fwd_s
    attn = 4 * SPEC.heads * T * T * hd / 1e12
    assert block_time(ct, HW, lay(), BlockKind.LAYER, seq_len=SEQ).fwd_s == pytest.approx(linear + attn)
    for cp in (2, 4):
        got = block_time(ct, HW, lay(cp=cp), BlockKind.LAYER, seq_len=SEQ).fwd_s
        assert got == pytest.approx(linear / cp + attn / cp * (2 * cp + 1) / (2 * cp))
    assert cp_attention_overwork(SPEC, 1) == 1.0
    # a stack some layers of which pass a state (a hybrid's attention beside Mamba scans): cp contiguous chunks, the
    # last rank's one against the whole prefix, cp chunk pairs where the ideal share is cp / 2: twice its share
    hybrid = compile_table(dataclasses.replace(base, blocks=blocks), dataclasses.replace(SPEC, passes_state=True))
    for cp in (2, 4):
        got = block_time(hybrid, HW, lay(cp=cp), BlockKind.LAYER, seq_len=SEQ).fwd_s
        assert got == pytest.approx(linear / cp + attn / cp * 2)


def test_state_bytes_under_zero():
    p = 1000.0
    assert state_bytes(p, lay(dp=4)).total == 18 * p  # 2 + 4 + 12 bytes per parameter
    assert state_bytes(p, lay(dp=4, zero=1)).total == (2 + 4 + 12 / 4) * p
    assert state_bytes(p, lay(dp=2, cp=2, zero=2)).total == (2 + 16 / 4) * p  # shards over dp x cp
    assert state_bytes(p, lay(dp=4, zero=3)).total == (4 + 4 + 8) * p / 4  # FSDP2: fp32 shards are the masters


def test_pipeline_time_is_1f1b():
    assert pipeline_time([1.0] * 4, 8) == pytest.approx(8 + 4 - 1)  # (m + p - 1) t
    assert pipeline_time([1.0, 2.0], 10) == pytest.approx(3 + 9 * 2)  # the slow stage paces


def test_estimate_is_the_composition_of_the_components():
    layout = lay(dp=2, pp=2)
    e = estimate(CT, SPEC, HW, layout, global_batch=GB, seq_len=SEQ)
    m = GB // 2
    assert e.microbatches == m
    bt = {k: block_time(CT, HW, layout, k, seq_len=SEQ) for k in BlockKind}
    p2p = p2p_time(CT, HW, layout, seq_len=SEQ)
    t0 = bt[BlockKind.EMBED].total_s + 2 * bt[BlockKind.LAYER].total_s + p2p
    t1 = 2 * bt[BlockKind.LAYER].total_s + bt[BlockKind.HEAD].total_s + p2p
    assert e.stage_times_s == pytest.approx((t0, t1))
    assert e.step_time_s == pytest.approx(pipeline_time([t0, t1], m) + e.time.dp_comm_exposed
                                          + e.time.optimizer)
    assert sum(e.time.as_dict().values()) == pytest.approx(e.step_time_s)
    # memory: stage 0 holds 2 micro-batches in flight under 1F1B, stage 1 one plus the logits peak
    def stage_bytes(kinds, in_flight, head):
        params = sum(c * block_params(CT, layout, k) for k, c in kinds)
        act = sum(c * block_activation_bytes(CT, layout, k, seq_len=SEQ) for k, c in kinds)
        extra = logits_bytes(CT, layout, seq_len=SEQ) if head else 0.0
        return state_bytes(params, layout).total + in_flight * act + extra + 2 * T * H * 2
    s0 = stage_bytes([(BlockKind.EMBED, 1), (BlockKind.LAYER, 2)], 2, False)
    s1 = stage_bytes([(BlockKind.LAYER, 2), (BlockKind.HEAD, 1)], 1, True)
    assert e.memory_gb == pytest.approx(max(s0, s1) / 1e9)
    assert e.mean_memory_gb == pytest.approx((s0 + s1) / 2 / 1e9)
    tokens = GB * SEQ
    assert e.tokens_per_s == pytest.approx(tokens / e.step_time_s)
    assert e.mfu == pytest.approx(cost.model_flops_per_token(CT, SEQ) * tokens / (e.step_time_s * 4 * 1e12))


@pytest.mark.parametrize("levels", [(Recompute.FULL, Recompute.NONE), (Recompute.NONE, Recompute.SELECTIVE),
                                    (Recompute.SELECTIVE, Recompute.FULL)])
def test_stages_are_priced_at_their_own_recompute_level(levels):
    """A plan mixing recompute levels per stage: each stage's time and memory equal those of the
    same stage in a plan where every stage runs at that stage's level (layout.recompute unused)."""
    from autoshard.ir import Stage
    kw = dict(global_batch=GB, seq_len=SEQ)
    layout = lay(dp=2, pp=2, tp=2, cp=2, zero=1)

    def split(r0, r1):
        return (Stage(first_layer=0, end_layer=2, embed=True, head=False, recompute=r0),
                Stage(first_layer=2, end_layer=4, embed=False, head=True, recompute=r1))

    mixed = estimate(CT, SPEC, HW, layout, stages=split(*levels), **kw)
    uniform = [estimate(CT, SPEC, HW, dataclasses.replace(layout, recompute=r), stages=split(r, r), **kw)
               for r in levels]
    for i in range(2):
        assert mixed.stage_times_s[i] == pytest.approx(uniform[i].stage_times_s[i])
        assert mixed.stage_memory_gb[i] == pytest.approx(uniform[i].stage_memory_gb[i])
    assert uniform[0].stage_times_s != uniform[1].stage_times_s  # the levels do differ here
    assert mixed.memory_gb == pytest.approx(max(mixed.stage_memory_gb))
    assert mixed.step_time_s == pytest.approx(pipeline_time(mixed.stage_times_s, mixed.microbatches)
                                              + mixed.time.dp_comm_exposed + mixed.time.optimizer)
    # no stages given: every stage at layout.recompute
    full = dataclasses.replace(layout, recompute=Recompute.FULL)
    assert estimate(CT, SPEC, HW, full, **kw).stage_times_s == pytest.approx(
        estimate(CT, SPEC, HW, full, stages=split(Recompute.FULL, Recompute.FULL), **kw).stage_times_s)


def test_more_devices_of_the_same_kind_run_faster_and_dp_sync_overlaps():
    e1 = estimate(CT, SPEC, HW, lay(), global_batch=GB, seq_len=SEQ)
    e4 = estimate(CT, SPEC, HW, lay(dp=4), global_batch=GB, seq_len=SEQ)
    assert e4.step_time_s < e1.step_time_s / 3
    params = sum(block_params(CT, lay(dp=4), k) * c
                 for k, c in {BlockKind.EMBED: 1, BlockKind.LAYER: 4, BlockKind.HEAD: 1}.items())
    unhidden = dp_exposed_time(HW, params, lay(dp=4), backward_s=0.0, forward_s=0.0)  # the whole sync
    assert 0 < unhidden and e4.time.dp_comm_exposed <= unhidden


def test_interleaved_sends_overlap_the_next_chunk():
    # Megatron-Core's interleaved schedule posts its p2p asynchronously (overlap_p2p_comm): v x the
    # sends, each behind one chunk's forward / backward; 1F1B's blocking sends are all exposed
    from autoshard.passes.cost.collectives import Collective, collective_time

    slow = dataclasses.replace(HW, intra_bandwidth=HW.intra_bandwidth / 1e4)  # a send outlasts a chunk
    one, two = lay(pp=2), dataclasses.replace(lay(pp=2), schedule="interleaved-1f1b", virtual_stages=2)
    send = collective_time(slow, Collective.SEND_RECV, T * H * 2, size=2, stride=1)
    bt = block_time(CT, slow, two, BlockKind.LAYER, seq_len=SEQ)  # 4 layers / (2 x 2): one per chunk
    assert send > bt.bwd_s > bt.fwd_s
    assert p2p_time(CT, slow, one, seq_len=SEQ) == pytest.approx(2 * send)
    assert p2p_time(CT, slow, two, seq_len=SEQ) == pytest.approx(2 * (2 * send - bt.fwd_s - bt.bwd_s))
    fast = dataclasses.replace(HW, intra_bandwidth=HW.intra_bandwidth * 1e3, intra_latency=1e-9)
    assert p2p_time(CT, fast, two, seq_len=SEQ) == 0.0 < p2p_time(CT, fast, one, seq_len=SEQ)


def test_dp_sync_exposes_the_last_bucket_and_one_chunk_of_v():
    # Megatron's buckets (max(40M, 1M x dp) parameters), one collective each: the last gradient
    # bucket is ready only when the backward ends; with v chunks per rank only the first chunk's
    # share outlasts the drain
    from autoshard.passes.cost.collectives import Collective, best_time

    params, one = 4e9, lay(dp=4, zero=1)
    two = dataclasses.replace(lay(dp=4, zero=1), schedule="interleaved-1f1b", virtual_stages=2)
    assert dp_bucket_params(one) == 40e6 and dp_bucket_params(lay(dp=256, zero=1)) == 256e6
    nb = one.numbers

    def t(op, n, b):  # n parameters in 40M buckets
        return n / 40e6 * best_time(HW, op, 40e6 * b, size=4, stride=1)

    rs, ag = t(Collective.REDUCE_SCATTER, params, nb.grad_bytes), t(Collective.ALL_GATHER, params, nb.param_bytes)
    assert bucketed_time(HW, Collective.REDUCE_SCATTER, params, nb.grad_bytes, size=4, stride=1) == pytest.approx(rs)
    last = t(Collective.REDUCE_SCATTER, 40e6, nb.grad_bytes) + t(Collective.ALL_GATHER, 40e6, nb.param_bytes)
    hidden = dp_exposed_time(HW, params, one, backward_s=1e3, forward_s=1e3)
    assert hidden == pytest.approx(last)  # all but one bucket behind a long backward / forward
    assert dp_exposed_time(HW, params, one, backward_s=0.0, forward_s=0.0) == pytest.approx(rs + ag)
    bwd, fwd = rs / 4, ag / 4  # the sync outlasts the compute it overlaps
    assert dp_exposed_time(HW, params, two, backward_s=bwd, forward_s=fwd) == pytest.approx(
        rs / 2 - bwd / 2 + ag / 2 - fwd / 2)
    assert (dp_exposed_time(HW, params, two, backward_s=bwd, forward_s=fwd)
            < dp_exposed_time(HW, params, one, backward_s=bwd, forward_s=fwd))


def test_zero3_pays_one_ring_per_block():
    # FSDP2 gathers and reduce-scatters block by block; NCCL runs those as rings, (N - 1) latencies each
    from autoshard.passes.cost.collectives import Collective, best_time

    h100, params = load_hardware("h100"), 35e9
    layout = lay(dp=1024, zero=3)
    nb = layout.numbers

    def per_block(k):
        ag = best_time(h100, Collective.ALL_GATHER, params / k * nb.param_bytes, size=1024, stride=1)
        return k * (2 * ag + best_time(h100, Collective.REDUCE_SCATTER, params / k * nb.grad_bytes, size=1024,
                                       stride=1))

    assert zero3_time(h100, params, layout, blocks=82) == pytest.approx(per_block(82))
    assert zero3_time(h100, params, layout) == pytest.approx(per_block(1))
    # 81 more ring latencies x 3 collectives: (N - 1) steps of inter_latency each
    extra = 81 * 3 * 1023 * h100.inter_latency
    assert zero3_time(h100, params, layout, blocks=82) - zero3_time(h100, params, layout) == \
        pytest.approx(extra, rel=1e-6)


def test_mfu_convention_matches_the_paper_for_llama():
    n = sum(b.params * b.count for b in toy_table().blocks)
    assert cost.model_flops_per_token(CT, 4096) == 6 * n + 12 * SPEC.layers * SPEC.hidden * 4096


def test_bad_layouts_are_refused():
    with pytest.raises(InvalidConfigError, match=r"global batch 16 is not divisible by dp \(3\)"):
        estimate(CT, SPEC, HW, lay(dp=3), global_batch=GB, seq_len=SEQ)
    with pytest.raises(InvalidConfigError, match="no experts"):
        estimate(CT, SPEC, HW, lay(ep=2), global_batch=GB, seq_len=SEQ)
    with pytest.raises(InvalidConfigError, match="pp"):
        estimate(CT, SPEC, HW, lay(pp=8), global_batch=GB, seq_len=SEQ)
    with pytest.raises(InvalidConfigError, match="zero"):
        lay(zero=4)


# ---- layouts ---------------------------------------------------------------------------------

def test_factorizations_cover_every_product():
    meshes = factorizations(8)
    assert len(meshes) == 35 == len(set(meshes))  # C(3 + 4, 4) ways to spread 2^3 over 5 axes
    assert all(m.size == 8 for m in meshes)


def test_rules():
    llama7 = get_spec("llama-7b")
    ok = dict(global_batch=1024, seq_len=4096)
    assert plan_violation(llama7, Mesh(dp=4, pp=2), **ok) is None
    assert "ep" in plan_violation(llama7, Mesh(dp=4, ep=2), **ok)
    assert "heads" in plan_violation(get_spec("llama-13b"), Mesh(tp=16), **ok)  # 40 heads
    assert plan_violation(get_spec("llama-tiny"), Mesh(tp=4), global_batch=8, seq_len=8) is None  # KV replicated
    odd = dataclasses.replace(get_spec("llama-tiny"), heads=12, kv_heads=4, vocab=252, ffn=180)
    assert "KV heads" in plan_violation(odd, Mesh(tp=6), global_batch=8, seq_len=8)
    assert plan_violation(get_spec("llama-70b"), Mesh(tp=16), **ok) is None  # 8 KV heads replicated twice
    assert plan_violation(get_spec("mamba2-1b"), Mesh(tp=2), **ok) is None  # one group: B/C kept whole (issue 11)
    assert "layers" in plan_violation(get_spec("llama-tiny"), Mesh(pp=8), **ok)
    assert "global batch" in plan_violation(llama7, Mesh(dp=8), global_batch=4, seq_len=4096)
    assert "2*cp" in plan_violation(llama7, Mesh(cp=4), global_batch=8, seq_len=4100)
    assert plan_violation(get_spec("mamba2-tiny"), Mesh(cp=4), global_batch=8, seq_len=4100) is None
    assert len(valid_meshes(llama7, 8, **ok)) == 20
    # issue 13: tp 5 divides llama-13b's 40 heads and 40 KV heads but not its MLP width 13824
    assert "MLP width" in plan_violation(get_spec("llama-13b"), Mesh(tp=5), global_batch=1, seq_len=2048)
    # the counts no intra-op choice can replicate are named before the vocabulary (4 heads, vocab 256)
    assert "number of heads" in plan_violation(get_spec("llama-tiny"), Mesh(tp=3), global_batch=8, seq_len=8)
    odd = dataclasses.replace(get_spec("llama-tiny"), vocab=255)
    assert "vocabulary" in plan_violation(odd, Mesh(tp=2), global_batch=8, seq_len=8)


def test_no_valid_factorisation_says_why():
    with pytest.raises(InvalidConfigError) as e:
        valid_meshes(get_spec("llama-tiny"), 7, global_batch=4, seq_len=8)
    msg = str(e.value)
    assert "no valid" in msg and "(7,1,1,1,1)" in msg and "global batch" in msg and "layers" in msg
    with pytest.raises(InvalidConfigError, match="positive"):
        valid_meshes(get_spec("llama-tiny"), 0, global_batch=4, seq_len=8)
    with pytest.raises(InvalidConfigError, match="micro-batch"):
        valid_meshes(get_spec("llama-tiny"), 2, global_batch=5, seq_len=8, micro_batch=2)


def test_zero2_reduce_scatters_with_every_micro_batch():
    # runtime/data_parallel.py (DeepSpeed stage 2): each micro-batch's gradients are reduce-scattered
    # behind its own backward and then dropped; ZeRO-1 reduces once per step, behind the last backward
    from autoshard.passes.cost.collectives import Collective, best_time

    slow = dataclasses.replace(HW, intra_bandwidth=HW.intra_bandwidth / 1000)  # the reduce-scatter outlasts a backward
    l1, l2 = lay(dp=4, zero=1), lay(dp=4, zero=2)
    kinds = {BlockKind.EMBED: 1, BlockKind.LAYER: 4, BlockKind.HEAD: 1}
    params = sum(block_params(CT, l2, k) * c for k, c in kinds.items())
    bwd = sum(block_time(CT, slow, l2, k, seq_len=SEQ).bwd_s * c for k, c in kinds.items())
    fwd = sum(block_time(CT, slow, l2, k, seq_len=SEQ).fwd_s * c for k, c in kinds.items())
    rs = best_time(slow, Collective.REDUCE_SCATTER, params * l2.numbers.grad_bytes, size=4, stride=1)
    ag = best_time(slow, Collective.ALL_GATHER, params * l2.numbers.param_bytes, size=4, stride=1)
    assert zero2_time(slow, params, l2) == rs > bwd
    assert zero2_time(slow, params, l1) == 0.0 == zero2_time(slow, params, lay(zero=2))
    e1, e2 = (estimate(CT, SPEC, slow, lt, global_batch=GB, seq_len=SEQ) for lt in (l1, l2))
    m = GB // 4
    # ZeRO-2's per-micro-batch reduce-scatter hides behind that backward; the step's DP sync is one
    # bucket here (params < dp_bucket_params), ready only when the backward ends / needed before
    # the forward starts: all of it exposed (ZeRO-1's reduce-scatter, both levels' weight all-gather)
    assert params < dp_bucket_params(l1)
    assert e2.time.dp_comm_exposed == pytest.approx(m * (rs - bwd) + ag)
    assert e1.time.dp_comm_exposed == pytest.approx(rs + ag)
    assert e2.step_time_s > e1.step_time_s and e2.memory.grads == pytest.approx(e1.memory.grads / 4)
    assert e2.time.pp_bubble == pytest.approx(0.0, abs=1e-12)


def test_zero2_and_3_need_pp_1():
    with pytest.raises(InvalidConfigError, match="ZeRO-2 with pp=2"):
        estimate(CT, SPEC, HW, lay(dp=2, pp=2, zero=2), global_batch=GB, seq_len=SEQ)
    with pytest.raises(InvalidConfigError, match="ZeRO-3 with pp=2"):
        estimate(CT, SPEC, HW, lay(pp=2, zero=3), global_batch=GB, seq_len=SEQ)
    from autoshard.passes.solve.planner import candidate_layouts

    found = candidate_layouts(SPEC, devices=4, global_batch=GB, seq_len=SEQ)
    assert {lt.zero for lt in found} == {0, 1, 2, 3}  # what the runtime runs (3: FSDP2)
    assert all(lt.zero < 2 for lt in found if lt.mesh.pp > 1)
    assert not any(lt.offload_optimizer for lt in found)
    offloaded = candidate_layouts(SPEC, devices=4, global_batch=GB, seq_len=SEQ, offload=True)
    assert {lt.zero for lt in offloaded if lt.offload_optimizer} == {3}


def test_offload_moves_state_to_the_host_and_pays_the_host_link():
    # ZeRO-Offload (arXiv 2101.06840) as FSDP2's CPUOffloadPolicy runs it: no weights, gradients or
    # optimizer state on the device; per micro-batch the weight shard crosses the host link twice
    # (before each gather) and the gradient shard once; Adam runs at the host's memory bandwidth
    p = 4000.0
    on, off = lay(dp=4, zero=3), lay(dp=4, zero=3, offload=True)
    assert state_bytes(p, off).total == 0.0 < state_bytes(p, on).total
    shard = p / 4
    n = off.numbers  # bytes per weight / gradient at the layout's precision
    assert offload_time(HW, p, off) == pytest.approx(shard * (2 * n.sharded_weight_bytes + n.grad_bytes) / HW.host_link_bandwidth)
    assert offload_time(HW, p, on) == 0.0
    assert optimizer_time(HW, p, off) == pytest.approx(
        shard * OPTIM_TRAFFIC / (HW.host_memory_bandwidth * HW.vector_efficiency))
    e_on, e_off = (estimate(CT, SPEC, HW, lt, global_batch=GB, seq_len=SEQ) for lt in (on, off))
    assert e_off.memory.total < e_on.memory.total and e_off.step_time_s > e_on.step_time_s
    with pytest.raises(InvalidConfigError, match="needs zero=3"):
        lay(dp=4, zero=1, offload=True)
    with pytest.raises(InvalidConfigError, match="ascend-910b.* has no host_link_bandwidth"):
        offload_time(load_hardware("ascend-910b"), p, off)


@pytest.mark.parametrize("spec_name", ["llama-tiny", "mamba2-tiny"])
def test_selective_prices_the_module_the_runtime_checkpoints(spec_name):
    """Selective recompute reruns, and stops saving, every forward node inside the module that
    passes/rewrite.py `_checkpointed` wraps (LLaMA: self_attn with q/k/v/o; Mamba-2: the mixer)."""
    from autoshard.passes.rewrite import _checkpointed
    from autoshard.passes.capture.shapes import build_cost_table

    spec = get_spec(spec_name)
    table = build_cost_table(spec)
    ct = compile_table(table, spec)
    prefix = ("model" if spec_name.startswith("llama") else "backbone") + ".layers.0"
    (module,) = _checkpointed(spec, [prefix], [Recompute.SELECTIVE])
    nodes = priced_nodes(table.block(BlockKind.LAYER))
    blk = ct.block(BlockKind.LAYER)
    inside = [n.module_path == module or n.module_path.startswith(module + ".") for n in nodes]
    assert list(blk.rerun) == inside and any(inside) and not all(inside)
    b, s = 2, 64
    rerun_flops = sum(int(n.flops.subs({B: b, S: s})) for n, r in zip(nodes, blk.rerun)
                      if r and n.phase == "fwd" and n.kind is OpKind.MATMUL)
    if spec_name == "llama-tiny":  # q, k, v, o projections and the attention's s x s matmuls
        hd, t = spec.hidden // spec.heads, b * s
        proj = 2 * t * spec.hidden * (2 * spec.hidden + 2 * spec.kv_heads * hd)
        assert rerun_flops == proj + 4 * b * spec.heads * s * s * hd
    seq = 64
    none, sel = (block_activation_bytes(ct, lay(recompute=r), BlockKind.LAYER, seq_len=seq)
                 for r in (Recompute.NONE, Recompute.SELECTIVE))
    vals = blk.evaluate(1, seq)
    assert none - sel == pytest.approx(float(vals[2][blk.fwd & blk.rerun].sum())) and sel < none
    t_none, t_sel = (block_time(ct, HW, lay(recompute=r), BlockKind.LAYER, seq_len=seq)
                     for r in (Recompute.NONE, Recompute.SELECTIVE))
    assert t_sel.recompute_s > 0 and t_none.recompute_s == 0


def test_proven_grad_sums_are_priced_once_per_step():
    """A replicated parameter whose gradient the placement propagation proves partial (Qwen3's q/k norms,
    passes/capture/tp_proof.py) costs one tp all-reduce per module and layer each step."""
    from autoshard.passes.cost.collectives import Collective, best_time

    summed = dataclasses.replace(SPEC, grad_sum=("self_attn.q_norm", "self_attn.k_norm"), grad_sum_numel=32)
    layout = lay(tp=2)
    plain = estimate(compile_table(toy_table(), SPEC), SPEC, HW, layout, global_batch=GB, seq_len=SEQ)
    proven = estimate(compile_table(toy_table(), summed), summed, HW, layout, global_batch=GB, seq_len=SEQ)
    one = best_time(HW, Collective.ALL_REDUCE, 16 * layout.numbers.grad_bytes, size=2, stride=1)
    assert proven.step_time_s - plain.step_time_s == pytest.approx(SPEC.layers * 2 * one)
    assert proven.time.dp_comm_exposed - plain.time.dp_comm_exposed == pytest.approx(SPEC.layers * 2 * one)
    assert cost.tp_grad_sum_time(HW, summed, lay(dp=2), SPEC.layers) == 0.0  # no tp: nothing to sum
