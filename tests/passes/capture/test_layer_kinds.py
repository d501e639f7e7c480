"""Layer kinds (passes/capture/layer_kinds.py): the kinds of HF's hybrid and mixed stacks, their one-layer copies,
and the per-kind cost table (passes/capture/shapes_trace._mixed) with HF's exact parameter count."""

import functools
import json
import math
from dataclasses import replace

import pytest
import torch

from autoshard.cli import main
from autoshard.errors import InvalidConfigError
from autoshard.models import build_model, get_spec
from autoshard.models.layered import layered_spec
from autoshard.passes.cost import cost
from autoshard.ir import BlockKind
from autoshard.passes.cost.block import block_params, block_time
from autoshard.passes.cost.compiled import compile_table, mixed_violation
from autoshard.passes.cost.layout import Layout
from autoshard.passes.capture import table_cache
from autoshard.passes.capture.layer_kinds import find_layer_stack, one_layer_copy
from autoshard.passes.capture.shapes import build_cost_table
from tests.models import hybrid_models

M, A = "linear_attention", "full_attention"
KINDS = {  # model type -> the kind of every layer, as the tiny configs of tests/models/hybrid_models.py set them
    "bamba": ((M, A, M, M), "config.layers_block_type"),
    "nemotron_h": ((M, "moe", A, "mlp", M, "mlp"), "config.layers_block_type"),
    "granitemoehybrid": ((M, A, M, M), "config.layers_block_type"),
    "jamba": (("mamba+dense", "mamba+moe", "attention", "mamba+moe"), "config.layers_block_type"),
    "zamba2": ((M, "hybrid", M, "hybrid"), "config.layers_block_type"),
    "deepseek_v3": (("attention+dense", "attention+moe", "attention+moe"), "parameters"),
    "falcon_h1": (("layer",) * 3, "config.layers_block_type"),  # attention and Mamba-2 in every layer: one kind
    "qwen2_moe": (("full_attention+dense", "full_attention+moe") * 2, "config.layer_types"),
    "qwen3_next": ((M, M, M, A), "config.layer_types"),
    "lfm2": (("conv", A, "conv", A), "config.layer_types"),
    "gemma3_text": (("layer",) * 6, "config.layer_types"),  # sliding and full attention, the same weights
}


def _meta(model_type):
    with torch.device("meta"):
        return hybrid_models.build(model_type)


@pytest.mark.parametrize("model_type", sorted(KINDS))
def test_kinds_and_one_layer_copies(model_type):
    model = _meta(model_type)
    stack = find_layer_stack(model)
    sequence, source = KINDS[model_type]
    assert stack.prefix == "model.layers" and stack.sequence == sequence and stack.source == source
    layers = model.get_submodule(stack.prefix)
    for kind in stack.kinds:
        one = one_layer_copy(model, stack, kind.name, torch.bfloat16)
        (layer,) = one.get_submodule(stack.prefix)
        assert type(layer) is type(layers[kind.layers[0]]) and not one.config.use_cache
        assert layer.named_parameters() is not None and next(layer.parameters()).device.type == "meta"
    # every parameter counted once: the layers' own, the ones several layers share, and the rest of the model
    rest = sum(p.numel() for name, p in model.named_parameters() if not name.startswith(stack.prefix + "."))
    assert rest + sum(k.params * k.count for k in stack.kinds) + stack.shared_params == model.num_parameters()


@pytest.mark.parametrize("model_type", ["ernie4_5_moe", "modernbert-decoder", "gpt_neox_japanese"])
def test_a_layer_narrowing_builds_otherwise_is_the_models_own(model_type):
    """Where the narrowed config builds another layer (Ernie-4.5-MoE's MoE from `moe_layer_start_index`,
    ModernBERT-decoder's norm on every layer but the first, GPT-NeoX-Japanese's bias on the last), the copy's
    one layer is a copy of the model's own, reading the narrowed config at layer index 0."""
    from autoshard.models.tiny import build_tiny, tiny_config
    from autoshard.passes.capture.layer_kinds import _signature

    model = build_tiny(tiny_config(model_type), device="meta")
    stack = find_layer_stack(model)
    layers = model.get_submodule(stack.prefix)
    assert not stack.uniform
    for kind in stack.kinds:
        one = one_layer_copy(model, stack, kind.name, torch.bfloat16)
        (layer,) = one.get_submodule(stack.prefix)
        assert _signature(layer) == _signature(layers[kind.layers[0]]), kind.name
        assert {p.device.type for p in layer.parameters()} == {"meta"} and layer is not layers[kind.layers[0]]
        assert all(getattr(m, "layer_idx", 0) in (0, None) for m in layer.modules()), kind.name


def test_a_router_module_around_its_gating_linear_is_the_router():
    """AFMoE's MoE layer (after its dense one) routes through `mlp.router.gate`, a linear inside a router module:
    the facts name it, as the traced graph's router check (fused_patterns.check_routing) finds it."""
    from autoshard.models.facts import _moe_modules
    from autoshard.models.tiny import build_tiny, tiny_config

    model = build_tiny(tiny_config("afmoe"), device="meta")
    layers = model.get_submodule(find_layer_stack(model).prefix)
    assert _moe_modules(layers[1], model.config.num_experts)[:2] == ("mlp.experts", "mlp.router.gate")
    assert _moe_modules(layers[0], model.config.num_experts) == ("", "", "", ())  # its dense layer


def test_uniform_models_are_one_kind():
    for name in ("llama-tiny", "mamba2-tiny", "mixtral-tiny"):
        model = build_model(get_spec(name), device="meta")
        stack = find_layer_stack(model)
        assert [k.name for k in stack.kinds] == ["layer"] and stack.num_layers == get_spec(name).layers
        assert layered_spec(model, name=name) is None  # the type gate reads it, as before


@functools.lru_cache(maxsize=None)
def _mixed_table(model_type):
    """(model, spec, table) of a tiny hybrid, traced once per test session (no on-disk cache)."""
    model = _meta(model_type)
    spec = layered_spec(model, name=model_type)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AUTOSHARD_CACHE_DIR", "off")
        return model, spec, build_cost_table(spec, model=model)


@pytest.mark.parametrize("model_type", ["bamba", "deepseek_v3"])
def test_mixed_table_counts_hf_parameters_and_round_trips(model_type):
    model, spec, table = _mixed_table(model_type)
    sequence, _ = KINDS[model_type]
    assert table.layer_kinds == sequence
    assert [b.name for b in table.blocks] == ["embed", *dict.fromkeys(sequence), "head"]
    assert [b.count for b in table.layer_blocks()] == [sequence.count(k) for k in dict.fromkeys(sequence)]
    assert table.params == model.num_parameters()
    again = table_cache.table_from_json(json.loads(json.dumps(table_cache.table_to_json(table))))
    assert again == table
    from autoshard.passes.solve import planner

    plan = planner.solve(spec, "h100", devices=4, global_batch=8, seq_len=64, table=table)  # its stages over its layers
    assert plan.stages[0].first_layer == 0 and plan.stages[-1].end_layer == len(sequence)


def test_inspect_has_a_row_per_kind(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOSHARD_CACHE_DIR", str(tmp_path))
    code = main(["inspect", "--model", "tests.models.hybrid_models:nemotron_h_tiny", "--seq-len", "64", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    data = json.loads(out)
    rows = {b["name"]: b for b in data["blocks"]}
    assert {k: rows[k]["count"] for k in (M, "moe", A, "mlp")} == {M: 2, "moe": 1, A: 1, "mlp": 2}
    assert data["params"] == hybrid_models.nemotron_h_tiny().num_parameters()
    assert data["layer_kinds"] == list(KINDS["nemotron_h"][0])
    assert "attention layer (1)" in data["model_flops_formula"] and "Mamba-2 layer (2" in data["model_flops_formula"]
    model = hybrid_models.nemotron_h_tiny()  # the routed experts of its one MoE layer, not of every layer
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mixer.experts." in n)
    assert data["expert_params"] == experts and data["dense_params"] == data["params"] - experts


def _as_two_kinds(table, sequence):
    """llama-tiny's table with its one layer block split into kinds "a" and "b" of the same numbers."""
    from dataclasses import replace

    from autoshard.ir import BlockKind

    embed, layer, head = (table.block(k) for k in (BlockKind.EMBED, BlockKind.LAYER, BlockKind.HEAD))
    kinds = tuple(replace(layer, name=k, count=sequence.count(k)) for k in dict.fromkeys(sequence))
    return replace(table, blocks=(embed, *kinds, head), layer_kinds=tuple(sequence))


def test_a_mixed_stack_is_priced_as_the_sum_of_its_layers():
    from autoshard.hardware import load_hardware
    from autoshard.ir import Mesh, Recompute, Stage

    spec, hw = get_spec("llama-tiny"), load_hardware("h100")
    uniform = build_cost_table(spec)
    mixed = _as_two_kinds(uniform, ("a", "b", "a", "a"))
    kw = dict(global_batch=16, seq_len=256)
    for mesh, recompute in ((Mesh(dp=2, pp=2), Recompute.FULL), (Mesh(pp=4), Recompute.NONE), (Mesh(dp=4), Recompute.NONE)):
        layout = Layout(mesh=mesh, micro_batch=1, zero=1, recompute=recompute)
        for stages in (None, (Stage(first_layer=0, end_layer=1, embed=True, head=False),
                                    Stage(first_layer=1, end_layer=4, embed=False, head=True))
                       if mesh.pp == 2 else None):
            want = cost.estimate(uniform, spec, hw, layout, stages=stages, **kw)
            got = cost.estimate(mixed, spec, hw, layout, stages=stages, **kw)
            # the same numbers, summed per kind (3 a + 1 b instead of 4 x: equal up to the last bit)
            assert got.step_time_s == pytest.approx(want.step_time_s, rel=1e-12)
            assert got.stage_memory_gb == pytest.approx(want.stage_memory_gb, rel=1e-12)
            assert got.mfu == pytest.approx(want.mfu, rel=1e-12)
    # kinds of other numbers: a stage's time is its own layers' (moving the different layer moves its time)
    _, bamba, table = _mixed_table("bamba")
    layout = Layout(mesh=Mesh(pp=2), micro_batch=1, zero=1, recompute=Recompute.NONE)
    split = lambda n: (Stage(first_layer=0, end_layer=n, embed=True, head=False),
                        Stage(first_layer=n, end_layer=4, embed=False, head=True))  # noqa: E731
    one, three = (cost.estimate(table, bamba, hw, layout, stages=split(n), global_batch=16, seq_len=64) for n in (1, 3))
    # layers M A M M: stage 0 holds M then M A M; stage 1 A M M then M
    ct = compile_table(table, bamba)
    t = [block_time(v, hw, layout, BlockKind.LAYER, seq_len=64).compute_s for v in ct.kinds]  # M, A
    assert three.stage_times_s[0] - one.stage_times_s[0] == pytest.approx(t[0] + t[1], rel=1e-9)
    assert one.stage_times_s[1] - three.stage_times_s[1] == pytest.approx(t[0] + t[1], rel=1e-9)
    assert mixed_violation(ct, Layout(mesh=Mesh(cp=2))) is None  # each kind by its own sequence mixers (below)
    with pytest.raises(InvalidConfigError, match=r"ZeRO-3 is not priced for a model whose layers are of several kinds"):
        cost.estimate(table, bamba, hw, Layout(mesh=Mesh(dp=2), micro_batch=1, zero=3), global_batch=16, seq_len=64)


@pytest.mark.parametrize("model_type", ["bamba", "jamba", "lfm2", "qwen3_next"])
def test_mixed_stack_cp_is_priced_per_kind(model_type):
    """cp on a hybrid: the stack's layout is contiguous (a kind passes a state: `ModelSpec.cp_contiguous`, as
    runtime/context_parallel.py `layout_of` reads the modules), each kind priced by its own sequence mixers: the
    attention kind all-gathers its K/V (kept for its backward) and runs its chunk against the whole prefix (the
    last rank: twice its share), a Mamba-2 kind its final states and conv halo, a Mamba-1 kind its states, halo and
    the entering state's elementwise work, a gated DeltaNet kind its states and transitions, its halo and three runs
    of its rule, a short-convolution kind its halo alone."""
    from autoshard.hardware import load_hardware
    from autoshard.ir import Mesh, Recompute
    from autoshard.passes.cost.collectives import Collective, best_time
    from autoshard.passes.cost.block import (CP_DELTA_RUNS, _cp_comm, _cp_kv_bytes, _cp_scan_work, _node_times_many,
                                             _passed_bytes, block_activation_bytes, cp_attention_overwork)

    _, spec, table = _mixed_table(model_type)
    hw = load_hardware("h100")
    ct = compile_table(table, spec)
    assert spec.cp_contiguous and spec.cp_halo == max(p.size("conv") for p in spec.parts if "conv" in dict(p.sizes)) - 1
    cp2, dp2 = (Layout(mesh=m, micro_batch=1, zero=1, recompute=Recompute.NONE) for m in (Mesh(cp=2), Mesh(dp=2)))
    mixers = {"bamba": {"ssd", "attention"}, "jamba": {"mamba1", "attention"}, "lfm2": {"short_conv", "attention"},
              "qwen3_next": {"delta", "attention"}}
    for view in ct.kinds:
        kinds = {p.kind for p in view.spec.parts} & mixers[model_type]
        assert view.spec.cp_contiguous and cp_attention_overwork(view.spec, 2) == 2.0
        kv, passed = _cp_kv_bytes(view.spec, cp2, 64), _passed_bytes(view.spec, cp2)
        assert (kv > 0) == ("attention" in kinds) and bool(passed) == bool(kinds - {"attention"})
        gathered = [kv, *(2 * n for n in passed)]
        want = sum(best_time(hw, Collective.ALL_GATHER, n, size=2, stride=1) for n in gathered if n)
        assert _cp_comm(view, hw, cp2, BlockKind.LAYER, 64)[0] == pytest.approx(want) and want > 0
        assert (_cp_scan_work(view, hw, cp2, BlockKind.LAYER, 64)[0] > 0) == ("mamba1" in kinds)
        rule = view.block(BlockKind.LAYER).delta_rule  # the rule's ops: 3 runs of half the tokens at cp 2
        assert rule.any() == ("delta" in kinds)
        one, two = _node_times_many(view, hw, (dp2, cp2), BlockKind.LAYER, 64)
        assert two[rule] == pytest.approx(one[rule] * CP_DELTA_RUNS / 2)
        if "attention" in kinds:  # the other rank's K/V alive for the backward: half the whole sequence's
            extra = block_activation_bytes(view, cp2, BlockKind.LAYER, seq_len=64) - block_activation_bytes(
                view, dp2, BlockKind.LAYER, seq_len=64) / 2
            assert extra == pytest.approx(kv / 2)
    est = {m: cost.estimate(table, spec, hw, lay, global_batch=16, seq_len=64) for m, lay in (("cp", cp2), ("dp", dp2))}
    assert est["cp"].time.cp_comm > 0 and est["cp"].memory.activations < est["dp"].memory.activations


@pytest.mark.parametrize("model_type", ["bamba", "nemotron_h", "deepseek_v3", "qwen3_next", "lfm2", "granitemoehybrid"])
def test_mixed_stack_tp_is_priced_per_layer_part(model_type):
    """tp on a hybrid: each kind's one-layer table is priced by its own layer parts' rules (attention by heads,
    MLA, Mamba-2 by heads / groups, a gated DeltaNet by key heads, a short convolution by channel, MLP column then
    row, a fused [gate; up] by halves, MoE whole), so the parameters a tp rank holds per
    kind are exactly those of the runtime's shard program (passes/rewrite.py) for a layer of that kind, and
    the tp all-reduces of a kind are its own row-parallel projections."""
    from autoshard.ir import Mesh, Plan, Shard
    from autoshard.passes.rewrite import shard_program
    from autoshard.rules import tp_collectives

    model, spec, table = _mixed_table(model_type)
    ct = compile_table(table, spec)
    one, two = (Layout(mesh=Mesh(tp=tp), micro_batch=1, zero=1) for tp in (1, 2))
    assert mixed_violation(ct, two) is None
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    plan = Plan(model=spec.name, fingerprint="", hardware="cpu", devices=2, global_batch=8, seq_len=16, mesh=Mesh(tp=2))
    program = shard_program(plan, spec, shapes, tp_rank=0)
    held = {n: (math.prod(shapes[n]) // (p.parts if isinstance(p, Shard) and not any(p.whole) else 1))
            for n, p in program.placements}
    prefix = find_layer_stack(model).prefix
    stack = find_layer_stack(model)
    rows = {}
    for kind, view in zip(stack.kinds, ct.kinds):
        i = kind.layers[0]
        local = sum(v for n, v in held.items() if n.startswith(f"{prefix}.{i}."))
        assert block_params(view, two, BlockKind.LAYER) == pytest.approx(local), kind.name
        full = block_params(view, one, BlockKind.LAYER)
        rows[kind.name] = tp_collectives.row_parallel_count(view.spec, BlockKind.LAYER)
        assert (local < full) == (rows[kind.name] > 0), kind.name  # a kind with split parts holds less
    assert rows == {"bamba": {M: 2, A: 2}, "nemotron_h": {M: 1, "moe": 0, A: 1, "mlp": 1},  # o / out / down_proj
                    "deepseek_v3": {"attention+dense": 2, "attention+moe": 1},
                    "qwen3_next": {M: 1, A: 1},  # the DeltaNet's out_proj, the attention's o_proj
                    "lfm2": {"conv": 2, A: 2},  # the short conv's / attention's out_proj, the MLP's w2
                    "granitemoehybrid": {M: 2, A: 2}}[model_type]  # and the shared MLP's output_linear


def test_moe_kinds_are_priced_under_ep():
    """DeepSeek-V3's stack (a dense layer, then MoE layers): its MoE kind keeps the routed experts (split over
    ep, all-to-alls priced), its dense kind is a data-parallel layer; plan searches ep."""
    from autoshard.hardware import load_hardware
    from autoshard.ir import Mesh
    from autoshard.passes.solve import planner

    _, spec, table = _mixed_table("deepseek_v3")
    assert spec.is_moe and spec.experts == 4 and spec.moe_paths[1] == "mlp.experts"
    ct = compile_table(table, spec)
    dense, moe = ct.kinds
    assert not dense.spec.is_moe and moe.spec.is_moe
    hw = load_hardware("h100")
    one, two = (Layout(mesh=Mesh(dp=4 // ep, ep=ep), micro_batch=1, zero=1) for ep in (1, 2))
    assert mixed_violation(ct, two) is None
    held = [block_params(moe, lay, BlockKind.LAYER) for lay in (one, two)]
    assert held[0] - held[1] == pytest.approx(spec.expert_params / 2)  # half the experts on each ep rank
    assert block_params(dense, two, BlockKind.LAYER) == block_params(dense, one, BlockKind.LAYER)
    assert block_time(moe, hw, two, BlockKind.LAYER, seq_len=64).ep_comm_s > 0
    assert block_time(dense, hw, two, BlockKind.LAYER, seq_len=64).ep_comm_s == 0
    assert "ep" not in dict(spec.refused)  # the runtime dispatches the MoE layers' experts (tests/runtime/hybrids.py)
    plan = planner.solve(spec, hw, devices=4, global_batch=8, seq_len=64, table=table)  # ep searched as read
    searched = {plan.mesh.ep, *(other["ep"] for other in plan.solver["other_eps"])}  # why this ep (show)
    assert searched == {1, 2, 4}


def test_a_gated_deltanet_is_split_by_key_heads():
    """Qwen3-Next's gated DeltaNet is a layer part of its own ("delta"), found by its pattern: each key head's
    fused [q, k, v, z] and [b, a] rows together (its projections laid out per key head), conv1d by [q; k; v], A_log /
    dt_bias by value head, out_proj row-parallel, the gated norm (one value head wide) whole with its gradient summed
    over tp; the gated attention's q_proj ([query; gate] of each head) split by the heads o_proj reads."""
    from autoshard.rules import sharding

    model = _meta("qwen3_next")
    spec = layered_spec(model, name="qwen3_next")
    delta = next(p for p in spec.parts if p.kind == "delta")
    assert delta.path == "linear_attn" and delta.layers == (0, 1, 2) and delta.names == ("norm",)
    assert delta.linears == (("in_proj_qkvz", "colwise"), ("in_proj_ba", "colwise"), ("out_proj", "rowwise"))
    assert delta.size("k_heads") == 2 and delta.size("v_heads") == 4
    attention = next(p for p in spec.parts if p.kind == "attention")
    assert attention.size("q") == 2 * attention.size("o")  # a gate beside each head's query
    roles = {r.path: r for r in sharding.table(spec) if r.layers == delta.layers}
    assert roles["linear_attn"].params == ("A_log", "dt_bias")
    assert [p.length.split(".")[1] for p in roles["linear_attn.conv1d"].pieces] == ["key", "key", "value"]
    assert roles["linear_attn.out_proj"].strategy is sharding.Strategy.ROWWISE
    assert roles["linear_attn.norm"].grad_sum
    assert sharding.tp_violation(spec, 2) is None
    assert sharding.tp_violation(spec, 4) == ("tp (4) does not divide the number of key heads (linear_num_key_heads) "
                                              "of layers.*.linear_attn of qwen3_next (2); use a tp that divides 2")


def test_an_mlp_as_wide_as_the_model_is_read_by_its_data_flow():
    """A dense MLP whose width equals the hidden size (every linear hidden -> hidden: DeepSeek-V3's first layer at
    intermediate_size == hidden_size) is found by which linear does not read the block's input (its output
    projection), not refused tp as "no MLP" as it was by widths alone."""
    from autoshard.models.layered import layer_parts
    from autoshard.models.tiny import build_tiny, tiny_config

    model = build_tiny(tiny_config("deepseek_v3", hidden_size=64, intermediate_size=64), device="meta")
    parts, why = layer_parts(model, find_layer_stack(model))
    assert why is None
    mlp = next(p for p in parts if p.kind == "mlp")
    assert mlp.names == ("gate_proj", "up_proj", "down_proj") and mlp.sizes == (("ffn", 64),)


def test_a_mixed_stack_searches_cp_where_nothing_fits_without_it(capsys):
    """A mixed stack's cp layouts (most of its space) are searched only where no layout without cp fits
    (passes/solve/planner.py `solve`: their bounds alone took seconds on DeepSeek-V3's 1024 H100): tiny Bamba at
    64k tokens on two devices plans tp2 where 150 MB fits it, cp2 (contiguous chunks, half the activations) where
    only 100 MB does."""
    import dataclasses

    from autoshard.hardware import load_hardware
    from autoshard.passes.solve.planner import solve

    _, spec, table = _mixed_table("bamba")
    hw = load_hardware("h100")
    plans = {mem: solve(spec, dataclasses.replace(hw, memory_bytes=mem), devices=2, global_batch=1, seq_len=65536,
                        table=table) for mem in (1.5e8, 1e8)}
    assert plans[1.5e8].mesh.cp == 1 and plans[1.5e8].mesh.tp == 2
    assert plans[1e8].mesh.cp == 2 and plans[1e8].predicted["memory_gb"] <= 0.1
    # `plan` says so where it found a plan without cp
    assert main(["plan", "--model", "tests.models.hybrid_models:bamba_tiny", "--hardware", "h100", "--devices", "4",
                 "--global-batch", "8", "--seq-len", "4096"]) == 0
    assert "cp not searched: a stack of several layer kinds searches cp only where no layout" in capsys.readouterr().out


def test_a_per_layer_input_embedding_is_priced_for_every_layer():
    """Gemma-4's per-layer input embedding ([vocab, layers x d]) and its projection (hidden -> layers x d) sit outside
    the layers and grow with the layer count: the one-layer copy holds one layer's slice, so they are grown to the
    model's (`shapes_trace._grown_outside_layers`). Parameters as HF counts them (before: refused, the table counting
    one layer's slice), and the projection's FLOPs those of the whole model's graph."""
    import sympy

    from autoshard.cost_table import B, S
    from autoshard.models.presets import spec_from_hf_config
    from autoshard.models.tiny import build_tiny, tiny_config
    from autoshard.passes.capture import shapes_trace
    from autoshard.passes.capture.capture import capture_model

    model = build_tiny(tiny_config("gemma4_text"), device="meta")
    assert model.config.hidden_size_per_layer_input and model.config.num_hidden_layers == 2
    spec = spec_from_hf_config(model.config, name="gemma4-ple", model=model)
    for read in (spec, layered_spec(model, name="gemma4-ple")):  # `parallelize`'s and `plan`'s readings alike
        assert [a for a, _ in read.refused if a in ("pp", "cp")] == ["pp"]  # cp runs it, per token
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AUTOSHARD_CACHE_DIR", "off")
        table = build_cost_table(spec, model=model)
    assert table.params == model.num_parameters()
    projection = "model.per_layer_model_projection"
    priced = sum(int(sympy.sympify(n.flops).subs({B: 2, S: 64})) for n in table.block(BlockKind.EMBED).nodes
                 if n.module_path == projection)
    cap = capture_model(model.to(torch.bfloat16), (torch.zeros(2, 64, dtype=torch.long),))
    measured = shapes_trace.measure(cap, spec, (2, 64), ())
    sites = dict(cap.sites)
    graph = sum(m.values[0] for name, m in measured.items() if sites[name].module_path == projection)
    # within 1%: the module's add of its input's gradient (b x s x hidden, not per layer) is priced per layer too
    assert graph <= priced < 1.01 * graph and graph > 0
