"""Where HF declares no `base_model_tp_plan`, the Megatron pairs are found on the traced graph
(passes/capture/tp_proposal.py) and proven by the placement propagation before anything prices or runs
them (no spawn; the tp2 runs of the same models are tests/runtime/families.py `NO_TP_PLAN`)."""

from __future__ import annotations

from dataclasses import replace

from autoshard.passes.capture.tp_proof import prove_tp
from autoshard.rules import sharding
from tests.runtime.families import NO_TP_PLAN

PERSIMMON = (("self_attn", "region", "heads"), ("self_attn.query_key_value", "colwise", "qkv"),
             ("self_attn.dense", "rowwise", "q"), ("mlp", "region", "ffn"), ("mlp.dense_h_to_4h", "colwise", "ffn"),
             ("mlp.dense_4h_to_h", "rowwise", "ffn"))


def test_persimmon_pairs_are_found_on_the_graph_and_proven():
    """Persimmon's fused per-head query_key_value -> dense and dense_h_to_4h -> dense_4h_to_h: names no table
    knows, found by data flow; the proof sums its per-head q/k layer norms' gradients over tp."""
    source = NO_TP_PLAN["persimmon"]
    assert not getattr(source.config, "base_model_tp_plan", None)
    spec = source.spec
    assert spec.tp_pairs == PERSIMMON
    assert "tp" not in dict(spec.refused)
    assert spec.grad_sum == ("self_attn.q_layernorm", "self_attn.k_layernorm")
    placed = dict(sharding.block_placements(spec, tp=2))
    assert placed["layers.*.self_attn.query_key_value"] == "colwise"
    assert placed["layers.*.mlp.dense_4h_to_h"] == "rowwise"
    assert sharding.selective_module(spec) == "self_attn"
    proof = prove_tp(spec, source.build())
    assert proof.proven and ("fwd", "layers.*.self_attn.dense") in proof.reduces, [f.message() for f in proof.findings]


def test_stablelm_pairs_are_megatrons_layout():
    spec = NO_TP_PLAN["stablelm"].spec
    assert [(p, s) for p, s, _ in spec.tp_pairs] == [
        ("self_attn", "region"), ("self_attn.q_proj", "colwise"), ("self_attn.k_proj", "colwise"),
        ("self_attn.v_proj", "colwise"), ("self_attn.o_proj", "rowwise"), ("mlp", "region"),
        ("mlp.gate_proj", "colwise"), ("mlp.up_proj", "colwise"), ("mlp.down_proj", "rowwise")]
    assert {length for _, _, length in spec.tp_pairs} == {"heads", "q", "kv", "ffn"}
    assert "tp" not in dict(spec.refused)


def test_a_lone_colwise_linear_in_the_layer_enters_the_region_itself():
    """BioGPT's fc1 -> fc2 sit directly in the layer, no module holds the pair: fc1's own input enters the tp region
    (its colwise role first, so its weight is split), the activation between runs on the shard; proven on the graph
    (the tp2 runs: OPT's in tests/runtime/families.py `CLASSIC`)."""
    from autoshard.models.tiny import tiny_config
    from tests.runtime.equivalence import Tiny

    source = Tiny("biogpt-tiny", tiny_config("biogpt"))
    spec = source.spec
    assert "tp" not in dict(spec.refused)
    assert spec.tp_pairs[-3:] == (("fc1", "colwise", "ffn"), ("fc1", "region", "ffn"), ("fc2", "rowwise", "ffn"))
    assert sharding.role_at(spec, "biogpt.layers.0.fc1").strategy is sharding.Strategy.COLWISE
    assert "biogpt.layers.0.fc1" in sharding.modules(spec, sharding.Strategy.REGION)
    proof = prove_tp(spec, source.build())
    assert proof.proven and ("fwd", "layers.*.fc2") in proof.reduces, [f.message() for f in proof.findings]


def test_the_proposal_is_proven_before_it_runs():
    """BitNet's pairs are found (q/k/v -> o_proj), but its sub-norm over the split width refuses tp by name;
    a wrong claim (Phi-3's concatenated q/k/v split as one per-head piece) is caught on the graph."""
    from autoshard.models.tiny import tiny_config
    from tests.runtime.equivalence import Tiny
    from tests.runtime.families import DENSE

    bitnet = Tiny("bitnet-tiny", tiny_config("bitnet")).spec
    assert ("self_attn.o_proj", "rowwise", "q") in bitnet.tp_pairs
    assert "layers.*.self_attn.attn_sub_norm: aten.mean" in dict(bitnet.refused)["tp"]
    phi3 = DENSE["phi3"]
    claim = (("self_attn", "region", "heads"), ("self_attn.qkv_proj", "colwise", "qkv"),
             ("self_attn.o_proj", "rowwise", "q"))
    proof = prove_tp(replace(phi3.spec, tp_pairs=claim, grad_sum=()), phi3.build())
    assert not proof.proven and "layers.*.self_attn" in proof.refusal(), proof.refusal()


def test_gpt2_transposed_linears_split_on_their_other_dim():
    """GPT-2's projections are HF's Conv1D (weight [input, output], applied by addmm): found as linears by structure,
    paired by data flow, their weights split on the other dim than nn.Linear's; its fused c_attn, cut into q, k and
    v by split_size, is proven only as packed [q; k; v] pieces (the per-head claim is caught on the graph), its
    split_size and each colwise Conv1D's nf set per rank (the tp runs: tests/runtime/families.py `CLASSIC`)."""
    from autoshard.ir import Mesh, Plan
    from autoshard.passes.rewrite import shard_program
    from tests.runtime.families import CLASSIC

    source = CLASSIC["gpt2"]
    spec = source.spec
    assert spec.transposed == ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    assert spec.tp_pairs == (("attn", "region", "heads"), ("attn.c_attn", "packed_colwise", "qkv"),
                             ("attn.c_proj", "rowwise", "q"), ("mlp", "region", "ffn"), ("mlp.c_fc", "colwise", "ffn"),
                             ("mlp.c_proj", "rowwise", "ffn"))
    assert "tp" not in dict(spec.refused)
    per_head = tuple((p, "colwise" if s == "packed_colwise" else s, n) for p, s, n in spec.tp_pairs)
    assert not prove_tp(replace(spec, tp_pairs=per_head, grad_sum=()), source.build()).proven
    model = source.build()
    program = shard_program(Plan(model="gpt2", fingerprint="", hardware="cpu", devices=2, global_batch=2, seq_len=16,
                                 mesh=Mesh(tp=2)), spec, {n: tuple(p.shape) for n, p in model.named_parameters()},
                            tp_rank=1)
    hidden = spec.hidden
    c_attn = program.placement("transformer.h.0.attn.c_attn.weight")
    assert (c_attn.dim, c_attn.segments) == (1, (hidden,) * 3)  # [hidden, 3 hidden]: q, k, v each split
    assert program.placement("transformer.h.0.attn.c_attn.bias").dim == 0
    assert program.placement("transformer.h.0.mlp.c_proj.weight").dim == 0  # rowwise: the input rows
    attrs = {(p, a): v for p, a, v in program.attrs}
    assert attrs[("transformer.h.0.attn", "split_size")] == hidden // 2
    assert attrs[("transformer.h.0.attn.c_attn", "nf")] == 3 * hidden // 2
    assert attrs[("transformer.h.0.mlp.c_fc", "nf")] == spec.ffn // 2


def test_the_llama_table_on_persimmon_is_caught_not_run():
    """Before the proposal, Persimmon was proven under the LLaMA table, whose q/k/v / o_proj / MLP names it lacks:
    everything in its tp regions replicated, the regions' input gradients whole yet all-reduced by the runtime
    (each tp times itself). The proof now names that."""
    source = NO_TP_PLAN["persimmon"]
    proof = prove_tp(replace(source.spec, tp_pairs=(), grad_sum=()), source.build())
    assert not proof.proven
    assert any(f.kind == "whole value all-reduced" and f.where == "layers.*.mlp" for f in proof.findings), \
        [f.message() for f in proof.findings]


def _toy(widths, *, shared: bool):
    """A one-layer LM whose MLP is `up` -> `down` (widths: up's outputs), `shared`: `up` also feeding `side`."""
    import types

    import torch
    from torch import nn

    class ToyMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(64, widths), nn.Linear(widths, 64)
            self.side = nn.Linear(widths, 64) if shared else None

        def forward(self, x):
            y = torch.relu(self.up(x))
            return self.down(y) + (self.side(y) if self.side is not None else 0)

    class ToyBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = ToyMLP()

        def forward(self, x):
            return x + self.mlp(x)

    class ToyLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.layers, self.head = nn.Embedding(256, 64), nn.ModuleList([ToyBlock()]), nn.Linear(64, 256)

        def forward(self, ids, labels=None):
            h = self.embed(ids)
            for layer in self.layers:
                h = layer(h)
            logits = self.head(h)
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()) if labels is not None else None
            return types.SimpleNamespace(loss=loss, logits=logits)

    return ToyLM()


def test_no_consistent_pairing_is_refused_naming_the_module():
    """A colwise projection feeding two row-parallel outputs, and a width no count of the config matches."""
    import torch

    from autoshard.models.presets import get_spec
    from autoshard.passes.capture.capture import capture_model
    from autoshard.passes.capture.tp_proposal import propose

    spec = replace(get_spec("llama-tiny"), ffn=96)
    for model, want in ((_toy(96, shared=True), "layers.*.mlp.up feeds both layers.*.mlp.down and layers.*.mlp.side"),
                        (_toy(40, shared=False), "layers.*.mlp.up: its colwise width 40 is not the MLP width "
                                                 "(intermediate_size)")):
        cap = capture_model(model, (torch.zeros(2, 8, dtype=torch.long),))
        found = propose(cap, model.layers[0], spec)
        assert not found.roles and want in found.refusal, found.refusal
    model = _toy(96, shared=False)
    found = propose(capture_model(model, (torch.zeros(2, 8, dtype=torch.long),)), model.layers[0], spec)
    assert found.roles == (("mlp", "region", "ffn"), ("mlp.up", "colwise", "ffn"), ("mlp.down", "rowwise", "ffn"))


def test_a_gathered_plan_is_read_as_declared_or_refused_by_name(monkeypatch):
    """HF's gathered styles (colwise_gather_output / rowwise_split_input) become roles by the linear's whole width,
    plain colwise / rowwise linears Megatron pairs in their parent's region; a gathered linear inside such a region,
    a pattern naming no linear and a width no size matches are refused naming the module."""
    from torch import nn

    from autoshard.models.presets import _declared_layout
    from autoshard.passes.capture.tp_proof import traced
    from autoshard.passes.capture.tp_proposal import declared
    from tests.runtime.families import DENSE

    gathered = (("self_attn.qkv_proj", "colwise_gather_output", "qkv"), ("self_attn.o_proj", "rowwise_split_input", "q"))
    # Phi-3's [gate; up] is chunked on its graph: a packed Megatron pair; unproven, it would run gathered as declared
    assert DENSE["phi3"].spec.tp_pairs == gathered + (
        ("mlp", "region", "ffn"), ("mlp.gate_up_proj", "packed_colwise", "gate_up"), ("mlp.down_proj", "rowwise", "ffn"))
    source = DENSE["phi3"]
    model, plan = source.build(), tuple(source.config.base_model_tp_plan.items())
    graph = traced(model)
    unproven = type("Proof", (), {"proven": False})()
    monkeypatch.setattr("autoshard.passes.capture.tp_proof.prove_tp", lambda *a, **k: unproven)
    assert _declared_layout(source.spec, model, graph, plan).roles == gathered + (
        ("mlp.gate_up_proj", "colwise_gather_output", "gate_up"), ("mlp.down_proj", "rowwise_split_input", "ffn"))
    spec = DENSE["phi3"].spec  # hidden 64, 4 heads of 16, 2 KV heads, MLP 96
    layer = nn.Module()
    layer.mlp = nn.Module()
    layer.mlp.up, layer.mlp.down, layer.mlp.inner = nn.Linear(64, 96), nn.Linear(96, 64), nn.Module()
    layer.mlp.inner.x, layer.mlp.inner.odd = nn.Linear(64, 192), nn.Linear(64, 100)
    pair = (("layers.*.mlp.up", "colwise"), ("layers.*.mlp.down", "rowwise"))
    assert declared(layer, spec, pair).roles == (("mlp", "region", "ffn"), ("mlp.up", "colwise", "ffn"),
                                                 ("mlp.down", "rowwise", "ffn"))
    gathered = (("layers.*.mlp.inner.x", "colwise_gather_output"),)
    assert declared(layer, spec, gathered).roles == (("mlp.inner.x", "colwise_gather_output", "gate_up"),)
    assert declared(layer, spec, pair + gathered).refusal.startswith(
        "layers.*.mlp.inner.x: HF declares it gathered inside layers.*.mlp, a tp region")
    assert "names no linear of the layer" in declared(layer, spec, (("layers.*.mlp.gone", "colwise"),)).refusal
    assert declared(layer, spec, (("layers.*.mlp.inner.odd", "colwise_gather_output"),)).refusal.startswith(
        "layers.*.mlp.inner.odd: its output width 100 is no size")


def test_gathered_styles_run_except_in_a_hybrids_parts_table():
    """HF's gathered styles are run styles (read as declared, above); a hybrid's layer-parts table, which is not
    proven on the graph, does not run them: tp refused naming the module and the style."""
    from autoshard.models.facts import ModelFacts, tp_style_refusal

    facts = ModelFacts(mixer="attention", base="model", layer_params=(), embedding_plain=True,
                       tp_plan=(("layers.*.self_attn.q_proj", "colwise_gather_output"),))
    assert tp_style_refusal(facts) is None
    assert tp_style_refusal(facts, layered=True).startswith(
        "layers.*.self_attn.q_proj: HF declares it 'colwise_gather_output', which a hybrid's layer-parts table")


def test_styles_that_run_where_the_table_holds_their_part():
    """`mla_kv_a_proj` runs where the table holds a multi-head latent attention part (its compressed KV projection
    whole, its gradient summed over tp), `packed_rowwise` on routed experts (whole on every tp rank); elsewhere each
    refuses tp naming the module, the style and where it runs. `local_params` marks a module whose own parameters
    other entries split (sinks): it runs."""
    from autoshard.models.facts import ModelFacts, tp_style_refusal

    def facts(*plan):
        return ModelFacts(mixer="attention", base="model", layer_params=(), embedding_plain=True, tp_plan=plan)

    mla = facts(("layers.*.self_attn.kv_a_proj_with_mqa", "mla_kv_a_proj"))
    assert tp_style_refusal(mla, layered=True, mla=True) is None
    assert tp_style_refusal(mla).startswith("layers.*.self_attn.kv_a_proj_with_mqa: HF declares it 'mla_kv_a_proj': "
                                            "multi-head latent attention's compressed KV projection runs only as a "
                                            "layer part")
    packed = facts(("layers.*.feed_forward.experts.gate_up_proj", "packed_rowwise"))
    assert tp_style_refusal(packed, experts=("feed_forward.experts",)) is None
    assert "runs only on routed experts" in tp_style_refusal(packed, experts=("mlp.experts",))
    assert "runs only on routed experts" in tp_style_refusal(facts(("layers.*.mlp.gate_up_proj", "packed_rowwise")))
    assert tp_style_refusal(facts(("layers.*.self_attn.sinks", "colwise"), ("layers.*.self_attn", "local_params"))) \
        is None
