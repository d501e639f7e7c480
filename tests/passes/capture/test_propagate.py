"""The placement propagation proves each family's tp strategy on its own traced graph (no spawn): the
gradients it finds partial are exactly the ones the equivalence runs sum (tests/runtime/families.py), HF's
gathered styles (Phi-3, OLMo-2) are proven as declared where the plain colwise reading of them is caught,
and a deliberately wrong table is caught with a named finding."""

from __future__ import annotations

import functools

import pytest

from autoshard.ir import BlockKind
from autoshard.models.presets import build_model, get_spec
from autoshard.passes.capture.placements import R, Shard
from autoshard.passes.capture.tp_proof import prove_tp, strategy, table_findings
from tests.runtime.families import DENSE, GATHERED, MOE, REFUSED

GRAD_SUMS = {name: ("self_attn.q_norm", "self_attn.k_norm") for name in ("qwen3", "gemma3", "qwen3_moe")}
PRESETS = ("llama-tiny", "mamba2-tiny", "mixtral-tiny", "qwen2-moe-tiny")
# the families REFUSED lists under tp are refused for an HF tp style autoshard has no rule for, none by the proof


@functools.cache
def _model(name: str):
    if name in PRESETS:
        spec = get_spec(name)
        return spec, build_model(spec, device="meta")
    source = {**DENSE, **MOE, **GATHERED}[name]
    return source.spec, source.build()


@functools.cache
def _proof(name: str):
    return prove_tp(*_model(name))


@pytest.mark.parametrize("name", [*DENSE, *MOE, *GATHERED, *PRESETS])
def test_the_proof_matches_the_equivalence_runs(name):
    spec, _ = _model(name)
    proof = _proof(name)
    assert (name, "tp") not in REFUSED or "HF's tp style" in REFUSED[name, "tp"]
    assert proof.proven, [f.message() for f in proof.findings]
    # exactly the gradients the equivalence runs sum (HF's replicated_with_grad_allreduce modules), and the
    # spec the cost model, the validator and the runtime read is the proof's
    declared = {p.removeprefix("layers.*.") for p, s in (getattr(_model(name)[1].config, "base_model_tp_plan", None)
                                                         or {}).items() if s == "replicated_with_grad_allreduce"}
    assert set(proof.grad_sums) == declared == set(GRAD_SUMS.get(name, ()))
    assert spec.grad_sum == proof.grad_sums or name in PRESETS
    assert not table_findings(spec, proof)
    # every parameter's gradient is placed as the parameter is, but for the summed ones
    placed = dict(proof.placements)
    for param, grad in proof.grads:
        module = param.rpartition(".")[0]
        assert grad == ("Partial" if module in proof.grad_sums else placed[param]), (param, grad)
    reduces = {m for _, m in proof.reduces}
    rowwise = {f"layers.*.{p}" for p, s in proof.placements if s == "Shard(1)"}
    assert {m + ".weight" for m in reduces if ("fwd", m) in proof.reduces} == rowwise  # one all-reduce per row-parallel linear


def test_qwen3_norms_are_summed_and_gpt_oss_sinks_split_by_head():
    assert set(_proof("qwen3").grad_sums) == {"self_attn.q_norm", "self_attn.k_norm"}
    oss = dict(_proof("gpt_oss").grads)
    assert oss["self_attn.sinks"] == "Shard(0)" and oss["self_attn.o_proj.bias"] == "Replicate"


def _plain(name: str):
    """The proof of `name` under LLaMA's table, HF's gathered styles read as plain colwise / rowwise (no gather)."""
    from dataclasses import replace

    spec, model = _model(name)
    return prove_tp(replace(spec, tp_pairs=(), grad_sum=()), model)


def test_olmo2_full_width_norm_is_a_reduction_over_the_split_dim():
    f = next(f for f in _plain("olmo2").findings if f.where == "layers.*.self_attn.q_norm")
    assert f.kind == "reduction over the split dim" and f.op == "aten.mean" and f.phase == "fwd"


def test_phi3_fused_qkv_is_a_fused_projection():
    f = _plain("phi3").findings[0]
    assert f.kind == "fused projection" and "self_attn.qkv_proj" in f.detail


@pytest.mark.parametrize("name", ["phi3", "olmo2", "olmoe"])
def test_gathered_styles_are_the_table_as_hf_declares_them(name):
    """The table of a model whose plan gathers is HF's declared plan: each colwise_gather_output / rowwise_split_input
    linear a gathered colwise / rowwise role by its whole width, no tp region around it (the attention whole on every
    rank), OLMo-2's plain MLP a Megatron pair in its region, Phi-3's fused [gate; up] too (packed: the graph chunks
    it); OLMoE's MoE block keeps its roles."""
    from autoshard.rules import sharding

    spec, model = _model(name)
    roles = {r.path: r for r in sharding.table(spec) if r.block is BlockKind.LAYER}
    declared = {p.removeprefix("layers.*."): s for p, s in model.config.base_model_tp_plan.items()
                if not p.startswith("layers.*.mlp.experts")}
    packed = ("mlp.gate_up_proj", "mlp.down_proj") if name == "phi3" else ()  # chunked on the graph: a Megatron pair
    for path, style in declared.items():
        role = roles[path]
        assert role.gathered == (style in ("colwise_gather_output", "rowwise_split_input") and path not in packed), path
        assert role.strategy.value == style.partition("_")[0], path
    assert [len(roles[p].pieces) for p in packed] == ([2, 1] if packed else [])  # [gate; up] by the MLP width
    regions = {p for p, r in roles.items() if r.strategy is sharding.Strategy.REGION}
    assert regions == ({"mlp"} if name != "olmoe" else set())
    assert roles.get("mlp.experts") is None or roles["mlp.experts"].strategy is sharding.Strategy.EXPERT
    assert "tp" not in dict(spec.refused)


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "olmo3", "solar_open"])
def test_one_kv_head_is_whole_and_its_gradient_summed(model_type):
    """Multi-query attention under tp: the one KV head stays whole on every rank, read by SDPA's native GQA
    (Llama) or repeated for the local query heads (Gemma-2's eager attention: `repeat_kv` by the count the rewrite
    sets per rank), and its projections' gradients come out partial, summed over tp as the rewrite sums shared
    heads (no second role for them). OLMo-3's attention runs whole on every rank (its q/k/v gathered), so nothing
    there is repeated per rank; Solar-Open's router expands its group mask the same way outside the attention: not
    a per-rank count."""
    from autoshard.models.presets import spec_from_hf_config
    from autoshard.models.tiny import exaggerated, tiny_config
    from autoshard.rules import sharding
    from tests.runtime.equivalence import Tiny

    source = Tiny(f"{model_type}-mq", exaggerated(tiny_config(model_type, num_key_value_heads=1)))
    model = source.build()
    spec = spec_from_hf_config(model.config, name=source.name, model=model)
    assert "tp" not in dict(spec.refused)
    proof = prove_tp(spec, model)
    assert proof.proven, [f.message() for f in proof.findings]
    assert not table_findings(spec, proof)
    grads, placed = dict(proof.grads), dict(proof.placements)
    kv = ("self_attn.k_proj", "self_attn.v_proj")
    if sharding.attention_whole(spec):  # gathered q/k/v: whole, their gradients whole
        assert all(placed[f"{m}.weight"] == grads[f"{m}.weight"] == "Replicate" for m in kv)
        return
    assert all(placed[f"{m}.weight"] == "Replicate" and grads[f"{m}.weight"] == "Partial" for m in kv)
    assert set(kv) <= set(proof.grad_sums) and set(kv) <= set(spec.grad_sum)
    assert [r.strategy for r in sharding.table(spec) if r.path in kv] == [sharding.Strategy.COLWISE] * 2
    assert placed["self_attn.q_proj.weight"] == "Shard(0)"


def _wrong(name: str, change):
    """The proof of `name`'s table with `change(params)` applied to its placements."""
    from autoshard.passes.capture.capture import capture_model
    from autoshard.passes.capture.propagate import propagate
    from autoshard.passes.capture.tp_proof import _one_of_each

    import torch

    spec, model = _model(name)
    cap = capture_model(_one_of_each(model), (torch.zeros(2, 8, dtype=torch.long),))
    st = strategy(spec, cap.param_names, tuple(model.config.base_model_tp_plan.items()), layers=cap.repeated[0].prefix)
    params = dict(st.params)
    change(params)
    return spec, propagate(cap, params, regions=st.regions, rowwise=st.rowwise)


def test_a_dropped_grad_sum_is_caught():
    from dataclasses import replace

    spec, _ = _model("qwen3")
    dropped = replace(spec, grad_sum=("self_attn.q_norm",))  # k_norm's sum dropped
    found = table_findings(dropped, _proof("qwen3"))
    assert found == ("layers.*.self_attn.k_norm: its gradient comes out partial on each tp rank, but the sharding "
                     "table does not sum it over tp",)
    extra = replace(spec, grad_sum=("self_attn.q_norm", "self_attn.k_norm", "input_layernorm"))
    assert "layers.*.input_layernorm: the sharding table sums" in table_findings(extra, _proof("qwen3"))[0]


def test_a_sharded_norm_weight_is_caught():
    def shard_norm(params):
        params["model.layers.0.input_layernorm.weight"] = Shard(0)

    _, proof = _wrong("mistral", shard_norm)
    f = proof.findings[0]
    assert f.where == "layers.*.input_layernorm" and f.kind == "replicated meets split", f.message()


def test_a_rowwise_linear_marked_colwise_is_caught():
    def colwise_o_proj(params):
        params["model.layers.0.self_attn.o_proj.weight"] = Shard(0)

    _, proof = _wrong("mistral", colwise_o_proj)
    f = proof.findings[0]
    assert f.where == "layers.*.self_attn.o_proj" and f.op == "aten.mm", f.message()


def test_replicated_sinks_beside_split_heads_are_caught():
    def whole_sinks(params):
        params["model.layers.0.self_attn.sinks"] = R

    _, proof = _wrong("gpt_oss", whole_sinks)
    f = proof.findings[0]
    assert f.where == "layers.*.self_attn" and "self_attn.sinks" in f.detail, f.message()


def test_what_hf_does_not_declare_is_found_on_the_graph():
    """Hunyuan declares no tp plan for its per-head q/k layer norms: the proof finds their gradients partial
    (the spec sums them); Cohere's attention and MLP read one norm side by side: each region's partial input
    gradient is all-reduced as it leaves, and the strategy is proven."""
    from autoshard.models.tiny import exaggerated, tiny_config
    from tests.runtime.equivalence import Tiny

    hunyuan = Tiny("hunyuan-tiny", exaggerated(tiny_config("hunyuan_v1_dense")))
    assert hunyuan.spec.grad_sum == ("self_attn.query_layernorm", "self_attn.key_layernorm")
    assert "tp" not in dict(hunyuan.spec.refused)
    cohere = Tiny("cohere-tiny", exaggerated(tiny_config("cohere")))
    proof = prove_tp(cohere.spec, cohere.build())
    assert proof.proven and ("bwd", "layers.*.self_attn") in proof.reduces, [f.message() for f in proof.findings]


def test_a_gained_dim_moves_the_split_dim_up():
    """unsqueeze(x, dim) and select_backward(grad, sizes, dim, index) both give the output a new dim (the dim is
    their second / third input): a split at or after it moves up one, a split before it stays."""
    from autoshard.passes.capture.placement_rules import RULES
    from autoshard.passes.capture.placements import Context

    ctx = Context(shapes=(), out=(2, 3, 4, 5), phase="fwd")
    for op, ins in (("unsqueeze", lambda p, d: (p, d)), ("select_backward", lambda p, d: (p, (2, 3, 4, 5), d, 0))):
        assert RULES[op](None, ins(Shard(1), 1), ctx) == Shard(2), op
        assert RULES[op](None, ins(Shard(1), 2), ctx) == Shard(1), op
        assert RULES[op](None, ins(Shard(2), -1), ctx) == Shard(2), op  # -1: the new last dim
        assert RULES[op](None, ins(R, 0), ctx) == R, op


def test_a_strided_cut_of_packed_pieces_is_caught():
    """An interleaved [gate; up] (every other column) is no packed pair: a strided slice of packed pieces is a
    finding, a contiguous cut at their bound is the piece."""
    from types import SimpleNamespace

    import torch

    from autoshard.passes.capture.placement_rules import RULES
    from autoshard.passes.capture.placements import Context, Unprovable

    node = SimpleNamespace(target=torch.ops.aten.slice.Tensor)
    packed = Shard(2, (8, 8))
    ctx = Context(shapes=((2, 4, 16),), out=(2, 4, 8), phase="fwd", counts=frozenset(), rowwise=False, names=(),
                  handled=[])
    assert RULES["slice"](node, [packed, 2, 8, 16, 1], ctx) == Shard(2)
    with pytest.raises(Unprovable, match="with step 2"):
        RULES["slice"](node, [packed, 2, 0, 16, 2], ctx)
