"""Mamba-2's gated RMSNorm on the GPU profiles is priced as autoshard's runtime runs it (issue 25 item 4).

The runtime runs mamba_ssm's fused SSD scan on CUDA (runtime/ssd.py `fused_scan`) but the mixer's gated norm as
HF's own module (`gated_norm` calls `mixer.norm(y, gate)`: torch ops, fp32 copies kept for backward; Mamba-2
layers are not compiled, runtime/compiled.py), not mamba_ssm's Triton RMSNormGated. So the GPU profiles price the
norm as the traced ops: the one fused region of a Mamba-2 layer is its plain input RMSNorm (found on the graph,
passes/capture/fused_patterns.py), the gated norm is in none, and listing the other LLaMA fusions (flash, SwiGLU,
RoPE) changes nothing of a Mamba-2 layer."""

import dataclasses

import numpy as np
import torch

from autoshard.hardware import load_hardware
from autoshard.ir import BlockKind, Mesh
from autoshard.models.presets import build_model, get_spec
from autoshard.passes.capture.shapes import build_cost_table
from autoshard.passes.cost.block import block_activation_bytes, block_time
from autoshard.passes.cost.compiled import compile_table
from autoshard.passes.cost.layout import Layout
from autoshard.runtime.ssd import gated_norm

SPEC = get_spec("mamba2-tiny")


def test_gpu_profiles_price_the_gated_norm_as_the_traced_ops():
    for name in ("a100-80g", "h100", "h200"):
        hw = load_hardware(name)
        scan_only = dataclasses.replace(hw, name=f"{name}-scan-only", kernels=("ssd_chunk_scan", "rmsnorm"))
        ct = compile_table(build_cost_table(SPEC, kernels=hw.kernels), SPEC)
        blk = ct.block(BlockKind.LAYER)
        regions = sorted(set(blk.region[blk.region >= 0].tolist()))
        assert [blk.region_kernels[r] for r in regions] == ["rmsnorm"]  # the input norm; the gated norm in none
        for lay in (Layout(mesh=Mesh(dp=2), micro_batch=2), Layout(mesh=Mesh(tp=2), micro_batch=2)):
            kw = dict(seq_len=64)
            assert block_activation_bytes(ct, lay, BlockKind.LAYER, hw=hw, **kw) == \
                block_activation_bytes(ct, lay, BlockKind.LAYER, hw=scan_only, **kw)
            assert block_time(ct, hw, lay, BlockKind.LAYER, **kw) == block_time(ct, scan_only, lay, BlockKind.LAYER, **kw)


def test_the_runtime_runs_the_models_own_gated_norm():
    torch.manual_seed(0)
    model = build_model(SPEC)
    mixer = model.backbone.layers[0].mixer
    y, gate = torch.randn(2, 8, SPEC.intermediate), torch.randn(2, 8, SPEC.intermediate)
    got = gated_norm(mixer, y, gate)
    assert torch.equal(got, mixer.norm(y, gate))
    assert not np.allclose(got.detach().numpy(), y.numpy())  # it normalised something
