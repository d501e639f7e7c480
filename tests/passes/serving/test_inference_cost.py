"""Inference cost model on hand-built tables whose numbers are checked by hand."""

import dataclasses
import itertools
import math

import pytest
import sympy

from autoshard.errors import InvalidConfigError
from autoshard.hardware import load_hardware
from autoshard.cost_table import B, S, BlockCost, CostTable, NodeCost
from autoshard.ir import BlockKind, OpKind
from autoshard.passes.cost.collectives import Collective, best_time
from autoshard.models.presets import get_spec
from autoshard.passes.serving import inference_cost as ic
from autoshard.passes.serving.inference_cost import ServeLayout, compile_inference_table, estimate_serving

LLAMA = get_spec("llama-tiny")  # hidden 64, 4 heads (head_dim 16), 2 KV heads, 4 layers, vocab 256
MAMBA = get_spec("mamba2-tiny")  # hidden 64, 8 heads of 16, 2 groups, state 16, conv 4, 4 layers
H = 64
# round numbers, no shape penalty: GEMM time = flops / 1e12, vector time = bytes / 1e11; no fused
# kernels (the toy tables are not HF graphs; fused pricing is tested in test_fused_regions.py)
HW = dataclasses.replace(load_hardware("h100"), name="toy", peak_flops=1e12, gemm_efficiency=1.0,
                         gemm_half_dim=1e-9, hbm_bandwidth=1e11, vector_efficiency=1.0, memory_bytes=1e9, kernels=())
W_UP = 2 * H * 256  # bf16 weight bytes of the up projection


def node(name, kind, phase, path, flops, nbytes, gemm=None):
    return NodeCost(name=name, target="aten." + name, kind=kind, phase=phase, module_path=path, block=0,
                    flops=sympy.sympify(flops), bytes_read=sympy.sympify(nbytes), bytes_written=sympy.Integer(0),
                    saved_bytes=sympy.Integer(0), gemm=None if gemm is None else tuple(map(sympy.sympify, gemm)))


# the sequence mixer's kernel, as the traced graph names it (where inference finds the layer's mixer)
CORE_TARGETS = {"self_attn": "aten._scaled_dot_product_flash_attention.default", "mixer": "autoshard.ssd_chunk_scan"}


def toy_table(core_path: str, core_flops, core_bytes, core_gemm=None):
    t = B * S
    L = "layers.0."
    core = node("core", OpKind.MATMUL if core_gemm else OpKind.VECTOR, "fwd", L + core_path, core_flops, core_bytes,
                gemm=core_gemm)
    layer = (
        node("norm", OpKind.VECTOR, "fwd", L + "norm", 0, 4 * t * H),
        dataclasses.replace(core, target=CORE_TARGETS.get(core_path, core.target)),
        node("up", OpKind.MATMUL, "fwd", L + "mlp.up_proj", 2 * t * H * 256, 2 * t * H + W_UP, gemm=(1, t, 256, H)),
        node("up_bwd", OpKind.MATMUL, "bwd", L + "mlp.up_proj", 4 * t * H * 256, 0, gemm=(1, t, H, 256)),
    )
    embed = (node("emb", OpKind.VECTOR, "fwd", "model.embed_tokens", 0, 2 * t * H),)
    head = (node("lm", OpKind.MATMUL, "fwd", "lm_head", 2 * t * H * 256, 0, gemm=(1, t, 256, H)),
            node("loss", OpKind.VECTOR, "fwd", "", 0, 1e9 * t))  # the training loss: inference does not run it
    return CostTable(model="toy", blocks=(
        BlockCost(name="embed", kind=BlockKind.EMBED, count=1, params=256 * H, nodes=embed),
        BlockCost(name="layer", kind=BlockKind.LAYER, count=4, params=1000, nodes=layer),
        BlockCost(name="head", kind=BlockKind.HEAD, count=1, params=256 * H, nodes=head),
    ))


# attention's full s x s score and value matmuls (PaLM counting): 4 * b * s^2 * heads * head_dim
LLAMA_TABLE = toy_table("self_attn", 4 * B * S ** 2 * H, 8 * B * S * H, core_gemm=(4 * B, S, S, 16))
MAMBA_TABLE = toy_table("mixer", 100 * B * S, 1000 * B * S)
P, O, BATCH = 64, 16, 2


def _layer_fwd(b, s, *, with_core_flops=0.0, with_core_bytes=0.0):
    """Hand roofline of the toy layer's forward nodes."""
    t = b * s
    return 4 * t * H / 1e11 + max(with_core_flops / 1e12, with_core_bytes / 1e11) + \
        max(2 * t * H * 256 / 1e12, (2 * t * H + W_UP) / 1e11)


def test_prefill_is_the_forward_of_the_tables_at_batch_and_prompt_length():
    est = estimate_serving(LLAMA_TABLE, LLAMA, HW, ServeLayout(batch=BATCH), prompt_len=P, output_len=O)
    t = BATCH * P
    layer = _layer_fwd(BATCH, P, with_core_flops=4 * BATCH * P ** 2 * H, with_core_bytes=8 * t * H)
    head = 2 * BATCH * 1 * H * 256 / 1e12  # last position only; the loss node is not run
    assert est.prefill.compute == pytest.approx(4 * layer + 2 * t * H / 1e11 + head)
    assert est.prefill.core == 0 and est.prefill.tp_comm == 0 and est.prefill.pp_comm == 0
    assert est.ttft_s == pytest.approx(est.prefill.total)


def test_llama_decode_reads_weights_and_the_kv_cache_once_per_token():
    est = estimate_serving(LLAMA_TABLE, LLAMA, HW, ServeLayout(batch=BATCH), prompt_len=P, output_len=O)
    c = P + O / 2  # mean context of the decode steps
    layer = _layer_fwd(BATCH, 1)  # the s x s node is replaced by the cache read
    assert est.decode.compute == pytest.approx(4 * layer + 2 * BATCH * H / 1e11 + 2 * BATCH * H * 256 / 1e12)
    flops = 4 * BATCH * H * c  # one query against c keys
    kv = 2 * BATCH * c * LLAMA.kv_heads * 16 * 2  # K and V, GQA heads, bf16
    assert est.decode.core == pytest.approx(4 * max(flops / 1e12, (kv + 2 * BATCH * H * 2) / 1e11))
    assert est.tpot_s == pytest.approx(est.decode.total)
    cycle = est.ttft_s + (O - 1) * est.tpot_s
    assert est.throughput_tokens_per_s == pytest.approx(BATCH * O / cycle)


def test_decode_grows_with_the_context_for_llama_not_for_mamba2():
    llama = compile_inference_table(LLAMA_TABLE, LLAMA)
    mamba = compile_inference_table(MAMBA_TABLE, MAMBA)
    short, long = (ic.decode_core_seconds(llama, HW, 1, batch=8, context=c) for c in (1000, 4000))
    assert long == pytest.approx(4 * short, rel=0.01)
    assert ic.decode_core_seconds(mamba, HW, 1, batch=8, context=1000) == \
        ic.decode_core_seconds(mamba, HW, 1, batch=8, context=1e6)
    # Mamba-2's step reads and writes the fp32 SSM state and the bf16 conv state once
    state = 8 * MAMBA.heads * MAMBA.head_dim * MAMBA.state
    conv = 8 * (MAMBA.intermediate + 2 * MAMBA.groups * MAMBA.state) * MAMBA.conv
    assert ic.decode_core_seconds(mamba, HW, 2, batch=8, context=1) == pytest.approx(
        2 * (state * 4 + conv * 2) / 2 / 1e11)


def test_tp_shards_cache_and_adds_latency_bound_all_reduces():
    one, two = (estimate_serving(LLAMA_TABLE, LLAMA, HW, ServeLayout(tp=tp, batch=BATCH), prompt_len=P,
                                 output_len=O) for tp in (1, 2))
    assert two.memory.cache == pytest.approx(one.memory.cache / 2)  # 2 KV heads over tp 2
    assert two.decode.tp_comm > 0 and one.decode.tp_comm == 0
    # one decode step's all-reduces carry (batch, 1, hidden): the latency term dominates
    latency = 2 * LLAMA.layers * HW.intra_latency
    assert two.decode.tp_comm > latency
    four = estimate_serving(LLAMA_TABLE, LLAMA, HW, ServeLayout(tp=4, batch=BATCH), prompt_len=P, output_len=O)
    assert four.memory.cache == pytest.approx(two.memory.cache)  # 2 KV heads: each of 4 ranks keeps one


def test_tp_steps_pay_the_drivers_broadcast_of_the_step_inputs():
    """tp > 1: each forward (prefill and decode) pays `step_input_broadcasts` ring broadcasts of the
    step's largest input tensor (one int64 per token, or the block table: one int32 per 16 cached
    tokens) over the replica's ranks; tp 1 and profiles without the count pay none."""
    one, two = (estimate_serving(LLAMA_TABLE, LLAMA, HW, ServeLayout(tp=tp, batch=BATCH), prompt_len=P,
                                 output_len=O) for tp in (1, 2))
    assert one.decode.step_inputs == 0 == one.prefill.step_inputs
    context = P + O / 2.0  # the mean decode step: 1 new token over P + O/2 cached
    decode = HW.step_input_broadcasts * best_time(HW, Collective.BROADCAST, BATCH * max(8.0, 4.0 * math.ceil(
        (context + 1) / 16)), size=2, stride=1, low_latency=True)
    assert two.decode.step_inputs == pytest.approx(decode) and decode > 0
    assert two.prefill.step_inputs == pytest.approx(HW.step_input_broadcasts * best_time(
        HW, Collective.BROADCAST, BATCH * 8.0 * P, size=2, stride=1, low_latency=True))
    assert two.decode.total == pytest.approx(sum(two.decode.as_dict().values()))
    assert two.decode.per_step == pytest.approx(two.decode.fixed + two.decode.step_inputs)
    spmd = dataclasses.replace(HW, step_input_broadcasts=0)
    assert estimate_serving(LLAMA_TABLE, LLAMA, spmd, ServeLayout(tp=2, batch=BATCH), prompt_len=P,
                            output_len=O).decode.step_inputs == 0


def test_memory_is_weights_cache_at_prompt_plus_output_and_prefill_activations():
    est = estimate_serving(LLAMA_TABLE, LLAMA, HW, ServeLayout(batch=BATCH), prompt_len=P, output_len=O)
    assert est.memory.weights == pytest.approx((256 * H * 2 + 4 * 1000) * 2)
    assert est.memory.cache == pytest.approx(4 * 2 * BATCH * (P + O) * LLAMA.kv_heads * 16 * 2)
    residual = 2 * BATCH * P * H * 2
    largest = 8 * BATCH * P * H  # the attention node's inputs and output
    assert est.memory.activations == pytest.approx(residual + largest + BATCH * 256 * 4)
    mamba = estimate_serving(MAMBA_TABLE, MAMBA, HW, ServeLayout(batch=BATCH), prompt_len=P, output_len=O)
    longer = estimate_serving(MAMBA_TABLE, MAMBA, HW, ServeLayout(batch=BATCH), prompt_len=P, output_len=10 * O)
    assert mamba.memory.cache == longer.memory.cache  # constant state


def test_pipeline_adds_hops_and_splits_weights():
    one, two = (estimate_serving(LLAMA_TABLE, LLAMA, HW, ServeLayout(pp=pp, batch=BATCH), prompt_len=P,
                                 output_len=O) for pp in (1, 2))
    assert two.decode.pp_comm > HW.intra_latency and one.decode.pp_comm == 0
    assert two.decode.compute == pytest.approx(one.decode.compute)  # stages run one after the other
    assert two.memory.weights < one.memory.weights


def test_bad_input_is_refused():
    with pytest.raises(InvalidConfigError, match="pp"):
        estimate_serving(LLAMA_TABLE, LLAMA, HW, ServeLayout(pp=8), prompt_len=P, output_len=O)
    with pytest.raises(InvalidConfigError, match="positive"):
        estimate_serving(LLAMA_TABLE, LLAMA, HW, ServeLayout(), prompt_len=0, output_len=O)
    with pytest.raises(InvalidConfigError, match="batch"):
        ServeLayout(batch=0)


def test_active_experts_is_the_exact_expectation_of_distinct_experts():
    """E (1 - (1 - k/E)^B) against enumerating every routing of B tokens to k of E experts."""
    E, k = 4, 2
    picks = list(itertools.combinations(range(E), k))
    for tokens in (1, 2, 3):
        routings = list(itertools.product(picks, repeat=tokens))
        mean = sum(len(set().union(*r)) for r in routings) / len(routings)
        assert ic.active_experts(E, k, tokens) == pytest.approx(mean)
    assert all(ic.active_experts(8, 2, b) <= min(8, 2 * b) + 1e-12 for b in range(1, 40))
    assert ic.active_experts(8, 2, 1) == 2 and ic.active_experts(8, 2, 10_000) == pytest.approx(8)


MOE = get_spec("mixtral-tiny")  # 4 experts, top-2, expert MLP width 96, hidden 64
W_EXPERTS = MOE.expert_params * 2  # bf16 bytes of one layer's routed experts


def _moe_table():
    t = B * S
    layer = (node("norm", OpKind.VECTOR, "fwd", "model.layers.0.input_layernorm", 0, 4 * t * H),
             # HF's grouped_mm experts: top-k rows, every expert's weights in its bytes
             node("experts", OpKind.MATMUL, "fwd", "model.layers.0.mlp.experts", 2 * 3 * t * MOE.top_k * H * 96,
                  W_EXPERTS + 2 * t * MOE.top_k * H, gemm=(4, t * MOE.top_k / 4, 96, H)))
    base = toy_table("self_attn", 0, 0)
    return CostTable(model="toy-moe", blocks=(base.blocks[0], BlockCost(name="layer", kind=BlockKind.LAYER,
                     count=4, params=1000, nodes=layer), base.blocks[2]))


def test_moe_decode_reads_only_the_experts_its_tokens_touch():
    it = compile_inference_table(_moe_table(), MOE)
    for batch in (1, 2, 64):
        got = ic._block_seconds(it, HW, 1, BlockKind.LAYER, batch=batch, seq_len=1, decode=True)
        touched = ic.active_experts(MOE.experts, MOE.top_k, batch) / MOE.experts  # 1/2 at batch 1
        flops = 2 * 3 * batch * MOE.top_k * H * 96
        expected = 4 * batch * H / 1e11 + max(flops / 1e12, (W_EXPERTS * touched + 2 * batch * MOE.top_k * H) / 1e11)
        assert got == pytest.approx(expected)
    prefill = ic._block_seconds(it, HW, 1, BlockKind.LAYER, batch=2, seq_len=P, decode=False)
    assert prefill == pytest.approx(4 * 2 * P * H / 1e11 + max(2 * 3 * 2 * P * 2 * H * 96 / 1e12,
                                                               (W_EXPERTS + 2 * 2 * P * 2 * H) / 1e11), rel=1e-6)
    # a serving replica splits every expert's GEMMs over tp (runtime/expert_parallel.py): each rank reads and
    # computes half of every touched expert, as ep 2 makes it read half of the touched experts
    for batch in (1, 64):
        assert ic._block_seconds(it, HW, 2, BlockKind.LAYER, batch=batch, seq_len=1, decode=True) == pytest.approx(
            ic._block_seconds(it, HW, 1, BlockKind.LAYER, batch=batch, seq_len=1, decode=True, ep=2))


def test_moe_tp_splits_the_experts_and_all_reduces_each_layer_over_tp():
    from autoshard.rules import sharding
    from autoshard.passes.cost.cost import tp_comm_times

    it = compile_inference_table(_moe_table(), MOE)
    one, two = (estimate_serving(it, MOE, HW, ServeLayout(tp=tp, batch=BATCH), prompt_len=P, output_len=O)
                for tp in (1, 2))
    lay = ic._layout(MOE, 2, BATCH)
    dense = MOE.layers * tp_comm_times(it.ct, HW, lay, BlockKind.LAYER, 1, low_latency=True)[0] + tp_comm_times(
        it.ct, HW, lay, BlockKind.EMBED, 1, low_latency=True)[0]
    head = best_time(HW, Collective.ALL_GATHER, BATCH * MOE.vocab * 4.0, size=2, stride=1, low_latency=True) \
        if sharding.vocab_parallel(MOE, BlockKind.HEAD, lay.strategies) else 0.0
    experts = MOE.layers * best_time(HW, Collective.ALL_REDUCE, BATCH * H * 2.0, size=2, stride=1, low_latency=True)
    assert two.decode.tp_comm == pytest.approx(dense + head + experts)
    # memory: half of every expert per rank, the rest as training shards it (which keeps the experts whole)
    from autoshard.ir import Mesh
    from autoshard.passes.cost.block import block_params
    from autoshard.passes.cost.layout import Layout

    def training_bytes(tp):
        held = Layout(mesh=Mesh(tp=tp), micro_batch=BATCH, strategies=ic._layout(MOE, tp, BATCH).strategies)
        return 2.0 * sum(block_params(it.ct, held, k) * (MOE.layers if k is BlockKind.LAYER else 1) for k in BlockKind)

    assert one.memory.weights == pytest.approx(training_bytes(1))
    assert two.memory.weights == pytest.approx(training_bytes(2) - MOE.layers * W_EXPERTS / 2)


def test_moe_ep_reads_its_share_of_the_touched_experts_and_all_reduces_each_layer():
    """ep (generate's expert slicing): each rank 1/ep of the touched experts' bytes and rows, E/ep
    experts in memory, plus one all-reduce of every layer's (batch, 1, hidden) bf16 output over ep."""
    it = compile_inference_table(_moe_table(), MOE)
    for batch in (1, 64):
        touched = ic.active_experts(MOE.experts, MOE.top_k, batch) / MOE.experts
        flops = 2 * 3 * batch * MOE.top_k * H * 96
        expected = 4 * batch * H / 1e11 + max(flops / 2 / 1e12, (W_EXPERTS * touched + 2 * batch * MOE.top_k * H) / 2 / 1e11)
        got = ic._block_seconds(it, HW, 1, BlockKind.LAYER, batch=batch, seq_len=1, decode=True, ep=2)
        assert got == pytest.approx(expected)
    one, two = (estimate_serving(it, MOE, HW, ServeLayout(ep=ep, batch=BATCH), prompt_len=P, output_len=O)
                for ep in (1, 2))
    assert one.decode.ep_comm == 0.0
    assert two.decode.ep_comm == pytest.approx(MOE.layers * best_time(HW, Collective.ALL_REDUCE, BATCH * H * 2.0,
                                                                      size=2, stride=1, low_latency=True))
    assert two.prefill.ep_comm == pytest.approx(MOE.layers * best_time(HW, Collective.ALL_REDUCE,
                                                                       BATCH * P * H * 2.0, size=2, stride=1,
                                                                       low_latency=True))
    assert one.memory.weights - two.memory.weights == pytest.approx(MOE.layers * W_EXPERTS / 2)
    assert two.layout.devices == 2 and two.layout.as_dict()["ep"] == 2
    with pytest.raises(InvalidConfigError, match="ep"):
        ServeLayout(ep=0)
