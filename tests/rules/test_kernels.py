"""One rule for the fused kernels a training run really runs (rules/kernels.py): the runtime compiles a model's
layers by default exactly where the cost model prices the compiled-layer fusions (RMSNorm, SwiGLU, RoPE)."""

from __future__ import annotations

import pytest

from autoshard.hardware import load_hardware
from autoshard.models import get_spec
from autoshard.passes.capture.shapes import build_cost_table
from autoshard.passes.cost import block, cost
from autoshard.passes.cost.compiled import compile_table
from autoshard.passes.cost.layout import Layout
from autoshard.ir import BlockKind, Mesh
from autoshard.rules.kernels import COMPILED_KERNELS, runs_fused
from autoshard.runtime.compiled import compile_backend


@pytest.mark.parametrize("name", ["llama-tiny", "mixtral-tiny", "mamba2-tiny", "qwen2-moe-tiny"])
def test_the_runtime_compiles_where_the_cost_model_prices_fusions(name):
    spec = get_spec(name)
    ct = compile_table(build_cost_table(spec), spec)
    compiled = compile_backend(None, spec, "cuda") is not None
    assert ct.layers_compiled == compiled == (name == "llama-tiny")
    h100 = load_hardware("h100")
    for kernel in h100.kernels:  # flash attention and the SSD run eagerly too; the element-wise fusions need Inductor
        assert runs_fused(kernel, h100.kernels, compiled) == (compiled or kernel not in COMPILED_KERNELS)
    assert compile_backend(None, spec, "cpu") is None and compile_backend(None, spec, "cuda", training=False) is None


def test_an_uncompiled_layer_is_priced_as_traced():
    """llama-tiny's layer priced as an eager run (layers_compiled False) reads and keeps what the traced ops do:
    more bytes than the compiled run, whose norms, RoPE and SwiGLU are each one kernel."""
    spec = get_spec("llama-tiny")
    table = build_cost_table(spec)
    h100 = load_hardware("h100")
    layout = cost.resolved(Layout(mesh=Mesh(dp=1, pp=1, tp=1, cp=1), micro_batch=1), h100)
    fused, eager = (block._fused_scales(compile_table(table, spec, layers_compiled=c), h100, layout, BlockKind.LAYER, 64)
                    for c in (True, False))
    assert all((scale == scale[0]).all() for scale in eager)  # one factor on every node: the precision's only
    assert fused[0].sum() < eager[0].sum() and fused[1].sum() < eager[1].sum()
