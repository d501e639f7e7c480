"""Mixtral / Qwen2-MoE: presets, capture on fake tensors, executed FLOPs and inspect's expert/dense split."""

import json

import pytest
import torch

from autoshard.cli import main
from autoshard.errors import CaptureError
from autoshard.models import build_model, get_spec
from autoshard.models.presets import spec_from_hf_config
from autoshard.passes.capture.capture import capture_model


def test_moe_presets_have_the_published_shapes():
    m = get_spec("mixtral-8x7b")
    assert (m.layers, m.hidden, m.heads, m.kv_heads, m.ffn, m.experts, m.top_k, m.vocab) == \
        (32, 4096, 32, 8, 14336, 8, 2, 32000)
    # Mixtral-8x7B has 46.7B parameters (arXiv 2401.04088), 12.9B active per token
    assert build_model(m, device="meta").num_parameters() == 46_702_792_704
    q = get_spec("qwen2-moe")
    assert (q.layers, q.hidden, q.heads, q.experts, q.top_k, q.ffn, q.shared_ffn, q.vocab) == \
        (24, 2048, 16, 60, 4, 1408, 5632, 151936)
    for name in ("mixtral-8x7b", "qwen2-moe", "mixtral-tiny", "qwen2-moe-tiny"):
        spec = get_spec(name)
        config = spec.hf_config()
        assert config._experts_implementation == "grouped_mm"
        assert spec_from_hf_config(config, name=name) == spec


def test_eager_experts_routing_is_a_clear_capture_error():
    model = build_model(get_spec("mixtral-tiny").__class__(**{**_fields(get_spec("mixtral-tiny")), "layers": 1}),
                        device="meta", dtype=torch.bfloat16)
    model.config._experts_implementation = "eager"
    with pytest.raises(CaptureError, match=r"nonzero.*grouped_mm"):
        capture_model(model, (torch.zeros(1, 8, dtype=torch.long),))


def test_experts_with_no_fixed_shape_implementation_are_named_so():
    """DBRX's experts run HF's eager loop only (no use_experts_implementation on DbrxExperts): the error said to
    switch to 'grouped_mm', which this class does not have."""
    from transformers import DbrxConfig, DbrxForCausalLM

    config = DbrxConfig(d_model=64, n_heads=4, n_layers=1, vocab_size=256, max_seq_len=64,
                        attn_config=dict(kv_n_heads=2, clip_qkv=8.0, rope_theta=10000.0),
                        ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2))
    with torch.device("meta"):
        model = DbrxForCausalLM(config)
    with pytest.raises(CaptureError, match=r"nonzero.*DbrxExperts has only that loop.*cannot price or plan") as e:
        capture_model(model, (torch.zeros(1, 8, dtype=torch.long),))
    assert "experts_implementation='grouped_mm'" not in str(e.value)


def test_misaligned_expert_width_is_a_clear_capture_error():
    """torch._grouped_mm needs 16-byte rows: an expert width of 36 in bf16 (72 bytes) cannot run."""
    spec = get_spec("mixtral-tiny").__class__(**{**_fields(get_spec("mixtral-tiny")), "layers": 1, "ffn": 36})
    model = build_model(spec, device="meta", dtype=torch.bfloat16)
    with pytest.raises(CaptureError, match=r"16 bytes.*'intermediate_size': 36.*multiples of 8"):
        capture_model(model, (torch.zeros(1, 8, dtype=torch.long),))


def _fields(spec):
    return {f: getattr(spec, f) for f in spec.__dataclass_fields__}


@pytest.mark.parametrize("name", ["mixtral-tiny", "qwen2-moe-tiny"])
def test_inspect_splits_expert_and_dense_params_and_counts_top_k_flops(capsys, name):
    assert main(["inspect", "--model", name, "--seq-len", "128", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    spec = get_spec(name)
    n = build_model(spec, device="meta").num_parameters()
    expert = spec.layers * spec.experts * 3 * spec.hidden * spec.ffn
    assert (data["params"], data["expert_params"], data["dense_params"]) == (n, expert, n - expert)
    active = n - expert + expert * spec.top_k // spec.experts
    assert data["active_params"] == active
    # executed FLOPs: 6 x active parameters (less the embedding lookup) + attention, not 6 x all experts
    expected = 6 * (active - spec.vocab * spec.hidden) + 12 * spec.layers * spec.hidden * 128
    assert data["flops_per_token"] == pytest.approx(expected, rel=0.05)
    assert data["flops_per_token"] < 6 * (n - spec.vocab * spec.hidden)
    assert main(["inspect", "--model", name, "--seq-len", "128"]) == 0
    assert "expert" in capsys.readouterr().out


def test_expert_params_are_the_experts_modules_own():
    """GPT-OSS's experts carry biases: the spec's expert parameters (inspect's expert / dense split, the
    experts' gradient and optimizer bytes) are its experts modules' own elements, as HF counts them."""
    from autoshard.models.tiny import build_tiny, tiny_config

    model = build_tiny(tiny_config("gpt_oss"))
    spec = spec_from_hf_config(model.config, name="gpt-oss-tiny", model=model)
    held = sum(p.numel() for name, p in model.named_parameters() if ".mlp.experts." in name)
    assert any(name.endswith("experts.down_proj_bias") for name, _ in model.named_parameters())
    assert spec.expert_params * spec.layers == held
