"""Kernel substitution for pricing (passes/cost/fused_regions.py): flash attention FLOPs, fused regions'
bytes and saved tensors on the real HF LLaMA graph, precision."""

import dataclasses

import numpy as np
import pytest

from autoshard.hardware import load_hardware
from autoshard.ir import BlockKind, Mesh, Precision
from autoshard.models.presets import get_spec
from autoshard.passes.cost import fused_regions
from autoshard.passes.cost.block import block_activation_bytes, block_time
from autoshard.passes.cost.pipeline import logits_bytes
from autoshard.passes.cost.state import state_bytes
from autoshard.passes.cost.compiled import compile_table
from autoshard.passes.cost.layout import Layout

SPEC = get_spec("llama-tiny")  # hidden 64, 4 heads, 2 KV heads (h_kv 32), ffn 176
H100 = load_hardware("h100")
UNFUSED = dataclasses.replace(H100, name="h100-unfused", kernels=())


@pytest.fixture(scope="module")
def ct():
    from autoshard.passes.capture.shapes import build_cost_table

    return compile_table(build_cost_table(SPEC), SPEC)


def test_causal_flash_visits_the_lower_triangle_of_tiles():
    assert fused_regions.causal_tile_fraction(128) == 1.0  # one tile: computed whole
    assert fused_regions.causal_tile_fraction(8192) == pytest.approx(65 / 128)  # n = 64 tiles: n(n+1)/2 of n^2
    traced = np.array([100.0, 200.0])  # forward full square, backward 2x (the trace's convention)
    got = fused_regions.flash_attention_flops(traced, np.array([True, False]), share=fused_regions.causal_tile_fraction(8192))
    share = 65 / 128
    assert got == pytest.approx([100 * share, 250 * share])  # flash backward is 2.5x forward


def test_fused_layer_saves_what_megatron_keeps(ct):
    """Per token of a LLaMA layer with fused kernels: x and y of both norms (+ fp32 rstd), q, k, v
    (GQA un-repeated), the flash output and logsumexp, gate and up, the SwiGLU output."""
    h, h_kv, f, heads, a = SPEC.hidden, 32, SPEC.ffn, SPEC.heads, 2
    want = 2 * (2 * a * h + 4) + a * (h + 2 * h_kv) + (a * h + 4 * heads) + 2 * a * f + a * f
    tokens = 1 * 16
    layout = Layout(mesh=Mesh(), micro_batch=1)
    got = block_activation_bytes(ct, layout, BlockKind.LAYER, seq_len=16, hw=H100)
    assert got == pytest.approx(want * tokens)
    unfused = block_activation_bytes(ct, layout, BlockKind.LAYER, seq_len=16, hw=UNFUSED)
    assert unfused > got  # the HF graph also saves the fp32 norm copies and silu's output


def test_kernels_cut_vector_time_not_gemm_time(ct):
    layout = Layout(mesh=Mesh(), micro_batch=2)
    fused = block_time(ct, H100, layout, BlockKind.LAYER, seq_len=4096)
    plain = block_time(ct, dataclasses.replace(UNFUSED, attention_efficiency=H100.attention_efficiency),
                            layout, BlockKind.LAYER, seq_len=4096)
    assert fused.compute_s < plain.compute_s


def test_fp32_doubles_bytes_and_halves_the_gemm_rate(ct):
    bf16 = Layout(mesh=Mesh(), micro_batch=1)
    fp32 = Layout(mesh=Mesh(), micro_batch=1, precision="fp32")
    act = [block_activation_bytes(ct, lay, BlockKind.LAYER, seq_len=64, hw=H100) for lay in (bf16, fp32)]
    assert act[1] == pytest.approx(2 * act[0])
    assert state_bytes(1000.0, fp32).total == pytest.approx(16000.0)  # 4 + 4 + 8 B per parameter
    assert state_bytes(1000.0, bf16).total == pytest.approx(18000.0)  # 2 + 4 + 12 B per parameter
    big = dataclasses.replace(H100, hbm_bandwidth=1e18)  # compute-bound: the GEMM rate alone
    t = [block_time(ct, big, lay, BlockKind.LAYER, seq_len=4096).compute_s for lay in (bf16, fp32)]
    assert t[1] == pytest.approx(2 * t[0])


def test_unknown_fused_kernel_is_a_clear_error():
    from autoshard.errors import InvalidConfigError

    with pytest.raises(InvalidConfigError, match="unknown fused kernel"):
        dataclasses.replace(H100, kernels=("warp_drive",))
    with pytest.raises(InvalidConfigError, match="'cross_entropy' is no longer a profile kernel.*remove it"):
        dataclasses.replace(H100, kernels=("flash_attention", "cross_entropy"))


def test_the_logits_peak_is_what_the_in_place_loss_holds_on_every_device(ct):
    """runtime/loss.py runs the same in-place cross-entropy everywhere: the logits the head writes
    (activation bytes) beside its fp32 softmax, which the graph's log-softmax already prices."""
    layout = Layout(mesh=Mesh(dp=1), micro_batch=2, zero=0, precision=Precision.BF16_MIXED)
    tokens_vocab = 2 * 64 * ct.spec.vocab
    for hw in ("h100", "ascend-910b", "cpu"):
        assert logits_bytes(ct, layout, seq_len=64, hw=load_hardware(hw)) == 2 * tokens_vocab
    fp32 = dataclasses.replace(layout, precision=Precision.FP32)
    assert logits_bytes(ct, fp32, seq_len=64, hw=load_hardware("cpu")) == 4 * tokens_vocab


def test_sliding_window_prices_its_band_not_the_causal_triangle():
    """A windowed layer's flash kernel visits the band of its last `window` keys (flash-attn window_size):
    at 8192 tokens (64 tiles) a 1024-token window is min(i + 1, 9) tiles per row; a window as long as the
    sequence is the causal triangle; a stack whose layers alternate (Gemma-2) pays the mean of the two."""
    assert fused_regions.window_tile_fraction(8192, 8192) == pytest.approx(fused_regions.causal_tile_fraction(8192))
    band = (sum(range(1, 10)) + 9 * (64 - 9)) / 64 ** 2
    assert fused_regions.window_tile_fraction(8192, 1024) == pytest.approx(band)
    llama = get_spec("llama-7b")
    mistral = dataclasses.replace(llama, sliding_window=1024, window_layers=llama.layers)
    alternating = dataclasses.replace(mistral, window_layers=llama.layers // 2)
    causal = fused_regions.causal_tile_fraction(8192)
    assert fused_regions.attention_tile_fraction(llama, 8192) == pytest.approx(causal)
    assert fused_regions.attention_tile_fraction(mistral, 8192) == pytest.approx(band)
    assert fused_regions.attention_tile_fraction(alternating, 8192) == pytest.approx((band + causal) / 2)


def test_sliding_window_cuts_the_layer_time_and_the_kv_cache(ct):
    from autoshard.passes.serving.inference_cost import cache_bytes_per_layer

    windowed = dataclasses.replace(SPEC, sliding_window=512, window_layers=SPEC.layers)
    layout = Layout(mesh=Mesh(), micro_batch=2)
    full = block_time(ct, H100, layout, BlockKind.LAYER, seq_len=8192).compute_s
    band = block_time(compile_table(_table(), windowed), H100, layout, BlockKind.LAYER, seq_len=8192).compute_s
    assert band < full
    kv = [cache_bytes_per_layer(s, batch=1, tokens=4096, tp=1) for s in (SPEC, windowed)]
    assert kv[1] == pytest.approx(kv[0] * 512 / 4096)  # each layer keeps its window's K and V


def _table():
    from autoshard.passes.capture.shapes import build_cost_table

    return build_cost_table(SPEC)
