"""passes/capture/fused_patterns.py: RMSNorm, SwiGLU, RoPE and MoE routing found on the captured graph by their op
patterns, whatever the modules are called; the routers agree with the model's facts (moe_paths) or an error names
both."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import CausalLMOutput

from autoshard.errors import CaptureError
from autoshard.passes.capture import fused_patterns, shapes_trace
from autoshard.passes.capture.capture import capture_model

TOKENS = 16


class _Norm(nn.Module):  # HF's RMSNorm: fp32 upcast, x * rsqrt(mean(x^2) + eps), weight * cast back
    def __init__(self, h):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))

    def forward(self, x):
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * y.to(x.dtype)


class _Glu(nn.Module):
    def __init__(self, h, f):
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(h, f, bias=False), nn.Linear(h, f, bias=False), nn.Linear(f, h, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _Attn(nn.Module):
    def __init__(self, h, heads):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(h, 3 * h, bias=False), nn.Linear(h, h, bias=False)

    def forward(self, x, cos, sin):
        b, s, h = x.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        rot = lambda t: torch.cat((-t[..., t.shape[-1] // 2:], t[..., :t.shape[-1] // 2]), dim=-1)  # noqa: E731
        q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h))


class _Toy(nn.Module):
    """A decoder whose module names are `names` (norm, MLP, attention); what the patterns find must not change."""

    def __init__(self, norm="input_layernorm", mlp="mlp", attn="self_attn", h=32, heads=4, vocab=64):
        super().__init__()
        self.names = (norm, mlp, attn)
        self.embed, self.head = nn.Embedding(vocab, h), nn.Linear(h, vocab, bias=False)
        self.layers = nn.ModuleList()
        for _ in range(2):
            layer = nn.Module()
            for name, mod in zip(self.names, (_Norm(h), _Glu(h, 48), _Attn(h, heads))):
                setattr(layer, name, mod)
            self.layers.append(layer)
        self.register_buffer("freq", torch.arange(h // heads // 2, dtype=torch.float32))

    def forward(self, input_ids, labels):
        norm, mlp, attn = self.names
        x = self.embed(input_ids)
        ang = torch.arange(input_ids.shape[1], dtype=torch.float32)[:, None] * self.freq
        cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
        for layer in self.layers:
            x = x + getattr(layer, attn)(getattr(layer, norm)(x), cos, sin)
            x = x + getattr(layer, mlp)(x)
        logits = self.head(x)
        return CausalLMOutput(loss=F.cross_entropy(logits.flatten(0, 1), labels.flatten()), logits=logits)


def _found(model):
    ids = torch.zeros(1, TOKENS, dtype=torch.long)
    cap = capture_model(model, (ids, ids))
    return fused_patterns.find_fused(cap, tokens=TOKENS)


def _shape(regions):
    return sorted((r.kernel, r.size, len(r.fwd), len(r.bwd)) for r in regions)


def test_a_renamed_model_gets_the_same_regions():
    plain, renamed = _found(_Toy()), _found(_Toy(norm="ln_x", mlp="ffwd", attn="mix"))
    assert _shape(plain) == _shape(renamed)
    # per layer: one norm of 32 wide rows, SwiGLU of 48 per token, RoPE of q, k, v (32 each per token)
    assert [k for k, *_ in _shape(plain)] == ["rmsnorm"] * 2 + ["rope"] * 2 + ["swiglu"] * 2
    assert {r.size for r in plain if r.kernel == "rmsnorm"} == {(1.0, 32.0)}
    assert {r.size for r in plain if r.kernel == "rope"} == {(32.0, 32.0, 32.0)}
    assert {r.module_path for r in renamed if r.kernel == "swiglu"} == {"layers.0.ffwd", "layers.1.ffwd"}
    assert {r.module_path for r in renamed if r.kernel == "rmsnorm"} == {"layers.0.ln_x", "layers.1.ln_x"}


def _hf_regions(model_type):
    from autoshard.models.presets import spec_from_hf_config
    from autoshard.models.tiny import build_tiny, tiny_config

    model = build_tiny(tiny_config(model_type), device="meta")
    spec = spec_from_hf_config(model.config, name=model_type, model=model)
    cap = shapes_trace._trace(shapes_trace._truncated(spec, torch.bfloat16, model), 1, TOKENS, True)
    return spec, fused_patterns.find_fused(cap, tokens=TOKENS)


def test_gemma_norms_and_geglu_and_qwen3_head_norms_are_found():
    _, gemma = _hf_regions("gemma")  # (1 + w) * y norms, gelu(gate) * up
    assert sum(r.kernel == "rmsnorm" for r in gemma) == 3 and sum(r.kernel == "swiglu" for r in gemma) == 1
    _, qwen3 = _hf_regions("qwen3")  # q / k norms over each head: heads (4) and KV heads (2) rows of 16 per token
    sizes = {r.module_path.rsplit(".", 1)[-1]: r.size for r in qwen3 if r.kernel == "rmsnorm"}
    assert sizes["q_norm"] == (4.0, 16.0) and sizes["k_norm"] == (2.0, 16.0)


def test_mamba2_gated_norm_is_not_a_plain_rmsnorm():
    spec, found = _hf_regions("mamba2")
    paths = sorted(r.module_path for r in found if r.kernel == "rmsnorm")
    assert paths == ["backbone.layers.0.norm", "backbone.norm_f"]  # not the mixer's gated norm


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "granitemoe"])
def test_the_graphs_router_is_the_module_trees(model_type):
    spec, found = _hf_regions(model_type)
    routers = [r for r in found if r.kernel == fused_patterns.ROUTER]
    assert len(routers) == 1 and routers[0].module_path.endswith(spec.moe_paths[0])
    fused_patterns.check_routing(found, spec)  # agrees
    with pytest.raises(CaptureError, match=r"graph's router is .* module tree's .*'mlp\.wrong'"):
        fused_patterns.check_routing(found, dataclasses.replace(spec, moe_paths=("mlp.wrong", *spec.moe_paths[1:])))
    with pytest.raises(CaptureError, match="found no mixture of experts"):
        fused_patterns.check_routing(found, dataclasses.replace(spec, experts=0, top_k=0, moe_paths=()))
    fused_patterns.check_routing(found, spec, holds_experts=True)  # the traced layer holds experts and routes
    unrouted = [r for r in found if r.kernel != fused_patterns.ROUTER]  # a routing pattern the graph does not match
    with pytest.raises(CaptureError, match=rf"routed experts at '{spec.moe_paths[1]}' but no router"):
        fused_patterns.check_routing(unrouted, spec, holds_experts=True)
    fused_patterns.check_routing(unrouted, spec)  # a layer without the experts (a dense kind) routes nothing


def test_a_router_with_a_one_row_bias_is_found():
    """Ernie-4.5-MoE adds its score correction, a (1, experts) parameter, before topk: a bias, not the router's
    weight matrix. Its MoE layer (layer 1; layer 0 is dense) traced from the one-layer copy of that kind."""
    from autoshard.models.presets import spec_from_hf_config
    from autoshard.models.tiny import build_tiny, tiny_config
    from autoshard.passes.capture import layer_kinds

    model = build_tiny(tiny_config("ernie4_5_moe"), device="meta")
    spec = spec_from_hf_config(model.config, name="ernie4_5_moe", model=model)
    stack = layer_kinds.find_layer_stack(model)
    one = layer_kinds.one_layer_copy(model, stack, stack.sequence[1], torch.bfloat16)
    found = fused_patterns.find_fused(shapes_trace._trace(one, 1, TOKENS, True), tokens=TOKENS)
    routers = [r for r in found if r.kernel == fused_patterns.ROUTER]
    assert [r.module_path for r in routers] == ["model.layers.0.mlp.gate"] and routers[0].size == (4.0,)
    fused_patterns.check_routing(found, spec, holds_experts=True)


def test_routed_experts_swiglu_is_priced_per_routed_row():
    spec, found = _hf_regions("mixtral")  # top-2 of 4 experts of width 96: 2 x 96 elements per token
    (experts,) = [r for r in found if r.kernel == "swiglu"]
    assert experts.size == (spec.top_k * spec.ffn,)
