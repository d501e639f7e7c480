"""Kernel substitution (passes/capture/kernels.py): the SSD region is found by its pattern, replaced by one
fused op with the chunked SSD's cost, and a device profile decides which kernels apply."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import sympy
import torch
import torch.nn.functional as F
from torch import nn

from autoshard.commands.inspect import ssd_flops_per_token
from autoshard.errors import InvalidConfigError
from autoshard.hardware import load_hardware
from autoshard.cost_table import B, S
from autoshard.ir import BlockKind
from autoshard.models.presets import build_model, get_spec
from autoshard.passes.capture import kernels, shapes
from autoshard.passes.capture.capture import capture_model


def _at(expr, b, s):
    return float(sympy.sympify(expr).subs({B: b, S: s}))


def test_one_region_per_mamba2_layer_none_in_llama():
    spec = get_spec("mamba2-tiny", layers=2)
    cap = capture_model(build_model(spec, device="meta", dtype=torch.bfloat16), (torch.zeros(2, 40, dtype=torch.long),))
    regions = kernels.find_regions(cap)
    assert [r.module_path for r in regions] == ["backbone.layers.0.mixer", "backbone.layers.1.mixer"]
    for r in regions:
        assert r.kernel == "ssd_chunk_scan" and len(r.inputs) == 4  # x, B, C (split of the conv) and dt
        assert len(r.param_inputs) == 3  # A_log, D, dt_bias
        assert r.fwd and r.bwd and not r.fwd & r.bwd
    llama = capture_model(build_model(get_spec("llama-tiny", layers=1), device="meta"),
                          (torch.zeros(2, 16, dtype=torch.long),))
    assert kernels.find_regions(llama) == ()


class _Scanner(nn.Module):
    """Not a Mamba2Mixer and not called `mixer`: the chunked scan inside any module is found."""

    def __init__(self, vocab=64, heads=4, head_dim=8, state=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, heads * head_dim)
        self.proj = nn.Linear(heads * head_dim, heads * head_dim + 2 * state + heads)
        self.A_log = nn.Parameter(torch.zeros(heads))
        self.out = nn.Linear(heads * head_dim, vocab)
        self.sizes = (heads, head_dim, state)

    def forward(self, input_ids, labels=None):
        from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

        h, p, n = self.sizes
        b, s = input_ids.shape
        x, Bm, C, dt = self.proj(self.embed(input_ids)).split([h * p, n, n, h], dim=-1)
        y = mamba2_chunk_scan(x.reshape(b, s, h, p), dt, -self.A_log.exp(), Bm.reshape(b, s, 1, n),
                              C.reshape(b, s, 1, n), chunk_size=8, dt_softplus=True)
        logits = self.out(y.reshape(b, s, h * p))
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten()) if labels is not None else None
        return SimpleNamespace(loss=loss, logits=logits)


def test_the_region_is_found_by_pattern_not_by_module_name():
    cap = capture_model(_Scanner(), (torch.zeros(2, 24, dtype=torch.long),))
    (region,) = kernels.find_regions(cap)
    assert region.module_path == "" and region.kernel == "ssd_chunk_scan"
    ops = {str(n.target) for n in cap.call_nodes() if n.name in region.fwd}
    assert "aten.bmm.default" in ops and "aten.mm.default" not in ops  # the projections stay outside


def test_fused_node_carries_the_chunked_ssd_cost():
    spec = get_spec("mamba2-7b")
    b, s = 1, 4096
    cost = kernels.ssd_cost(spec, b, s)
    paper_forward = ssd_flops_per_token(spec, s) * s / spec.layers / 3  # arXiv 2405.21060 sec. 8.3
    assert cost.fwd_flops == pytest.approx(paper_forward, rel=0.05)
    assert cost.bwd_flops == 3 * cost.fwd_flops  # gradients (2x) plus the chunk-local recomputation
    chunks = s // spec.chunk
    assert cost.state_bytes == b * chunks * spec.heads * spec.head_dim * spec.state * 4
    table = shapes.build_cost_table(get_spec("mamba2-tiny"))
    layer = table.block(BlockKind.LAYER)
    fwd = [n for n in layer.nodes if n.target == "autoshard.ssd_chunk_scan"]
    bwd = [n for n in layer.nodes if n.target == "autoshard.ssd_chunk_scan.backward"]
    assert len(fwd) == len(bwd) == 1 and fwd[0].module_path.endswith(".mixer")
    tiny = get_spec("mamba2-tiny")
    assert _at(fwd[0].flops, 2, 48) == kernels.ssd_cost(tiny, 2, 48).fwd_flops
    assert _at(fwd[0].flops, 2, 40) == kernels.ssd_cost(tiny, 2, 40).fwd_flops  # padded to whole chunks
    assert not any(n.target.startswith("aten.bmm") for n in layer.nodes)  # no chunk-local matmul is left


def test_substitution_cuts_saved_and_moved_bytes_and_a_profile_can_opt_out():
    spec = get_spec("mamba2-tiny")
    fused, traced = (shapes.build_cost_table(spec, kernels=k).block(BlockKind.LAYER) for k in (None, ()))
    total = lambda blk, f: sum(_at(f(n), 2, 64) for n in blk.nodes)  # noqa: E731
    assert total(fused, lambda n: n.saved_bytes) < 0.5 * total(traced, lambda n: n.saved_bytes)
    moved = lambda n: n.bytes_read + n.bytes_written  # noqa: E731
    assert total(fused, moved) < 0.5 * total(traced, moved)
    assert not any(n.target.startswith("autoshard.") for n in traced.nodes)
    # what autoshard's runtime runs there; MindSpeed-LLM's torch scan is its stack's (hardware.StackRecipe)
    assert load_hardware("ascend-910b").kernels == ("ssd_chunk_scan",)
    assert load_hardware("ascend-910b").stack_kernels("ssd") == ("ssd_chunk_scan_torch",)


def test_unknown_kernel_names_are_refused(tmp_path):
    with pytest.raises(InvalidConfigError, match="unknown fused kernel"):
        shapes.build_cost_table(get_spec("mamba2-tiny"), kernels=("flash_ssd",))
    path = tmp_path / "dev.json"
    base = dataclasses.asdict(load_hardware("cpu"))
    base.pop("sources")
    import json

    path.write_text(json.dumps({**base, "kernels": "ssd_chunk_scan"}))
    with pytest.raises(InvalidConfigError, match="'kernels' must be a list"):
        load_hardware(str(path))
    path.write_text(json.dumps({**base, "kernels": []}))
    assert load_hardware(str(path)).kernels == ()
