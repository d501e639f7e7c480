"""The gated delta rule captured as one op (passes/capture/gated_delta_rule.py): it computes HF's chunked rule,
it is found by its signature (not a class or function name), the traced graph is the same at every sequence
length, and Qwen3-Next inspects and plans with HF's parameter count."""

from __future__ import annotations

import functools
import json

import sympy
import torch
from torch import nn

from autoshard.cli import main
from autoshard.cost_table import SCAN_TARGETS, B, S
from autoshard.passes.capture import gated_delta_rule
from autoshard.passes.capture.capture import capture_model
from tests.models import hybrid_models

QWEN3_NEXT = "tests.models.hybrid_models:qwen3_next_tiny"


def _hf_rule():
    from transformers.models.qwen3_next import modeling_qwen3_next

    return modeling_qwen3_next.torch_chunk_gated_delta_rule


def _inputs(b=2, s=70, hk=2, hv=4, dk=8, dv=6, seed=0):
    """70 tokens: two of HF's 64-token chunks, the second padded; grouped value heads (hv = 2 hk)."""
    g = torch.Generator().manual_seed(seed)
    t = dict(query=torch.randn(b, s, hk, dk, generator=g), key=torch.randn(b, s, hk, dk, generator=g),
             value=torch.randn(b, s, hv, dv, generator=g), g=-torch.rand(b, s, hv, generator=g),
             beta=torch.rand(b, s, hv, generator=g), initial_state=torch.randn(b, hv, dk, dv, generator=g))
    return {k: v.requires_grad_() for k, v in t.items()}


def test_the_op_computes_hfs_rule_its_state_and_gradients():
    t = _inputs()
    want, want_state = _hf_rule()(**t, output_final_state=True, use_qk_l2norm_in_kernel=True)
    got, got_state = gated_delta_rule.substitute_delta_rule(**t, output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_state, want_state, rtol=1e-4, atol=1e-5)
    dy = torch.randn_like(want)
    for name, g_want, g_got in zip(t, torch.autograd.grad(want, list(t.values()), dy),
                                   torch.autograd.grad(got, list(t.values()), dy)):
        torch.testing.assert_close(g_got, g_want, rtol=1e-4, atol=1e-4, msg=lambda m: f"d{name}: {m}")
    _, none = gated_delta_rule.substitute_delta_rule(**t)
    assert none is None  # output_final_state=False, as HF returns it


class _Renamed(nn.Module):
    """A mixer of no HF class whose forward calls a delta rule under another name: found by the signature, the
    global swapped only while the context is open."""

    def forward(self, x):
        q = x[..., None].expand(*x.shape, 4)
        return my_rule(q, q, q, -x.abs(), x.sigmoid(), initial_state=None)[0]


def my_rule(q, k, v, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False):
    raise AssertionError("the torch loop ran: the substitution did not happen")


def test_found_by_signature_and_restored():
    module = _Renamed()
    with gated_delta_rule.substituted(module) as swapped:
        assert swapped == 1 and globals()["my_rule"] is gated_delta_rule.substitute_delta_rule
        assert module(torch.randn(1, 3, 2)).shape == (1, 3, 2, 4)
    assert globals()["my_rule"] is not gated_delta_rule.substitute_delta_rule
    with gated_delta_rule.substituted(hybrid_models.build("qwen3_next")) as swapped:
        assert swapped == 2  # HF's chunked rule and its one-token recurrent form, one global each


def test_one_graph_for_every_sequence_length_and_symbolic_cost():
    model = hybrid_models.build("qwen3_next").to(torch.bfloat16)  # the fake grouped_mm of its experts wants bf16
    caps = [capture_model(model, (torch.zeros(2, s, dtype=torch.long),)) for s in (16, 48)]
    sigs = [[(n.name, str(n.target)) for n in cap.call_nodes()] for cap in caps]
    assert sigs[0] == sigs[1]
    targets = [t for _, t in sigs[0]]
    linear = sum(t == "linear_attention" for t in model.config.layer_types)
    assert targets.count("autoshard.gated_delta_rule.default") == linear
    assert f"autoshard.{gated_delta_rule.OP}." in SCAN_TARGETS  # where CostTable.scan_layers finds it
    assert targets.count("autoshard.gated_delta_rule_backward.default") == linear


@functools.lru_cache(maxsize=None)
def _summary():
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["inspect", "--model", QWEN3_NEXT, "--seq-len", "64", "--json"]) == 0
    return json.loads(out.getvalue())


def test_qwen3_next_inspects_with_hfs_count_and_plans(tmp_path):
    summary = _summary()
    assert summary["params"] == hybrid_models.build("qwen3_next").num_parameters()
    assert summary["layer_kinds"] == list(hybrid_models.build("qwen3_next").config.layer_types)
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", QWEN3_NEXT, "--hardware", "h100", "--devices", "4", "--global-batch", "8",
                 "--seq-len", "64", "--out", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["predicted"]["step_time_s"] > 0 and plan["mesh"]["cp"] == 1  # cp refused by name for the rule


def test_the_rule_is_priced_as_flas_chunked_kernel():
    from autoshard.commands.common import cost_table_for

    _, table = cost_table_for(QWEN3_NEXT, spinner=False)
    mixer = hybrid_models.build("qwen3_next").model.layers[0].linear_attn
    hv, dk, dv = mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim
    nodes = [n for blk in table.layer_blocks() for n in blk.nodes]
    (fwd,) = [n for n in nodes if n.target == "autoshard.gated_delta_rule.default"]
    (bwd,) = [n for n in nodes if n.target == "autoshard.gated_delta_rule_backward.default"]
    c = gated_delta_rule.CHUNK
    assert sympy.simplify(fwd.flops - B * S * hv * (5 * c * dk + 3 * c * dv + 6 * dk * dv)) == 0
    assert sympy.simplify(bwd.flops - 3 * fwd.flops) == 0
    flops, _ = table.scan_layers()  # the model FLOPs of the MFU convention count the rule's forward per token
    assert flops == 3 * hv * (5 * c * dk + 3 * c * dv + 6 * dk * dv)
