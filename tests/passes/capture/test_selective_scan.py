"""The Mamba-1 selective scan captured as one op (passes/capture/selective_scan.py): it computes HF's scan, it is
found by its pattern (not a class name), its cost table is symbolic in s, and Mamba-1 and Jamba inspect and plan
with HF's parameter counts."""

from __future__ import annotations

import functools
import json

import pytest
import sympy
import torch
from torch import nn

from autoshard.cli import main
from autoshard.commands.common import cost_table_for, model_for
from autoshard.cost_table import B, S
from autoshard.hardware import load_hardware
from autoshard.ir import BlockKind, Mesh, Recompute
from autoshard.passes.capture import selective_scan
from autoshard.passes.capture.capture import capture_model
from autoshard.passes.cost import cost
from autoshard.passes.cost.compiled import compile_table
from autoshard.passes.cost.layout import Layout

MAMBA = "tests.models.mamba1_models:mamba_tiny"
JAMBA = "tests.models.hybrid_models:jamba_tiny"


def _scan_inputs(b=2, d=6, s=7, n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = {"u": (b, d, s), "dt": (b, d, s), "B": (b, n, s), "C": (b, n, s), "D": (d,), "z": (b, d, s),
              "delta_bias": (d,)}
    t = {k: torch.randn(v, generator=g) for k, v in shapes.items()}
    t["A"] = -torch.rand(d, n, generator=g)
    return {k: v.requires_grad_() for k, v in t.items()}


def _hf_scan():
    """HF's own scan function, as MambaMixer's forward dispatches to it."""
    from transformers.models.mamba import modeling_mamba

    return modeling_mamba.mamba_selective_scan


def _call(fn, t, **kw):
    return fn(t["u"], t["dt"], t["A"], t["B"], t["C"], D=t["D"], z=t["z"], delta_bias=t["delta_bias"],
              delta_softplus=True, **kw)


def test_the_op_computes_hfs_scan_and_its_gradients():
    t = _scan_inputs()
    want, got = _call(_hf_scan(), t), _call(selective_scan.substitute_scan, t)
    torch.testing.assert_close(got, want)
    dy = torch.randn_like(want)
    for g_want, g_got in zip(torch.autograd.grad(want, list(t.values()), dy),
                             torch.autograd.grad(got, list(t.values()), dy)):
        torch.testing.assert_close(g_got, g_want)
    (_, last_want), (_, last_got) = (_call(f, t, return_last_state=True) for f in (_hf_scan(), selective_scan.substitute_scan))
    torch.testing.assert_close(last_got, last_want)


class _Scanless(nn.Module):
    """A Mamba-1-patterned mixer of no HF class, whose forward scans through a global with selective_scan_fn's
    interface: found by the pattern, the global swapped only while the context is open."""

    def __init__(self, d=4, n=2, r=1):
        super().__init__()
        self.x_proj, self.dt_proj = nn.Linear(d, r + 2 * n, bias=False), nn.Linear(r, d)
        self.A_log, self.D = nn.Parameter(torch.zeros(d, n)), nn.Parameter(torch.ones(d))

    def forward(self, u):
        return my_scan(u, u, -torch.exp(self.A_log), u[:, :2], u[:, :2], D=self.D, z=None, delta_bias=None,
                       delta_softplus=True, return_last_state=False)


def my_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, return_last_state=False):
    raise AssertionError("the reference loop ran: the substitution did not happen")


def test_found_by_pattern_and_restored():
    module = _Scanless()
    assert selective_scan.scan_dispatch(module) == (globals(), "my_scan")
    with selective_scan.substituted(module) as swapped:
        assert swapped == 1 and globals()["my_scan"] is selective_scan.substitute_scan
        assert module(torch.randn(1, 4, 3)).shape == (1, 4, 3)
    assert globals()["my_scan"] is not selective_scan.substitute_scan
    for name in (MAMBA, JAMBA, "tests.models.mamba1_models:falcon_mamba_tiny"):
        _, model = model_for(name)
        with selective_scan.substituted(model) as swapped:
            assert swapped == 1  # one dispatch point (the modeling module's global) serves every mixer


class _KernelBound(_Scanless):
    """A Mamba-1 mixer whose forward calls causal-conv1d's kernel signature (x first) beside its scan: context
    parallelism swaps both (models/dispatch.py `split_points`); with a second conv it refuses, naming the count."""

    def forward(self, u):
        return my_scan(my_conv(u, self.D[:, None], None, activation="silu"), u, -torch.exp(self.A_log), u[:, :2],
                       u[:, :2], D=self.D, z=None, delta_bias=None, delta_softplus=True, return_last_state=False)


class _TwoConvs(_Scanless):
    def forward(self, u):
        return my_scan(my_conv(my_other_conv(u, self.D[:, None], None, activation=None), self.D[:, None], None,
                               activation="silu"), u, -torch.exp(self.A_log), u[:, :2], u[:, :2])


def my_conv(x, weight, bias=None, seq_idx=None, initial_states=None, activation=None):
    return x


my_other_conv = my_conv


def test_cp_finds_the_scan_and_conv_by_signature():
    from autoshard.models.dispatch import split_points

    assert split_points(_KernelBound()) == ((globals(), "my_scan"), (globals(), "my_conv"))
    assert "calls 1 selective scans and 2 causal convs" in split_points(_TwoConvs())
    assert "calls 1 selective scans and 0 causal convs" in split_points(_Scanless())
    for name in (MAMBA, JAMBA, "tests.models.mamba1_models:falcon_mamba_tiny"):
        _, model = model_for(name)
        mixer = selective_scan.scan_mixers(model)[0][1]
        assert [n for _, n in split_points(mixer)] == ["mamba_selective_scan", "causal_conv1d_fn"]


def test_one_graph_for_every_sequence_length():
    _, model = model_for(MAMBA)
    caps = [capture_model(model, (torch.zeros(2, s, dtype=torch.long),)) for s in (16, 48)]
    sigs = [[(n.name, str(n.target)) for n in cap.call_nodes()] for cap in caps]
    assert sigs[0] == sigs[1]
    targets = [t for _, t in sigs[0]]
    layers = len(model.backbone.layers)
    assert targets.count("autoshard.selective_scan.default") == layers
    assert targets.count("autoshard.selective_scan_backward.default") == layers


@functools.lru_cache(maxsize=None)
def _table(name):
    return cost_table_for(name, spinner=False)


def test_scan_node_cost_is_symbolic_in_s():
    spec, table = _table(MAMBA)
    _, model = model_for(MAMBA)
    mixer = model.backbone.layers[0].mixer
    d, n = mixer.intermediate_size, mixer.ssm_state_size
    layer = next(b for b in table.layer_blocks())
    fwd = [x for x in layer.nodes if x.target == "autoshard.selective_scan.default"]
    bwd = [x for x in layer.nodes if x.target == "autoshard.selective_scan_backward.default"]
    assert len(fwd) == len(bwd) == 1
    assert sympy.simplify(fwd[0].flops - (9 * B * S * d * n + 2 * B * S * d)) == 0  # 9bsdn + D skip + z gate
    assert sympy.simplify(bwd[0].flops - 3 * fwd[0].flops) == 0
    assert fwd[0].gemm is None and str(fwd[0].kind.value) == "vector"
    for node in (*fwd, *bwd):  # twice the tokens, twice the scan's work, at any batch
        at = lambda b, s: int(node.flops.subs({B: b, S: s}))  # noqa: E731
        assert at(3, 8192) == 2 * at(3, 4096) and at(2, 4096) * 3 == at(3, 4096) * 2
    # the kernel's traffic (bf16 table): u, delta, z, B, C per token; A, D, delta_bias fp32 once; it writes the
    # output and the pre-gate output per token and one fp32 chunk state (d, 2n) per sequence up to 2048 tokens
    assert sympy.expand(fwd[0].bytes_read - (2 * (3 * d + 2 * n) * B * S + 4 * d * n + 2 * 4 * d)) == 0
    assert sympy.expand(fwd[0].bytes_written - (2 * 2 * d * B * S + 4 * d * 2 * n * B)) == 0
    # the whole layer is linear in s: no loop, no s^2 term
    for field in ("flops", "bytes_read", "bytes_written", "saved_bytes"):
        assert sympy.degree(sympy.expand(sum(getattr(x, field) for x in layer.nodes)), S) == 1
    # what the kernel keeps beyond its inputs: the pre-gate output (b, d, s) and one chunk state (b, d, 2n) fp32
    saved = {x.name: x.saved_bytes for x in layer.nodes if x.saved_bytes != 0}
    assert 4 * d * 2 * n * B in saved.values() and 2 * d * B * S in saved.values()
    assert not any("selective_scan" in x.target for x in layer.nodes if x.saved_bytes != 0)  # kept: its outputs


@pytest.mark.parametrize("name", [MAMBA, JAMBA, "autoshard.models.mamba1:mamba_130m"])  # 130m: 129,135,360
def test_inspect_counts_hf_parameters(name, capsys):
    assert main(["inspect", "--model", name, "--seq-len", "64", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    _, model = model_for(name)
    assert data["params"] == model.num_parameters()
    kernels = {(k["kernel"], k["block"]) for k in data["fused_kernels"]}
    assert {k for k, _ in kernels} == {"selective_scan"}
    if name == JAMBA:
        assert {b for _, b in kernels} == {"mamba+dense", "mamba+moe"}  # not in the attention layer
        return
    # the MFU convention of a stack of Mamba-1 layers: 6N + 3x the scan's forward, no attention term
    mixer = model.backbone.layers[0].mixer
    d, n, layers = mixer.intermediate_size, mixer.ssm_state_size, len(model.backbone.layers)
    want = 6 * model.num_parameters() + 3 * layers * (9 * d * n + 2 * d)
    assert data["model_flops_per_token"] == want
    spec, table = _table(name)
    assert cost.model_flops_per_token(compile_table(table, spec), 64) == want


def test_mamba_plans_tp_by_its_inner_channels_and_cp_by_state_passing(tmp_path, capsys):
    """A uniform stack of Mamba-1 scans is read by its parts (models/layered.py `layered_spec`), as Jamba's Mamba-1
    layers are: tp splits the scan's inner channels (its x_proj row-parallel inside the region), priced; cp passes
    each rank's final state (runtime/cp_scan.py), priced by its all-gathers and the entering state's work."""
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", MAMBA, "--hardware", "cpu", "--devices", "4", "--global-batch", "8",
                 "--seq-len", "64", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert json.loads(out.read_text())["mesh"]["cp"] == 1 and "tp not searched" not in text
    assert "cp not searched" not in text
    spec, table = _table(MAMBA)
    assert [p.kind for p in spec.parts if p.kind == "mamba1"] == ["mamba1"]
    layout = Layout(mesh=Mesh(tp=2), micro_batch=1, zero=1, recompute=Recompute.NONE)
    hw = load_hardware("h100")
    assert cost.estimate(table, spec, hw, layout, global_batch=8, seq_len=256).time.tp_comm > 0
    # out_proj all-reduces the hidden width, x_proj (row-parallel inside the region) only its dt_rank + 2 x state
    from autoshard.passes.cost.block import _tp_comm
    from autoshard.passes.cost.collectives import Collective, best_time

    scan = next(p for p in spec.parts if p.kind == "mamba1")
    ar = lambda width: best_time(hw, Collective.ALL_REDUCE, 256 * width * layout.numbers.act_bytes, size=2, stride=1)
    forward, _ = _tp_comm(compile_table(table, spec), hw, layout, BlockKind.LAYER, 256)
    assert scan.size("x_out") != spec.hidden and forward == pytest.approx(ar(spec.hidden) + ar(scan.size("x_out")))
    _check_cp_priced(spec, table, hw)


def _check_cp_priced(spec, table, hw) -> None:
    """cp 2 of a Mamba-1 stack: each rank's fp32 final state and log-decay (b, inner, n) and its conv - 1 pre-conv
    tokens all-gathered forward (reduce-scattered backward), and the entering state's elementwise work on a
    (b, s / cp, inner, n) tensor (`CP_SCAN_PASSES`); no attention K/V."""
    from autoshard.passes.cost.block import CP_SCAN_PASSES, _cp_comm, _cp_scan_work
    from autoshard.passes.cost.collectives import Collective, best_time

    scan = next(p for p in spec.parts if p.kind == "mamba1")
    inner, n, conv = scan.size("inner"), (scan.size("x_out") - scan.size("dt_rank")) // 2, scan.size("conv")
    layout = Layout(mesh=Mesh(cp=2), micro_batch=1, zero=1, recompute=Recompute.NONE)
    ct = compile_table(table, spec)
    gathered = [best_time(hw, Collective.ALL_GATHER, 2 * nbytes, size=2, stride=1)
                for nbytes in (inner * n * 2 * 4.0, (conv - 1) * inner * layout.numbers.act_bytes)]
    assert _cp_comm(ct, hw, layout, BlockKind.LAYER, 256)[0] == pytest.approx(sum(gathered))
    work = _cp_scan_work(ct, hw, layout, BlockKind.LAYER, 256)
    one = 128 * inner * n * 4.0 / (hw.hbm_bandwidth * hw.vector_efficiency)
    assert work == pytest.approx(tuple(p * one for p in CP_SCAN_PASSES))
    dp = cost.estimate(table, spec, hw, Layout(mesh=Mesh(dp=2), micro_batch=1, zero=1, recompute=Recompute.NONE),
                       global_batch=8, seq_len=256)
    cp = cost.estimate(table, spec, hw, layout, global_batch=8, seq_len=256)
    assert cp.time.cp_comm > 0 and cp.memory.activations < dp.memory.activations


def test_jamba_prices_tp_and_ep_runs_cp():
    spec, table = _table(JAMBA)
    hw = load_hardware("h100")
    step = {}
    for mesh in (Mesh(dp=4), Mesh(dp=2, tp=2), Mesh(dp=2, ep=2), Mesh(dp=2, pp=2)):
        layout = Layout(mesh=mesh, micro_batch=1, zero=1, recompute=Recompute.NONE)
        step[mesh] = cost.estimate(table, spec, hw, layout, global_batch=8, seq_len=256).step_time_s
    assert all(t > 0 for t in step.values()) and len(set(step.values())) == len(step)
    # the runtime runs Jamba's Mamba-1 layers under tp, and under cp by state passing (runtime/cp_scan.py)
    assert all(axis not in ("tp", "cp") for axis, _ in spec.refused)
